//! The lifecycle actor: the one owner of the engine child and of the lifecycle state.
//!
//! Owns: the [`Machine`], the engine process of the current generation, its key (see
//! [`crate::lifecycle::engine_key`]), its readiness probe, and the oneshot replies of waiting requests.
//! Everything else talks to it through a [`Handle`] (commands on a bounded channel, lease
//! releases and engine events on an unbounded one, since a `Drop` cannot wait) and reads its
//! state from a `watch`.
//! Must not: decide anything itself; the rules are in `state.rs`.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dsv4_client::AlertKind;
use dsv4_engine::{EngineChild, ExitReport, OutputTail, Readiness, SpawnSpec};
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, oneshot, watch};
// The clock tests can pause; the std clock is banned in this crate (supervisor/clippy.toml).
use tokio::time::Instant;

use super::engine_ref::EngineRef;
use super::state::{
    EngineFailure, Event, Gen, KvSteps, Limits, Machine, MemoryCheck, Phase, Refusal, Sig, WaiterId,
};
use crate::config::{Config, EngineLimits};
use crate::host::sysroot::SysRoot;
use crate::lifecycle::alert::Alerts;
use crate::lifecycle::engine_key::{EngineKey, KeyFolder};
use crate::lifecycle::leftover;
use crate::lifecycle::upstream::Upstream;

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

/// The lifecycle state as others see it: the engine part of `GET /status` and `Status()`.
pub type Status = dsv4_client::EngineStatus;

/// The right to send one request to the engine; the engine is not stopped while any lease is
/// held. Dropping it tells the actor, so idle time counts from the last lease released.
#[derive(Debug)]
pub struct Lease {
    pub engine: Arc<EngineRef>,
    release: mpsc::UnboundedSender<Internal>,
    served: bool,
}

impl Lease {
    /// The response went out whole: the engine serves (see `Event::Served`). Told to the
    /// actor with the release, in one message.
    pub fn served(&mut self) {
        self.served = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.release.send(Internal::Release {
            gen: self.engine.gen,
            served: self.served,
        });
    }
}

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

enum Command {
    Acquire {
        waiter: WaiterId,
        reply: oneshot::Sender<Result<Lease, Refused>>,
    },
    /// `Start`, then `Acquire` for `waiter`: one command, so nothing can come between.
    StartAndAcquire {
        waiter: WaiterId,
        reply: oneshot::Sender<Result<Lease, Refused>>,
    },
    Start,
    Stop {
        now: bool,
    },
    SetProfile {
        name: String,
        reply: oneshot::Sender<Result<(), ControlError>>,
    },
    Shutdown {
        done: oneshot::Sender<()>,
    },
    Reload {
        config: Arc<Config>,
    },
    /// Too hot, or cool again (`None`): see [`Event::Heat`].
    Heat {
        hot: Option<(String, Option<Duration>)>,
    },
    /// Answered at once: the watchdog's proof that the actor turns.
    Ping {
        reply: oneshot::Sender<()>,
    },
    /// Test-only: the actor stops turning (see `Handle::stall`).
    Stall,
}

#[derive(Debug)]
enum Internal {
    /// A lease given back; `served` when its response went out whole first.
    Release {
        gen: Gen,
        served: bool,
    },
    Cancel {
        waiter: WaiterId,
    },
    Ready {
        gen: Gen,
    },
    Exited {
        gen: Gen,
        report: ExitReport,
    },
    /// The KV restore (`restore`) or save of generation `gen` is over.
    KvDone {
        gen: Gen,
        restore: bool,
    },
    /// The memory of the engine that exited last came back, or will not (said already).
    MemorySettled,
}

/// The way in to the actor; cheap to clone.
#[derive(Clone)]
pub struct Handle {
    commands: mpsc::Sender<Command>,
    internal: mpsc::UnboundedSender<Internal>,
    status: watch::Receiver<Status>,
    figures: watch::Receiver<u64>,
    next_waiter: Arc<AtomicU64>,
    log: OutputTail,
    kv: crate::kv::Book,
}

impl Handle {
    /// The KV checkpoint steps' record.
    pub fn kv(&self) -> &crate::kv::Book {
        &self.kv
    }

    /// Waits until the engine is ready (starting it if needed) and takes a lease on it.
    pub async fn acquire(&self) -> Result<Lease, Refused> {
        self.wait_for_lease(|waiter, reply| Command::Acquire { waiter, reply })
            .await
    }

    /// Starts the engine now (a backoff after a failed start is skipped, as with
    /// [`start`](Self::start)) and waits for it like a request: the answer is a lease once it
    /// is ready, or the refusal that ended the start.
    pub async fn start_and_acquire(&self) -> Result<Lease, Refused> {
        self.wait_for_lease(|waiter, reply| Command::StartAndAcquire { waiter, reply })
            .await
    }

    async fn wait_for_lease(
        &self,
        command: impl FnOnce(WaiterId, oneshot::Sender<Result<Lease, Refused>>) -> Command,
    ) -> Result<Lease, Refused> {
        let waiter = self.next_waiter.fetch_add(1, Ordering::Relaxed);
        let (reply, rx) = oneshot::channel();
        if self.commands.send(command(waiter, reply)).await.is_err() {
            return Err(Refusal::ShuttingDown);
        }
        // If this future is dropped (the client went away), free the place in the queue.
        let guard = CancelOnDrop {
            waiter,
            internal: &self.internal,
            armed: true,
        };
        let answer = rx.await;
        guard.disarm();
        answer.unwrap_or(Err(Refusal::ShuttingDown))
    }

