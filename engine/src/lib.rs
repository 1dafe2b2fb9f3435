//! Engine adapters and engine child-process control.
//!
//! Owns: how each engine the supervisor drives (llama.cpp's `llama-server`, antirez's
//! `ds4-server`) is started (argv), how its readiness is probed, and how its process is
//! spawned, watched and stopped. Must not: know about YAML, HTTP clients of the supervisor,
//! or the lifecycle rules (when to start or stop): those belong to the supervisor.

pub mod adapter;
pub mod child;
pub mod procs;

pub use adapter::{EngineKind, EngineParams, FlashAttn, GpuLayers, Readiness};
pub use child::{EngineChild, ExitReport, OutputTail, SpawnError, SpawnSpec};

/// The tracing target of the engine's output lines, as they go to the log.
pub const LOG_TARGET: &str = "engine";
