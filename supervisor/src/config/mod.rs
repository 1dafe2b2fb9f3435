//! The supervisor's configuration: `supervisor.yaml` and the engine profiles in its
//! `profiles_dir` (`profiles/<name>.yaml`).
//!
//! [`Config::load`] reads and validates everything in one go and reports every problem it
//! finds (see [`ConfigError`]), each with its file, line, column and key path where known.
//! Unknown keys are errors. Durations are written with units (`90s`, `15m`, `1h30m`), sizes
//! with binary or decimal units (`64MiB`, `87.82GiB`, `20GB`) and temperatures in Celsius
//! (`85C`); see [`parse_duration`], [`parse_size`] and [`parse_temperature`].
//!
//! Relative paths in `supervisor.yaml` (`profiles_dir`, `state_dir`, `api_keys_file`)
//! resolve against the folder of `supervisor.yaml`; relative paths in a profile (`command`
//! when it contains a `/`, `model`, `mmproj`, `kv_disk_dir`) resolve against the profiles
//! folder. A bare `command` such as `llama-server` is kept as is and looked up in `PATH` when
//! the engine is spawned.
//!
//! Besides the text, loading checks what the configuration names on disk: the engine
//! `command` must be an executable file (a bare name must be found in `PATH`, the profile's
//! `env.PATH` when set), `model` and `mmproj` must be files (a sharded model must be named
//! by its first shard, with the others beside it), `kv_disk_dir` must be a folder or be
//! creatable in an existing one, and `api_keys_file` must be a file that only its owner may
//! read or write (mode 600, as the daemon requires). Keys the profile's engine ignores (`mmproj` for ds4, `kv_disk_dir` for llama-server) may
//! name files that do not exist. A missing file under the shipped example paths
//! (`/srv/models/dsv4-flash/`, `/usr/local/bin/llama-server`, `/usr/local/bin/ds4-server`)
//! is reported as the unedited example. `state_dir` is not checked (systemd creates it).
//!
//! Messages show paths relative to the folder of `supervisor.yaml` when they are inside it,
//! else absolute: `profiles/320k.yaml:12:10: context: must be at least 512`.

mod error;
mod files;
mod load;
mod locate;
mod raw;
mod rules;
mod units;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams};
use serde::Deserialize;

pub use error::{ConfigError, Problem};
pub use units::{
    format_duration, format_size, format_temperature, parse_duration, parse_size, parse_temperature,
};

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
    /// Returns all problems found: a file that does not parse stops at its first error, but
    /// the other files are still read and checked.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        load::load(path, load::Options::default())
    }

    /// A short report for `dsv4d --check-config`: a first line naming the file, the number of
    /// profiles and the default, then one line per profile.
    ///
    /// ```text
    /// supervisor.yaml OK: 2 profiles in profiles, default 320k
    ///   320k: llama-server, context 327680, planned memory 87.82GiB (320K service profile)
    ///   64k: llama-server, context 65536, planned memory 86GiB (64K validation profile)
    /// ```
    pub fn summary(&self) -> String {
        let name = self.file.file_name().map_or_else(
            || self.file.display().to_string(),
            |n| n.to_string_lossy().into(),
        );
        let dir = self.file.parent().unwrap_or(Path::new(""));
        let count = self.profiles.len();
        let mut out = format!(
            "{name} OK: {count} profile{} in {}, default {}",
            if count == 1 { "" } else { "s" },
            files::Shown::new(dir).text(&self.supervisor.profiles_dir),
            self.supervisor.default_profile
        );
        for (name, p) in &self.profiles {
            out.push_str(&format!("\n  {name}: {}", p.engine));
            match p.context() {
                Some(context) => out.push_str(&format!(", context {context}")),
                None => out.push_str(", the engine's default context"),
            }
            if let Some(bytes) = p.planned_memory {
                out.push_str(&format!(", planned memory {}", format_size(bytes)));
            }
            if let Some(description) = p.description.as_deref().filter(|d| !d.is_empty()) {
                out.push_str(&format!(" ({description})"));
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

/// `supervisor.yaml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Supervisor {
    pub api: Api,
    pub engine: EngineLimits,
    /// Resolved against the folder of `supervisor.yaml` when relative.
    pub profiles_dir: PathBuf,
    /// Used until a profile is chosen; the choice then persists in `state_dir`.
    pub default_profile: String,
    /// Resolved against the folder of `supervisor.yaml` when relative.
    pub state_dir: PathBuf,
    /// The daemon exits once the engine has been stopped this long; `None` = never.
    pub exit_when_idle: Option<Duration>,
    pub power: Power,
    pub monitor: Monitor,
    pub thermal: Thermal,
    pub memory: Memory,
}

impl Supervisor {
    /// The documented defaults, with `profiles_dir` = `base_dir/profiles`.
    pub fn defaults(base_dir: &Path) -> Supervisor {
        Supervisor {
            api: Api::default(),
            engine: EngineLimits::default(),
            profiles_dir: base_dir.join("profiles"),
            default_profile: "320k".to_string(),
            state_dir: PathBuf::from("/var/lib/dsv4"),
            exit_when_idle: Some(Duration::from_secs(30 * 60)),
            power: Power::default(),
            monitor: Monitor::default(),
            thermal: Thermal::default(),
            memory: Memory::default(),
        }
    }
}

impl Default for Supervisor {
    /// [`Supervisor::defaults`] relative to the current folder (`./profiles`).
    fn default() -> Self {
        Supervisor::defaults(Path::new("."))
    }
}

/// `api:`.
#[derive(Debug, Clone, PartialEq)]
pub struct Api {
    /// `IP:port` (checked to parse as a `SocketAddr`); used only when not socket-activated.
    pub listen: String,
    /// One key per line; `None` = no authentication. Resolved against the config folder.
    pub api_keys_file: Option<PathBuf>,
    /// Largest accepted request body, in bytes.
    pub max_body: u64,
}

impl Default for Api {
    fn default() -> Self {
        Api {
            listen: "127.0.0.1:8080".to_string(),
            api_keys_file: None,
            max_body: 64 << 20,
        }
    }
}

/// `engine:`, the lifecycle limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLimits {
    /// Engine spawn to ready.
    pub start_timeout: Duration,
    /// No request in flight for this long: stop the engine.
    pub idle_timeout: Duration,
    /// SIGTERM to SIGKILL grace.
    pub stop_timeout: Duration,
    /// Requests held while the engine starts; beyond that, 503 with Retry-After.
    pub max_waiting: usize,
}

impl Default for EngineLimits {
    fn default() -> Self {
        EngineLimits {
            start_timeout: Duration::from_secs(10 * 60),
            idle_timeout: Duration::from_secs(15 * 60),
            stop_timeout: Duration::from_secs(120),
            max_waiting: 256,
        }
    }
}

/// `power:`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Power {
    pub cpu: CpuPolicy,
    pub gpu: GpuPolicy,
    pub method: PowerMethod,
}

