//! Where dsv4d's log goes: a writer thread of its own (`sink`), and under systemd the
//! journal, each event an entry with its priority and fields (`journal`, `entry`). The text
//! of a line on a terminal is `crate::control::log_format`'s.

pub mod entry;
pub mod journal;
pub mod sink;
