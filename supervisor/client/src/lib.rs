//! The client side of dsv4's control interface: D-Bus names, the proxy for
//! `io.github.dsv4.Supervisor1`, and the JSON types of `Status()` / `GET /status`.
//!
//! Owns: the contract as a client sees it. Must not: depend on the daemon's internals;
//! `dsv4ctl` links this crate only, and the daemon's tests check that what it serves
//! parses into these types.

pub mod duration;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The well-known bus name, object path and interface of the supervisor.
pub const BUS_NAME: &str = "io.github.dsv4.Supervisor1";
pub const OBJECT_PATH: &str = "/io/github/dsv4/Supervisor1";
pub const INTERFACE: &str = "io.github.dsv4.Supervisor1";
/// The group whose members (and root) may change the supervisor's state.
pub const CONTROL_GROUP: &str = "dsv4";
/// Error names beyond the standard `org.freedesktop.DBus.Error.AccessDenied`.
pub const ERROR_UNKNOWN_PROFILE: &str = "io.github.dsv4.Supervisor1.Error.UnknownProfile";
pub const ERROR_FAILED: &str = "io.github.dsv4.Supervisor1.Error.Failed";

/// `io.github.dsv4.Supervisor1`.
///
/// Reading is open to every caller; `Start`, `Stop`, `StopNow` and `SetProfile` need root or
/// membership of the control group (`dsv4`), else `org.freedesktop.DBus.Error.AccessDenied`.
#[zbus::proxy(
    interface = "io.github.dsv4.Supervisor1",
    default_service = "io.github.dsv4.Supervisor1",
    default_path = "/io/github/dsv4/Supervisor1"
)]
pub trait Supervisor1 {
    /// Starts the engine of the active profile now.
    fn start(&self) -> zbus::Result<()>;
    /// Stops the engine once in-flight requests have finished.
    fn stop(&self) -> zbus::Result<()>;
    /// Stops the engine at once, cutting in-flight requests.
    fn stop_now(&self) -> zbus::Result<()>;
    /// Makes `name` the active profile (persisted); a running engine is drained and
    /// restarted with it.
    fn set_profile(&self, name: &str) -> zbus::Result<()>;
    /// The status as JSON (the same document as `GET /status`): see [`Status`].
    fn status(&self) -> zbus::Result<String>;
    /// The profiles as a JSON array: see [`ProfileInfo`].
    fn list_profiles(&self) -> zbus::Result<String>;
    /// Engine output lines numbered from `since` on (at most the last `max` of them), and the
    /// number to ask from next time. Numbers run across engine restarts.
    fn logs(&self, since: u64, max: u32) -> zbus::Result<(u64, Vec<String>)>;

    /// stopped | starting | ready | draining | stopping | backoff
    #[zbus(property)]
    fn state(&self) -> zbus::Result<String>;
    /// The active profile (the next start uses it).
    #[zbus(property)]
    fn profile(&self) -> zbus::Result<String>;
    /// The profile of the running engine; empty when none runs.
    #[zbus(property)]
    fn engine_profile(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn profiles(&self) -> zbus::Result<Vec<String>>;
    #[zbus(property)]
    fn in_flight(&self) -> zbus::Result<u32>;
    #[zbus(property)]
    fn waiting(&self) -> zbus::Result<u32>;
    /// 0 when no engine runs.
    #[zbus(property)]
    fn engine_pid(&self) -> zbus::Result<u32>;
    /// Unix time (s) at which the idle engine will be stopped; 0 when none.
    #[zbus(property)]
    fn idle_deadline(&self) -> zbus::Result<f64>;
    /// Why the last start failed or the engine died; empty when fine.
    #[zbus(property)]
    fn last_error(&self) -> zbus::Result<String>;

    /// `StateChanged(state, profile)`: the lifecycle state changed. (Named apart in Rust
    /// from the `State` property's own change stream.)
    #[zbus(signal, name = "StateChanged")]
    fn lifecycle_changed(&self, state: &str, profile: &str) -> zbus::Result<()>;
}

/// `Status()` / `GET /status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub state: String,
    pub profile: String,
    pub engine_profile: Option<String>,
    pub engine_pid: Option<u32>,
    pub generation: Option<u64>,
    pub in_flight: u32,
    pub waiting: usize,
    /// Unix time (s).
    pub idle_deadline: Option<f64>,
    /// Unix time (s).
    pub ready_since: Option<f64>,
    pub failures: u32,
    pub last_error: Option<String>,
    /// The running engine's profile changed in the configuration; it applies at the next start.
    #[serde(default)]
    pub restart_pending: bool,
    pub requests: Requests,
}

/// Request statistics: totals with token-weighted rates (tokens per second).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub decode_tok_s: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    pub long_prompt_requests: u64,
    pub long_prompt_prefill_tok_s: Option<f64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Requests {
    #[serde(flatten)]
    pub all: Totals,
    pub by_profile: BTreeMap<String, Totals>,
    pub recent: Vec<RequestRecord>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub profile: String,
    pub path: String,
    pub at: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub prefill_tok_s: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub prompt_ms: f64,
    pub decode_ms: f64,
    pub wall_ms: f64,
}

/// One entry of `ListProfiles()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileInfo {
    pub name: String,
    pub description: Option<String>,
    pub engine: String,
    pub context: Option<u32>,
    pub active: bool,
}
