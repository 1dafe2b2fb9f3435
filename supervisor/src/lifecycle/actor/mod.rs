//! The lifecycle actor: the one owner of the engine child and of the lifecycle state.
//!
//! Owns: the [`Machine`], the engine process of the current generation, its key (see
//! [`crate::lifecycle::engine_key`]), its readiness probe, and the oneshot replies of waiting requests.
//! Everything else talks to it through a [`Handle`] (commands on a bounded channel, lease
//! releases and engine events on an unbounded one, since a `Drop` cannot wait) and reads its
//! state from a `watch`.
//! Must not: decide anything itself; the rules are in `state.rs`.
//!
//! Its parts: the way in ([`Handle`], `handle.rs`), the messages it takes (`messages.rs`)
//! and its inbox (`events.rs`), starting an
//! engine (`spawn.rs`) and probing it (`probe.rs`), the KV steps (`kv.rs`), the memory an
//! engine leaves behind (`memory.rs`), and what it publishes (`publish.rs`).

mod engine;
mod events;
mod handle;
mod identity;
mod kv;
mod memory;
mod messages;
mod probe;
mod publish;
mod services;
mod spawn;
mod workers;

pub use handle::Handle;
pub use messages::Lease;
pub use services::{Redactor, Services};

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use dsv4_client::telemetry::MemoryFigures;
use dsv4_client::AlertKind;
use dsv4_engine::OutputTail;
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::Instrument as _;
// The clock tests can pause; the std clock is banned in this crate (supervisor/clippy.toml).
use tokio::time::Instant;

use engine::{Engine, KvTask};
use memory::{memory_now_off_thread, NOT_ADMITTED_GAP};
use messages::{Command, Internal};

use super::gate::Gate;
use super::state::{Event, Limits, Machine, MemoryCheck, Refusal, Sig, WaiterId};
use crate::config::{Config, EngineLimits};
use crate::host::sysroot::SysRoot;
use crate::lifecycle::alert::Alerts;
use crate::lifecycle::engine_key::KeyFolder;

/// How many lines of one engine's output are kept (for its error messages).
const TAIL_LINES: usize = 200;
/// How many lines of engine output, across restarts, are kept for `dsv4ctl logs`.
const LOG_LINES: usize = 2000;
/// How many of those go into an error message.
pub const ERROR_TAIL_LINES: usize = 12;
/// Readiness polling: first interval, and the cap it backs off to.
const PROBE_FIRST: Duration = Duration::from_millis(5);
const PROBE_MAX: Duration = Duration::from_millis(40);
/// Checks triggered by engine output are at least this far apart, whatever the engine logs.
const PROBE_MIN_GAP: Duration = Duration::from_millis(5);
/// One probe attempt that hangs longer than this counts as "not ready yet".
const PROBE_ATTEMPT: Duration = Duration::from_secs(5);
/// How many ports one start tries when another process takes the engine's port first.
const PORT_TRIES: u32 = 3;

/// The lifecycle state as others see it: the engine part of `GET /status` and `Status()`.
pub type Status = dsv4_client::EngineStatus;

/// A request was not let through; maps to an HTTP error.
pub type Refused = Refusal;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ControlError {
    #[error("unknown profile `{name}`; profiles: {}", known.join(", "))]
    UnknownProfile { name: String, known: Vec<String> },
    #[error("cannot remember profile {name} in {dir}: {why}; nothing changed (state_dir must be writable by dsv4d)")]
    NotSaved {
        name: String,
        dir: String,
        why: String,
    },
    #[error("the supervisor is shutting down")]
    Gone,
}

