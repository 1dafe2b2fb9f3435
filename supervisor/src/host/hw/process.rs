//! The engine process's memory and CPU time, through `sysinfo`.
//!
//! Follows: proc(5) (`/proc/PID/stat`, `statm`), which sysinfo reads. Owns: a `sysinfo`
//! view refreshed for the one engine pid only (never a full process scan). Must not: read
//! other processes. Process figures come from this machine's own `/proc`, not the
//! `--sysroot` (a fixture tree has no processes).

use dsv4_client::telemetry::EngineProcess;
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

#[derive(Default)]
pub struct ProcessReader {
    sys: Option<System>,
}

impl ProcessReader {
    /// The process `pid`, if it exists.
    pub fn read(&mut self, pid: u32) -> Option<EngineProcess> {
        let sys = self.sys.get_or_insert_with(System::new);
        let spid = Pid::from_u32(pid);
        sys.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[spid]),
            true,
            ProcessRefreshKind::nothing().with_memory().with_cpu(),
        );
        let p = sys.process(spid)?;
        Some(EngineProcess {
            pid,
            rss_bytes: p.memory(),
            cpu_ms: p.accumulated_cpu_time(),
        })
    }

    /// Forgets the processes seen (when the engine is gone).
    pub fn clear(&mut self) {
        self.sys = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_read_and_a_missing_one_is_absent() {
        let mut r = ProcessReader::default();
        let me = r.read(std::process::id()).unwrap();
        assert_eq!(me.pid, std::process::id());
        assert!(me.rss_bytes > 1 << 20, "{me:?}");
        // Burn some CPU, then it shows.
        let t = tokio::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(30) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        assert!(x > 0);
        let again = r.read(std::process::id()).unwrap();
        assert!(again.cpu_ms >= me.cpu_ms);
        assert_eq!(r.read(u32::MAX - 7), None);
    }
}
