//! The machine as files: the hardware readers (`hw`), the root they read below (`sysroot`,
//! `/` or a fixture tree), the daemon's own state files (`state_file`), and reading any file
//! of its own without a FIFO or a device hanging it (`regular`).

pub mod hw;
pub mod regular;
pub mod state_file;
pub mod sysroot;