/// Starts the actor on the current tokio runtime.
pub fn spawn(
    config_rx: watch::Receiver<Arc<Config>>,
    profile: String,
    services: Services,
) -> (Handle, tokio::task::JoinHandle<()>) {
    let config = config_rx.borrow().clone();
    let Services {
        alerts,
        sysroot,
        key_folder,
        trial,
        redact,
    } = services;
    let key_folder = key_folder.unwrap_or_else(|| KeyFolder::below(&config.supervisor.state_dir));
    let (cmd_tx, cmd_rx) = mpsc::channel(1024);
    let (int_tx, int_rx) = mpsc::unbounded_channel();
    let mut machine = Machine::new(profile, limits(&config.supervisor.engine), Instant::now());
    machine.set_memory_return(config.supervisor.memory.return_timeout);
    let (status_tx, status_rx) = watch::channel(Status::stopped(machine.profile()));
    let figures_tx = crate::lifecycle::gate::Figures::default();
    let gate = Arc::new(Gate::new(status_tx.clone(), figures_tx.clone()));
    let log = OutputTail::new(LOG_LINES);
    let kv = crate::kv::Book::new(config_rx.clone());
    let (loading, loading_rx) = watch::channel(None);
    let worker_book = crate::lifecycle::workers::WorkerBook::default();
    let mut actor = Actor {
        kv: kv.clone(),
        log: log.clone(),
        config,
        config_rx,
        machine,
        engine: None,
        waiters: HashMap::new(),
        internal: int_tx.clone(),
        status: status_tx,
        figures: figures_tx.clone(),
        shutdown_done: Vec::new(),
        alerts: alerts.clone(),
        sysroot,
        key_folder,
        trial,
        redact,
        outbox: Vec::new(),
        exited: false,
        stalled: false,
        memory_read: MemoryFigures::default(),
        need: None,
        next_spawned: None,
        not_admitted_said: None,
        gate: gate.clone(),
        kv_suspended: None,
        loading,
        holding: None,
        worker_book: worker_book.clone(),
        model_cache: None,
        identity: None,
    };
    // What a stopped engine's status can say from the configuration (its key, say).
    actor.publish();
    let task = tokio::spawn(actor.run(cmd_rx, int_rx));
    let handle = Handle {
        commands: cmd_tx,
        internal: int_tx,
        status: status_rx,
        figures: figures_tx,
        next_waiter: Arc::new(AtomicU64::new(1)),
        log,
        kv,
        gate,
        loading: loading_rx,
        workers: worker_book,
        alerts,
    };
    (handle, task)
}

fn limits(e: &EngineLimits) -> Limits {
    Limits {
        start_timeout: e.start_timeout,
        idle_timeout: e.idle_timeout,
        stop_timeout: e.stop_timeout,
        max_waiting: e.max_waiting,
    }
}

struct Actor {
    /// The configuration in force as last seen in `config_rx`, which the reloads publish
    /// to: looked at again at the start of every turn.
    config: Arc<Config>,
    config_rx: watch::Receiver<Arc<Config>>,
    /// What the KV checkpoint steps did.
    kv: crate::kv::Book,
    /// Every engine's output, across restarts.
    log: OutputTail,
    machine: Machine,
    engine: Option<Engine>,
    waiters: HashMap<WaiterId, oneshot::Sender<Result<Lease, Refused>>>,
    internal: mpsc::UnboundedSender<Internal>,
    /// The status, told to its watchers when anything but the per-request figures changes.
    status: watch::Sender<Status>,
    /// Counts the changes of the per-request figures alone (`in_flight`, `waiting`,
    /// `idle_deadline`), which `status` holds without waking its watchers: every request
    /// changes them twice, and waking the half-dozen tasks that follow the state (power,
    /// monitor, idle exit...) for each one was a large share of dsv4d's CPU per request.
    figures: crate::lifecycle::gate::Figures,
    shutdown_done: Vec<oneshot::Sender<()>>,
    alerts: Alerts,
    sysroot: SysRoot,
    key_folder: KeyFolder,
    /// A validation matrix cell's arguments for its profile's engine.
    trial: crate::lifecycle::trial::Trial,
    /// The keys taken out of every engine's output lines.
    redact: dsv4_engine::Redactor,
    /// Answers held back until the status they imply is published, so a caller that reads
    /// the status right after its answer sees its own change.
    outbox: Vec<Reply>,
    exited: bool,
    /// A test's fault switch: the actor stops answering, as a hung one would.
    stalled: bool,
    /// The memory figures read before the event being handled (off the runtime's thread).
    memory_read: MemoryFigures,
    /// The active profile's memory need, read off the runtime's thread (its model's header)
    /// once per profile and configuration: (profile, the configuration it was read for, it).
    need: Option<(String, Arc<Config>, super::need::Need)>,
    /// Tells the check of the last engine's memory that the next engine is spawned.
    next_spawned: Option<watch::Sender<bool>>,
    /// When a start refused for memory was last logged and alerted.
    not_admitted_said: Option<Instant>,
    /// Open between the actor's turns while the rules grant at once; closed during each.
    gate: Arc<Gate>,
    /// A profile whose engines neither restore nor save a KV checkpoint: a validation's
    /// (its benchmark prompts must not replace the real checkpoint).
    kv_suspended: Option<String>,
    /// The engine that loads, for the requests that wait for it.
    loading: watch::Sender<Option<crate::lifecycle::loading::Loading>>,
    /// A start whose profile has workers, while they are held (before its engine spawns).
    holding: Option<workers::Holding>,
    /// The worker boxes of the engine that starts or runs, for the status.
    worker_book: crate::lifecycle::workers::WorkerBook,
    /// What the page cache held of the model at the last spawn: the class its load is
    /// estimated and recorded by, and what the status shows.
    model_cache: Option<dsv4_client::ModelCache>,
    /// The running engine's identity, once read, and what changed since its profile's last
    /// start.
    identity: Option<dsv4_client::identity::IdentityStatus>,
}

