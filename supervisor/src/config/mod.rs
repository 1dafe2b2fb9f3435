//! The supervisor's configuration: `supervisor.yaml` and the engine profiles in its
//! `profiles_dir` (`profiles/<name>.yaml`). `docs/configuration.md` is the reference: every
//! key, the units, how relative paths resolve, and what is checked on disk.
//!
//! [`Config::load`] reads and checks everything in one go and reports every problem it
//! finds (see [`ConfigError`]), each with its file, line, column and key path where known:
//! the text and the types (`yaml`, `node`), ranges and rules between keys (`load`), the
//! files and programs the settings name (`files`), and what a profile passes to the engine
//! (`rules`). Messages show paths relative to the folder of `supervisor.yaml` when they are
//! inside it, else absolute: `profiles/320k.yaml:12:10: context: must be at least 512`.

mod error;
mod files;
pub use files::{
    find_in_path, is_credential, load_files, model_files, program_search_path, resolve_command,
    same_file, shared_key_file,
};
mod load;
pub mod matrix;
pub mod names;
pub mod profiles;
mod raw;
mod rules;
pub use rules::kv_cache_type_size;

/// A YAML text as JSON (a profile's settings, kept with a validation run); `None` when it is
/// not YAML.
pub fn yaml_to_json(text: &str) -> Option<serde_json::Value> {
    let mut problems = Vec::new();
    let file = std::path::PathBuf::new();
    let (_, value) = yaml::Doc::read(file, text, |_| true, &mut problems);
    value.filter(|_| problems.is_empty())
}
mod yaml;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams};
use serde::Deserialize;
use smart_default::SmartDefault;

pub use dsv4_client::duration::{format as format_duration, parse as parse_duration};
pub use dsv4_client::units::{format_size, format_temperature, parse_size, parse_temperature};
pub use dsv4_client::words::PowerMethod;
pub use error::{ConfigError, Problem};

/// The whole configuration: the supervisor settings and every profile, by name.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// `supervisor.yaml`, made absolute (without resolving symlinks).
    pub file: PathBuf,
    pub supervisor: Supervisor,
    pub profiles: BTreeMap<String, Profile>,
}

