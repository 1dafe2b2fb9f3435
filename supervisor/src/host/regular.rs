//! Reading the daemon's own files (in `state_dir`, the KV folder, the configuration) so that
//! what sits at a path cannot hang it: a FIFO blocks an `open` until a writer comes, and a
//! device or `/dev/zero` behind a link never ends a read.
//!
//! Owns: [`open`] (without blocking, then `fstat`: a regular file or a clear error naming the
//! path and what is there) and [`read`] (within a size). Must not: decide what a file that
//! cannot be read means (each caller treats it as it treats a damaged file).

use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The most any state file (`profile`, `engine-group`, `power-restore.json`, a KV manifest)
/// may hold; each is a few hundred bytes.
pub const STATE_MAX: u64 = 1 << 20;

/// What a file of type `meta` is, in messages: `a FIFO`, `a folder`.
pub fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    match () {
        _ if t.is_file() => "a regular file",
        _ if t.is_dir() => "a folder",
        _ if t.is_fifo() => "a FIFO (named pipe)",
        _ if t.is_socket() => "a socket",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ => "not a regular file",
    }
}

/// Opens `path` for reading without blocking (`O_NONBLOCK`: opening a FIFO would wait for a
/// writer) and checks, on what was opened, that it is a regular file. The error of anything
/// else names the path and what is there (kind `InvalidData`); a missing file is `NotFound`.
pub fn open(path: &Path) -> io::Result<(File, Metadata)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        let message = format!("{} is {}, not a regular file", path.display(), kind(&meta));
        return Err(io::Error::new(io::ErrorKind::InvalidData, message));
    }
    Ok((file, meta))
}

/// The bytes of the regular file at `path` ([`open`]), refused when larger than `max`.
pub fn read(path: &Path, max: u64) -> io::Result<Vec<u8>> {
    let (file, meta) = open(path)?;
    let mut bytes = Vec::with_capacity(meta.len().min(max) as usize);
    // Bounded by what is read, not by the size it had: it may grow meanwhile.
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        let message = format!(
            "{} is larger than {max} bytes, the most it may be",
            path.display()
        );
        return Err(io::Error::new(io::ErrorKind::InvalidData, message));
    }
    Ok(bytes)
}

/// [`read`], as UTF-8 text.
pub fn read_text(path: &Path, max: u64) -> io::Result<String> {
    String::from_utf8(read(path, max)?).map_err(|_| {
        let message = format!("{} is not UTF-8 text", path.display());
        io::Error::new(io::ErrorKind::InvalidData, message)
    })
}

/// [`read_text`] for a state file that may be missing: `None` when it is; when it cannot be
/// read (not a regular file, too large, unreadable), a warning naming it and `None`, as for
/// a damaged file, so that dsv4d carries on without it.
pub fn read_state(path: &Path) -> Option<String> {
    match read_text(path, STATE_MAX) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            tracing::warn!("{}; it is ignored", shown(path, &e));
            None
        }
    }
}

/// The error `e` about `path`, naming the path once.
pub fn shown(path: &Path, e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::InvalidData => e.to_string(),
        _ => format!("cannot read {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_regular_file_within_its_bound_is_read() {
        let dir = std::env::temp_dir().join(format!("dsv4-regular-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, "12345").unwrap();
        assert_eq!(read(&file, 5).unwrap(), b"12345");
        let e = read(&file, 4).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{} is larger than 4 bytes, the most it may be",
                file.display()
            )
        );

        // A FIFO with no writer: opening it for reading without O_NONBLOCK waits forever.
        let fifo = dir.join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = read(&fifo, 5).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let named = format!(
            "{} is a FIFO (named pipe), not a regular file",
            fifo.display()
        );
        assert_eq!(e.to_string(), named);
        assert_eq!(read_state(&fifo), None);
        // What a link leads to counts; so does a folder, and a device that never ends.
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero")).unwrap();
        let e = read(&dir.join("zero"), 5).unwrap_err().to_string();
        assert!(
            e.ends_with("zero is a character device, not a regular file"),
            "{e}"
        );
        let e = read(&dir, 5).unwrap_err().to_string();
        assert!(e.ends_with("is a folder, not a regular file"), "{e}");
        assert_eq!(read_state(&dir.join("missing")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
