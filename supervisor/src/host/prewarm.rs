//! Reading a model back into the page cache after an idle stop (`engine.prewarm`), so that
//! the next load is warm: an 80 GiB GGUF loads in seconds from the page cache and in a minute
//! or more from the disk. A validation's cold-load test reads the model back with it too.
//!
//! Owns: the reading, on a thread of its own at idle I/O priority, chunk by chunk, and why it
//! stopped. Must not: push out what the box needs (it reads no more than the memory available
//! less `memory.reserve`, and stops when memory pressure rises), or hold up a start (it stops
//! before its next chunk once one begins).

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::host::hw::meminfo;
use crate::host::pagecache;
use crate::host::sysroot::SysRoot;

/// Read at once; a start waits for no more than one of these.
pub const CHUNK: u64 = 8 << 20;
/// `some avg10` of `/proc/pressure/memory` (the share of the last 10 s in which some task
/// waited for memory, in percent) at or above which the reading stops.
pub const PRESSURE_LIMIT: f64 = 10.0;
const PRESSURE: &str = "/proc/pressure/memory";

/// Why the reading ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Every byte of the files is in the page cache.
    Done,
    /// A start began.
    Started,
    /// The next chunk would not fit in what is available beyond `memory.reserve`.
    Memory {
        room: u64,
    },
    Pressure {
        avg10: f64,
    },
    Failed(String),
}

/// What a run did: bytes read, bytes found in the page cache already, of `total`.
#[derive(Debug, Clone, PartialEq)]
pub struct Prewarmed {
    pub read: u64,
    pub found: u64,
    pub total: u64,
    pub ended: Ended,
}

impl Prewarmed {
    /// One line for the journal.
    pub fn said(&self) -> String {
        let size = crate::config::format_size;
        let how = match &self.ended {
            Ended::Done => "done".to_string(),
            Ended::Started => "stopped: a start began".to_string(),
            Ended::Memory { room } => format!(
                "stopped at the memory limit: {} available beyond memory.reserve",
                size(*room)
            ),
            Ended::Pressure { avg10 } => format!(
                "stopped: memory pressure (some avg10 {avg10:.1}%, the limit {PRESSURE_LIMIT}%)"
            ),
            Ended::Failed(why) => format!("stopped: {why}"),
        };
        format!(
            "read {} of {} back into the page cache ({} of it was there): {how}",
            size(self.read),
            size(self.total),
            size(self.found)
        )
    }
}

/// Reads `files` into the page cache, chunk by chunk, skipping what is there; before each
/// chunk, stops if `started()` says a start began, if memory pressure is at the limit, or if
/// the chunk would take the bytes read beyond what `root`'s memory has available less
/// `reserve`. Blocking: run it on a thread of its own ([`idle_io_priority`] first).
pub fn run(
    files: &[PathBuf],
    root: &SysRoot,
    reserve: u64,
    started: &dyn Fn() -> bool,
) -> Prewarmed {
    let total = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    let mut done = Prewarmed {
        read: 0,
        found: 0,
        total,
        ended: Ended::Done,
    };
    let mut buf = vec![0u8; CHUNK as usize];
    for path in files {
        if let Err(ended) = file(path, root, reserve, started, &mut buf, &mut done) {
            done.ended = ended;
            return done;
        }
    }
    done
}

/// One file of [`run`]: `Err` with why it stopped.
fn file(
    path: &std::path::Path,
    root: &SysRoot,
    reserve: u64,
    started: &dyn Fn() -> bool,
    buf: &mut [u8],
    done: &mut Prewarmed,
) -> Result<(), Ended> {
    let failed = |e: std::io::Error| Ended::Failed(format!("{}: {e}", path.display()));
    let f = std::fs::File::open(path).map_err(failed)?;
    let len = f.metadata().map_err(failed)?.len();
    let mut at = 0;
    while at < len {
        let n = CHUNK.min(len - at);
        if started() {
            return Err(Ended::Started);
        }
        if let Some(avg10) = pressure(root).filter(|p| *p >= PRESSURE_LIMIT) {
            return Err(Ended::Pressure { avg10 });
        }
        let there = pagecache::resident_in(&f, at, n).map_err(failed)?;
        if there < n {
            let room = meminfo::admissible(root)
                .ok_or_else(|| Ended::Failed(format!("no MemAvailable in {}", meminfo::PATH)))?
                .saturating_sub(reserve);
            if done.read + n > room {
                return Err(Ended::Memory { room });
            }
            f.read_exact_at(&mut buf[..n as usize], at)
                .map_err(failed)?;
            done.read += n;
        } else {
            done.found += n;
        }
        at += n;
    }
    Ok(())
}