impl Config {
    /// Reads `supervisor.yaml` at `path` and every profile in its `profiles_dir`.
    ///
    /// Returns all problems found: every unknown key and every value that does not fit, and
    /// the problems in what was read. A file that is not YAML stops at its first error, but
    /// the other files are still read and checked.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        load::load(path, true, true)
    }

    /// As [`load`](Self::load), for a reload: everything is checked but the API key file,
    /// which the reloader reads itself. A key file that cannot be used does not keep the
    /// last good configuration (with its keys) in force; it refuses every keyed request.
    pub fn load_for_reload(path: &Path) -> Result<Config, ConfigError> {
        load::load(path, true, false)
    }

    /// As [`load`](Self::load), without looking at the files and programs it names: for the
    /// doctor, which checks each of those itself, as the service user.
    pub fn load_without_files(path: &Path) -> Result<Config, ConfigError> {
        load::load_with(path, false, false, &load::Credentials::from_env(true))
    }

    /// As [`load`](Self::load), for `dsv4d --check-config`: a key file that is a systemd
    /// credential (`credential:NAME`) is checked when this process has the service's
    /// credentials (`$CREDENTIALS_DIRECTORY`, as the unit's `ExecReload=` check has), and
    /// else left as written, which [`summary`](Self::summary) says.
    pub fn load_to_check(path: &Path) -> Result<Config, ConfigError> {
        load::load_with(path, true, true, &load::Credentials::from_env(true))
    }

    /// `supervisor.yaml` at `path` with its drop-ins (`supervisor.yaml.d/*.yaml`) laid over
    /// it, as YAML: every key that is written, each value with the file and line it comes
    /// from (`dsv4d --check-config --merged`). An error only when a file cannot be read or
    /// is not YAML; the settings are not checked.
    pub fn merged(path: &Path) -> Result<String, ConfigError> {
        load::merged(path)
    }

    /// The drop-in folder of this configuration: `supervisor.yaml.d` beside the file.
    pub fn dropin_dir(&self) -> PathBuf {
        load::dropin_dir(&self.file)
    }

    /// A short report for `dsv4d --check-config`: a first line naming the file, the number of
    /// profiles and the default, then one line per profile.
    ///
    /// ```text
    /// supervisor.yaml OK: 2 profiles in profiles, default 320k
    ///   320k: llama-server, context 327680, planned memory 87.8 GiB (320K service profile)
    ///   64k: llama-server, context 65536, planned memory 86.0 GiB (64K validation profile)
    /// ```
    pub fn summary(&self) -> String {
        let name = self.file.file_name().unwrap_or(self.file.as_os_str());
        let shown = files::Shown(self.file.parent().unwrap_or(Path::new("")).into());
        let (count, s) = (self.profiles.len(), &self.supervisor);
        let (name, dir) = (name.to_string_lossy(), shown.text(&s.profiles_dir));
        let plural = if count == 1 { "" } else { "s" };
        let default = &s.default_profile;
        let mut out = format!("{name} OK: {count} profile{plural} in {dir}, default {default}");
        let dropins = load::dropin_files(&self.file).unwrap_or_default();
        if !dropins.is_empty() {
            let names: Vec<String> = dropins.iter().map(|f| shown.text(f)).collect();
            out += &format!("; drop-ins, in order: {}", names.join(", "));
        }
        for (key, file) in [
            ("api.api_keys_file", &s.api.api_keys_file),
            ("api.admin_keys_file", &s.api.admin_keys_file),
        ] {
            let written = file.as_deref().map(|f| f.to_string_lossy());
            if let Some(name) = written
                .as_deref()
                .and_then(|w| w.strip_prefix(load::CREDENTIAL))
            {
                out += &format!(
                    "\n  {key}: the systemd credential {name:?}, which only the service has: \
                     checked by `systemctl reload dsv4`"
                );
            }
        }
        for (name, p) in &self.profiles {
            out += &format!("\n  {name}: {}", p.engine);
            match p.context() {
                Some(context) => out += &format!(", context {context}"),
                None => out += ", the engine's default context",
            }
            if let Some(bytes) = p.planned_memory {
                out += &format!(", planned memory {}", format_size(bytes));
            }
            if let Some(description) = p.description.as_deref().filter(|d| !d.is_empty()) {
                out += &format!(" ({description})");
            }
        }
        out
    }

    pub fn profile(&self, name: &str) -> Option<&Profile> {
        self.profiles.get(name)
    }

    /// Profile names in sorted order.
    pub fn profile_names(&self) -> Vec<&str> {
        self.profiles.keys().map(String::as_str).collect()
    }

    /// The profile named by `default_profile` (always present in a loaded config).
    pub fn default_profile(&self) -> Option<&Profile> {
        self.profile(&self.supervisor.default_profile)
    }
}

// The settings deserialize straight into these types, over their defaults; `load.rs` then
// checks them and resolves the relative paths. In the files a key set to null counts as
// not written (see `yaml::Doc::read`), so `api:` alone means every `api` default.

/// `supervisor.yaml`.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of supervisor settings")]
pub struct Supervisor {
    pub api: Api,
    pub engine: EngineLimits,
    /// Resolved against the folder of `supervisor.yaml` when relative.
    #[default = "profiles"]
    pub profiles_dir: PathBuf,
    /// Used until a profile is chosen; the choice then persists in `state_dir`.
    #[default = "320k"]
    pub default_profile: String,
    /// Resolved against the folder of `supervisor.yaml` when relative.
    #[default = "/var/lib/dsv4"]
    pub state_dir: PathBuf,
    /// The daemon exits once the engine has been stopped this long; `None` (written `null`) =
    /// never.
    #[serde(deserialize_with = "raw::duration_or_never")]
    #[default(Some(Duration::from_secs(30 * 60)))]
    pub exit_when_idle: Option<Duration>,
    pub power: PowerSettings,
    pub monitor: Monitor,
    pub thermal: ThermalSettings,
    pub memory: Memory,
    pub notify: Notify,
    pub peers: Peers,
    pub canary: Canary,
}

