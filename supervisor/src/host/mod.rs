//! The machine as files: the hardware readers (`hw`), the root they read below (`sysroot`,
//! `/` or a fixture tree), the daemon's own state files (`state_file`, `load_times`), reading
//! any file of its own without a FIFO or a device hanging it (`regular`), and the process's
//! own open-file limits ([`open_file_limits`]), and the helper units dsv4d starts through
//! systemd (`units`).

pub mod gguf;
pub mod hw;
pub mod identity;
pub mod keys;
pub mod load_times;
pub mod pagecache;
pub mod prewarm;
pub mod regular;
pub mod run;
pub mod state_file;
pub mod sysroot;
pub mod units;

use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};

/// The open-file limits in force (soft and hard; `None`: unlimited), for the status.
pub fn open_file_limits() -> dsv4_client::Limits {
    let finite = |n: u64| (n != RLIM_INFINITY).then_some(n);
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => dsv4_client::Limits {
            open_files: finite(soft),
            open_files_hard: finite(hard),
        },
        Err(_) => dsv4_client::Limits::default(),
    }
}