/// `some avg10` of the memory pressure file, when the kernel has one (`CONFIG_PSI`).
fn pressure(root: &SysRoot) -> Option<f64> {
    let text = root.read(PRESSURE).ok()?;
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace()
        .find_map(|w| w.strip_prefix("avg10="))?
        .parse()
        .ok()
}

/// Puts the calling thread's disk reads in the idle class (`ioprio_set(2)`): served only when
/// no other process wants the disk.
pub fn idle_io_priority() -> std::io::Result<()> {
    const IOPRIO_WHO_PROCESS: nix::libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: nix::libc::c_long = 3;
    const IOPRIO_CLASS_SHIFT: nix::libc::c_long = 13;
    // SAFETY: ioprio_set(2) takes three integers; `who` 0 is the calling thread.
    let r = unsafe {
        nix::libc::syscall(
            nix::libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        )
    };
    match r {
        -1 => Err(std::io::Error::last_os_error()),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A file of `mib` MiB on the build's disk (not /tmp, which may be a tmpfs), out of the
    /// page cache.
    fn evicted(dir: &std::path::Path, mib: usize) -> PathBuf {
        let path = dir.join("model.gguf");
        std::fs::write(&path, vec![7u8; mib << 20]).unwrap();
        std::fs::File::open(&path).unwrap().sync_all().unwrap();
        pagecache::evict(&path).unwrap();
        path
    }

    /// A sysroot whose meminfo says `available_kib` and whose pressure file says `avg10`.
    fn root(available_kib: u64, avg10: f64) -> (tempfile::TempDir, SysRoot) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc/pressure")).unwrap();
        std::fs::write(
            dir.path().join("proc/meminfo"),
            format!("MemTotal: 131072000 kB\nMemAvailable: {available_kib} kB\n"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("proc/pressure/memory"),
            format!("some avg10={avg10:.2} avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"),
        )
        .unwrap();
        let root = SysRoot::new(dir.path()).unwrap();
        (dir, root)
    }

    #[test]
    fn it_reads_what_is_missing_and_stops_for_a_start_memory_or_pressure() {
        let build =
            tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let model = evicted(build.path(), 48);
        let files = [model.clone()];
        let never = || false;
        // Plenty of memory: all of it read, and in the page cache after.
        let (_t, plenty) = root(64 << 20, 0.0);
        let r = run(&files, &plenty, 0, &never);
        // (What the kernel reads ahead of a chunk is found there by the next.)
        assert_eq!(
            (r.read + r.found, r.total, &r.ended),
            (48 << 20, 48 << 20, &Ended::Done)
        );
        assert!(r.read >= CHUNK, "{r:?}");
        assert!(pagecache::residency(&model).unwrap().percent() > 99.0);
        // Again: found there, nothing read.
        let r = run(&files, &plenty, 0, &never);
        assert_eq!((r.read, r.found), (0, 48 << 20));
        // Room for one chunk beyond the reserve: one chunk read.
        pagecache::evict(&model).unwrap();
        let (_t, tight) = root((1 << 20) + 12 * 1024, 0.0);
        let r = run(&files, &tight, 1 << 30, &never);
        assert_eq!(r.read, CHUNK);
        assert_eq!(r.ended, Ended::Memory { room: 12 << 20 });
        assert!(
            r.said().contains("stopped at the memory limit: 12.0 MiB"),
            "{}",
            r.said()
        );
        // A start begins after the first chunk: it stops before the second.
        pagecache::evict(&model).unwrap();
        let asked = Cell::new(0);
        let started = || {
            asked.set(asked.get() + 1);
            asked.get() > 1
        };
        let r = run(&files, &plenty, 0, &started);
        assert_eq!((r.read, &r.ended), (CHUNK, &Ended::Started));
        // Memory pressure: nothing read.
        let (_t, pressed) = root(64 << 20, 12.5);
        let r = run(&files, &pressed, 0, &never);
        assert_eq!((r.read, &r.ended), (0, &Ended::Pressure { avg10: 12.5 }));
        // A file that is gone is named.
        let r = run(&[build.path().join("gone.gguf")], &plenty, 0, &never);
        assert!(
            matches!(&r.ended, Ended::Failed(why) if why.contains("gone.gguf")),
            "{r:?}"
        );
    }

    #[test]
    fn the_thread_can_take_the_idle_class() {
        std::thread::spawn(|| idle_io_priority().unwrap())
            .join()
            .unwrap();
    }
}
