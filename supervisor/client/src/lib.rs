//! The client side of dsv4's control interface: D-Bus names, the proxy for
//! `io.github.dsv4.Supervisor1`, and the JSON types of `Status()` / `GET /status`.
//!
//! Owns: the project's shared vocabulary: the engine [`State`], the [`Status`] document, the
//! [`Bus`], [`ProfileInfo`] and the [`AlertKind`]s. The daemon publishes these very types and
//! `dsv4ctl` parses them, so the two cannot drift apart. Must not: depend on the daemon's
//! internals; `dsv4ctl` links this crate only.

pub mod clock;
pub mod doctor;
pub mod duration;
pub mod identity;
pub mod kv;
pub mod telemetry;
pub mod text;
pub mod units;
pub mod validate;
pub mod words;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

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
/// `StartAndWait()` was answered with a refusal: the engine did not start (its message says
/// why, with the engine's last lines), the start timed out, or it was cancelled.
pub const ERROR_START_FAILED: &str = "io.github.dsv4.Supervisor1.Error.StartFailed";
/// The longest `WaitLogs()` waits for a line, whatever the caller asks.
pub const WAIT_LOGS_MAX_MS: u32 = 10_000;

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
    /// Starts the engine of the active profile (a failed start's backoff is skipped) and
    /// returns once it is ready, with the profile it runs; or fails with
    /// [`ERROR_START_FAILED`] and the reason (the engine's last lines included) as soon as the
    /// start fails, times out or is cancelled. It waits like a request does, so it can take
    /// as long as the engine takes to load (at most `engine.start_timeout`).
    fn start_and_wait(&self) -> zbus::Result<String>;
    /// Stops the engine once in-flight requests have finished.
    fn stop(&self) -> zbus::Result<()>;
    /// Stops the engine at once, cutting in-flight requests.
    fn stop_now(&self) -> zbus::Result<()>;
    /// Makes `name` the active profile (persisted); a running engine is drained and
    /// restarted with it.
    fn set_profile(&self, name: &str) -> zbus::Result<()>;
    /// The status as JSON (the same document as `GET /status`): see [`Status`].
    fn status(&self) -> zbus::Result<String>;
    /// The KV checkpoints on disk as a JSON array: see [`kv::KvCheckpoint`].
    fn kv_checkpoints(&self) -> zbus::Result<String>;
    /// Removes the KV checkpoints `what` names (`all`, a profile, an id); the ids removed,
    /// as a JSON array. Root and the `dsv4` group only.
    fn drop_kv(&self, what: &str) -> zbus::Result<String>;
    /// Starts a validation run: `request` is a [`validate::ValidateRequest`] as JSON; the
    /// answer is the validation profile. Root and the `dsv4` group only.
    fn validate(&self, request: &str) -> zbus::Result<String>;
    /// Ends the running validation; `false` when none runs.
    fn cancel_validation(&self) -> zbus::Result<bool>;
    /// Records the drifted canary of `profile` as its reference (a profile held by
    /// `canary.hold` serves again); answers what was done. Root and the `dsv4` group only.
    fn canary_accept(&self, profile: &str) -> zbus::Result<String>;
    /// The kept validation results of `profile` (all with ""), newest first, as JSON.
    fn validations(&self, profile: &str) -> zbus::Result<String>;
    /// A [`validate::Progress`] of the running validation, as JSON.
    #[zbus(signal)]
    fn validation_progress(&self, progress: &str) -> zbus::Result<()>;
    /// The [`validate::ValidationResult`] of the validation that just ended, as JSON.
    #[zbus(signal)]
    fn validation_done(&self, result: &str) -> zbus::Result<()>;
    /// The profiles as a JSON array: see [`ProfileInfo`].
    fn list_profiles(&self) -> zbus::Result<String>;
    /// The samples of the host taken at or after `since` (unix s), oldest first, at most
    /// `max` (the newest ones; an hour at most), as a JSON array of
    /// [`telemetry::Sample`]s. The daemon keeps the last hour.
    fn history(&self, since: f64, max: u32) -> zbus::Result<String>;
    /// Engine output lines numbered from `since` on (at most the last `max` of them), and the
    /// number to ask from next time. Numbers run across engine restarts.
    fn logs(&self, since: u64, max: u32) -> zbus::Result<(u64, Vec<String>)>;
    /// As [`logs`](Self::logs), but when no line numbered `since` or later exists yet, waits
    /// up to `wait_ms` (at most [`WAIT_LOGS_MAX_MS`]) for the engine to write one: `logs -f`
    /// asks again as soon as it has an answer, and costs nothing while the engine is quiet.
    fn wait_logs(&self, since: u64, max: u32, wait_ms: u32) -> zbus::Result<(u64, Vec<String>)>;

    /// A [`State`] by name (`.parse::<State>()`).
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
    /// The requests in flight with their phases: the status's `in_progress`, as JSON (a
    /// [`Vec<InProgress>`]). Never announced (it changes with every token): read it when
    /// wanted.
    #[zbus(property(emits_changed_signal = "false"))]
    fn in_progress(&self) -> zbus::Result<String>;

    /// `StateChanged(state, profile)`: the lifecycle state changed. (Named apart in Rust
    /// from the `State` property's own change stream.)
    #[zbus(signal, name = "StateChanged")]
    fn lifecycle_changed(&self, state: State, profile: &str) -> zbus::Result<()>;

    /// `Alert(kind, message)`: something a desktop user should hear about.
    #[zbus(signal)]
    fn alert(&self, kind: AlertKind, message: &str) -> zbus::Result<()>;

    /// `ThermalEvent(level, sensor, celsius, message)`: `level` is `warn`, `critical` or
    /// `normal` for a sensor (`edge`, `tctl`) changing level (or still critical), or
    /// `throttling` / `throttling-ended` (sensor `throttle`); `celsius` is NaN when no
    /// temperature applies; `message` says it in words.
    #[zbus(signal)]
    fn thermal_event(
        &self,
        level: &str,
        sensor: &str,
        celsius: f64,
        message: &str,
    ) -> zbus::Result<()>;
}

