//! Engine kinds and engine child-process control.
//!
//! Owns: everything known about each engine the supervisor drives (llama.cpp's
//! `llama-server`, antirez's `ds4-server`, any OpenAI-compatible server its profile
//! describes), one description per kind in [`kinds`] (argv, readiness, stop, key, KV keeping
//! and its reports, validation API, how it tells a prefill's progress, status wording), and
//! how an engine's process is spawned, watched and stopped. Must not: know about YAML, HTTP
//! clients of the supervisor, or the lifecycle rules (when to start or stop): those belong to
//! the supervisor, which asks a kind's description and never tells the kinds apart itself.

pub mod adapter;
pub mod child;
pub mod kinds;
pub mod procs;
pub mod redact;
pub mod settings;

pub use adapter::{
    EngineKind, EngineParams, FlashAttn, GivenKey, GpuLayers, KeyPassing, Launch, Readiness, Stop,
};
pub use child::{EngineChild, ExitReport, OutputTail, SpawnError, SpawnSpec};
pub use kinds::openai::{check_args, check_key_arg, parse_health, parse_stop_signal};
pub use kinds::{
    BackendReport, Identify, Kind, KvKeeping, KvSaved, OwnKv, OwnLoad, Prefill, PrefillLine,
    PrefillReport, ValidationApi,
};
pub use redact::{Redactor, Secrets};
pub use settings::Setting;

/// The tracing target of the engine's output lines, as they go to the log.
pub const LOG_TARGET: &str = "engine";
