//! How much of a file the page cache holds (`mincore(2)` over a read-only map of it): what
//! decides whether the next engine load is warm or cold. An 80 GiB GGUF loads in seconds
//! from the page cache and in a minute or more from the disk.
//!
//! Owns: the measure, and the eviction of a validation's cold-load test ([`evict`]; reading
//! back is [`crate::host::prewarm`]'s). Must not: read the file's data (a map that is never
//! touched faults nothing in), or change what the cache holds for anything else.

use std::os::fd::AsFd;
use std::path::Path;

/// How much of the file is mapped at a time: the residency vector stays small (a byte a
/// page: 256 KiB for a GiB of 4 KiB pages) however large the model.
const WINDOW: u64 = 1 << 30;

/// A file's bytes in the page cache, of its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Residency {
    pub resident: u64,
    pub size: u64,
}

impl Residency {
    /// The share held, in percent (100 for an empty file).
    pub fn percent(&self) -> f64 {
        if self.size == 0 {
            return 100.0;
        }
        self.resident as f64 * 100.0 / self.size as f64
    }

    /// Two files' together.
    pub fn plus(self, other: Residency) -> Residency {
        Residency {
            resident: self.resident + other.resident,
            size: self.size + other.size,
        }
    }
}

/// The bytes of `path` in the page cache now. A page counts whole (its last one too, as
/// `fincore` counts it), so `resident` is a multiple of the page size, capped at the size.
pub fn residency(path: &Path) -> std::io::Result<Residency> {
    let file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let page = page_size();
    let mut resident = 0u64;
    let mut at = 0u64;
    while at < size {
        let len = (size - at).min(WINDOW);
        resident += window(&file, at, len, page)? * page;
        at += len;
    }
    Ok(Residency {
        resident: resident.min(size),
        size,
    })
}

fn page_size() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .and_then(|p| u64::try_from(p).ok())
        .unwrap_or(4096)
}

/// The bytes of the `len` bytes of `file` from `at` (a multiple of the page size, at most a
/// GiB) that are in the page cache, a page counting whole.
pub fn resident_in(file: &std::fs::File, at: u64, len: u64) -> std::io::Result<u64> {
    let page = page_size();
    Ok((window(file, at, len, page)? * page).min(len))
}

/// The resident pages of the `len` bytes of `file` from `at` (a multiple of the page size).
fn window(file: &std::fs::File, at: u64, len: u64, page: u64) -> std::io::Result<u64> {
    use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
    let length = std::num::NonZeroUsize::new(usize::try_from(len).map_err(std::io::Error::other)?)
        .ok_or_else(|| std::io::Error::other("an empty window"))?;
    let offset = nix::libc::off_t::try_from(at).map_err(std::io::Error::other)?;
    // SAFETY: a private read-only map of a file this process opened, never read through
    // here (only its pages' residency is asked for), and unmapped below.
    let map = unsafe {
        mmap(
            None,
            length,
            ProtFlags::PROT_READ,
            MapFlags::MAP_SHARED,
            file.as_fd(),
            offset,
        )
    }
    .map_err(std::io::Error::from)?;
    let pages = usize::try_from(len.div_ceil(page)).map_err(std::io::Error::other)?;
    let mut vec = vec![0u8; pages];
    // SAFETY: `map` is a live mapping of `length` bytes, and `vec` has a byte for each of
    // its pages, as mincore(2) wants.
    let asked = unsafe { nix::libc::mincore(map.as_ptr(), length.get(), vec.as_mut_ptr()) };
    let err = std::io::Error::last_os_error();
    // SAFETY: the mapping made above, of that length, used no more.
    let _ = unsafe { munmap(map, length.get()) };
    if asked != 0 {
        return Err(err);
    }
    Ok(vec.iter().filter(|b| **b & 1 == 1).count() as u64)
}

/// Drops `path`'s pages from the page cache (`POSIX_FADV_DONTNEED`; clean pages only): for
/// the tests and a validation's cold-load test (which reads them back with
/// [`crate::host::prewarm::run`]), never for a load of the user's.
pub fn evict(path: &Path) -> std::io::Result<()> {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    let file = std::fs::File::open(path)?;
    posix_fadvise(file.as_fd(), 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
        .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// What `fincore --bytes --noheadings --output RES` says of `path`.
    fn fincore(path: &Path) -> u64 {
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--output", "RES"])
            .arg(path)
            .output()
            .expect("fincore (util-linux)");
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    #[test]
    fn the_figure_follows_fincore_for_a_file_read_and_evicted() {
        // Not /tmp, which may be a tmpfs: its pages are never evicted.
        let dir = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let path = dir.path().join("model.gguf");
        // Not a whole number of pages: the last page counts as fincore counts it.
        let mut f = std::fs::File::create(&path).unwrap();
        let block = vec![7u8; 1 << 20];
        for _ in 0..24 {
            f.write_all(&block).unwrap();
        }
        f.write_all(&[1u8; 1000]).unwrap();
        f.sync_all().unwrap();
        drop(f);
        let size = std::fs::metadata(&path).unwrap().len();
        evict(&path).unwrap();
        let cold = residency(&path).unwrap();
        assert_eq!(cold.size, size);
        let page = 4096;
        assert!(cold.resident.abs_diff(fincore(&path)) <= page, "{cold:?}");
        assert!(cold.percent() < 50.0, "{cold:?}");
        // Read whole: warm.
        let mut all = Vec::new();
        std::fs::File::open(&path)
            .unwrap()
            .read_to_end(&mut all)
            .unwrap();
        let warm = residency(&path).unwrap();
        assert!(warm.resident.abs_diff(fincore(&path)) <= page, "{warm:?}");
        assert!(warm.percent() > 99.0, "{warm:?}");
        // Evicted again: cold, as fincore says.
        evict(&path).unwrap();
        let again = residency(&path).unwrap();
        assert!(again.resident.abs_diff(fincore(&path)) <= page, "{again:?}");
        assert!(again.resident < warm.resident, "{again:?} {warm:?}");
        // Read back in (as a validation's cold-load test does): warm again.
        let root = crate::host::sysroot::SysRoot::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/sysfs/strix-halo"
        ))
        .unwrap();
        let r = crate::host::prewarm::run(std::slice::from_ref(&path), &root, 0, &|| false);
        assert_eq!(r.read + r.found, size, "{r:?}");
        let back = residency(&path).unwrap();
        assert!(back.percent() > 99.0, "{back:?}");
        assert!(back.resident.abs_diff(fincore(&path)) <= page, "{back:?}");
    }

    #[test]
    fn an_empty_or_missing_file_is_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "").unwrap();
        let r = residency(&empty).unwrap();
        assert_eq!((r.resident, r.size), (0, 0));
        assert_eq!(r.percent(), 100.0);
        assert!(residency(&dir.path().join("none")).is_err());
    }
}
