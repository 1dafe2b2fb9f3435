//! The engine process the actor runs, and what it keeps of it until it has exited.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dsv4_client::telemetry::MemoryFigures;
use dsv4_engine::EngineChild;
use tokio::time::Instant;

use crate::lifecycle::engine_key::EngineKey;
use crate::lifecycle::leftover;
use crate::lifecycle::state::{EngineFailure, Event, Gen};
use crate::lifecycle::EngineRef;

/// The engine process the actor owns, with what a lease needs to reach it.
pub(super) struct Engine {
    pub(super) child: EngineChild,
    /// The profile as it was when this engine started.
    pub(super) spawned: crate::config::Profile,
    pub(super) shared: Arc<EngineRef>,
    pub(super) probe: tokio::task::JoinHandle<()>,
    /// The KV restore or save running for it, if one does.
    pub(super) kv_task: Option<KvTask>,
    /// What its KV steps learned: its key, the checkpoint being restored.
    pub(super) kv: Arc<crate::kv::slots::EngineKv>,
    /// A validation ran on it (its profile's checkpoints were suspended while it lived): its
    /// slots hold the benchmark's prompts, so it neither restores nor saves, ever.
    pub(super) validated: bool,
    /// When it was sent SIGTERM (how long ds4-server's save took is measured from it).
    pub(super) term_at: Option<Instant>,
    pub(super) ready_at: Option<SystemTime>,
    /// From the spawn until it served.
    pub(super) load_took: Option<Duration>,
    /// Its spawn: how long it took to load is counted from it.
    pub(super) spawned_at: Instant,
    /// The memory figures just before it started, to check that they come back after it.
    pub(super) memory_before: MemoryFigures,
    /// The OOM killer's count in dsv4d's cgroup just before it started (see
    /// `hw::cgroup`): a higher one at its exit names the cause.
    pub(super) oom_kills_before: Option<u64>,
    /// Its key, when the engine takes one: the file goes when this engine is dropped, that
    /// is once it has exited (or with the actor, which kills it).
    pub(super) _key: Option<EngineKey>,
    /// The record of its process group in `state_dir`, gone with it likewise.
    pub(super) _group: Option<leftover::Guard>,
    /// This start's earlier engines whose port another process had taken.
    pub(super) port_tries: u32,
    /// Another process was found listening on its port (see `probe`).
    pub(super) port_taken: Option<dsv4_engine::procs::Stranger>,
    /// Its span: its profile, generation and pid (see `crate::log::journal`).
    pub(super) span: tracing::Span,
    /// Its profile's workers, held while it lives: let go once it has exited (dropped with it).
    pub(super) holds: Option<crate::lifecycle::workers::Holds>,
    /// A worker went away while it ran: why, naming the box (its exit is told so).
    pub(super) lost: Option<String>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.probe.abort();
        if let Some(task) = &self.kv_task {
            task.handle.abort();
        }
    }
}

/// A KV checkpoint step in progress.
pub(super) struct KvTask {
    pub(super) restore: bool,
    pub(super) handle: tokio::task::JoinHandle<()>,
    pub(super) started: Instant,
    /// When the rules end its phase: `save_timeout` or `restore_timeout` from the phase's
    /// start, a moment before the task's own start.
    pub(super) deadline: Option<Instant>,
}

/// A start of `gen` that ends before any engine ran, for `summary` (logged), told to the
/// rules as an engine's exit.
pub(super) fn failed_start(gen: Gen, summary: String) -> Option<Event> {
    tracing::error!("{summary}");
    Some(Event::Exited {
        gen,
        failure: EngineFailure {
            summary,
            tail: Vec::new(),
        },
        spawned: false,
    })
}