    pub async fn start(&self) -> Result<(), ControlError> {
        self.commands
            .send(Command::Start)
            .await
            .map_err(|_| ControlError::Gone)
    }

    /// Stops the engine: after in-flight requests finish, or at once with `now`.
    pub async fn stop(&self, now: bool) -> Result<(), ControlError> {
        self.commands
            .send(Command::Stop { now })
            .await
            .map_err(|_| ControlError::Gone)
    }

    /// Makes `name` the active profile; a running engine is drained and restarted with it.
    pub async fn set_profile(&self, name: &str) -> Result<(), ControlError> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::SetProfile {
                name: name.to_string(),
                reply,
            })
            .await
            .map_err(|_| ControlError::Gone)?;
        rx.await.map_err(|_| ControlError::Gone)?
    }

    /// Resolves once the actor has handled a command: what the watchdog checks before it
    /// tells systemd that the daemon is alive. `false` when the actor is gone.
    pub async fn ping(&self) -> bool {
        let (reply, rx) = oneshot::channel();
        if self.commands.send(Command::Ping { reply }).await.is_err() {
            return false;
        }
        rx.await.is_ok()
    }

    /// Test-only fault switch: the actor stops handling anything, as if hung (the watchdog
    /// must then let systemd restart the daemon). dsv4d offers it only when told to by
    /// `DSV4_TEST_FAULTS`.
    pub async fn stall(&self) {
        let _ = self.commands.send(Command::Stall).await;
    }

    /// Too hot to serve (`thermal.on_critical`: new requests refused with `message`, the
    /// engine stopped when idle, or after at most `drain`), or cool again with `None`.
    pub async fn heat(&self, hot: Option<(String, Option<Duration>)>) {
        let _ = self.commands.send(Command::Heat { hot }).await;
    }

    /// Replaces the configuration: limits apply at once, profile settings at the next start.
    pub async fn reload(&self, config: Arc<Config>) {
        let _ = self.commands.send(Command::Reload { config }).await;
    }

    /// Drains (bounded by `stop_timeout`), stops the engine, and resolves once it is gone.
    pub async fn shutdown(&self) {
        let (done, rx) = oneshot::channel();
        if self.commands.send(Command::Shutdown { done }).await.is_ok() {
            let _ = rx.await;
        }
    }

    pub fn status(&self) -> Status {
        self.status.borrow().clone()
    }

    /// The status, its watchers woken when anything but the per-request figures changes
    /// (`borrow` always gives the latest figures; see [`watch_figures`](Self::watch_figures)).
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Changes when the per-request figures of the status (`in_flight`, `waiting`,
    /// `idle_deadline`) changed and nothing else did.
    pub fn watch_figures(&self) -> watch::Receiver<u64> {
        self.figures.clone()
    }

    /// Engine output lines numbered `since` on (at most the last `max`), across engine
    /// restarts, and the number of the next line.
    pub fn logs(&self, since: u64, max: usize) -> (u64, Vec<String>) {
        self.log.since(since, max)
    }

    /// As [`logs`](Self::logs), waiting up to `wait` for a line when there is none yet.
    pub async fn wait_logs(&self, since: u64, max: usize, wait: Duration) -> (u64, Vec<String>) {
        self.log.since_or_wait(since, max, wait).await
    }
}

struct CancelOnDrop<'a> {
    waiter: WaiterId,
    internal: &'a mpsc::UnboundedSender<Internal>,
    armed: bool,
}

impl CancelOnDrop<'_> {
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.internal.send(Internal::Cancel {
                waiter: self.waiter,
            });
        }
    }
}

