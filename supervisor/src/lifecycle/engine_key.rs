//! The engine's key: a fresh random secret for each engine generation, so that the engine's
//! loopback port, which every local user can see (`ss`, the engine's argv) and connect to,
//! does not bypass the API keys.
//!
//! Owns: the private folder the keys are written to, and one key file per engine that can
//! take a key (llama-server's `--api-key-file`; an engine that takes it from its environment
//! gets the same secret there), removed when its [`EngineKey`] is dropped, which the
//! lifecycle actor does once that engine has exited. Must not: put a secret on an engine's
//! command line (`/proc/PID/cmdline` is readable by all) unless its profile asks for it
//! (`key_arg`), or in a log, or write one anywhere but a folder that only dsv4d's user can
//! enter.
//!
//! The folder is `engine-keys` below systemd's `$RUNTIME_DIRECTORY` when there is one (a
//! tmpfs: the secrets never reach a disk), else below `state_dir`. dsv4d creates it with mode
//! 0700 and refuses one that is not its own or that group or others may enter.

use std::fs::{DirBuilder, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use http::HeaderValue;

/// The folder's name below the runtime or state folder.
const FOLDER: &str = "engine-keys";
/// Random bytes per secret: 256 bits from the kernel's generator.
const SECRET_BYTES: usize = 32;

/// Why a key could not be made.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot create the engine key folder {path}: {source}")]
    CreateFolder { path: PathBuf, source: io::Error },
    #[error("cannot inspect the engine key folder {path}: {source}")]
    InspectFolder { path: PathBuf, source: io::Error },
    #[error("refusing the engine key folder {path}: {problem}")]
    NotPrivate { path: PathBuf, problem: String },
    #[error("cannot write the engine key file {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read random bytes from /dev/urandom for the engine key: {0}")]
    Random(io::Error),
}

/// Where engine keys are written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFolder {
    path: PathBuf,
}

impl KeyFolder {
    /// The key folder below `base` (systemd's runtime folder, or `state_dir`).
    pub fn below(base: &Path) -> KeyFolder {
        KeyFolder {
            path: base.join(FOLDER),
        }
    }

    /// The folder below `$RUNTIME_DIRECTORY` (its first entry, when systemd lists several)
    /// if systemd set one, else below `state_dir`.
    pub fn for_daemon(state_dir: &Path) -> KeyFolder {
        let runtime = std::env::var_os("RUNTIME_DIRECTORY")
            .and_then(|v| std::env::split_paths(&v).next())
            .filter(|p| p.is_absolute());
        KeyFolder::below(runtime.as_deref().unwrap_or(state_dir))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Makes sure the folder exists and is private, and removes the key files a previous
    /// dsv4d left behind (one that was killed had no chance to): at start-up, before any
    /// engine of this daemon exists.
    pub fn prepare(&self) -> Result<(), KeyError> {
        self.ensure()?;
        let entries = std::fs::read_dir(&self.path).map_err(|source| KeyError::InspectFolder {
            path: self.path.clone(),
            source,
        })?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("engine-") && name.ends_with(".key") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }

    /// A fresh secret for engine generation `gen`, written to its own file of mode 0600
    /// (created with that mode) in the folder, which is checked again first.
    pub fn issue(&self, gen: u64) -> Result<EngineKey, KeyError> {
        self.ensure()?;
        let secret = random_secret()?;
        let path = self.path.join(format!("engine-{gen}.key"));
        let write_err = |source| KeyError::Write {
            path: path.clone(),
            source,
        };
        // Nobody else can enter the folder, so a file of that name is one of ours from an
        // earlier daemon.
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(write_err(e)),
            _ => {}
        }
        // `create_new` (O_EXCL) also refuses to follow a symbolic link.
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(write_err)?;
        // From here on the file is removed when the key is dropped, also on a failed write.
        let file_guard = KeyFile { path: path.clone() };
        file.write_all(format!("{secret}\n").as_bytes())
            .map_err(write_err)?;
        let mut authorization = HeaderValue::try_from(format!("Bearer {secret}"))
            .map_err(|e| write_err(io::Error::other(e)))?;
        authorization.set_sensitive(true);
        Ok(EngineKey {
            file: file_guard,
            authorization,
            secret: Secret(secret),
        })
    }

