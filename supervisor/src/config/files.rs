//! Checks against the file system: the engine program, the model files, the folders and the
//! API keys file named in the configuration must be there.
//!
//! Every function returns the problem as a message (or `None` when all is well); the caller
//! attaches the file, the position and the key. Paths in messages are shown by [`Shown`]:
//! relative to the folder of `supervisor.yaml` when inside it, else as they are (absolute).

use std::env;
use std::ffi::OsString;
use std::fs::{self, Metadata};
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

/// Where the shipped profiles expect the model; a missing file under it is the unedited
/// example.
pub(crate) const EXAMPLE_MODEL_DIR: &str = "/srv/models/dsv4-flash/";

/// The engine programs the shipped profiles name.
pub(crate) const EXAMPLE_COMMANDS: &[&str] =
    &["/usr/local/bin/llama-server", "/usr/local/bin/ds4-server"];

const EXAMPLE: &str = "this is the example path shipped in the profile";

/// Whether a configuration file or folder (`what`, at `path`) is held as a key file is:
/// owned by root or by dsv4d's user (`me`), and not writable by group or others, who could
/// otherwise change what dsv4d does (its listen address, its keys). The problem, naming it
/// with its owner or mode and the command that mends it.
pub(crate) fn held(what: &str, path: &Path, meta: &Metadata, me: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let (shown, mode) = (path.display(), meta.mode() & 0o7777);
    if meta.uid() != 0 && meta.uid() != me {
        return Some(format!(
            "{what} {shown} is owned by uid {}, not by root or dsv4d's user (uid {me}): it is \
             refused (`sudo chown root: {shown}`)",
            meta.uid()
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "{what} {shown} may be written by group or others (mode {mode:04o}): it is refused \
             (`sudo chmod go-w {shown}`)"
        ));
    }
    None
}

/// Shows paths in messages relative to its path (the folder of `supervisor.yaml`) when they
/// are inside it.
#[derive(Debug, Clone)]
pub(crate) struct Shown(pub PathBuf);

impl Shown {
    /// `base/profiles/./a.yaml` -> `profiles/a.yaml`; `base` itself -> `.`; a path outside
    /// `base` (or leaving it through `..`) is kept as it is.
    pub fn path(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(&self.0) {
            Ok(rest) if rest.as_os_str().is_empty() => PathBuf::from("."),
            Ok(rest) if rest.components().all(|c| matches!(c, Component::Normal(_))) => {
                rest.components().collect()
            }
            _ => path.to_path_buf(),
        }
    }

    /// [`Shown::path`] as text.
    pub fn text(&self, path: &Path) -> String {
        self.path(path).display().to_string()
    }
}

/// A regular file (following symlinks) must be at `path`, else the problem; `what` it is for
/// (`file`, `program`), and `example`, what to do when it is missing and is the shipped
/// example.
fn regular(
    shown: &Shown,
    path: &Path,
    what: &str,
    example: Option<&str>,
) -> Result<Metadata, String> {
    let text = shown.text(path);
    match fs::metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(match example {
            Some(note) => format!("{text} does not exist ({EXAMPLE}: {note})"),
            None => format!("{text} does not exist"),
        }),
        Err(e) => Err(format!("cannot access {text}: {e}")),
        Ok(m) if m.is_dir() => Err(format!("{text} is a folder, not a {what}")),
        Ok(m) if !m.is_file() => Err(format!("{text} is not a regular file")),
        Ok(m) => Ok(m),
    }
}

/// A regular file (following symlinks) must be at `path`; `example` says what to do when it
/// is missing under the shipped example folder.
fn check_file(shown: &Shown, path: &Path, example: &str) -> Option<String> {
    let example = path.starts_with(EXAMPLE_MODEL_DIR).then_some(example);
    regular(shown, path, "file", example).err()
}

/// `model`: a file, named by its first shard when it is split into shards.
pub(crate) fn check_model(shown: &Shown, path: &Path) -> Option<String> {
    let example = "edit it to point at your model";
    check_file(shown, path, example).or_else(|| check_shards(shown, path))
}

/// `mmproj`: a file.
pub(crate) fn check_mmproj(shown: &Shown, path: &Path) -> Option<String> {
    let example = "edit it to point at your vision projector, or remove mmproj";
    check_file(shown, path, example)
}