enum Reply {
    Lease(
        oneshot::Sender<Result<Lease, Refused>>,
        Result<Lease, Refused>,
    ),
    Control(
        oneshot::Sender<Result<(), ControlError>>,
        Result<(), ControlError>,
    ),
    /// An alert about a change the status shows: raised once that status is out, so that a
    /// client that reads the status on the alert sees the change.
    Alert(AlertKind, String),
}

impl Actor {
    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut internal: mpsc::UnboundedReceiver<Internal>,
    ) {
        let mut commands_open = true;
        let mut config_open = true;
        // One timer for the actor's life, moved only to an earlier deadline. Each request
        // takes the idle deadline away and its release brings a later one back: re-arming
        // for that would wake the runtime's driver twice per request (measured: an eventfd
        // write and an extra epoll_wait each). A tick that comes early changes nothing: the
        // rules look at the time.
        let timer = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(timer);
        let mut armed: Option<Instant> = None;
        while !self.exited {
            if self.stalled {
                tracing::warn!("the lifecycle actor stalls (a test's fault switch)");
                std::future::pending::<()>().await;
            }
            if let Some(due) = self.machine.next_deadline() {
                if armed.is_none_or(|a| due < a) {
                    timer.as_mut().reset(due);
                    armed = Some(due);
                }
            }
            // Each turn first closes the gate, so the rules see every lease it gave, and takes
            // in a reload published meanwhile, so a command sent after it was seen sees it.
            // The turn runs in the span of the engine generation it acts on, whose fields
            // the journal's entries carry (see `crate::log::journal`).
            let span = self.turn_span();
            let event = async {
                tokio::select! {
                    biased;
                    Some(i) = internal.recv() => {
                        self.begin_turn().await;
                        self.internal_event(i)
                    }
                    changed = self.config_rx.changed(), if config_open => {
                        config_open = changed.is_ok();
                        self.begin_turn().await;
                        None
                    }
                    c = commands.recv(), if commands_open => {
                        self.begin_turn().await;
                        match c {
                            Some(c) => self.command(c).await,
                            // Every handle is gone: nobody can use the engine any more.
                            None => {
                                commands_open = false;
                                Some(Event::Shutdown)
                            }
                        }
                    }
                    _ = &mut timer, if armed.is_some() => {
                        self.begin_turn().await;
                        armed = None;
                        Some(Event::Tick)
                    }
                }
            }
            .instrument(span)
            .await;
            match event {
                Some(event) => {
                    let span = self.turn_span();
                    self.handle(event).instrument(span).await
                }
                None => self.flush_outbox(),
            }
            self.open_gate();
        }
        for done in self.shutdown_done.drain(..) {
            let _ = done.send(());
        }
    }

    /// Runs one event (and those its effects cause at once) through the rules.
    async fn handle(&mut self, first: Event) {
        // An engine a validation uses (its requests come as events) is marked for good: the
        // suspension may be lifted before it stops, and its save would replace the real
        // checkpoint with the benchmark's slots.
        self.mark_validated();
        let was_held = self.machine.held_for_memory();
        let mut queue = VecDeque::from([first]);
        while let Some(event) = queue.pop_front() {
            if self.machine.could_start() {
                // Fresh figures for the admission rule, should this event start an engine,
                // read on a blocking worker (sysfs reads may stall).
                self.memory_read = memory_now_off_thread(&self.sysroot).await;
                self.read_need().await;
                self.machine.set_memory(self.memory_check());
            }
            let effects = self.machine.step(event, Instant::now());
            for fx in effects {
                if let Some(follow) = self.perform(fx) {
                    queue.push_back(follow);
                }
            }
        }
        if self.machine.held_for_memory() && !was_held {
            tracing::info!(
                "the start waits for the last engine's memory to come back (at most {})",
                crate::config::format_duration(self.config.supervisor.memory.return_timeout)
            );
        }
        self.end_stale_kv_task();
        self.publish();
        self.flush_outbox();
    }

    /// What every turn begins with: the gate closed (see `close_gate`), and the configuration
    /// in force taken in if a reload changed it: limits at once, profile settings at the
    /// next start; an active profile gone from it falls back to the default.
    async fn begin_turn(&mut self) {
        self.close_gate();
        // Compared, not asked `has_changed`: the select's `changed()` marks it seen.
        let config = self.config_rx.borrow_and_update().clone();
        if Arc::ptr_eq(&config, &self.config) {
            return;
        }
        self.machine.set_limits(limits(&config.supervisor.engine));
        self.machine
            .set_memory_return(config.supervisor.memory.return_timeout);
        self.config = config;
        match self.fall_back_if_gone() {
            Some(event) => Box::pin(self.handle(event)).await,
            // Nothing changes state, but the status (restart pending) may.
            None => self.publish(),
        }
    }

    /// Closes the gate and tells the rules what it did while open (no effect can follow:
    /// they count its leases and move the idle time on).
    fn close_gate(&mut self) {
        if let Some(passed) = self.gate.close() {
            let effects = self.machine.step(passed, Instant::now());
            debug_assert!(
                effects.is_empty(),
                "the gate's report asked for {effects:?}"
            );
        }
    }

    /// Opens the gate on the ready engine when the rules would grant any request at once.
    fn open_gate(&mut self) {
        if self.stalled || self.exited {
            return;
        }
        let m = &self.machine;
        let shared = self.engine.as_ref().map(|e| &e.shared);
        if let Some(engine) = super::gate::opens_on(m.grants_at_once(), shared) {
            let idle_timeout = m.limits().idle_timeout;
            self.gate
                .open(engine, m.leases(), m.idle_deadline(), idle_timeout);
        }
    }

    fn flush_outbox(&mut self) {
        for reply in self.outbox.drain(..) {
            // A failed send drops the lease inside, which releases it.
            let _ = match reply {
                Reply::Lease(tx, r) => tx.send(r).map_err(drop),
                Reply::Control(tx, r) => tx.send(r).map_err(drop),
                Reply::Alert(kind, message) => {
                    self.alerts.raise(kind, message);
                    Ok(())
                }
            };
        }
    }

    fn perform(&mut self, fx: super::state::Effect) -> Option<Event> {
        use super::state::Effect;
        match fx {
            Effect::Spawn { gen, profile } => return self.spawn_engine(gen, &profile),
            Effect::Signal { gen, sig } => {
                if self.engine.as_ref().is_none_or(|e| e.shared.gen != gen) {
                    if let Some(ended) = self.stop_holding(gen) {
                        return Some(ended);
                    }
                }
                if let Some(e) = self.engine.as_ref().filter(|e| e.shared.gen == gen) {
                    let signal = match sig {
                        Sig::Term => e.spawned.engine.stop(&e.spawned.params).signal,
                        Sig::Int => Signal::SIGINT,
                        Sig::Kill => Signal::SIGKILL,
                    };
                    tracing::info!(
                        pid = e.shared.pid,
                        "sending {} to the engine",
                        signal.as_str()
                    );
                    e.child.signal(signal);
                }
                if let (Sig::Term, Some(e)) = (sig, self.engine.as_mut()) {
                    e.term_at.get_or_insert_with(Instant::now);
                }
            }
            Effect::Grant { gen, waiters } => {
                let engine = self
                    .engine
                    .as_ref()
                    .filter(|e| e.shared.gen == gen)
                    .map(|e| e.shared.clone());
                for w in waiters {
                    let Some(reply) = self.waiters.remove(&w) else {
                        // Cancelled in the meantime: give the lease back at once.
                        let _ = self.internal.send(Internal::Release { gen, served: false });
                        continue;
                    };
                    match &engine {
                        Some(engine) => {
                            let lease = Lease {
                                engine: engine.clone(),
                                release: self.internal.clone(),
                                ticket: None,
                                served: false,
                            };
                            // A failed send drops the lease, which releases it.
                            self.outbox.push(Reply::Lease(reply, Ok(lease)));
                        }
                        None => {
                            let _ = self.internal.send(Internal::Release { gen, served: false });
                            self.outbox
                                .push(Reply::Lease(reply, Err(Refusal::ShuttingDown)));
                        }
                    }
                }
            }
            Effect::Refuse { waiters, mut why } => {
                if let Refusal::StartTimeout { tail, .. } = &mut why {
                    if let Some(e) = &self.engine {
                        *tail = e.shared.output.last(ERROR_TAIL_LINES);
                    }
                }
                for w in waiters {
                    if let Some(reply) = self.waiters.remove(&w) {
                        self.outbox.push(Reply::Lease(reply, Err(why.clone())));
                    }
                }
            }
            Effect::Exit => {
                self.exited = true;
            }
            Effect::RestoreKv { gen, .. } => return self.start_kv_task(gen, true),
            Effect::SaveKv { gen, .. } => return self.start_kv_task(gen, false),
            Effect::NotAdmitted { profile, short } => {
                let message = format!("{}; nothing was started", short.describe(&profile));
                // Each refused request would say it again: once a minute is enough.
                let now = Instant::now();
                if self
                    .not_admitted_said
                    .is_none_or(|t| now.duration_since(t) >= NOT_ADMITTED_GAP)
                {
                    self.not_admitted_said = Some(now);
                    tracing::warn!("{message}");
                    self.alerts.raise(AlertKind::Memory, message);
                } else {
                    tracing::debug!("{message}");
                }
            }
        }
        None
    }

    /// Reads the active profile's need, unless it was read for this profile and
    /// configuration already.
    async fn read_need(&mut self) {
        let name = self.machine.profile();
        if let Some((n, c, _)) = &self.need {
            if n == name && Arc::ptr_eq(c, &self.config) {
                return;
            }
        }
        let Some(profile) = self.config.profile(name).cloned() else {
            self.need = None;
            return;
        };
        let need = tokio::task::spawn_blocking(move || super::need::of(&profile))
            .await
            .unwrap_or_default();
        for what in &need.unknown {
            tracing::debug!("memory need of profile {name}: cannot read {what}");
        }
        self.need = Some((name.to_string(), self.config.clone(), need));
    }

    /// What a start of the active profile would need (its `planned_memory`, else the
    /// estimate from its files and flags), and what the machine had when
    /// [`Actor::memory_read`] was read.
    fn memory_check(&self) -> MemoryCheck {
        let name = self.machine.profile();
        let need = self
            .need
            .as_ref()
            .filter(|(n, c, _)| n == name && Arc::ptr_eq(c, &self.config))
            .map(|(_, _, need)| need);
        let planned = need.and_then(|n| n.charged());
        let estimated = need.is_some_and(|n| n.planned.is_none());
        let reserve = self.config.supervisor.memory.reserve;
        MemoryCheck {
            planned,
            estimated,
            reserve,
            now: self.memory_read,
        }
    }
}