    /// Creates the folder (mode 0700) when it is missing, and checks that it is private.
    fn ensure(&self) -> Result<(), KeyError> {
        let path = &self.path;
        let create_err = |source| KeyError::CreateFolder {
            path: path.clone(),
            source,
        };
        // The runtime or state folder itself is made as `state_dir` is elsewhere; the key
        // folder with no rights for anyone else from the start.
        if let Some(base) = path.parent() {
            std::fs::create_dir_all(base).map_err(create_err)?;
        }
        match DirBuilder::new().mode(0o700).create(path) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(create_err(e)),
            _ => {}
        }
        let meta = std::fs::symlink_metadata(path).map_err(|source| KeyError::InspectFolder {
            path: path.clone(),
            source,
        })?;
        let euid = nix::unistd::geteuid().as_raw();
        match folder_problem(
            path,
            meta.file_type().is_dir(),
            meta.uid(),
            meta.mode(),
            euid,
        ) {
            Some(problem) => Err(KeyError::NotPrivate {
                path: path.clone(),
                problem,
            }),
            None => Ok(()),
        }
    }
}

/// What is wrong with the key folder `path` of this type, owner and mode for a daemon running
/// as `euid`, if anything.
fn folder_problem(path: &Path, is_dir: bool, owner: u32, mode: u32, euid: u32) -> Option<String> {
    if !is_dir {
        return Some("it is not a folder (a symbolic link or a file); remove it".into());
    }
    if owner != euid {
        return Some(format!(
            "it is owned by uid {owner}, not by the user dsv4d runs as (uid {euid}); remove it \
             and dsv4d makes its own"
        ));
    }
    if mode & 0o077 != 0 {
        return Some(format!(
            "group or others may use it (mode {:04o}); run chmod 700 {}",
            mode & 0o7777,
            path.display()
        ));
    }
    None
}

/// `SECRET_BYTES` from the kernel's generator, in hex: printable, one line, and a valid
/// header value.
fn random_secret() -> Result<String, KeyError> {
    random_hex(SECRET_BYTES).map_err(KeyError::Random)
}

/// `n` bytes from the kernel's random source, in hex.
pub(crate) fn random_hex(n: usize) -> io::Result<String> {
    let mut bytes = vec![0u8; n];
    random_bytes(&mut bytes)?;
    Ok(hex::encode(bytes))
}

/// Fills `bytes` from the kernel's random source.
pub(crate) fn random_bytes(bytes: &mut [u8]) -> io::Result<()> {
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(bytes))
}

/// One engine generation's key: the file the engine reads it from, and the header dsv4d sends
/// it in. Dropping it removes the file.
#[derive(Debug)]
pub struct EngineKey {
    file: KeyFile,
    authorization: HeaderValue,
    /// Handed to an engine that takes its key from its environment or command line.
    secret: Secret,
}

/// A secret that `Debug` does not show.
struct Secret(String);

impl std::ops::Deref for Secret {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl EngineKey {
    /// The file that holds the secret, for the engine's `--api-key-file`.
    pub fn path(&self) -> &Path {
        &self.file.path
    }

    /// The secret and its file, as the engine is given them (see
    /// [`dsv4_engine::KeyPassing`]).
    pub fn given(&self) -> dsv4_engine::GivenKey<'_> {
        dsv4_engine::GivenKey {
            file: &self.file.path,
            secret: &self.secret,
        }
    }

    /// `Authorization: Bearer <secret>`, marked sensitive (never shown by `Debug`).
    pub fn authorization(&self) -> &HeaderValue {
        &self.authorization
    }
}