/// The engine's lifecycle state. Serialized lower-case, as in `Status()`, the `State`
/// property, `StateChanged` and the `dsv4_engine_state` metric.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    zbus::zvariant::Type,
)]
#[serde(rename_all = "lowercase")]
#[zvariant(signature = "s")]
pub enum State {
    /// No engine runs; the next request starts one.
    Stopped,
    /// The engine was spawned and is loading; requests wait for it.
    Starting,
    /// The engine answers requests.
    Ready,
    /// The engine finishes its in-flight requests before it stops (or restarts).
    Draining,
    /// The engine was signalled and is on its way out.
    Stopping,
    /// A start failed; the next one is allowed after a pause.
    Backoff,
}

impl State {
    /// Every state, in lifecycle order.
    pub const ALL: [State; 6] = [
        State::Stopped,
        State::Starting,
        State::Ready,
        State::Draining,
        State::Stopping,
        State::Backoff,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Stopped => "stopped",
            State::Starting => "starting",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Stopping => "stopping",
            State::Backoff => "backoff",
        }
    }

    /// Whether an engine process exists in this state.
    pub fn has_engine(self) -> bool {
        matches!(
            self,
            State::Starting | State::Ready | State::Draining | State::Stopping
        )
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not one of the [`State`]s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownState(pub String);

impl fmt::Display for UnknownState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown engine state {:?}; states: ", self.0)?;
        let names: Vec<&str> = State::ALL.iter().map(|s| s.as_str()).collect();
        f.write_str(&names.join(", "))
    }
}

impl std::error::Error for UnknownState {}

impl FromStr for State {
    type Err = UnknownState;
    fn from_str(s: &str) -> Result<State, UnknownState> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_string()))
    }
}

/// The message bus the supervisor's control interface is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Bus {
    /// The system bus (dsv4d as a system service).
    System,
    /// The session bus of the user (dsv4d run by hand or as a user service).
    Session,
}

impl Bus {
    pub fn as_str(self) -> &'static str {
        match self {
            Bus::System => "system",
            Bus::Session => "session",
        }
    }
}

impl fmt::Display for Bus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Bus {
    type Err = String;
    fn from_str(s: &str) -> Result<Bus, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "system" => Ok(Bus::System),
            "session" => Ok(Bus::Session),
            _ => Err(format!("the bus must be system or session, not {s:?}")),
        }
    }
}