/// The engine process the actor owns, with what a lease needs to reach it.
struct Engine {
    child: EngineChild,
    /// The profile as it was when this engine started.
    spawned: crate::config::Profile,
    shared: Arc<EngineRef>,
    probe: tokio::task::JoinHandle<()>,
    /// The KV restore or save running for it, if one does.
    kv_task: Option<KvTask>,
    /// A validation ran on it (its profile's checkpoints were suspended while it lived): its
    /// slots hold the benchmark's prompts, so it neither restores nor saves, ever.
    validated: bool,
    /// When it was sent SIGTERM (how long ds4-server's save took is measured from it).
    term_at: Option<Instant>,
    ready_at: Option<SystemTime>,
    /// The memory figures just before it started, to check that they come back after it.
    memory_before: crate::host::hw::MemoryNow,
    /// The OOM killer's count in dsv4d's cgroup just before it started (see
    /// `hw::cgroup`): a higher one at its exit names the cause.
    oom_kills_before: Option<u64>,
    /// Its key, when the engine takes one: the file goes when this engine is dropped, that
    /// is once it has exited (or with the actor, which kills it).
    _key: Option<EngineKey>,
    /// The record of its process group in `state_dir`, gone with it likewise.
    _group: Option<leftover::Guard>,
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
struct KvTask {
    restore: bool,
    handle: tokio::task::JoinHandle<()>,
    started: Instant,
    /// When the rules end its phase: `save_timeout` or `restore_timeout` from the phase's
    /// start, a moment before the task's own start.
    deadline: Option<Instant>,
}

/// What the actor uses from the rest of the daemon.
#[derive(Debug, Clone, Default)]
pub struct Services {
    /// Gets an alert when an engine dies while it serves.
    pub alerts: Alerts,
    /// Where the host's memory figures are read before each start.
    pub sysroot: SysRoot,
    /// Where each engine's key is written; `None`: `engine-keys` below `state_dir`.
    pub key_folder: Option<KeyFolder>,
}

/// Starts the actor on the current tokio runtime.
pub fn spawn(
    config: Arc<Config>,
    profile: String,
    services: Services,
) -> (Handle, tokio::task::JoinHandle<()>) {
    let Services {
        alerts,
        sysroot,
        key_folder,
    } = services;
    let key_folder = key_folder.unwrap_or_else(|| KeyFolder::below(&config.supervisor.state_dir));
    let (cmd_tx, cmd_rx) = mpsc::channel(1024);
    let (int_tx, int_rx) = mpsc::unbounded_channel();
    let mut machine = Machine::new(profile, limits(&config.supervisor.engine), Instant::now());
    machine.set_memory_return(config.supervisor.memory.return_timeout);
    let (status_tx, status_rx) = watch::channel(Status::stopped(machine.profile()));
    let (figures_tx, figures_rx) = watch::channel(0);
    let log = OutputTail::new(LOG_LINES);
    let kv = crate::kv::Book::default();
    kv.set_config(config.clone());
    let mut actor = Actor {
        kv: kv.clone(),
        log: log.clone(),
        config,
        machine,
        engine: None,
        waiters: HashMap::new(),
        internal: int_tx.clone(),
        status: status_tx,
        figures: figures_tx,
        shutdown_done: Vec::new(),
        alerts,
        sysroot,
        key_folder,
        outbox: Vec::new(),
        exited: false,
        stalled: false,
        memory_read: crate::host::hw::MemoryNow::default(),
        next_spawned: None,
        not_admitted_said: None,
    };
    // What a stopped engine's status can say from the configuration (its key, say).
    actor.publish();
    let task = tokio::spawn(actor.run(cmd_rx, int_rx));
    let handle = Handle {
        commands: cmd_tx,
        internal: int_tx,
        status: status_rx,
        figures: figures_rx,
        next_waiter: Arc::new(AtomicU64::new(1)),
        log,
        kv,
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
    config: Arc<Config>,
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
    figures: watch::Sender<u64>,
    shutdown_done: Vec<oneshot::Sender<()>>,
    alerts: Alerts,
    sysroot: SysRoot,
    key_folder: KeyFolder,
    /// Answers held back until the status they imply is published, so a caller that reads
    /// the status right after its answer sees its own change.
    outbox: Vec<Reply>,
    exited: bool,
    /// A test's fault switch: the actor stops answering, as a hung one would.
    stalled: bool,
    /// The memory figures read before the event being handled (off the runtime's thread).
    memory_read: crate::host::hw::MemoryNow,
    /// Tells the check of the last engine's memory that the next engine is spawned.
    next_spawned: Option<watch::Sender<bool>>,
    /// When a start refused for memory was last logged and alerted.
    not_admitted_said: Option<Instant>,
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
            let event = tokio::select! {
                biased;
                Some(i) = internal.recv() => self.internal_event(i),
                c = commands.recv(), if commands_open => match c {
                    Some(c) => self.command(c).await,
                    // Every handle is gone: nobody can use the engine any more.
                    None => {
                        commands_open = false;
                        Some(Event::Shutdown)
                    }
                },
                _ = &mut timer, if armed.is_some() => {
                    armed = None;
                    Some(Event::Tick)
                }
            };
            match event {
                Some(event) => self.handle(event).await,
                None => self.flush_outbox(),
            }
        }
        for done in self.shutdown_done.drain(..) {
            let _ = done.send(());
        }
    }

    async fn command(&mut self, c: Command) -> Option<Event> {
        match c {
            Command::Acquire { waiter, reply } => {
                if reply.is_closed() {
                    return None; // the client left while the command was queued
                }
                self.waiters.insert(waiter, reply);
                Some(Event::Acquire { waiter })
            }
            Command::StartAndAcquire { waiter, reply } => {
                if reply.is_closed() {
                    return None;
                }
                self.handle(Event::Start).await;
                self.waiters.insert(waiter, reply);
                Some(Event::Acquire { waiter })
            }
            Command::Start => Some(Event::Start),
            Command::Stop { now } => Some(Event::Stop { now }),
            Command::Ping { reply } => {
                let _ = reply.send(());
                None
            }
            Command::Stall => {
                self.stalled = true;
                None
            }
            Command::Heat { hot } => Some(match hot {
                Some((message, drain)) => Event::Heat { message, drain },
                None => Event::Cooled,
            }),
            Command::SetProfile { name, reply } => {
                if self.config.profile(&name).is_none() {
                    let known = self
                        .config
                        .profile_names()
                        .into_iter()
                        .map(String::from)
                        .collect();
                    self.outbox.push(Reply::Control(
                        reply,
                        Err(ControlError::UnknownProfile { name, known }),
                    ));
                    return None;
                }
                let state_dir = &self.config.supervisor.state_dir;
                if let Err(e) = crate::host::state_file::save_profile(state_dir, &name) {
                    // A switch that a restart would quietly undo is refused whole.
                    let err = ControlError::NotSaved {
                        name,
                        dir: state_dir.display().to_string(),
                        why: e.to_string(),
                    };
                    tracing::warn!("{err}");
                    self.outbox.push(Reply::Control(reply, Err(err)));
                    return None;
                }
                tracing::info!("profile set to {name}");
                self.outbox.push(Reply::Control(reply, Ok(())));
                Some(Event::SetProfile { profile: name })
            }
            Command::Shutdown { done } => {
                self.shutdown_done.push(done);
                Some(Event::Shutdown)
            }
            Command::Reload { config } => {
                self.machine.set_limits(limits(&config.supervisor.engine));
                self.machine
                    .set_memory_return(config.supervisor.memory.return_timeout);
                self.kv.set_config(config.clone());
                self.config = config;
                if let Some(event) = self.fall_back_if_gone() {
                    return Some(event);
                }
                // No event: nothing changes state, but the status (restart pending) may.
                self.publish();
                None
            }
        }
    }

