//! The load test: how long the validation profile's engine takes from its spawn until it
//! serves, once with the page cache as it was and once after the model's files were dropped
//! from it, so the user sees whether a slow load is the disk's.
//!
//! Dropping is `posix_fadvise(POSIX_FADV_DONTNEED)` on each file, which needs no privilege
//! (unlike `/proc/sys/vm/drop_caches`) and touches no other file. It is done while no engine
//! runs: the kernel keeps pages that a process still maps.

use std::os::fd::AsFd;
use std::path::PathBuf;

use crate::config::Profile;

/// The files of `profile` its engine reads at load: the model (every shard) and the vision
/// projector.
pub fn files(profile: &Profile) -> Vec<PathBuf> {
    let mut files = Vec::new();
    if let Some(model) = &profile.params.model {
        files.extend(crate::config::model_files(model));
    }
    files.extend(profile.params.mmproj.iter().cloned());
    files
}

/// Asks the kernel to drop `files` from the page cache: how many bytes they hold in all.
/// A file that cannot be opened or advised is an error naming it.
pub fn drop_from_cache(files: &[PathBuf]) -> Result<u64, String> {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    let mut bytes = 0;
    for path in files {
        let shown = path.display();
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open {shown}: {e}"))?;
        let len = file
            .metadata()
            .map_err(|e| format!("cannot read {shown}: {e}"))?
            .len();
        posix_fadvise(file.as_fd(), 0, 0, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
            .map_err(|e| format!("cannot drop {shown} from the page cache: {e}"))?;
        bytes += len;
    }
    Ok(bytes)
}

/// How many bytes of `files` are in the page cache, by `mincore(2)` on a mapping of each
/// (nothing is read). A file that cannot be looked at counts as none.
pub fn cached(files: &[PathBuf]) -> u64 {
    files
        .iter()
        .filter_map(|f| resident(f).ok())
        .map(|(r, _)| r)
        .sum()
}

/// The bytes of `path` in the page cache, and its length.
pub fn resident(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    use std::os::fd::AsRawFd;
    /// The span asked about at once (its vector: one byte a page, 256 KiB).
    const CHUNK: usize = 1 << 30;
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok((0, 0));
    }
    // Safety: a private read-only mapping of a file this process opened, unmapped before
    // return; only its residency is asked, its bytes are never read.
    unsafe {
        let addr = nix::libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            nix::libc::PROT_READ,
            nix::libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        );
        if addr == nix::libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let page = nix::libc::sysconf(nix::libc::_SC_PAGESIZE).max(4096) as usize;
        let mut pages = vec![0u8; CHUNK / page];
        let (mut at, mut resident) = (0usize, 0u64);
        let mut failed = None;
        while at < len as usize {
            let span = (len as usize - at).min(CHUNK);
            let n = span.div_ceil(page);
            let start = (addr as *mut u8).add(at) as *mut nix::libc::c_void;
            if nix::libc::mincore(start, span, pages.as_mut_ptr()) != 0 {
                failed = Some(std::io::Error::last_os_error());
                break;
            }
            resident += pages[..n].iter().filter(|b| *b & 1 == 1).count() as u64 * page as u64;
            at += span;
        }
        nix::libc::munmap(addr, len as usize);
        match failed {
            Some(e) => Err(e),
            None => Ok((resident.min(len), len)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_file_leaves_the_page_cache() {
        // Beside the test binary, on the build's disk: on a tmpfs (/tmp may be one) the pages
        // are the file, and no advice drops them.
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let path = dir.path().join("model.gguf");
        // Written, then read: its pages are in the cache.
        std::fs::write(&path, vec![7u8; 8 << 20]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        let _ = std::fs::read(&path).unwrap();
        let (before, len) = resident(&path).unwrap();
        assert_eq!(len, 8 << 20);
        assert!(before > 0, "nothing of the file was cached to begin with");
        assert_eq!(drop_from_cache(std::slice::from_ref(&path)), Ok(8 << 20));
        let (after, _) = resident(&path).unwrap();
        assert!(after < before, "still {after} of {before} bytes cached");
        // A file that is not there is named.
        let missing = dir.path().join("gone.gguf");
        let e = drop_from_cache(&[missing]).unwrap_err();
        assert!(e.contains("gone.gguf"), "{e}");
    }
}