/// A model split into shards (`name-00001-of-00004.gguf`) must be named by its first shard,
/// and the other shards must sit next to it (llama.cpp loads them from there).
fn check_shards(shown: &Shown, model: &Path) -> Option<String> {
    let name = model.file_name()?.to_str()?;
    let (prefix, index, count) = split_shard_name(name)?;
    let shard = |i: u32| format!("{prefix}-{i:05}-of-{count:05}.gguf");
    let model_text = shown.text(model);
    if index != 1 {
        let first = shard(1);
        return Some(format!(
            "{model_text} is shard {index} of {count}; name the first one, {first}"
        ));
    }
    let folder = model.parent()?;
    let missing: Vec<String> = (2..=count)
        .map(shard)
        .filter(|name| !folder.join(name).is_file())
        .collect();
    let (n, missing) = (missing.len(), list(&missing, 4));
    let are = if n == 1 { "shard is" } else { "shards are" };
    (n > 0).then(|| {
        format!("{model_text} is shard 1 of {count}, but {n} {are} missing next to it: {missing}")
    })
}

/// The files `profile`'s engine reads at load: the model (every shard) and the vision
/// projector.
pub fn load_files(profile: &super::Profile) -> Vec<PathBuf> {
    let mut files = Vec::new();
    if let Some(model) = &profile.params.model {
        files.extend(model_files(model));
    }
    files.extend(profile.params.mmproj.iter().cloned());
    files
}

/// Every file of the model named `model`: its shards when it is the first of several
/// (`name-00001-of-00004.gguf`), else itself.
pub fn model_files(model: &Path) -> Vec<PathBuf> {
    let shards = model
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(split_shard_name)
        .filter(|(_, index, _)| *index == 1);
    match (shards, model.parent()) {
        (Some((prefix, _, count)), Some(folder)) => (1..=count)
            .map(|i| folder.join(format!("{prefix}-{i:05}-of-{count:05}.gguf")))
            .collect(),
        _ => vec![model.to_path_buf()],
    }
}

/// `prefix-NNNNN-of-MMMMM.gguf` -> (prefix, N, M).
fn split_shard_name(name: &str) -> Option<(&str, u32, u32)> {
    let (rest, count) = name.strip_suffix(".gguf")?.rsplit_once("-of-")?;
    let (prefix, index) = rest.rsplit_once('-')?;
    let number = |s: &str| {
        let digits = s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
        digits.then(|| s.parse::<u32>().ok()).flatten()
    };
    let (index, count) = (number(index)?, number(count)?);
    (!prefix.is_empty() && 1 <= index && index <= count).then_some((prefix, index, count))
}

/// At most `max` items, then `and N more`.
fn list(items: &[String], max: usize) -> String {
    match items.len().checked_sub(max) {
        Some(more) if more > 0 => format!("{}, and {more} more", items[..max].join(", ")),
        _ => items.join(", "),
    }
}

/// The program a profile runs: its `command`, or a bare name looked up as the engine's
/// spawn looks it up (the profile's `env.PATH`, else `PATH`), by the configuration's own
/// lookup.
pub fn resolve_command(profile: &super::Profile) -> PathBuf {
    let command = &profile.command;
    let bare = command.components().count() == 1 && !command.is_absolute();
    let name = command.to_str().filter(|_| bare);
    name.and_then(|name| {
        let search = program_search_path(profile.env.get("PATH").map(String::as_str));
        find_in_path(name, &search)
    })
    .unwrap_or_else(|| command.clone())
}

/// The search path a bare program name of a profile is looked up in: the profile's
/// `env.PATH` when it sets one (the engine is spawned with it), else the daemon's `PATH`.
pub fn program_search_path(env_path: Option<&str>) -> OsString {
    match env_path {
        Some(p) => OsString::from(p),
        None => env::var_os("PATH").unwrap_or_default(),
    }
}

