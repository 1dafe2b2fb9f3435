//! The load test: how long the validation profile's engine takes from its spawn until it
//! serves, once with the page cache as it was and once after the model's files were dropped
//! from it, so the user sees whether a slow load is the disk's.
//!
//! Dropping is `posix_fadvise(POSIX_FADV_DONTNEED)` on each file, which needs no privilege
//! (unlike `/proc/sys/vm/drop_caches`) and touches no other file. It is done while no engine
//! runs: the kernel keeps pages that a process still maps. After the cold load, what the
//! engine did not read back itself is read back when memory allows: a validation does not
//! leave the box's next start colder than it found it.

use std::path::PathBuf;

use crate::host::pagecache;

/// Asks the kernel to drop `files` from the page cache: how many bytes they hold in all.
/// A file that cannot be opened or advised is an error naming it.
pub fn drop_from_cache(files: &[PathBuf]) -> Result<u64, String> {
    let mut bytes = 0;
    for path in files {
        let shown = path.display();
        let len = std::fs::metadata(path)
            .map_err(|e| format!("cannot read {shown}: {e}"))?
            .len();
        pagecache::evict(path)
            .map_err(|e| format!("cannot drop {shown} from the page cache: {e}"))?;
        bytes += len;
    }
    Ok(bytes)
}

/// How many bytes of `files` are in the page cache (`mincore`; nothing is read). A file
/// that cannot be looked at counts as none.
pub fn cached(files: &[PathBuf]) -> u64 {
    files
        .iter()
        .filter_map(|f| pagecache::residency(f).ok())
        .map(|r| r.resident)
        .sum()
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
        let r = pagecache::residency(&path).unwrap();
        let before = r.resident;
        assert_eq!(r.size, 8 << 20);
        assert!(before > 0, "nothing of the file was cached to begin with");
        assert_eq!(drop_from_cache(std::slice::from_ref(&path)), Ok(8 << 20));
        let after = cached(std::slice::from_ref(&path));
        assert!(after < before, "still {after} of {before} bytes cached");
        // A file that is not there is named.
        let missing = dir.path().join("gone.gguf");
        let e = drop_from_cache(&[missing]).unwrap_err();
        assert!(e.contains("gone.gguf"), "{e}");
    }
}
