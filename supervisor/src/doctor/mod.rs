//! `dsv4d --doctor`: the machine checked against every promise dsv4 makes, from where the
//! service runs.
//!
//! `dsv4ctl doctor` runs `dsv4d --doctor --part service` as the service user inside a copy of
//! the service's sandbox (`systemd-run` with `dsv4.service`'s own user, groups and
//! protections), so the file, device, engine and power checks see what the engine will see;
//! and `dsv4d --doctor --part host` as the caller, for what the sandbox hides (the kernel's
//! log, its command line). Each part prints its [`Check`]s as JSON. Owns: making each check,
//! from the configuration, the sysroot and what the engine says of itself. Must not: change
//! anything: the one fix it offers (a drop-in) is written by `dsv4ctl doctor --fix`.

pub mod flags;
pub mod gguf;
pub mod kernel;

pub use dsv4_client::doctor::{Check, DropIn, Verdict};