/// What an `Alert(kind, message)` is about. On the bus the kind is its lower-case name; a
/// kind this client does not know (from a newer daemon) arrives as [`AlertKind::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, zbus::zvariant::Type)]
#[serde(rename_all = "lowercase")]
#[zvariant(signature = "s")]
pub enum AlertKind {
    /// A configuration change was rejected; the last good configuration stays in force.
    Config,
    /// The engine died while it was serving (not at a stop the supervisor asked for).
    Engine,
    /// A start was refused for memory, or an engine's memory did not come back after it
    /// stopped.
    Memory,
    /// The power policy met something: the GPU's level drifted, or a setting could not be
    /// written.
    Power,
    /// A request whose prefill outlasted `notify.long_request`: its prefill ended (decode
    /// started), or its answer did, or it failed.
    Request,
    /// A worker box of this box's engine (`workers:`) said a thermal event of its own, or
    /// went away while the engine ran.
    Worker,
    /// A KV checkpoint restore the engine did not use: the next request's prefill ran again.
    Kv,
    /// The correctness canary, run after the engine changed, drifted from its reference.
    Canary,
    /// A kind this client does not know.
    #[serde(other)]
    Other,
}

impl AlertKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AlertKind::Config => "config",
            AlertKind::Engine => "engine",
            AlertKind::Memory => "memory",
            AlertKind::Power => "power",
            AlertKind::Request => "request",
            AlertKind::Worker => "worker",
            AlertKind::Kv => "kv",
            AlertKind::Canary => "canary",
            AlertKind::Other => "other",
        }
    }
}

impl fmt::Display for AlertKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The engine's part of [`Status`]: what the lifecycle actor publishes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineStatus {
    pub state: State,
    /// The active profile: the one the next start uses.
    pub profile: String,
    /// The profile of the engine that runs now, if one does.
    pub engine_profile: Option<String>,
    pub engine_pid: Option<u32>,
    /// Counts engine starts; stale events from an older engine are told apart by it.
    pub generation: Option<u64>,
    /// Requests holding a lease on the engine (streams until their last byte).
    pub in_flight: u32,
    /// Requests waiting for the engine to become ready.
    pub waiting: usize,
    /// Unix time (s) at which the idle engine will be stopped.
    pub idle_deadline: Option<f64>,
    /// Unix time (s) at which the engine became ready.
    pub ready_since: Option<f64>,
    /// How long the running engine took from its spawn until it served, in seconds.
    #[serde(default)]
    pub load_seconds: Option<f64>,
    /// Consecutive failed starts.
    pub failures: u32,
    /// Why the last start failed or the engine died.
    pub last_error: Option<String>,
    /// The running engine's profile changed in the configuration; it applies at the next start.
    #[serde(default)]
    pub restart_pending: bool,
    /// What keeps other local users off the engine's loopback port: `per-generation secret`
    /// (a fresh key for each engine start, which only dsv4d sends), or `none (...)` with the
    /// reason, for an engine that takes no key. About the running engine, else the one the
    /// next start would run; `None` when neither is known (or from an older daemon).
    #[serde(default)]
    pub engine_key: Option<String>,
    /// The KV checkpoint step under way: `restoring` (the last part of `starting`) or
    /// `saving` (the first part of `stopping`).
    #[serde(default)]
    pub kv_step: Option<words::KvActivity>,
    /// How much of the model's files the page cache held when the engine (the running one,
    /// else the last) started: what made its load warm or cold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<ModelCache>,
    /// The running engine's identity (once it is ready and known), and what changed since
    /// its profile's last start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<identity::IdentityStatus>,
}

/// The model's files in the page cache at an engine's start.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelCache {
    pub resident_bytes: u64,
    pub total_bytes: u64,
    pub class: CacheClass,
    /// When it was measured (Unix time, seconds).
    pub at: f64,
}

/// A load's class by what the page cache held of the model: `warm` (90% or more), `cold`
/// (under 10%) or `partly`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheClass {
    Warm,
    Partly,
    Cold,
}