/// `canary:`: what a drift of the correctness canary does (see [`crate::validate::after_change`]).
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `canary` settings")]
pub struct Canary {
    /// A profile whose canary drifted refuses requests (503 naming the drift) until
    /// `dsv4ctl canary accept PROFILE` records the new reference.
    pub hold: bool,
}

/// `peers:`: where coordinators on other boxes reach this one to hold its profiles, and
/// their keys.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `peers` settings")]
pub struct Peers {
    /// `IP:port` on the link between the boxes; used only when not socket-activated (the
    /// socket named `peers`). `None`: this box lends to no one.
    pub listen: Option<String>,
    /// The keys of the coordinators allowed to hold this box's profiles, one per line, under
    /// the rules of `api.api_keys_file`. Resolved against the config folder.
    pub keys_file: Option<PathBuf>,
}

impl Supervisor {
    /// The documented defaults, with `profiles_dir` = `base_dir/profiles` (the [`Default`] has
    /// it relative, `profiles`).
    #[cfg(test)]
    pub fn defaults(base_dir: &Path) -> Supervisor {
        let profiles_dir = base_dir.join("profiles");
        Supervisor {
            profiles_dir,
            ..Supervisor::default()
        }
    }
}

/// `api:`.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `api` settings")]
pub struct Api {
    /// `IP:port` (checked to parse as a `SocketAddr`); used only when not socket-activated.
    #[default = "127.0.0.1:8080"]
    pub listen: String,
    /// One key per line; `None` = no authentication. Resolved against the config folder.
    pub api_keys_file: Option<PathBuf>,
    /// Keys for the dashboard's actions (start, stop, profile, KV, validation), one per
    /// line, under the same rules as `api_keys_file`; `None` = the dashboard only looks.
    pub admin_keys_file: Option<PathBuf>,
    /// Largest accepted request body, in bytes.
    #[serde(deserialize_with = "raw::size")]
    #[default(64 << 20)]
    pub max_body: u64,
    /// How long a request's body may take to arrive in full, from the end of its head. dsv4d
    /// reads every body whole before the request takes a lease or reaches the engine (see
    /// [`crate::http::intake`]); a client slower than this gets 408.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(30))]
    pub body_timeout: Duration,
    /// The least rate a request's body must keep, in bytes a second, once it has had
    /// [`crate::http::intake::GRACE`] (5 s) at any rate: a body that falls further behind
    /// gets 408. 0: no minimum (`api.body_timeout` alone). Written `1KiB/s`.
    #[serde(deserialize_with = "raw::rate")]
    #[default(1 << 10)]
    pub min_body_rate: u64,
    /// Request bodies held in memory at once (being read, or read and waiting for the engine);
    /// a body that would go past it gets 503 with Retry-After.
    #[serde(deserialize_with = "raw::size")]
    #[default(1 << 30)]
    pub max_buffered: u64,
    /// Web pages whose scripts may use the API from a browser: origins
    /// (`scheme://host[:port]`), or `*` for any. The loader writes each in its canonical form
    /// (lowercase, without the scheme's default port); see [`names`].
    pub cors_origins: Vec<String>,
    /// Names (`host` or `host:port`) that requests may give in `Host` besides the loopback
    /// ones, which are always allowed. Canonical, as `cors_origins`.
    pub allowed_hosts: Vec<String>,
    /// Client connections open at once; one more is answered 503 and closed. The daemon caps
    /// it lower when its open-file limit would not cover it (see [`crate::http::connections`]).
    #[default = 4096]
    pub max_connections: usize,
    /// Dashboard event streams (`GET /events`) open at once; one more gets 503 (see
    /// [`crate::http::dashboard`]). They count against `max_connections` too.
    #[default = 32]
    pub max_event_streams: usize,
    /// A streamed answer (`"stream": true`) to which nothing was written for this long gets an
    /// SSE comment line, and one still waiting for its engine after this long gets dsv4d's own
    /// head (see [`crate::http::keepalive`]); `None` = never.
    #[serde(deserialize_with = "raw::duration_or_never")]
    #[default(Some(Duration::from_secs(10)))]
    pub stream_keepalive: Option<Duration>,
    /// A chat stream waiting for its engine gets the words of each keep-alive comment as a
    /// `reasoning_content` delta too, which chat UIs show (see [`crate::http::keepalive`]).
    #[serde(deserialize_with = "raw::flag")]
    pub loading_reasoning: bool,
}

