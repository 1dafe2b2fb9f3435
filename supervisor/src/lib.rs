//! dsv4: the on-demand supervisor for a local LLM engine.
//!
//! The subsystems, from the bottom up. A module imports only from its own subsystem and from
//! those below it; `tests/integration/architecture.rs` reads every `crate::` path and fails on
//! an import that runs upward (the table there is this list):
//!
//! 1. [`log`]: where the log goes: its writer thread, the journal's entries and their fields.
//! 2. [`config`]: the settings, their files, their checks, the profiles.
//! 3. [`host`]: the machine as files: hardware readers, the sysfs root, the daemon's state files.
//! 4. [`kv`]: the KV checkpoints on disk and their book.
//! 5. [`lifecycle`]: the engine: the rules, the actor that carries them out, its spawn, its
//!    key, its connections, the KV steps, leftover engines, alerts.
//! 6. [`observe`]: what is measured: the host's samples, request statistics, `/metrics`.
//! 7. [`policy`]: what the machine's state changes: power settings, thermal rules.
//! 8. [`validate`]: validation runs.
//! 9. [`actions`]: what an operator may do (start, stop, profile, KV, validation): one path
//!    for D-Bus and the dashboard.
//! 10. [`parts`]: the handles both faces below serve from, bundled once.
//! 11. [`http`]: the API: listener, front door, keys, bodies, the proxy, its errors.
//! 12. [`control`]: D-Bus, systemd, reloads, exit when idle, the text of log lines.
//! 13. [`doctor`]: `dsv4d --doctor`: the machine checked against every promise, from the
//!     service's own place.
//! 14. [`cli`]: dsv4d's command line.

pub mod actions;
pub mod cli;
pub mod config;
pub mod control;
pub mod doctor;
pub mod host;
pub mod http;
pub mod kv;
pub mod lifecycle;
pub mod log;
pub mod observe;
pub mod parts;
pub mod policy;
pub mod validate;