impl CacheClass {
    /// The class of a load with `percent` of the model in the page cache.
    pub fn of(percent: f64) -> CacheClass {
        if percent >= 90.0 {
            CacheClass::Warm
        } else if percent < 10.0 {
            CacheClass::Cold
        } else {
            CacheClass::Partly
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CacheClass::Warm => "warm",
            CacheClass::Partly => "partly",
            CacheClass::Cold => "cold",
        }
    }
}

impl ModelCache {
    /// The share held, in percent.
    pub fn percent(&self) -> f64 {
        if self.total_bytes == 0 {
            return 100.0;
        }
        self.resident_bytes as f64 * 100.0 / self.total_bytes as f64
    }
}

impl EngineStatus {
    /// No engine, nothing waiting: how a supervisor begins.
    pub fn stopped(profile: impl Into<String>) -> EngineStatus {
        EngineStatus {
            state: State::Stopped,
            profile: profile.into(),
            engine_profile: None,
            engine_pid: None,
            generation: None,
            in_flight: 0,
            waiting: 0,
            idle_deadline: None,
            ready_since: None,
            failures: 0,
            last_error: None,
            restart_pending: false,
            engine_key: None,
            kv_step: None,
            load_seconds: None,
            model_cache: None,
            identity: None,
        }
    }
}

/// `Status()` / `GET /status` / `dsv4ctl status --json`: one document, made of parts. The
/// engine's fields sit at the top level (so `.state` is the engine state); each other part
/// has a key of its own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    #[serde(flatten)]
    pub engine: EngineStatus,
    pub requests: Requests,
    /// The latest sample of the host (none before the first, or from an older daemon).
    #[serde(default)]
    pub telemetry: Option<telemetry::Sample>,
    /// What the power policy did (none from an older daemon).
    #[serde(default)]
    pub power: Option<PowerStatus>,
    /// The thermal levels (none from an older daemon).
    #[serde(default)]
    pub thermal: Option<ThermalStatus>,
    /// The KV checkpoints (none from an older daemon).
    #[serde(default)]
    pub kv: Option<kv::KvStatus>,
    /// The daemon's own limits (none from an older daemon).
    #[serde(default)]
    pub limits: Option<Limits>,
    /// The requests in flight, oldest first, each with its phase (none from an older daemon).
    #[serde(default)]
    pub in_progress: Vec<InProgress>,
    /// The coordinators on other boxes that hold this box's profile (`peers:`), oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<Hold>,
    /// The worker boxes of the engine that starts or runs (its profile's `workers:`), in
    /// their order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workers: Vec<WorkerStatus>,
    /// Each profile's last correctness canary, and the one due or running (none from an
    /// older daemon).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub canary: Vec<validate::CanaryCheck>,
}

/// A worker box of this box's engine, as its hold goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// The box, as messages name it (the host of `at`).
    #[serde(rename = "box")]
    pub host: String,
    /// Its `peers.listen`.
    pub at: String,
    /// The profile held there.
    pub profile: String,
    /// `connecting`, `waking`, `loading`, `serving` or `lost`.
    pub state: String,
    /// Since when it is in that state (Unix time, seconds).
    pub since: f64,
    /// How long its engine took to be ready, once it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_seconds: Option<f64>,
    /// Why it was lost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// That box's latest sample (its GTT, temperatures and power), as it last said while held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<telemetry::Sample>,
    /// That box's thermal levels, as it last said while held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thermal: Option<ThermalStatus>,
}

/// A coordinator on another box holding this box's profile: its engine lends this box's
/// devices to that box's engine for as long as the hold lasts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hold {
    /// The coordinator's address on the link.
    pub from: String,
    pub profile: String,
    /// When the hold began (Unix time, seconds).
    pub since: f64,
}

impl Status {
    /// The document of a supervisor that has done nothing yet: no engine, no request, no
    /// part reported.
    pub fn stopped(profile: impl Into<String>) -> Status {
        Status {
            engine: EngineStatus::stopped(profile),
            requests: Requests::default(),
            telemetry: None,
            power: None,
            thermal: None,
            kv: None,
            limits: None,
            in_progress: Vec::new(),
            holds: Vec::new(),
            workers: Vec::new(),
            canary: Vec::new(),
        }
    }
}