/// The first executable file `dir/name` for the folders of `search` (a `PATH` value).
pub fn find_in_path(name: &str, search: &std::ffi::OsStr) -> Option<PathBuf> {
    env::split_paths(search)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// The engine program: a path (`written` contains a `/`, resolved to `resolved`) must be an
/// executable file; a bare name must be found in `PATH`, the profile's `env.PATH` when it sets
/// one (the engine is spawned with it), else the daemon's. `dir` is the profiles folder, for
/// a hint when a bare name that is not in `PATH` is there.
pub(crate) fn check_command(
    shown: &Shown,
    written: &str,
    resolved: &Path,
    dir: &Path,
    env_path: Option<&str>,
) -> Option<String> {
    let executable = |m: &Metadata| m.permissions().mode() & 0o111 != 0;
    if !written.contains('/') {
        let from = if env_path.is_some() {
            ", from env.PATH"
        } else {
            ""
        };
        let search = program_search_path(env_path);
        let search = search.to_string_lossy();
        if search.is_empty() {
            return Some(format!(
                "{written} is not a path and PATH is empty or not set: write the full path"
            ));
        }
        let found = find_in_path(written, search.as_ref().as_ref()).is_some();
        let mut message = format!("{written} not found in PATH ({search}{from})");
        let local = dir.join(written);
        if local.exists() {
            message += &format!("; for {}, write ./{written}", shown.text(&local));
        }
        return (!found).then_some(message);
    }
    let shipped = EXAMPLE_COMMANDS.iter().any(|c| resolved == Path::new(c));
    let name = resolved.file_name().unwrap_or_default().to_string_lossy();
    let (example, text) = (
        format!("edit it to point at your {name}"),
        shown.text(resolved),
    );
    match regular(shown, resolved, "program", shipped.then_some(&example)) {
        Ok(m) if !executable(&m) => Some(format!("{text} is not executable (chmod +x it)")),
        Ok(_) => None,
        Err(message) => Some(message),
    }
}

/// A folder the engine creates (`kv_disk_dir`): if it exists it must be a folder, else its
/// parent must.
pub(crate) fn check_creatable_dir(shown: &Shown, dir: &Path) -> Option<String> {
    let (parent, text) = match fs::metadata(dir) {
        Ok(m) if m.is_dir() => return None,
        Ok(_) => return Some(format!("{} exists and is not a folder", shown.text(dir))),
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Some(format!("cannot access {}: {e}", shown.text(dir)))
        }
        Err(_) => {
            let parent = dir.parent().filter(|p| !p.as_os_str().is_empty())?;
            (parent, shown.text(parent))
        }
    };
    match fs::metadata(parent) {
        Ok(m) if m.is_dir() => None,
        Ok(_) => Some(format!("parent folder {text} is not a folder")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            Some(format!("parent folder {text} does not exist"))
        }
        Err(e) => Some(format!("cannot access {text}: {e}")),
    }
}

/// A folder dsv4d creates with its parents when it needs it (`kv_checkpoint.dir`): what
/// exists of it must be folders.
pub(crate) fn check_makeable_dir(shown: &Shown, dir: &Path) -> Option<String> {
    let mut at = dir;
    loop {
        match fs::metadata(at) {
            Ok(m) if m.is_dir() => return None,
            Ok(_) => return Some(format!("{} exists and is not a folder", shown.text(at))),
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Some(format!("cannot access {}: {e}", shown.text(at)))
            }
            Err(_) => match at.parent().filter(|p| !p.as_os_str().is_empty()) {
                Some(parent) => at = parent,
                None => return None,
            },
        }
    }
}

/// The API keys file: a regular file that only its owner may read or write, since it holds
/// secrets (the same rule as `auth::ApiKeys::load`, which reads it).
/// Whether `path` is one of the service's systemd credentials: a file right inside
/// `$CREDENTIALS_DIRECTORY`. systemd makes that folder for the service alone (its user may
/// read it, nobody may write it), and from systemd 254 gives the files group bits through
/// an ACL mask (mode 0440): the mode and owner rules of a key file do not apply to them.
pub fn is_credential(path: &Path) -> bool {
    credential_in(path, credentials_dir().as_deref())
}

