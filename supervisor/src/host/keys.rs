//! Key files: one key per line, read under the rules that keep them secret, and a key
//! compared in constant time. The API's and the dashboard's keys (`crate::http::auth`), the
//! keys of the coordinators a box lends to (`peers.keys_file`) and a worker's key on the
//! coordinator (`workers[].key_file`) are all read here.
//!
//! Must not: log, print or echo a key, or let the time a comparison takes depend on which
//! key matched or on how much of a key was right.

use std::fmt;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use subtle::{Choice, ConstantTimeEq};

/// Keys shorter than this are warned about at load: they can be guessed.
pub const SHORT_KEY: usize = 16;

/// The largest key file read (a key a line: thousands of keys in a few hundred KiB).
const KEY_FILE_MAX: u64 = 4 << 20;

/// The keys read from `api.api_keys_file`: at least one, none empty.
pub struct ApiKeys {
    keys: Vec<Box<[u8]>>,
    /// The lines (1-based) of keys shorter than [`SHORT_KEY`].
    short: Vec<usize>,
}

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiKeys({} redacted)", self.keys.len())
    }
}

/// Whether the key file's owner and folder leave it to dsv4d's user: the file is that
/// user's or root's, and its folder is that user's or root's and not writable by group or
/// others (who could replace the file). `me` is dsv4d's effective uid.
pub fn owner_problem(file_uid: u32, dir_uid: u32, dir_mode: u32, me: u32) -> Option<String> {
    let ours = |uid: u32| uid == me || uid == 0;
    if !ours(file_uid) {
        return Some(format!(
            "is owned by uid {file_uid}, not by dsv4d's user (uid {me}) or root"
        ));
    }
    if !ours(dir_uid) {
        return Some(format!(
            "is in a folder owned by uid {dir_uid}, not by dsv4d's user (uid {me}) or root"
        ));
    }
    if dir_mode & 0o022 != 0 {
        return Some(format!(
            "is in a folder that group or others may write (mode {:04o}), so they could \
             replace it",
            dir_mode & 0o7777
        ));
    }
    None
}

impl ApiKeys {
    /// Reads the key file at `path`: one key per line, blank lines and lines starting with `#`
    /// ignored, surrounding whitespace trimmed. The file must not be open to group or others
    /// (no bit of `0o077` set in its mode).
    pub fn load(path: &Path) -> Result<ApiKeys, String> {
        ApiKeys::load_as(path, "API key")
    }

    /// [`load`](Self::load), for keys that messages call `what` (`admin key`).
    pub fn load_as(path: &Path, what: &str) -> Result<ApiKeys, String> {
        let shown = path.display();
        // Opened without blocking (a FIFO would hang the open), and judged by what was opened,
        // not by whatever the path names a moment later.
        let (file, meta) = crate::host::regular::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => format!("the {what} file {e}"),
            _ => format!("cannot open the {what} file {shown}: {e}"),
        })?;
        // A systemd credential's folder is the service's alone, made by systemd.
        let credential = crate::config::is_credential(path);
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 && !credential {
            return Err(format!(
                "the {what} file {shown} may be read or written by group or others \
                 (mode {mode:04o}); run chmod 600 {shown}"
            ));
        }
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = std::fs::metadata(dir.unwrap_or(Path::new(".")))
            .map_err(|e| format!("cannot read the folder of the {what} file {shown}: {e}"))?;
        let me = nix::unistd::geteuid().as_raw();
        let owner = (!credential).then(|| owner_problem(meta.uid(), dir.uid(), dir.mode(), me));
        if let Some(problem) = owner.flatten() {
            return Err(format!("the {what} file {shown} {problem}"));
        }
        let mut text = String::new();
        file.take(KEY_FILE_MAX + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read the {what} file {shown}: {e}"))?;
        if text.len() as u64 > KEY_FILE_MAX {
            return Err(format!(
                "the {what} file {shown} is larger than {} KiB, the most a key file may be",
                KEY_FILE_MAX >> 10
            ));
        }
        ApiKeys::parse(&text).map_err(|e| format!("the {what} file {shown}: {e}"))
    }

    /// Parses the text of a key file. Errors name lines, never their content.
    pub fn parse(text: &str) -> Result<ApiKeys, String> {
        let mut keys = Vec::new();
        let mut short = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let key = line.trim();
            if key.is_empty() || key.starts_with('#') {
                continue;
            }
            if key.chars().any(char::is_control) {
                return Err(format!(
                    "line {}: the key holds a control character, which no HTTP header can carry",
                    n + 1
                ));
            }
            if key.chars().count() < SHORT_KEY {
                short.push(n + 1);
            }
            keys.push(Box::from(key.as_bytes()));
        }
        if keys.is_empty() {
            return Err(
                "holds no key (one key per line; blank lines and lines starting \
                        with # are ignored)"
                    .to_string(),
            );
        }
        Ok(ApiKeys { keys, short })
    }

    /// The lines (1-based) of keys shorter than [`SHORT_KEY`] characters.
    pub fn short_lines(&self) -> &[usize] {
        &self.short
    }

    /// The keys as text (each was read as text).
    pub fn texts(&self) -> impl Iterator<Item = String> + '_ {
        self.keys
            .iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
    }

    /// How many keys there are.
    pub fn count(&self) -> usize {
        self.keys.len()
    }

    /// Whether `candidate` is one of the keys. Every key is compared, each in time that
    /// depends only on the lengths (subtle's slice comparison returns at once when the
    /// lengths differ, which tells a caller no more than that no key has this length), and
    /// the results are combined without a branch: the time does not tell which key matched,
    /// or whether one did.
    pub fn matches(&self, candidate: &[u8]) -> Choice {
        let mut found = Choice::from(0);
        for key in &self.keys {
            found |= key.ct_eq(candidate);
        }
        found
    }
}