    /// When the active profile is no longer configured (its file was deleted or renamed),
    /// `default_profile` becomes the active one, as at start-up, remembered in `state_dir`
    /// as `SetProfile` does, with an alert: else every later start would fail until someone
    /// picked a profile. A running engine of the old profile is drained and replaced, as
    /// after `SetProfile`.
    fn fall_back_if_gone(&mut self) -> Option<Event> {
        let gone = self.machine.profile();
        if self.config.profile(gone).is_some() {
            return None;
        }
        let default = self.config.supervisor.default_profile.clone();
        let state_dir = &self.config.supervisor.state_dir;
        let message = format!(
            "the active profile {gone} is not configured any more; \
             using default_profile {default}"
        );
        tracing::warn!("{message}");
        if let Err(e) = crate::host::state_file::save_profile(state_dir, &default) {
            // A restart also falls back, since the remembered profile is not configured.
            tracing::warn!(
                "cannot remember profile {default} in {}: {e}",
                state_dir.display()
            );
        }
        self.outbox.push(Reply::Alert(AlertKind::Config, message));
        Some(Event::SetProfile { profile: default })
    }

    fn internal_event(&mut self, i: Internal) -> Option<Event> {
        match i {
            Internal::Release { gen, served } => {
                if served {
                    // Before the release, as when they were two messages.
                    let effects = self.machine.step(Event::Served { gen }, Instant::now());
                    for fx in effects {
                        if let Some(follow) = self.perform(fx) {
                            tracing::warn!("an event after Served was dropped: {follow:?}");
                        }
                    }
                }
                Some(Event::Release { gen })
            }
            Internal::Cancel { waiter } => {
                self.waiters.remove(&waiter);
                Some(Event::Cancel { waiter })
            }
            Internal::Ready { gen } => Some(Event::Ready { gen }),
            Internal::MemorySettled => Some(Event::MemorySettled),
            Internal::KvDone { gen, restore } => {
                if let Some(e) = self.engine.as_mut().filter(|e| e.shared.gen == gen) {
                    e.kv_task = None;
                }
                Some(match restore {
                    true => Event::KvRestored { gen },
                    false => Event::KvSaved { gen },
                })
            }
            Internal::Exited { gen, report } => {
                let engine = self.engine.take_if(|e| e.shared.gen == gen);
                if let Some(e) = &engine {
                    self.ds4_save_report(e);
                    let (sysroot, alerts) = (self.sysroot.clone(), self.alerts.clone());
                    let (before, profile) = (e.memory_before, e.shared.profile.clone());
                    let within = self.config.supervisor.memory.return_timeout;
                    let settled = self.internal.clone();
                    let (next_tx, next) = watch::channel(false);
                    self.next_spawned = Some(next_tx);
                    tokio::spawn(memory_comes_back(
                        sysroot, before, profile, within, alerts, settled, next,
                    ));
                }
                let tail = engine
                    .as_ref()
                    .map(|e| e.shared.output.last(ERROR_TAIL_LINES))
                    .unwrap_or_default();
                let pid = engine.as_ref().map(|e| e.shared.pid).unwrap_or(0);
                // Killed while the OOM killer's count in our cgroup went up: say so.
                let oom = engine.as_ref().and_then(|e| {
                    let before = e.oom_kills_before?;
                    let (file, now) = crate::host::hw::cgroup::oom_kills(&self.sysroot)?;
                    (report.signal.is_some() && now > before).then(|| {
                        format!(
                            "out of memory: the kernel's OOM killer ended it ({} in {file} went \
                             from {before} to {now})",
                            "oom_kill"
                        )
                    })
                });
                let report = match &oom {
                    Some(why) => format!("{report}; {why}"),
                    None => report.to_string(),
                };
                let summary = match self.machine.phase() {
                    Phase::Starting { .. } => {
                        format!("the engine exited before it was ready ({report})")
                    }
                    Phase::Restoring { .. }
                    | Phase::Ready { .. }
                    | Phase::Draining { .. }
                    | Phase::Saving { .. } => {
                        format!("the engine exited unexpectedly ({report})")
                    }
                    _ => format!("the engine stopped ({report})"),
                };
                match self.machine.phase() {
                    Phase::Starting { .. } => tracing::warn!(pid, "{summary}"),
                    // It was serving (or finishing what it served): someone should hear of it.
                    Phase::Restoring { profile, .. }
                    | Phase::Ready { profile, .. }
                    | Phase::Draining { profile, .. }
                    | Phase::Saving { profile, .. } => {
                        tracing::warn!(pid, "{summary}");
                        let mut message = format!("engine (profile {profile}) crashed: {report}");
                        if !tail.is_empty() {
                            message.push_str("; its last lines:\n");
                            message.push_str(&tail.join("\n"));
                        }
                        self.alerts.raise(AlertKind::Engine, message);
                    }
                    _ => tracing::info!(pid, "{summary}"),
                }
                Some(Event::Exited {
                    gen,
                    failure: EngineFailure { summary, tail },
                })
            }
        }
    }

