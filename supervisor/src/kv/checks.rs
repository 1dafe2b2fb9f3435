//! The checks of each profile's last restores, kept across restarts for the doctor: the file
//! `state_dir/kv-restore-checks.json` (`{"320k": [{"at": ..., "reused": 14, "shared":
//! 98000, "missed": true}, ...]}`, oldest first, the last [`KEEP`]).
//!
//! Owns: that file, and what it says of a profile. Must not: fail anything: a file that is
//! missing or not what it should be holds no checks (and is written anew at the next one).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dsv4_client::kv::RestoreCheck;

/// Checks kept per profile.
pub const KEEP: usize = 5;

/// The checks of each profile, oldest first.
pub type Checks = BTreeMap<String, Vec<RestoreCheck>>;

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("kv-restore-checks.json")
}

/// The checks kept in `state_dir`.
pub fn read(state_dir: &Path) -> Checks {
    crate::host::regular::read_state(&path(state_dir))
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// `check` of `profile`'s last restore, kept (the oldest beyond [`KEEP`] go).
pub fn record(state_dir: &Path, profile: &str, check: RestoreCheck) -> std::io::Result<()> {
    let mut all = read(state_dir);
    let kept = all.entry(profile.to_string()).or_default();
    kept.push(check);
    let over = kept.len().saturating_sub(KEEP);
    kept.drain(..over);
    let text = serde_json::to_string(&all).map_err(std::io::Error::other)?;
    crate::host::state_file::write_atomic(&path(state_dir), text.as_bytes())
}

/// How many of the newest checks missed, one after the other.
pub fn misses_in_a_row(checks: &[RestoreCheck]) -> usize {
    checks.iter().rev().take_while(|c| c.missed).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(missed: bool) -> RestoreCheck {
        RestoreCheck {
            at: 1.0,
            reused: if missed { 0 } else { 99 },
            shared: 100,
            missed,
        }
    }

    #[test]
    fn the_last_checks_are_kept_and_the_misses_counted_from_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).is_empty());
        for missed in [true, false, true, true, false, true, true] {
            record(dir.path(), "320k", check(missed)).unwrap();
        }
        record(dir.path(), "64k", check(false)).unwrap();
        let all = read(dir.path());
        assert_eq!(all["320k"].len(), KEEP);
        assert_eq!(misses_in_a_row(&all["320k"]), 2);
        assert_eq!(misses_in_a_row(&all["64k"]), 0);
        assert_eq!(misses_in_a_row(&[]), 0);
        // A file that is not one holds nothing, and the next check writes it anew.
        std::fs::write(path(dir.path()), "{not json").unwrap();
        assert!(read(dir.path()).is_empty());
        record(dir.path(), "320k", check(true)).unwrap();
        assert_eq!(read(dir.path())["320k"].len(), 1);
    }
}
