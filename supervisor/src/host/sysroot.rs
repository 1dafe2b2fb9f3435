//! The root below which the daemon reads `/proc` and `/sys`: `/` on a real host, a fixture
//! tree shaped like the real one in tests (`dsv4d --sysroot DIR`).
//!
//! Owns: turning a system path (`/proc/meminfo`) into the file to read, and reading it with
//! errors that name that file. Must not: know what the files mean; their readers do. Every
//! part that reads the host (memory admission, telemetry, power) gets the daemon's one
//! `SysRoot` and reads through it, so a fixture tree stands in for all of them at once.

use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Where `/proc` and `/sys` are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysRoot {
    root: PathBuf,
}

impl Default for SysRoot {
    /// The host itself.
    fn default() -> Self {
        SysRoot {
            root: PathBuf::from("/"),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SysError {
    #[error("--sysroot {}: {why}", root.display())]
    BadRoot { root: PathBuf, why: String },
    #[error("cannot read {}: {why}", path.display())]
    Read { path: PathBuf, why: String },
    #[error("{}: {what}", path.display())]
    Parse { path: PathBuf, what: String },
}

impl SysRoot {
    /// `dir` as the root; it must be a folder.
    pub fn new(dir: impl Into<PathBuf>) -> Result<SysRoot, SysError> {
        let root = dir.into();
        match std::fs::metadata(&root) {
            Ok(m) if m.is_dir() => Ok(SysRoot { root }),
            Ok(_) => Err(SysError::BadRoot {
                root,
                why: "not a folder".into(),
            }),
            Err(e) => Err(SysError::BadRoot {
                why: e.to_string(),
                root,
            }),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file that stands for the system path `system` (absolute, like `/proc/meminfo`).
    pub fn path(&self, system: &str) -> PathBuf {
        self.root.join(system.trim_start_matches('/'))
    }

    /// The whole file, without the NUL bytes a reader of a fixed-size buffer may have padded
    /// it with (some tools capture sysfs that way).
    pub fn read(&self, system: &str) -> Result<String, SysError> {
        let path = self.path(system);
        std::fs::read_to_string(&path)
            .map(|mut text| {
                text.truncate(text.trim_end_matches('\0').len());
                text
            })
            .map_err(|e| SysError::Read {
                why: e.to_string(),
                path,
            })
    }

    /// A file holding one value (most of sysfs): its trimmed content, parsed.
    pub fn value<T: FromStr>(&self, system: &str) -> Result<T, SysError>
    where
        T::Err: std::fmt::Display,
    {
        let text = self.read(system)?;
        let t = text.trim();
        t.parse().map_err(|e| SysError::Parse {
            path: self.path(system),
            what: format!("{t:?}: {e}"),
        })
    }

    /// The whole file as bytes, read to its end (sysfs binary files such as `gpu_metrics`
    /// give a size that is only an upper bound).
    pub fn read_bytes(&self, system: &str) -> Result<Vec<u8>, SysError> {
        let path = self.path(system);
        std::fs::read(&path).map_err(|e| SysError::Read {
            why: e.to_string(),
            path,
        })
    }

    /// The names in the folder `system`, sorted; empty when it cannot be read.
    pub fn list(&self, system: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.path(system))
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> (PathBuf, SysRoot) {
        let dir = std::env::temp_dir().join(format!(
            "dsv4-sysroot-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(dir.join("proc")).unwrap();
        std::fs::create_dir_all(dir.join("sys/class/drm/card1/device")).unwrap();
        std::fs::write(
            dir.join("proc/meminfo"),
            "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   98304000 kB\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("sys/class/drm/card1/device/mem_info_gtt_used"),
            "86973087744\n",
        )
        .unwrap();
        let root = SysRoot::new(&dir).unwrap();
        (dir, root)
    }

    #[test]
    fn system_paths_resolve_below_the_root() {
        let (dir, root) = tree();
        assert_eq!(root.path("/proc/meminfo"), dir.join("proc/meminfo"));
        assert_eq!(
            SysRoot::default().path("/proc/meminfo"),
            PathBuf::from("/proc/meminfo")
        );
        assert_eq!(
            crate::host::hw::meminfo::read(&root).map(|m| m.available),
            Some(98_304_000 * 1024)
        );
        assert_eq!(root.list("/sys/class/drm"), ["card1"]);
        assert!(root.list("/sys/class/none").is_empty());
        assert_eq!(
            root.value::<u64>("/sys/class/drm/card1/device/mem_info_gtt_used"),
            Ok(86_973_087_744)
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn errors_name_the_file_read() {
        let (dir, root) = tree();
        let missing = root
            .read("/sys/class/hwmon/hwmon9/temp1_input")
            .unwrap_err();
        assert!(
            missing.to_string().starts_with(&format!(
                "cannot read {}/sys/class/hwmon/hwmon9/temp1_input: ",
                dir.display()
            )),
            "{missing}"
        );
        std::fs::write(dir.join("proc/x"), "lots\n").unwrap();
        let bad = root.value::<u64>("/proc/x").unwrap_err().to_string();
        assert!(bad.contains("/proc/x: \"lots\": invalid digit"), "{bad}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn the_root_must_be_a_folder() {
        let e = SysRoot::new("/nonexistent/dsv4-root").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--sysroot /nonexistent/dsv4-root: "),
            "{e}"
        );
        let e = SysRoot::new("/proc/self/status").unwrap_err();
        assert_eq!(e.to_string(), "--sysroot /proc/self/status: not a folder");
    }
}
