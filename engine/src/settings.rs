//! The settings an engine is started with, and the shapes of what a kind says of it (how it
//! takes its key, is probed, is stopped, and what it is launched with). A leaf: it imports
//! nothing of this crate, so the kinds (`crate::kinds`) and the kind enum
//! (`crate::adapter`) both build on it without a circle.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::Signal;

/// A profile key whose value an engine kind may take: the kinds declare which they read,
/// require and ignore with these ([`crate::kinds::Kind`]), and the config reader names
/// them by [`Setting::key`]. One per setting of [`EngineParams`] a profile gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Setting {
    Model,
    Mmproj,
    Context,
    Parallel,
    Batch,
    Ubatch,
    KvCache,
    FlashAttn,
    GpuLayers,
    PrefillChunk,
    KvDiskDir,
    KvDiskSpace,
    KvCheckpoint,
    Args,
    Health,
    KeyEnv,
    KeyArg,
    StopSignal,
    StopGrace,
    Workers,
}

impl Setting {
    pub const ALL: [Setting; 20] = [
        Setting::Model,
        Setting::Mmproj,
        Setting::Context,
        Setting::Parallel,
        Setting::Batch,
        Setting::Ubatch,
        Setting::KvCache,
        Setting::FlashAttn,
        Setting::GpuLayers,
        Setting::PrefillChunk,
        Setting::KvDiskDir,
        Setting::KvDiskSpace,
        Setting::KvCheckpoint,
        Setting::Args,
        Setting::Health,
        Setting::KeyEnv,
        Setting::KeyArg,
        Setting::StopSignal,
        Setting::StopGrace,
        Setting::Workers,
    ];

    /// Its key in a profile.
    pub fn key(self) -> &'static str {
        match self {
            Setting::Model => "model",
            Setting::Mmproj => "mmproj",
            Setting::Context => "context",
            Setting::Parallel => "parallel",
            Setting::Batch => "batch",
            Setting::Ubatch => "ubatch",
            Setting::KvCache => "kv_cache",
            Setting::FlashAttn => "flash_attn",
            Setting::GpuLayers => "gpu_layers",
            Setting::PrefillChunk => "prefill_chunk",
            Setting::KvDiskDir => "kv_disk_dir",
            Setting::KvDiskSpace => "kv_disk_space",
            Setting::KvCheckpoint => "kv_checkpoint",
            Setting::Args => "args",
            Setting::Health => "health",
            Setting::KeyEnv => "key_env",
            Setting::KeyArg => "key_arg",
            Setting::StopSignal => "stop_signal",
            Setting::StopGrace => "stop_grace",
            Setting::Workers => "workers",
        }
    }
}

/// The key dsv4d made for one engine: the private file it is written to, and its value.
#[derive(Debug, Clone, Copy)]
pub struct GivenKey<'a> {
    pub file: &'a Path,
    pub secret: &'a str,
}

/// What an engine is started with (see [`EngineKind::launch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub args: Vec<OsString>,
    /// Added to its environment, after the profile's `env`.
    pub env: Vec<(OsString, OsString)>,
}

/// How an engine is given the key that it then requires on every request but its
/// readiness check.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KeyPassing {
    /// It is given none: any local user can use its port.
    #[default]
    None,
    /// `FLAG FILE`: it reads the key from the private file named after the flag.
    File(&'static str),
    /// In the environment variable of this name (`/proc/PID/environ` is readable by its own
    /// user alone).
    Env(String),
    /// `FLAG KEY` on its command line, which every local user can read in
    /// `/proc/PID/cmdline`: only when a profile asks for it.
    Arg(String),
}

impl KeyPassing {
    /// Whether the engine is given a key at all.
    pub fn takes_key(&self) -> bool {
        !matches!(self, KeyPassing::None)
    }
}

/// How an engine is stopped: `signal` to its process group; SIGINT after `interrupt_grace`
/// when it has one; SIGKILL after `grace` (`None`: the supervisor's `engine.stop_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    pub signal: Signal,
    /// `signal` -> SIGINT, for an engine that may deadlock in its handler; `None`: never
    /// interrupted, it gets the whole grace.
    pub interrupt_grace: Option<Duration>,
    /// `signal` -> SIGKILL; `None`: `engine.stop_timeout`.
    pub grace: Option<Duration>,
}

/// How readiness is probed. Until it succeeds a refused connection and any other answer
/// both mean "still loading", which covers both ways engines load: llama-server binds its
/// port at once and answers `/health` with 503 while it loads; ds4-server opens its port only
/// once the model is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// `GET path` answers 200.
    Get(Cow<'static, str>),
    /// The port accepts a connection (for an engine that opens it only once it can serve).
    Connect,
}

impl Readiness {
    /// The path asked, when readiness is an answer to a request.
    pub fn path(&self) -> Option<&str> {
        match self {
            Readiness::Get(path) => Some(path),
            Readiness::Connect => None,
        }
    }
}

/// `-fa on|off|auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttn {
    On,
    Off,
    Auto,
}

impl FlashAttn {
    pub fn as_str(self) -> &'static str {
        match self {
            FlashAttn::On => "on",
            FlashAttn::Off => "off",
            FlashAttn::Auto => "auto",
        }
    }
}

/// `-ngl`: every layer, or a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    All,
    Count(u32),
}

impl fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuLayers::All => f.write_str("all"),
            GpuLayers::Count(n) => write!(f, "{n}"),
        }
    }
}

/// The engine settings of a profile, already validated; `None` leaves the engine's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineParams {
    pub model: Option<PathBuf>,
    pub mmproj: Option<PathBuf>,
    pub context: Option<u32>,
    pub parallel: Option<u32>,
    pub batch: Option<u32>,
    pub ubatch: Option<u32>,
    pub kv_cache: Option<String>,
    pub flash_attn: Option<FlashAttn>,
    pub gpu_layers: Option<GpuLayers>,
    pub prefill_chunk: Option<u32>,
    pub kv_disk_dir: Option<PathBuf>,
    pub kv_disk_space_mb: Option<u64>,
    /// llama-server `--slot-save-path`: where slots are saved and restored from.
    pub slot_save_path: Option<PathBuf>,
    pub extra_args: Vec<String>,
    /// The engine's whole argv, with `{port}` and `{host}` (a kind whose command line the
    /// profile gives: `args`).
    pub args: Vec<String>,
    /// How its readiness shows (`health`).
    pub health: Option<Readiness>,
    /// How it is given its key (`key_env`, `key_arg`).
    pub key: KeyPassing,
    /// `stop_signal`; `None`: the kind's.
    pub stop_signal: Option<Signal>,
    /// `stop_grace`: stop signal to SIGKILL; `None`: `engine.stop_timeout`.
    pub stop_grace: Option<Duration>,
    /// Where the engine reaches the devices its profile's `workers` lend it (`host:port` each,
    /// dsv4d's relays on loopback): filled in at each start, once every worker is held.
    pub workers: Vec<String>,
}
