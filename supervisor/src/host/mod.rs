//! The machine as files: the hardware readers (`hw`), the root they read below (`sysroot`,
//! `/` or a fixture tree), and the daemon's own state files (`state_file`).

pub mod hw;
pub mod state_file;
pub mod sysroot;