/// The service's credentials folder, `$CREDENTIALS_DIRECTORY`, when systemd set it.
pub(crate) fn credentials_dir() -> Option<PathBuf> {
    std::env::var_os("CREDENTIALS_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// Whether `path` is a file right inside the credentials folder `dir`.
fn credential_in(path: &Path, dir: Option<&Path>) -> bool {
    dir.is_some_and(|dir| path.parent() == Some(dir) && path.file_name().is_some())
}

/// What is wrong with the credential file at `path`: only that it is not a regular file
/// (see [`is_credential`]).
pub(crate) fn check_credential_file(shown: &Shown, path: &Path) -> Option<String> {
    regular(shown, path, "file", None).err()
}

pub(crate) fn check_secret_file(shown: &Shown, path: &Path) -> Option<String> {
    let mode = match regular(shown, path, "file", None) {
        Ok(m) => m.permissions().mode() & 0o7777,
        Err(message) => return Some(message),
    };
    let text = shown.text(path);
    let why = format!("may be read or written by group or others (mode {mode:04o})");
    (mode & 0o077 != 0).then(|| format!("{text} {why}; it holds secrets: chmod 600 it"))
}

/// Whether `a` and `b` name the same file: the same path, or the same device and inode
/// (following links), so that a symbolic or a hard link to the file counts as the file.
pub fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if a == b {
        return true;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Why `api.admin_keys_file` cannot be `admin`, when it is the file `api.api_keys_file`
/// (`api`, shown as `api_shown`) names too: every API client would then hold an admin key.
pub fn shared_key_file(api: &Path, admin: &Path, api_shown: &str) -> Option<String> {
    same_file(api, admin).then(|| {
        format!(
            "is the same file as api.api_keys_file ({api_shown}), so every API client would hold an \
             admin key: give the admin keys a file of their own"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_paths() {
        let shown = Shown(PathBuf::from("/etc/dsv4"));
        let text = |p: &str| shown.text(Path::new(p));
        assert_eq!(text("/etc/dsv4/profiles/a.yaml"), "profiles/a.yaml");
        assert_eq!(text("/etc/dsv4/profiles/./bin/x"), "profiles/bin/x");
        assert_eq!(text("/etc/dsv4"), ".");
        assert_eq!(text("/etc/dsv4/../x"), "/etc/dsv4/../x");
        assert_eq!(text("/etc/dsv4x/a"), "/etc/dsv4x/a");
        assert_eq!(text("/srv/m.gguf"), "/srv/m.gguf");
    }

    #[test]
    fn shard_names() {
        assert_eq!(
            split_shard_name("IQ2_XXS-00001-of-00004.gguf"),
            Some(("IQ2_XXS", 1, 4))
        );
        assert_eq!(split_shard_name("a-00004-of-00004.gguf"), Some(("a", 4, 4)));
        assert_eq!(
            model_files(Path::new("/m/a-00001-of-00002.gguf")),
            [
                PathBuf::from("/m/a-00001-of-00002.gguf"),
                PathBuf::from("/m/a-00002-of-00002.gguf")
            ]
        );
        assert_eq!(
            model_files(Path::new("/m/a.gguf")),
            [PathBuf::from("/m/a.gguf")]
        );
        for name in [
            "IQ2_XXS.gguf",
            "-00001-of-00004.gguf",
            "a-00005-of-00004.gguf",
            "a-00000-of-00004.gguf",
            "a-0001-of-00004.gguf",
            "a_00001-of-00004.gguf",
            "a-00001_of-00004.gguf",
            "a-00001-of-00004.bin",
            "é-00001-of-0000é.gguf",
            "",
        ] {
            assert_eq!(split_shard_name(name), None, "{name}");
        }
    }

    #[test]
    fn lists_are_cut() {
        let items: Vec<String> = (1..=6).map(|i| i.to_string()).collect();
        assert_eq!(list(&items[..2], 4), "1, 2");
        assert_eq!(list(&items, 4), "1, 2, 3, 4, and 2 more");
    }

    #[test]
    fn a_credential_is_a_file_right_inside_the_credentials_folder() {
        let dir = Some(Path::new("/run/credentials/dsv4.service"));
        let table = [
            ("/run/credentials/dsv4.service/api-keys", dir, true),
            ("/run/credentials/dsv4.service/sub/api-keys", dir, false),
            ("/run/credentials/dsv4.service", dir, false),
            ("/etc/dsv4/api-keys", dir, false),
            ("/run/credentials/dsv4.service/api-keys", None, false),
            ("/api-keys", Some(Path::new("")), false),
        ];
        for (path, dir, want) in table {
            assert_eq!(
                credential_in(Path::new(path), dir),
                want,
                "{path} in {dir:?}"
            );
        }
    }
}