/// A request in flight, as [`Status::in_progress`] shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InProgress {
    /// Its number, in the order requests came (from 1 at the daemon's start).
    pub id: u64,
    /// Its path, as the engine routes it.
    pub path: String,
    /// Whether it asked for a streamed answer.
    pub stream: bool,
    /// The profile whose engine serves it, once it has one.
    pub profile: Option<String>,
    /// Seconds since it came.
    pub age_s: f64,
    pub phase: words::Phase,
    /// While `waiting`: for what.
    #[serde(default)]
    pub waiting_for: Option<words::WaitingFor>,
    /// While `loading`: seconds into the load, and what this profile's last loads took.
    #[serde(default)]
    pub loading_s: Option<f64>,
    #[serde(default)]
    pub loading_about_s: Option<f64>,
    /// How far its prefill has got, as far as the engine tells (see docs/http-api.md).
    #[serde(default)]
    pub prefill: Option<PrefillProgress>,
    /// The answer's content events so far, one a token (which events: its API's row in
    /// dsv4d's protocol table; see docs/http-api.md).
    #[serde(default)]
    pub tokens: u64,
}

/// How far a prefill has got.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefillProgress {
    /// New prompt tokens read, of `total` (the ones the cache held are in neither).
    pub done: u64,
    pub total: u64,
    /// Prompt tokens the engine's cache already held.
    pub cached: u64,
    /// Tokens a second so far, and the seconds left at that rate, once known.
    pub rate: Option<f64>,
    pub left_s: Option<f64>,
}

/// The daemon's process limits, as it runs (the engine inherits them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// The soft open-file limit (`RLIMIT_NOFILE`), after dsv4d raised it to the hard one;
    /// `None`: unlimited.
    pub open_files: Option<u64>,
    /// The hard open-file limit; `None`: unlimited.
    pub open_files_hard: Option<u64>,
}

/// The thermal policy's part of [`Status`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ThermalStatus {
    /// The highest level of any sensor.
    pub level: words::ThermalLevel,
    pub sensors: Vec<SensorThermal>,
    /// Unix time (s) since which the hardware has been throttling, while it does.
    pub throttling_since: Option<f64>,
    /// What dsv4d does about it (`thermal.on_critical`), while critical.
    pub action: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SensorThermal {
    /// `edge` (GPU) or `tctl` (CPU).
    pub sensor: String,
    pub level: words::ThermalLevel,
    /// Unix time (s) since when it is at this level.
    pub since: Option<f64>,
    /// The hottest it was at this level.
    pub peak: Option<f64>,
}

/// The power policy's part of [`Status`]: what dsv4d changed on the machine for the engine.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PowerStatus {
    /// How the CPU's profile is set: `ppd`, `cpufreq` or `none`; `""` (`None`) before the
    /// first engine start decided it.
    #[serde(with = "words::method_or_empty")]
    pub method: Option<words::PowerMethod>,
    /// Why that method (what was found on the machine).
    pub why: String,
    /// What is applied now, in words (`power-saver held through net.hadess.PowerProfiles`,
    /// `governor powersave, EPP power on 16 policies`); `None` while nothing is.
    pub cpu: Option<String>,
    /// Whether a power-profiles-daemon hold is in force.
    pub held: bool,
    /// Whether `power.prefill`'s profile is in force, for a request long in its prefill
    /// (absent from older daemons).
    #[serde(default)]
    pub prefill: bool,
    /// Something to know about the CPU's profile: why nothing is held, or that the user
    /// chose another profile while it was held (shown until the next start).
    pub cpu_note: Option<String>,
    /// The GPU's performance level, as last read.
    pub gpu_level: Option<words::GpuLevel>,
    /// What was done about it, or why nothing could be.
    pub gpu_note: Option<String>,
    /// SoC power just before the engine started, and now (W).
    pub soc_watts_before: Option<f64>,
    pub soc_watts_now: Option<f64>,
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
    /// Of the requests with times, those timed by dsv4d's clock (their answers had no engine
    /// `timings`): when above 0, the rates are (partly) the clock's. Absent from older daemons.
    #[serde(default)]
    pub clock_timed_requests: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Requests {
    #[serde(flatten)]
    pub all: Totals,
    pub by_profile: BTreeMap<String, Totals>,
    /// Totals per API (`openai`, `anthropic`, `responses`); absent from older daemons.
    #[serde(default)]
    pub by_protocol: BTreeMap<ApiProtocol, Totals>,
    pub recent: Vec<RequestRecord>,
}