/// `engine:`, the lifecycle limits.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `engine` settings")]
pub struct EngineLimits {
    /// Engine spawn to ready.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(10 * 60))]
    pub start_timeout: Duration,
    /// No request in flight for this long: stop the engine.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(15 * 60))]
    pub idle_timeout: Duration,
    /// SIGTERM to SIGKILL grace.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(120))]
    pub stop_timeout: Duration,
    /// Requests held while the engine starts; beyond that, 503 with Retry-After.
    #[default = 256]
    pub max_waiting: usize,
    /// After a stop that leaves the engine stopped (the idle stop), once its memory is back,
    /// read the model's files back into the page cache (see [`crate::host::prewarm`]).
    #[serde(deserialize_with = "raw::flag")]
    pub prewarm: bool,
}

/// `power:`.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `power` settings")]
pub struct PowerSettings {
    pub cpu: CpuPolicy,
    pub gpu: GpuPolicy,
    /// `power.method`: how power settings are applied; `None` is `auto`
    /// (power-profiles-daemon when present, else cpufreq).
    #[serde(deserialize_with = "raw::power_method")]
    pub method: Option<PowerMethod>,
    /// `power.prefill`: the CPU profile while a request has been in its prefill for
    /// `prefill_after`; `None` (`none`): the CPU stays on `cpu` throughout.
    #[serde(deserialize_with = "raw::prefill_policy")]
    pub prefill: Option<CpuPolicy>,
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(30))]
    pub prefill_after: Duration,
}

/// `monitor:`, how often to sample temperatures and memory.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `monitor` settings")]
pub struct Monitor {
    /// While the engine runs.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(1))]
    pub interval: Duration,
    /// While it does not.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(10))]
    pub idle_interval: Duration,
}

/// `thermal:`, in degrees Celsius.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `thermal` settings")]
pub struct ThermalSettings {
    #[serde(deserialize_with = "raw::celsius")]
    #[default = 85.0]
    pub warn: f64,
    #[serde(deserialize_with = "raw::celsius")]
    #[default = 95.0]
    pub critical: f64,
    /// How far below a threshold the temperature must fall before its alarm clears.
    #[serde(deserialize_with = "raw::celsius")]
    #[default = 5.0]
    pub hysteresis: f64,
    pub on_critical: OnCritical,
}

/// `memory:`.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `memory` settings")]
pub struct Memory {
    /// Refuse an engine start that would leave less than this many bytes available.
    #[serde(deserialize_with = "raw::size")]
    #[default(8 << 30)]
    pub reserve: u64,
    /// After an engine stops, how long its memory (available memory, GTT) may take to come
    /// back before an alert says it did not.
    #[serde(deserialize_with = "raw::duration")]
    #[default(Duration::from_secs(30))]
    pub return_timeout: Duration,
}

/// `notify:`, what raises an alert besides the thermal levels, memory and power.
#[derive(Debug, Clone, PartialEq, Deserialize, SmartDefault)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of `notify` settings")]
pub struct Notify {
    /// A request whose prefill lasts longer than this raises an alert when the prefill ends
    /// and when its answer ends or fails (see [`crate::observe::flights`]); `None` = never.
    #[serde(deserialize_with = "raw::duration_or_never")]
    #[default(Some(Duration::from_secs(10 * 60)))]
    pub long_request: Option<Duration>,
}

/// `power.cpu`: the CPU power profile while the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CpuPolicy {
    #[default]
    PowerSaver,
    Balanced,
    Performance,
    /// Leave it alone.
    Keep,
}

