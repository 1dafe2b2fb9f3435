//! What dsv4d remembers across restarts, in `state_dir`: the active profile, and how a file
//! there is written.
//!
//! Owns: the file `state_dir/profile` (one line, the profile name), the file
//! `state_dir/keys-required` (the key settings the last configuration in force had, one a
//! line), and [`write_atomic`].
//! Must not: decide which profile is valid (the caller checks the name against the
//! configuration).

use std::io;
use std::path::{Path, PathBuf};

fn profile_file(state_dir: &Path) -> PathBuf {
    state_dir.join("profile")
}

/// The remembered profile, if one was saved and can be read.
pub fn load_profile(state_dir: &Path) -> Option<String> {
    let text = super::regular::read_state(&profile_file(state_dir))?;
    let name = text.trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// Remembers `name`.
pub fn save_profile(state_dir: &Path, name: &str) -> io::Result<()> {
    write_atomic(&profile_file(state_dir), format!("{name}\n").as_bytes())
}

fn keys_file(state_dir: &Path) -> PathBuf {
    state_dir.join("keys-required")
}

/// The key settings (`api.api_keys_file`, `api.admin_keys_file`) the last configuration in
/// force had; `None` when none was remembered.
pub fn load_keys(state_dir: &Path) -> Option<Vec<String>> {
    let text = super::regular::read_state(&keys_file(state_dir))?;
    Some(
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect(),
    )
}

/// Remembers the key settings of the configuration in force.
pub fn save_keys(state_dir: &Path, settings: &[&str]) -> io::Result<()> {
    let mut text = settings.join("\n");
    text.push('\n');
    write_atomic(&keys_file(state_dir), text.trim_start().as_bytes())
}

/// Writes `value` as pretty JSON to `path` by [`write_atomic`].
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> io::Result<()> {
    write_atomic(
        path,
        &serde_json::to_vec_pretty(value).map_err(io::Error::other)?,
    )
}

/// Writes `path` atomically and durably, creating its folder when missing: the bytes go to
/// a temporary file beside it, which is synced, then renamed over it, and the folder is
/// synced, so that a crash or a power cut leaves the old file or the new one, never half or
/// none.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.unwrap_or_default()));
    // A new file: whatever was left at its name (a FIFO would block the open) goes first.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    // Owner only: state and checkpoints hold what was said to the model.
    let mut f = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?
    };
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_profile_loads_back() {
        let dir = std::env::temp_dir().join(format!("dsv4-state-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(load_profile(&dir), None);
        save_profile(&dir.join("nested"), "64k").unwrap();
        assert_eq!(load_profile(&dir.join("nested")).as_deref(), Some("64k"));
        save_profile(&dir.join("nested"), "320k").unwrap();
        assert_eq!(load_profile(&dir.join("nested")).as_deref(), Some("320k"));
        std::fs::write(dir.join("nested/profile"), "  \n").unwrap();
        assert_eq!(load_profile(&dir.join("nested")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