    /// Runs one event (and those its effects cause at once) through the rules.
    async fn handle(&mut self, first: Event) {
        // An engine a validation uses (its requests come as events) is marked for good: the
        // suspension may be lifted before it stops, and its save would replace the real
        // checkpoint with the benchmark's slots.
        if let Some(e) = self.engine.as_mut() {
            if !e.validated && self.kv.suspended(&e.spawned.name) {
                e.validated = true;
                tracing::info!(
                    pid = e.shared.pid,
                    "a validation runs on this engine: it will not save its KV cache"
                );
            }
        }
        let was_held = self.machine.held_for_memory();
        let mut queue = VecDeque::from([first]);
        while let Some(event) = queue.pop_front() {
            if self.machine.could_start() {
                // Fresh figures for the admission rule, should this event start an engine,
                // read on a blocking worker (sysfs reads may stall).
                self.memory_read = memory_now_off_thread(&self.sysroot).await;
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
                if let Some(e) = self.engine.as_ref().filter(|e| e.shared.gen == gen) {
                    let signal = match sig {
                        Sig::Term => Signal::SIGTERM,
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

    /// What a start of the active profile would need, and what the machine had when
    /// [`Actor::memory_read`] was read.
    fn memory_check(&self) -> MemoryCheck {
        let planned = self
            .config
            .profile(self.machine.profile())
            .and_then(|p| p.planned_memory);
        let reserve = self.config.supervisor.memory.reserve;
        let now = self.memory_read;
        MemoryCheck {
            planned,
            reserve,
            available: now.available,
            gtt_used: now.gtt_used,
            gtt_total: now.gtt_total,
            vram_used: now.vram_used,
            vram_total: now.vram_total,
        }
    }

    fn spawn_engine(&mut self, gen: Gen, profile_name: &str) -> Option<Event> {
        let fail = |summary: String| {
            tracing::error!("{summary}");
            Some(Event::Exited {
                gen,
                failure: EngineFailure {
                    summary,
                    tail: Vec::new(),
                },
            })
        };
        let Some(profile) = self.config.profile(profile_name) else {
            return fail(format!(
                "profile `{profile_name}` is not in the configuration any more"
            ));
        };
        let port = match free_port() {
            Ok(p) => p,
            Err(e) => {
                return fail(format!(
                    "cannot find a free loopback port for the engine: {e}"
                ))
            }
        };
        // A fresh secret for each engine that can require one: a key that outlived its engine
        // (read from a file of the old generation, say) opens nothing.
        let key = match profile.engine.key_file_flag() {
            Some(_) => match self.key_folder.issue(gen) {
                Ok(key) => Some(key),
                Err(e) => return fail(e.to_string()),
            },
            None => None,
        };
        let key_file = key.as_ref().map(EngineKey::path);
        let args = profile
            .engine
            .argv(&profile.params, "127.0.0.1", port, key_file);
        // Every process of this engine carries the mark, whatever it starts: a next dsv4d
        // ends what is left of it only by the mark (see `crate::lifecycle::leftover`).
        let tag = match leftover::new_tag() {
            Ok(tag) => tag,
            Err(e) => return fail(format!("cannot make the engine's process mark: {e}")),
        };
        let mut env: Vec<(std::ffi::OsString, std::ffi::OsString)> = profile
            .env
            .iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        env.push((leftover::TAG_VAR.into(), tag.clone().into()));
        let spec = SpawnSpec {
            program: profile.command.clone(),
            args,
            env,
            tail_lines: TAIL_LINES,
            also: Some(self.log.clone()),
        };
        let shown: Vec<_> = spec.args.iter().map(|a| a.to_string_lossy()).collect();
        tracing::info!(
            profile = profile_name,
            "starting engine: {} {}",
            spec.program.display(),
            shown.join(" ")
        );
        // Read just before the step that spawns (see `handle`).
        let before = self.memory_read;
        if let Some(next) = self.next_spawned.take() {
            next.send_replace(true);
        }
        match before.available {
            Some(bytes) => tracing::info!(
                "memory available before the start: {:.1} GiB",
                bytes as f64 / (1u64 << 30) as f64
            ),
            None => tracing::debug!(
                "memory available before the start: unknown (no {})",
                self.sysroot.path(crate::host::hw::meminfo::PATH).display()
            ),
        }
        if let Some(kv) = &profile.kv_checkpoint {
            // llama-server saves only into a folder that exists.
            if let Err(e) = crate::kv::store::Store::new(&kv.dir).ensure() {
                tracing::warn!(
                    "cannot create the KV checkpoint folder {}: {e}; saves will fail",
                    kv.dir.display()
                );
            }
        }
        let child = match EngineChild::spawn(&spec) {
            Ok(c) => c,
            Err(e) => return fail(e.to_string()),
        };
        let state_dir = &self.config.supervisor.state_dir;
        let group = match leftover::Guard::write(state_dir, child.pid(), &tag) {
            Ok(g) => Some(g),
            Err(e) => {
                // The engine runs all the same; only a crash of dsv4d could leave it behind.
                tracing::warn!(
                    "cannot write {}: {e}; an engine left running by a killed dsv4d would not \
                     be ended at its next start",
                    leftover::record_path(state_dir).display()
                );
                None
            }
        };
        self.machine
            .set_interrupt_grace(profile.engine.interrupt_grace());
        self.machine.set_kv_steps(
            profile
                .kv_checkpoint
                .as_ref()
                .filter(|_| !self.kv.suspended(profile_name))
                .map(|kv| KvSteps {
                    save_timeout: kv.save_timeout,
                    restore_timeout: kv.restore_timeout,
                }),
        );
        let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let shared = Arc::new(EngineRef {
            gen,
            profile: profile_name.to_string(),
            pid: child.pid(),
            upstream,
            connections: Upstream::new(upstream, key.as_ref().map(|k| k.authorization().clone())),
            output: child.output().clone(),
            exit: child.exit_watch(),
        });
        let probe = tokio::spawn(probe_ready(
            profile.engine.readiness(),
            shared.clone(),
            self.internal.clone(),
        ));
        let internal = self.internal.clone();
        let exit = child.exit_watch();
        tokio::spawn(async move {
            let mut exit = exit;
            let report = match exit.wait_for(Option::is_some).await {
                Ok(r) => r.clone(),
                Err(_) => None,
            };
            let report = report.unwrap_or(ExitReport {
                code: None,
                signal: None,
            });
            let _ = internal.send(Internal::Exited { gen, report });
        });
        self.engine = Some(Engine {
            spawned: profile.clone(),
            child,
            shared,
            probe,
            kv_task: None,
            validated: false,
            term_at: None,
            ready_at: None,
            memory_before: before,
            oom_kills_before: crate::host::hw::cgroup::oom_kills(&self.sysroot).map(|(_, n)| n),
            _key: key,
            _group: group,
        });
        None
    }

    /// Runs the KV restore or save of generation `gen` as a task that reports back.
    fn start_kv_task(&mut self, gen: Gen, restore: bool) -> Option<Event> {
        let done = match restore {
            true => Event::KvRestored { gen },
            false => Event::KvSaved { gen },
        };
        let Some(e) = self.engine.as_mut().filter(|e| e.shared.gen == gen) else {
            return Some(done);
        };
        if e.spawned.kv_checkpoint.is_none() || e.validated || self.kv.suspended(&e.spawned.name) {
            return Some(done);
        }
        let (engine, profile, book) = (e.shared.clone(), e.spawned.clone(), self.kv.clone());
        let internal = self.internal.clone();
        tracing::info!(
            profile = profile.name,
            "{} the KV checkpoint",
            if restore { "restoring" } else { "saving" }
        );
        let handle = tokio::spawn(async move {
            let name = profile.name.clone();
            if restore {
                let step = super::kv_steps::restore(engine, profile, book.clone()).await;
                book.restored(&name, step);
            } else {
                let step = super::kv_steps::save(engine, profile, book.clone()).await;
                book.saved(&name, step);
            }
            let _ = internal.send(Internal::KvDone { gen, restore });
        });
        let deadline = match self.machine.phase() {
            Phase::Restoring { deadline, .. } | Phase::Saving { deadline, .. } => Some(*deadline),
            _ => None,
        };
        e.kv_task = Some(KvTask {
            restore,
            handle,
            started: Instant::now(),
            deadline,
        });
        None
    }

    /// A KV step whose phase the rules have left (its timeout, a stop) is ended, and said so.
    fn end_stale_kv_task(&mut self) {
        let phase = self.machine.phase();
        let Some(e) = self.engine.as_mut() else {
            return;
        };
        let Some(task) = &e.kv_task else { return };
        let current = match phase {
            Phase::Restoring { gen, .. } => task.restore && *gen == e.shared.gen,
            Phase::Saving { gen, .. } => !task.restore && *gen == e.shared.gen,
            _ => false,
        };
        if current {
            return;
        }
        let Some(task) = e.kv_task.take() else { return };
        task.handle.abort();
        let Some(kv) = &e.spawned.kv_checkpoint else {
            return;
        };
        let seconds = task.started.elapsed().as_secs_f64();
        let (what, timeout) = match task.restore {
            true => ("restore", kv.restore_timeout),
            false => ("save", kv.save_timeout),
        };
        // Judged by the phase's deadline, which passes a moment before `timeout` has gone by
        // since the task started (it started after the phase): by the task's own clock a
        // step cut at its timeout read as "cut off by a stop" (seen: 0.997 s of 1 s).
        let timed_out = match task.deadline {
            Some(deadline) => Instant::now() >= deadline,
            None => task.started.elapsed() >= timeout,
        };
        let result = match timed_out {
            true => format!(
                "cut off by kv_checkpoint.{what}_timeout ({})",
                crate::config::format_duration(timeout)
            ),
            false => "cut off by a stop".to_string(),
        };
        match task.restore {
            true => tracing::warn!(
                "the KV checkpoint restore was {result}; the engine serves without it"
            ),
            false => tracing::warn!("the KV checkpoint save was {result}; nothing was kept"),
        }
        let step = dsv4_client::kv::KvStep {
            at: crate::kv::unix_now(),
            seconds,
            result,
            ..Default::default()
        };
        if task.restore {
            // Cut by a stop, the engine did not die on the checkpoint, which stays usable.
            // Cut by its timeout, the restore may still go on inside the engine: the mark
            // stays (the engine's next save replaces the checkpoint and clears it).
            if let Some(id) = self.kv.restoring(e.shared.gen).filter(|_| !timed_out) {
                let store = crate::kv::store::Store::new(&kv.dir);
                tokio::task::spawn_blocking(move || store.clear_restoring(&id));
            }
            self.kv.restored(&e.spawned.name, step);
        } else {
            self.kv.saved(&e.spawned.name, step);
        }
    }

    /// ds4-server saves its KV cache after SIGTERM: how long it took to exit, and what it said.
    fn ds4_save_report(&self, e: &Engine) {
        if e.spawned.engine != dsv4_engine::EngineKind::Ds4
            || e.spawned.params.kv_disk_dir.is_none()
        {
            return;
        }
        let Some(term_at) = e.term_at else { return };
        let seconds = term_at.elapsed().as_secs_f64();
        let lines = e.shared.output.last(TAIL_LINES);
        let step = match crate::kv::ds4_saved(&lines) {
            Some((mut step, said)) => {
                tracing::info!(
                    profile = e.spawned.name,
                    "ds4-server stopped {seconds:.1} s after SIGTERM; it said: {said}"
                );
                step.seconds = seconds;
                step
            }
            None => {
                tracing::info!(
                    profile = e.spawned.name,
                    "ds4-server stopped {seconds:.1} s after SIGTERM and said nothing of a KV checkpoint (it saves none under 512 tokens)"
                );
                dsv4_client::kv::KvStep {
                    at: crate::kv::unix_now(),
                    seconds,
                    result: "nothing said".into(),
                    ..Default::default()
                }
            }
        };
        self.kv.saved(&e.spawned.name, step);
    }

    fn publish(&mut self) {
        let m = &self.machine;
        if let (Phase::Ready { .. }, Some(e)) = (m.phase(), self.engine.as_mut()) {
            e.ready_at.get_or_insert_with(SystemTime::now);
        }
        let unix = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .ok()
        };
        let idle_deadline = m.idle_deadline().and_then(|d| {
            let left = d.saturating_duration_since(Instant::now());
            unix(SystemTime::now() + left)
        });
        // Everything but the figures, borrowed: compared with what stands before anything is
        // allocated (every request publishes twice, and mostly only the figures moved).
        let engine_pid = self.engine.as_ref().map(|e| e.shared.pid);
        let ready_since = self.engine.as_ref().and_then(|e| e.ready_at).and_then(unix);
        let last_error = m.last_failure().map(|f| f.summary.as_str());
        let restart_pending = self
            .engine
            .as_ref()
            .is_some_and(|e| self.config.profile(&e.shared.profile) != Some(&e.spawned));
        // The running engine's, else the one the next start would run.
        let engine_key = match &self.engine {
            Some(e) => Some(e.spawned.engine),
            None => self.config.profile(m.profile()).map(|p| p.engine),
        }
        .map(|kind| kind.key_protection());
        let kv_step = match m.phase() {
            Phase::Restoring { .. } => Some("restoring"),
            Phase::Saving { .. } => Some("saving"),
            _ => None,
        };
        let same_but_figures = {
            let old = self.status.borrow();
            old.state == m.state()
                && old.profile == m.profile()
                && old.engine_profile.as_deref() == m.phase().engine_profile()
                && old.engine_pid == engine_pid
                && old.generation == m.phase().gen()
                && old.ready_since == ready_since
                && old.failures == m.failures()
                && old.last_error.as_deref() == last_error
                && old.restart_pending == restart_pending
                && old.engine_key.as_deref() == engine_key
                && old.kv_step.as_deref() == kv_step
        };
        if same_but_figures {
            let (in_flight, waiting) = (m.leases(), m.waiting());
            let mut moved = false;
            // Held without waking the state's watchers (see `figures`).
            self.status.send_if_modified(|s| {
                moved = (s.in_flight, s.waiting, s.idle_deadline)
                    != (in_flight, waiting, idle_deadline);
                s.in_flight = in_flight;
                s.waiting = waiting;
                s.idle_deadline = idle_deadline;
                false
            });
            if moved {
                self.figures.send_modify(|n| *n = n.wrapping_add(1));
            }
            return;
        }
        let status = Status {
            state: m.state(),
            profile: m.profile().to_string(),
            engine_profile: m.phase().engine_profile().map(String::from),
            engine_pid,
            generation: m.phase().gen(),
            in_flight: m.leases(),
            waiting: m.waiting(),
            idle_deadline,
            ready_since,
            failures: m.failures(),
            last_error: last_error.map(String::from),
            restart_pending,
            engine_key: engine_key.map(String::from),
            kv_step: kv_step.map(String::from),
        };
        let state = status.state;
        let mut state_changed = false;
        self.status.send_modify(|old| {
            state_changed = old.state != status.state;
            *old = status;
        });
        if state_changed {
            tracing::info!("engine state: {state}");
        }
    }
}

/// A loopback port that was free a moment ago. Engines cannot take an open socket (llama-server
/// binds its own), so the port is handed over by number; if another process takes it first the
/// engine fails to bind, which is a start failure like any other.
fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(l.local_addr()?.port())
}

/// Polls the engine until it answers its readiness check, then tells the actor. Also looks
/// again whenever the engine writes a line of output (it usually logs when it gets ready).
///
/// A line that names the probe's path is the engine logging the probe itself and does not
/// count, or every probe would trigger the next; [`PROBE_MIN_GAP`] bounds the rest.
async fn probe_ready(
    readiness: Readiness,
    engine: Arc<EngineRef>,
    internal: mpsc::UnboundedSender<Internal>,
) {
    let mut interval = PROBE_FIRST;
    let mut conn = None;
    loop {
        if engine.exit.borrow().is_some() {
            return;
        }
        let attempt = tokio::time::timeout(
            PROBE_ATTEMPT,
            probe_once(&mut conn, engine.upstream, readiness.path()),
        );
        if matches!(attempt.await, Ok(true)) {
            let _ = internal.send(Internal::Ready { gen: engine.gen });
            return;
        }
        let probed = tokio::time::Instant::now();
        let next = probed + interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                _ = engine.output.next_line() => {
                    let about_probe = engine.output.last(1).first().is_some_and(|l| l.contains(readiness.path()));
                    if !about_probe {
                        tokio::time::sleep_until(probed + PROBE_MIN_GAP).await;
                        break;
                    }
                }
            }
        }
        interval = (interval * 2).min(PROBE_MAX);
    }
}

type ProbeConn = hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>;

/// One readiness check, on the connection of the previous check when the engine kept it open
/// (a load of a minute is hundreds of checks; one connection each would be wasteful).
async fn probe_once(conn: &mut Option<ProbeConn>, addr: SocketAddr, path: &str) -> bool {
    use http_body_util::Empty;
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = None;
        let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
            return false;
        };
        let _ = stream.set_nodelay(true);
        let io = hyper_util::rt::TokioIo::new(stream);
        let Ok((sender, driver)) = hyper::client::conn::http1::handshake(io).await else {
            return false;
        };
        // The driver ends with the connection; it does not outlive the engine.
        tokio::spawn(driver);
        *conn = Some(sender);
    }
    let Some(sender) = conn.as_mut() else {
        return false;
    };
    if sender.ready().await.is_err() {
        *conn = None;
        return false;
    }
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::new());
    let Ok(req) = req else { return false };
    match sender.send_request(req).await {
        Ok(resp) => {
            let ok = resp.status() == hyper::StatusCode::OK;
            // Read the body so the connection can carry the next check.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            ok
        }
        Err(_) => {
            *conn = None;
            false
        }
    }
}