/// A key file, removed on drop.
#[derive(Debug)]
struct KeyFile {
    path: PathBuf,
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!("cannot remove the engine key {}: {e}", self.path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "dsv4-engine-key-{}-{}",
            std::process::id(),
            random_secret().unwrap()
        ));
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn a_key_is_a_fresh_secret_in_a_private_file_removed_on_drop() {
        let base = temp();
        let folder = KeyFolder::below(&base);
        let one = folder.issue(1).unwrap();
        let two = folder.issue(2).unwrap();
        let meta = std::fs::metadata(folder.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
        for key in [&one, &two] {
            let meta = std::fs::metadata(key.path()).unwrap();
            assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
            let text = std::fs::read_to_string(key.path()).unwrap();
            let secret = text.strip_suffix('\n').unwrap();
            assert_eq!(secret.len(), 2 * SECRET_BYTES);
            assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{secret}");
            assert_eq!(
                key.authorization().to_str().unwrap(),
                format!("Bearer {secret}")
            );
            assert!(key.authorization().is_sensitive());
            assert!(!format!("{key:?}").contains(secret));
        }
        assert_ne!(one.authorization(), two.authorization());
        let path = one.path().to_path_buf();
        drop(one);
        assert!(!path.exists());
        assert!(two.path().exists());
        drop(two);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn leftovers_are_removed_and_a_stale_file_is_replaced() {
        let base = temp();
        let folder = KeyFolder::below(&base);
        folder.prepare().unwrap();
        let stale = folder.path().join("engine-1.key");
        std::fs::write(&stale, "old\n").unwrap();
        let key = folder.issue(1).unwrap();
        assert_ne!(std::fs::read_to_string(key.path()).unwrap(), "old\n");
        std::mem::forget(key);
        std::fs::write(folder.path().join("engine-7.key"), "old\n").unwrap();
        std::fs::write(folder.path().join("notes"), "kept\n").unwrap();
        folder.prepare().unwrap();
        let mut left: Vec<_> = std::fs::read_dir(folder.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["notes"]);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn an_open_folder_is_refused_and_left_as_it_is() {
        let base = temp();
        let folder = KeyFolder::below(&base);
        std::fs::create_dir(folder.path()).unwrap();
        std::fs::set_permissions(folder.path(), std::fs::Permissions::from_mode(0o750)).unwrap();
        let err = folder.issue(1).unwrap_err().to_string();
        let path = folder.path().display();
        assert_eq!(
            err,
            format!(
                "refusing the engine key folder {path}: group or others may use it (mode \
                 0750); run chmod 700 {path}"
            )
        );
        let mode = std::fs::metadata(folder.path())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o7777, 0o750);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn a_missing_base_folder_is_made() {
        let base = temp();
        let folder = KeyFolder::below(&base.join("state"));
        folder.prepare().unwrap();
        let meta = std::fs::metadata(folder.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
        std::fs::remove_dir_all(base).unwrap();
    }

    #[test]
    fn what_makes_a_folder_not_private() {
        let k = Path::new("/k");
        assert_eq!(folder_problem(k, true, 1000, 0o40700, 1000), None);
        assert!(folder_problem(k, false, 1000, 0o120777, 1000)
            .unwrap()
            .contains("not a folder"));
        assert_eq!(
            folder_problem(k, true, 65534, 0o40700, 1000).as_deref(),
            Some(
                "it is owned by uid 65534, not by the user dsv4d runs as (uid 1000); remove \
                 it and dsv4d makes its own"
            )
        );
        for open in [0o40701, 0o40710, 0o40755, 0o40777, 0o41777] {
            let why = folder_problem(k, true, 0, open, 0).unwrap();
            assert!(why.starts_with("group or others may use it"), "{why}");
            assert!(why.ends_with("; run chmod 700 /k"), "{why}");
        }
    }
}