/// The API a request spoke, by its path: where its answer's token counts are.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum ApiProtocol {
    /// OpenAI's chat and text completions (and llama-server's own `/completion`, and any other
    /// path that reports llama-server's `timings`): `usage.prompt_tokens`, ...
    #[default]
    #[serde(rename = "openai")]
    OpenAi,
    /// Anthropic's Messages (`/v1/messages`): `usage.input_tokens`, ...
    #[serde(rename = "anthropic")]
    Anthropic,
    /// OpenAI's Responses (`/v1/responses`): `usage.input_tokens`, ...
    #[serde(rename = "responses")]
    Responses,
}

impl ApiProtocol {
    pub const ALL: [ApiProtocol; 3] = [
        ApiProtocol::OpenAi,
        ApiProtocol::Anthropic,
        ApiProtocol::Responses,
    ];

    /// Its name in `/status` and `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiProtocol::OpenAi => "openai",
            ApiProtocol::Anthropic => "anthropic",
            ApiProtocol::Responses => "responses",
        }
    }
}

impl fmt::Display for ApiProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub profile: String,
    pub path: String,
    /// The API it spoke (older daemons counted OpenAI's alone).
    #[serde(default)]
    pub protocol: ApiProtocol,
    pub at: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub prefill_tok_s: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub prompt_ms: f64,
    pub decode_ms: f64,
    pub wall_ms: f64,
    /// The prefill and decode times are dsv4d's clock (from the request's sending to its
    /// answer's first event, then to its end), the answer having no engine `timings`; with
    /// neither (a plain answer without `timings`), the times are 0 and the rates absent.
    #[serde(default)]
    pub clock_times: bool,
    /// Temperatures, power, GTT and throttling over the request's span.
    #[serde(default)]
    pub resources: Option<telemetry::Resources>,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_are_their_lower_case_names_everywhere() {
        for s in State::ALL {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
            assert_eq!(serde_json::from_str::<State>(&json).unwrap(), s);
            assert_eq!(s.as_str().parse::<State>(), Ok(s));
            assert_eq!(s.to_string(), s.as_str());
        }
        let bad = "loading".parse::<State>().unwrap_err();
        assert_eq!(
            bad.to_string(),
            "unknown engine state \"loading\"; states: stopped, starting, ready, draining, \
             stopping, backoff"
        );
    }

    #[test]
    fn states_with_an_engine() {
        let with: Vec<State> = State::ALL.into_iter().filter(|s| s.has_engine()).collect();
        assert_eq!(
            with,
            [
                State::Starting,
                State::Ready,
                State::Draining,
                State::Stopping
            ]
        );
    }

    #[test]
    fn an_alert_kind_from_a_newer_daemon_is_other() {
        let k: AlertKind = serde_json::from_str("\"thermal-x\"").unwrap();
        assert_eq!(k, AlertKind::Other);
        let k: AlertKind = serde_json::from_str("\"engine\"").unwrap();
        assert_eq!(k, AlertKind::Engine);
        assert_eq!(
            serde_json::to_string(&AlertKind::Config).unwrap(),
            "\"config\""
        );
    }

    #[test]
    fn alert_kinds_and_states_travel_as_strings_on_the_bus() {
        use zbus::zvariant::{serialized::Context, to_bytes, Type, LE};
        assert_eq!(AlertKind::SIGNATURE, &zbus::zvariant::Signature::Str);
        assert_eq!(State::SIGNATURE, &zbus::zvariant::Signature::Str);
        let ctxt = Context::new_dbus(LE, 0);
        let bytes = to_bytes(ctxt, &(AlertKind::Engine, "gone")).unwrap();
        let (back, _): ((AlertKind, String), _) = bytes.deserialize().unwrap();
        assert_eq!(back, (AlertKind::Engine, "gone".to_string()));
        let unknown = to_bytes(ctxt, &("memory-pressure", "x")).unwrap();
        let (back, _): ((AlertKind, String), _) = unknown.deserialize().unwrap();
        assert_eq!(back.0, AlertKind::Other);
        let state = to_bytes(ctxt, &State::Backoff).unwrap();
        let (s, _): (String, _) = state.deserialize().unwrap();
        assert_eq!(s, "backoff");
    }

    #[test]
    fn the_status_document_keeps_the_engine_fields_at_the_top() {
        let s = Status {
            engine: EngineStatus::stopped("320k"),
            requests: Requests::default(),
            telemetry: Some(telemetry::Sample::default()),
            power: Some(PowerStatus::default()),
            thermal: Some(ThermalStatus::default()),
            kv: Some(kv::KvStatus::default()),
            limits: Some(Limits {
                open_files: Some(524_288),
                open_files_hard: None,
            }),
            in_progress: vec![InProgress {
                id: 7,
                path: "/v1/chat/completions".into(),
                stream: true,
                profile: Some("320k".into()),
                age_s: 61.5,
                phase: words::Phase::Prefill,
                waiting_for: None,
                loading_s: None,
                loading_about_s: None,
                prefill: Some(PrefillProgress {
                    done: 4096,
                    total: 262_144,
                    cached: 0,
                    rate: Some(122.7),
                    left_s: Some(2103.1),
                }),
                tokens: 0,
            }],
            holds: vec![Hold {
                from: "10.77.0.1".into(),
                profile: "rpc".into(),
                since: 1_767_225_600.0,
            }],
            workers: vec![WorkerStatus {
                host: "10.77.0.2".into(),
                at: "10.77.0.2:8090".into(),
                profile: "rpc".into(),
                state: "serving".into(),
                since: 1_767_225_600.0,
                load_seconds: Some(0.5),
                error: None,
                telemetry: None,
                thermal: None,
            }],
            canary: Vec::new(),
        };
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["state"], "stopped");
        assert_eq!(v["profile"], "320k");
        assert!(v["requests"]["by_profile"].is_object());
        assert!(v.get("engine").is_none());
        let back: Status = serde_json::from_value(v).unwrap();
        assert_eq!(back, s);
    }

    #[test]
    fn a_status_from_an_older_daemon_still_parses() {
        let mut v = serde_json::to_value(Status::stopped("320k")).unwrap();
        let top = v.as_object_mut().unwrap();
        top.remove("engine_key");
        top.remove("restart_pending");
        top.remove("telemetry");
        top.remove("power");
        top.remove("thermal");
        top.remove("limits");
        let back: Status = serde_json::from_value(v).unwrap();
        assert_eq!(back.telemetry, None);
        assert_eq!(back.engine.engine_key, None);
        assert!(!back.engine.restart_pending);
    }

    #[test]
    fn buses_by_name() {
        assert_eq!("system".parse::<Bus>(), Ok(Bus::System));
        assert_eq!(" Session ".parse::<Bus>(), Ok(Bus::Session));
        assert!("user"
            .parse::<Bus>()
            .unwrap_err()
            .contains("system or session"));
        assert_eq!(Bus::Session.to_string(), "session");
    }
}

/// The state names are spelled in [`State`] only: everything else in the workspace (the
/// daemon, the CLI, the engine adapters, the tests and the bench) goes through the enum, so
/// a renamed or added state cannot leave a stale string behind.
#[cfg(test)]
mod one_spelling {
    use super::State;
    use std::path::{Path, PathBuf};

    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n == "target") {
                    continue;
                }
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    #[test]
    fn no_state_name_is_a_string_literal_outside_state() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let own = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs");
        let mut files = Vec::new();
        for dir in ["supervisor", "engine", "tests"] {
            rust_files(&root.join(dir), &mut files);
        }
        assert!(files.len() > 20, "found only {} files", files.len());
        let mut found = Vec::new();
        for f in files {
            if f.canonicalize().ok() == own.canonicalize().ok() {
                continue;
            }
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            for (n, line) in text.lines().enumerate() {
                for s in State::ALL {
                    if line.contains(&format!("\"{}\"", s.as_str())) {
                        found.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
                    }
                }
            }
        }
        assert!(
            found.is_empty(),
            "engine state names spelled as strings (use dsv4_client::State):\n{}",
            found.join("\n")
        );
    }
}