/// The least time between two alerts for starts refused for memory.
const NOT_ADMITTED_GAP: Duration = Duration::from_secs(60);

/// How far below its level before the start available memory may stay, and how far above
/// GTT use, once the engine has stopped: the rest of the machine moves meanwhile.
const MEMORY_RETURN_MARGIN: u64 = 2 << 30;

/// After an engine has exited: waits (up to `within`) for available memory and GTT to come
/// back to where they were before it started, and raises an alert if they do not (ROCm has
/// been seen to keep GTT after its process exited).
///
/// The next start waits for GTT, or VRAM where the model lives in a large carve-out (amdgpu
/// frees it some time after the exit): `settled` is told once it is back, or at once where
/// the GPU reports none, or when the alert is raised. Available memory moves with the rest of the machine as well, so it only ever
/// raises the alert, and its check ends, silently, when `next` says a next engine is
/// spawned: that engine's allocations are never counted as this one's.
async fn memory_comes_back(
    sysroot: SysRoot,
    before: crate::host::hw::MemoryNow,
    profile: String,
    within: Duration,
    alerts: Alerts,
    settled: mpsc::UnboundedSender<Internal>,
    mut next: watch::Receiver<bool>,
) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let started = Instant::now();
    let mut told = false;
    let tell = |told: &mut bool| {
        if !std::mem::replace(told, true) {
            let _ = settled.send(Internal::MemorySettled);
        }
    };
    loop {
        let now = memory_now_off_thread(&sysroot).await;
        if *next.borrow() {
            tracing::debug!(
                "the next engine is starting: the last one's memory is not looked at any more"
            );
            return;
        }
        let available_back = match (before.available, now.available) {
            (Some(b), Some(n)) => n + MEMORY_RETURN_MARGIN >= b,
            _ => true,
        };
        // GTT, or VRAM where the model lives in a large carve-out.
        let gpu_back = match (before.pool_used(), now.pool_used()) {
            (Some(b), Some(n)) => n <= b + MEMORY_RETURN_MARGIN,
            _ => true,
        };
        if gpu_back {
            tell(&mut told);
        }
        if available_back && gpu_back {
            tracing::debug!(
                "the engine's memory came back within {:.1} s",
                started.elapsed().as_secs_f64()
            );
            return;
        }
        // The last look is taken before `within` has passed: a start that waits for this
        // (no longer than `within`) never overlaps it.
        if started.elapsed() + MEMORY_LOOK_EVERY >= within {
            let mut parts = Vec::new();
            if let (false, Some(b), Some(n)) = (gpu_back, before.pool_used(), now.pool_used()) {
                let pool =
                    dsv4_client::telemetry::MemoryPool::of(before.vram_total, before.gtt_total)
                        .map_or("GPU memory", |p| p.name());
                parts.push(format!(
                    "{pool} in use is {:.1} GiB, {:.1} GiB before it started",
                    gib(n),
                    gib(b)
                ));
            }
            if let (false, Some(b), Some(n)) = (available_back, before.available, now.available) {
                parts.push(format!(
                    "available memory is {:.1} GiB, {:.1} GiB before it started",
                    gib(n),
                    gib(b)
                ));
            }
            let message = format!(
                "the memory of the engine (profile {profile}) did not come back within {} of \
                 its stop: {}; a process may still hold it (ROCm has kept GTT after exit \
                 before), and the next start may be refused",
                crate::config::format_duration(within),
                parts.join("; ")
            );
            tracing::warn!("{message}");
            alerts.raise(AlertKind::Memory, message);
            tell(&mut told);
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(MEMORY_LOOK_EVERY) => {}
            _ = next.changed() => {}
        }
    }
}

/// How often [`memory_comes_back`] looks.
const MEMORY_LOOK_EVERY: Duration = Duration::from_millis(250);

/// [`crate::host::hw::memory_now`] on a blocking worker: sysfs reads may stall (the SMU), and the
/// runtime's one thread carries every stream.
async fn memory_now_off_thread(sysroot: &SysRoot) -> crate::host::hw::MemoryNow {
    let root = sysroot.clone();
    tokio::task::spawn_blocking(move || crate::host::hw::memory_now(&root))
        .await
        .unwrap_or_default()
}