/// `monitor:`, how often to sample temperatures and memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Monitor {
    /// While the engine runs.
    pub interval: Duration,
    /// While it does not.
    pub idle_interval: Duration,
}

impl Default for Monitor {
    fn default() -> Self {
        Monitor {
            interval: Duration::from_secs(1),
            idle_interval: Duration::from_secs(10),
        }
    }
}

/// `thermal:`, in degrees Celsius.
#[derive(Debug, Clone, PartialEq)]
pub struct Thermal {
    pub warn: f64,
    pub critical: f64,
    /// How far below a threshold the temperature must fall before its alarm clears.
    pub hysteresis: f64,
    pub on_critical: OnCritical,
}

impl Default for Thermal {
    fn default() -> Self {
        Thermal {
            warn: 85.0,
            critical: 95.0,
            hysteresis: 5.0,
            on_critical: OnCritical::Notify,
        }
    }
}

/// `memory:`.
#[derive(Debug, Clone, PartialEq)]
pub struct Memory {
    /// Refuse an engine start that would leave less than this many bytes available.
    pub reserve: u64,
}

impl Default for Memory {
    fn default() -> Self {
        Memory { reserve: 8 << 30 }
    }
}

/// Defines a config enum with its YAML spellings: `NAMES`, `as_str`, `Display`, `FromStr`
/// and serde.
/// The default variant is marked `#[default]`.
macro_rules! spelled_enum {
    (
        $(#[$meta:meta])*
        $name:ident, $expecting:literal,
        { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
        #[serde(expecting = $expecting)]
        pub enum $name {
            $(
                $(#[$vmeta])*
                #[serde(rename = $text)]
                $variant,
            )+
        }

        impl $name {
            /// The spellings accepted in YAML, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(format!(
                        "invalid value {other:?}, expected one of: {}",
                        $name::NAMES.join(", ")
                    )),
                }
            }
        }
    };
}

spelled_enum! {
    /// `power.cpu`: the CPU power profile while the engine runs.
    CpuPolicy, "one of power-saver, balanced, performance, keep",
    {
        #[default]
        PowerSaver = "power-saver",
        Balanced = "balanced",
        Performance = "performance",
        /// Leave it alone.
        Keep = "keep",
    }
}

spelled_enum! {
    /// `power.gpu`: the GPU power level while the engine runs.
    GpuPolicy, "one of auto, low, high, keep",
    {
        #[default]
        Auto = "auto",
        Low = "low",
        High = "high",
        /// Leave it alone.
        Keep = "keep",
    }
}

spelled_enum! {
    /// `power.method`: how power settings are applied.
    PowerMethod, "one of auto, ppd, cpufreq, none",
    {
        /// power-profiles-daemon when present, else cpufreq.
        #[default]
        Auto = "auto",
        /// power-profiles-daemon.
        Ppd = "ppd",
        /// The cpufreq governor in sysfs.
        Cpufreq = "cpufreq",
        /// Do not touch power settings.
        None = "none",
    }
}

spelled_enum! {
    /// `thermal.on_critical`: what to do at the critical temperature.
    OnCritical, "one of notify, stop-when-idle, stop",
    {
        /// Log and report only.
        #[default]
        Notify = "notify",
        /// Stop the engine as soon as no request is in flight.
        StopWhenIdle = "stop-when-idle",
        /// Stop the engine now.
        Stop = "stop",
    }
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
}

impl Profile {
    /// The context length, when the profile sets one.
    pub fn context(&self) -> Option<u32> {
        self.params.context
    }
}