impl CpuPolicy {
    /// Its name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            CpuPolicy::PowerSaver => "power-saver",
            CpuPolicy::Balanced => "balanced",
            CpuPolicy::Performance => "performance",
            CpuPolicy::Keep => "keep",
        }
    }
}

/// `power.gpu`: the GPU power level while the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuPolicy {
    #[default]
    Auto,
    Low,
    High,
    /// Leave it alone.
    Keep,
}

/// `thermal.on_critical`: what to do at the critical temperature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnCritical {
    /// Log and report only.
    #[default]
    Notify,
    /// Stop the engine as soon as no request is in flight.
    StopWhenIdle,
    /// Stop the engine now.
    Stop,
}

/// One engine profile, `profiles/<name>.yaml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// The file stem.
    pub name: String,
    pub file: PathBuf,
    pub description: Option<String>,
    pub engine: EngineKind,
    /// Absolute, or a bare program name looked up in `PATH` at spawn.
    pub command: PathBuf,
    pub params: EngineParams,
    /// Bytes the engine is expected to use, for admission control.
    pub planned_memory: Option<u64>,
    /// Added to the engine's environment.
    pub env: BTreeMap<String, String>,
    /// llama-server: KV checkpoints across stops (`kv_checkpoint`); `None`: off.
    pub kv_checkpoint: Option<KvCheckpoint>,
    /// The settings `dsv4ctl validate --matrix` compares (`matrix:`).
    pub matrix: Option<matrix::Matrix>,
    /// Profiles of other boxes whose engines lend this one their devices (`workers:`),
    /// held before each start of this profile's engine and let go after its stop.
    pub workers: Vec<Worker>,
}

/// One of a profile's `workers:`: a profile of another box, held through that box's dsv4d.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// That box's `peers.listen`, as `host:port`.
    pub at: String,
    /// The profile held there (an engine that lends its devices, `rpc-server`).
    pub profile: String,
    /// The key that box's `peers.keys_file` holds for this one (its first key).
    pub key_file: PathBuf,
    /// How to wake that box when it does not answer.
    pub wake: Option<Wake>,
}

/// A Wake-on-LAN target: the box's MAC, and the address its magic packet is sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wake {
    pub mac: [u8; 6],
    pub broadcast: SocketAddr,
}

impl Wake {
    /// The request as one word, `MAC/BROADCAST` (`aa:bb:cc:dd:ee:ff/10.77.0.255:9`): the
    /// instance of `dsv4-wake@.service`, before systemd's escaping.
    pub fn instance(&self) -> String {
        let mac: Vec<String> = self.mac.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}/{}", mac.join(":"), self.broadcast)
    }

    /// Reads [`instance`](Self::instance)'s word back, under the configuration's rules.
    pub fn from_instance(word: &str) -> Result<Wake, String> {
        let (mac, broadcast) = word
            .split_once('/')
            .ok_or_else(|| format!("{word:?} is not MAC/BROADCAST"))?;
        rules::wake(Some(mac), Some(broadcast)).map_err(|(_, message)| message)
    }
}

impl Worker {
    /// The box, as messages name it: the host of `at`.
    pub fn host(&self) -> &str {
        self.at.rsplit_once(':').map_or(&self.at, |(host, _)| host)
    }
}

/// `kv_checkpoint:` of a llama-server profile: the slots' KV cache is saved to `dir` on every
/// planned stop and put back at the next start of a profile it is valid for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCheckpoint {
    /// Where the checkpoints live (also the engine's `--slot-save-path`).
    pub dir: PathBuf,
    /// The most the checkpoint files in `dir` may take; the oldest go first. `None`: no bound
    /// but the disk's.
    pub max_size: Option<u64>,
    /// How long a stop waits for the save before it signals the engine.
    pub save_timeout: Duration,
    /// How long waiting requests wait for the restore before the engine serves cold.
    pub restore_timeout: Duration,
}

impl KvCheckpoint {
    pub const DEFAULT_SAVE_TIMEOUT: Duration = Duration::from_secs(120);
    pub const DEFAULT_RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
}

impl Profile {
    /// The context length, when the profile sets one.
    pub fn context(&self) -> Option<u32> {
        self.params.context
    }
}
