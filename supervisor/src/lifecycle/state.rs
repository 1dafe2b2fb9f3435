//! The lifecycle rules as a pure transition function.
//!
//! Owns: every decision about the engine: when to spawn, when a request may go through, when
//! to drain, signal, give up, back off, or exit. Must not: do I/O, read clocks or hold channel
//! ends: the actor (`actor/`) feeds it events with the current time and carries out the
//! [`Effect`]s it returns. Keeping it pure is what lets the table tests and the proptest
//! invariants below cover every rule.
//!
//! States (one engine generation `gen` at a time; events of older generations are ignored):
//!
//! ```text
//!   Stopped --request/Start--> Starting --ready--> Ready --idle/Stop--> Stopping --exit--> Stopped
//!                                 |  \--exit/timeout--> (Stopping) --> Backoff --until--> Stopped
//!                      Ready --SetProfile/Stop/Shutdown with leases--> Draining --last lease--> Stopping
//! ```
//! With KV checkpoints on (the engine's profile has `kv_checkpoint`, see [`KvSteps`]), two
//! steps join in, each bounded by its own timeout and never fatal:
//! ```text
//!   Starting --ready--> Restoring --restored/timeout--> Ready      (waiters wait for the restore)
//!   Ready/Draining --planned stop, no lease held--> Saving --saved/timeout--> Stopping
//! ```
//! A stop that cuts requests (`stop --now` with leases, a forced drain deadline) or a stop of
//! an engine that never served skips the save: only an idle engine's cache is consistent.
//! Requests that arrive while the engine starts, drains or stops wait (up to `max_waiting`),
//! and every waiter is answered, granted or failed, on every settled transition.

use std::collections::VecDeque;
use std::time::Duration;

// A value type here (the rules never read a clock); tokio's, so the actor can take `now`
// from a clock that tests pause.
use tokio::time::Instant;

use dsv4_client::telemetry::MemoryFigures;
pub use dsv4_client::telemetry::MemoryPool;
pub use dsv4_client::State;

pub use crate::kv::Gen;
pub type WaiterId = u64;

/// The limits the rules use (from `engine.*` in the config).
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub start_timeout: Duration,
    pub idle_timeout: Duration,
    pub stop_timeout: Duration,
    pub max_waiting: usize,
}

/// Signals the actor sends to the engine's process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sig {
    /// The engine's stop signal: SIGTERM, unless its kind or profile names another.
    Term,
    Int,
    Kill,
}

/// Why an engine went away or never came up: a summary and the tail of its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFailure {
    pub summary: String,
    pub tail: Vec<String>,
}

/// What a start would need and what the machine has, as read just before the rules may
/// start an engine (the actor hands the rules fresh figures then; see [`Machine::set_memory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryCheck {
    /// The active profile's need: its `planned_memory`, else the estimate from its files
    /// and flags (`lifecycle::need`); `None`: not known, so never refused.
    pub planned: Option<u64>,
    /// Whether `planned` is the estimate rather than `planned_memory`.
    pub estimated: bool,
    /// `memory.reserve`: what must stay available after the engine has taken its share.
    pub reserve: u64,
    /// MemAvailable and the GPU's GTT and VRAM (the firmware's carve-out), when readable.
    pub now: MemoryFigures,
}

/// A start refused for memory: the figures it was refused on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryShort {
    pub profile_planned: u64,
    /// Whether that need is the estimate rather than `planned_memory`.
    pub estimated: bool,
    pub reserve: u64,
    pub available: Option<u64>,
    /// The GPU memory the model lives in, when the GPU reports it.
    pub pool: Option<MemoryPool>,
    /// Set when GPU memory is what is short: that pool, free and total.
    pub gpu: Option<(MemoryPool, u64, u64)>,
}

impl MemoryShort {
    /// The refusal in words, with its figures.
    pub fn describe(&self, profile: &str) -> String {
        let gib = dsv4_client::units::format_gib;
        let needs = gib(self.profile_planned);
        let whence = if self.estimated {
            "estimated from its files and flags; set planned_memory to override"
        } else {
            "planned_memory"
        };
        match self.gpu {
            Some((pool, free, total)) => format!(
                "not enough GPU memory to start profile {profile}: it needs {needs} \
                 ({whence}), and the GPU has {} of {} free of {}",
                gib(free),
                pool.name(),
                gib(total)
            ),
            None if self.pool == Some(MemoryPool::Vram) => format!(
                "not enough memory to start profile {profile}: its {needs} ({whence}) \
                 go to VRAM, but {} of system memory is available, and memory.reserve keeps \
                 {} free",
                self.available.map_or_else(|| "less".to_string(), gib),
                gib(self.reserve)
            ),
            None => format!(
                "not enough memory to start profile {profile}: it needs {needs} \
                 ({whence}), {} is available, and memory.reserve keeps {} free",
                self.available.map_or_else(|| "less".to_string(), gib),
                gib(self.reserve)
            ),
        }
    }
}

impl MemoryCheck {
    /// Why a start now would not fit. Where the model lives in GTT (system RAM) or the GPU
    /// reports nothing: MemAvailable less the planned memory would go below the reserve, or
    /// the free GTT is less than the planned memory. Where it lives in a large VRAM
    /// carve-out: the free VRAM is less than the planned memory, or MemAvailable is already
    /// below the reserve.
    pub fn shortfall(&self) -> Option<MemoryShort> {
        let planned = self.planned?;
        let gpu = self.now.gpu;
        let pool = gpu.pool();
        let short = |gpu| MemoryShort {
            profile_planned: planned,
            estimated: self.estimated,
            reserve: self.reserve,
            available: self.now.available,
            pool,
            gpu,
        };
        let (charged, used, total) = self.sides(planned);
        if let Some(available) = self.now.available {
            if available.saturating_sub(charged) < self.reserve || available < charged {
                return Some(short(None));
            }
        }
        if let (Some(used), Some(total)) = (used, total) {
            let free = total.saturating_sub(used);
            if free < planned {
                let pool = pool.unwrap_or(MemoryPool::Gtt);
                return Some(short(Some((pool, free, total))));
            }
        }
        None
    }

    /// What a start of `planned` bytes is charged against: (what MemAvailable is charged,
    /// the GPU pool's used and total). A model in a large VRAM carve-out charges VRAM, not
    /// system RAM; otherwise it charges both RAM and GTT.
    fn sides(&self, planned: u64) -> (u64, Option<u64>, Option<u64>) {
        let gpu = self.now.gpu;
        match gpu.pool() {
            Some(MemoryPool::Vram) => (0, gpu.vram_used, gpu.vram_total),
            _ => (planned, gpu.gtt_used, gpu.gtt_total),
        }
    }

    /// What a start that fits would leave, by the tighter of the rule's two sides:
    /// MemAvailable less its charge and the reserve, and the GPU pool's free memory less the
    /// need. `None` when the start would not fit, or no figure is known.
    pub fn margin(&self) -> Option<u64> {
        let planned = self.planned?;
        if self.shortfall().is_some() {
            return None;
        }
        let (charged, used, total) = self.sides(planned);
        let by_ram = self
            .now
            .available
            .map(|a| a.saturating_sub(charged).saturating_sub(self.reserve));
        let by_gpu = used
            .zip(total)
            .map(|(u, t)| t.saturating_sub(u).saturating_sub(planned));
        by_ram.into_iter().chain(by_gpu).min()
    }
}

/// Why a waiting request is not served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `max_waiting` requests already wait for the engine.
    QueueFull { max_waiting: usize },
    /// The engine exited (or could not be spawned) before it was ready.
    StartFailed(EngineFailure),
    /// The engine was not ready within `start_timeout`.
    StartTimeout {
        timeout: Duration,
        tail: Vec<String>,
    },
    /// Recent starts failed; the next try is allowed after `retry_after`.
    Backoff {
        retry_after: Duration,
        last: Option<EngineFailure>,
    },
    /// A `Stop` cancelled the start this request waited for.
    StartCancelled,
    /// The supervisor is shutting down.
    ShuttingDown,
    /// The engine of `profile` would not fit in memory now; nothing was started, and the next
    /// request looks again.
    NotEnoughMemory { profile: String, short: MemoryShort },
    /// The machine is critically hot (`thermal.on_critical` stops the engine): `message` says
    /// which sensor and how hot.
    TooHot { message: String },
}

/// What the rules ask the actor to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Spawn generation `gen` of the engine with `profile`.
    Spawn { gen: Gen, profile: String },
    /// Signal the engine of generation `gen`.
    Signal { gen: Gen, sig: Sig },
    /// Give each waiter a lease on generation `gen`.
    Grant { gen: Gen, waiters: Vec<WaiterId> },
    /// Answer each waiter with a refusal.
    Refuse {
        waiters: Vec<WaiterId>,
        why: Refusal,
    },
    /// Shutdown is complete: the engine is gone, the daemon may exit.
    Exit,
    /// Put the saved KV cache of `profile` back into the engine of `gen`, then report
    /// [`Event::KvRestored`] (whatever came of it: a failed restore means a cold cache).
    RestoreKv { gen: Gen, profile: String },
    /// Save the engine's KV cache to disk, then report [`Event::KvSaved`].
    SaveKv { gen: Gen, profile: String },
    /// A start of `profile` was refused for memory (waiters, if any, are refused too).
    NotAdmitted { profile: String, short: MemoryShort },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request wants a lease on a ready engine.
    Acquire { waiter: WaiterId },
    /// A waiting request went away before it was answered.
    Cancel { waiter: WaiterId },
    /// A lease on generation `gen` ended (response body finished or dropped).
    Release { gen: Gen },
    /// A response of generation `gen` was delivered whole: the engine serves (a death after
    /// it is not a crash loop).
    Served { gen: Gen },
    /// What the gate did while it was open on the ready engine of `gen` (see
    /// [`Machine::grants_at_once`]): `held` leases it gave are still out and count here from
    /// now on; the last of those it got back came back at `idle_from`; `served`: one of them
    /// delivered its response whole.
    Passed {
        gen: Gen,
        held: u32,
        idle_from: Option<Instant>,
        served: bool,
    },
    /// The engine of `gen` answered its readiness probe.
    Ready { gen: Gen },
    /// The engine of `gen` ended (or could not be spawned).
    /// `spawned`: an engine process ran (and may hold memory that comes back late); a start
    /// that failed before its spawn (its workers not held, its program not started) had none.
    Exited {
        gen: Gen,
        failure: EngineFailure,
        spawned: bool,
    },
    /// Time passed: timers are checked.
    Tick,
    /// Start the engine now (no request needed).
    Start,
    /// Stop the engine: after in-flight requests finish, or at once with `now`.
    Stop { now: bool },
    /// Make `profile` the active profile; a running engine is drained and restarted.
    SetProfile { profile: String },
    /// The daemon is going down: drain (bounded by `stop_timeout`), stop, then exit.
    Shutdown,
    /// Critically hot: new requests are refused with `message`, no engine starts, and a
    /// running one stops once no request is in flight (`drain: None`), or after at most
    /// `drain` (in-flight requests are cut then).
    Heat {
        message: String,
        drain: Option<Duration>,
    },
    /// Cool again: requests are served, and start the engine, as before.
    Cooled,
    /// The restore asked of generation `gen` is over (restored, nothing to restore, failed).
    KvRestored { gen: Gen },
    /// The save asked of generation `gen` is over (saved or failed).
    KvSaved { gen: Gen },
    /// The memory of the engine that exited last has come back (or the actor gave up
    /// waiting for it, and said so): a start held for it goes ahead.
    MemorySettled,
}

/// The bounds of the KV checkpoint steps of an engine whose profile has `kv_checkpoint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSteps {
    pub save_timeout: Duration,
    pub restore_timeout: Duration,
}

/// What happens once the engine has exited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Stay stopped, unless requests wait: then start again.
    Idle,
    /// Start again with the active profile.
    Restart,
    /// The start failed: back off before the next try.
    Backoff,
    /// The daemon exits.
    Exit,
    /// Called off while the save ran (a request came, or a start was asked): once the save
    /// is over the engine serves again, no signal sent.
    Serve,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    Stopped,
    Starting {
        gen: Gen,
        profile: String,
        deadline: Instant,
    },
    /// Ready by its probe; its saved KV cache goes back in before any request is granted,
    /// until `deadline` at most.
    Restoring {
        gen: Gen,
        profile: String,
        deadline: Instant,
    },
    Ready {
        gen: Gen,
        profile: String,
        since: Instant,
    },
    /// No lease is held: the engine saves its KV cache (until `deadline` at most), then gets
    /// the signal.
    Saving {
        gen: Gen,
        profile: String,
        then: Then,
        deadline: Instant,
    },
    /// Waiting for the leases of `gen` to end; forced at `deadline` when set.
    Draining {
        gen: Gen,
        profile: String,
        then: Then,
        deadline: Option<Instant>,
    },
    /// Signalled; waiting for the exit. SIGINT at `interrupt_at`, SIGKILL at `kill_at`.
    Stopping {
        gen: Gen,
        profile: String,
        then: Then,
        interrupt_at: Option<Instant>,
        kill_at: Option<Instant>,
    },
    Backoff {
        until: Instant,
    },
}

impl Phase {
    /// The state clients see.
    pub fn state(&self) -> State {
        match self {
            Phase::Stopped => State::Stopped,
            // The restore is the last step of a start, the save the first of a stop.
            Phase::Starting { .. } | Phase::Restoring { .. } => State::Starting,
            Phase::Ready { .. } => State::Ready,
            Phase::Saving { .. } => State::Stopping,
            Phase::Draining { .. } => State::Draining,
            Phase::Stopping { .. } => State::Stopping,
            Phase::Backoff { .. } => State::Backoff,
        }
    }

    /// The generation of the engine process that exists in this phase, if any.
    pub fn gen(&self) -> Option<Gen> {
        match self {
            Phase::Starting { gen, .. }
            | Phase::Restoring { gen, .. }
            | Phase::Ready { gen, .. }
            | Phase::Draining { gen, .. }
            | Phase::Saving { gen, .. }
            | Phase::Stopping { gen, .. } => Some(*gen),
            Phase::Stopped | Phase::Backoff { .. } => None,
        }
    }

    /// The profile of the engine that exists in this phase, if any.
    pub fn engine_profile(&self) -> Option<&str> {
        match self {
            Phase::Starting { profile, .. }
            | Phase::Restoring { profile, .. }
            | Phase::Ready { profile, .. }
            | Phase::Draining { profile, .. }
            | Phase::Saving { profile, .. }
            | Phase::Stopping { profile, .. } => Some(profile),
            Phase::Stopped | Phase::Backoff { .. } => None,
        }
    }
}

/// First retry delay after a failed start; doubles per failure up to [`BACKOFF_MAX`].
pub const BACKOFF_BASE: Duration = Duration::from_secs(1);
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// An engine that dies after it was ready, a second time within this long with no response
/// delivered in between, is crash-looping (a request that OOMs it, retried): the next start
/// backs off as after a failed start.
pub const CRASH_WINDOW: Duration = Duration::from_secs(10 * 60);

/// The whole lifecycle state.
#[derive(Debug, Clone)]
pub struct Machine {
    phase: Phase,
    limits: Limits,
    /// SIGTERM -> SIGINT grace for engines that may deadlock on SIGTERM (llama-server);
    /// `None` for engines that must get their whole `stop_timeout` (ds4 saves its KV cache).
    interrupt_grace: Option<Duration>,
    /// Stop signal -> SIGKILL grace of the engine that runs (or is spawned next), when its
    /// profile sets one; `None`: `stop_timeout`.
    stop_grace: Option<Duration>,
    /// The KV checkpoint steps of the engine that runs (or is spawned next); `None`: off.
    kv: Option<KvSteps>,
    profile: String,
    next_gen: Gen,
    leases: u32,
    idle_since: Instant,
    waiters: VecDeque<WaiterId>,
    failures: u32,
    last_failure: Option<EngineFailure>,
    /// When a ready engine last died with no response delivered since (see [`CRASH_WINDOW`]).
    unserved_death: Option<Instant>,
    shutting_down: bool,
    /// The figures the next start is admitted on.
    memory: MemoryCheck,
    /// After an engine exits, how long at most a start waits for its memory to come back.
    memory_return: Duration,
    /// The memory of the engine that exited last is coming back, until this instant at
    /// most: a start waits for [`Event::MemorySettled`] or this instant.
    settling: Option<Instant>,
    /// A start is wanted and waits for the memory to settle.
    held: bool,
    /// Too hot to serve: why (see [`Event::Heat`]).
    hot: Option<String>,
    /// The drain in progress is the heat's: cooling down calls it off.
    heat_drain: bool,
}

impl Machine {
    pub fn new(profile: String, limits: Limits, now: Instant) -> Self {
        Machine {
            phase: Phase::Stopped,
            limits,
            interrupt_grace: None,
            stop_grace: None,
            kv: None,
            profile,
            next_gen: 1,
            leases: 0,
            idle_since: now,
            waiters: VecDeque::new(),
            failures: 0,
            last_failure: None,
            unserved_death: None,
            shutting_down: false,
            memory: MemoryCheck::default(),
            memory_return: Duration::ZERO,
            settling: None,
            held: false,
            hot: None,
            heat_drain: false,
        }
    }

    /// Why requests are refused for heat, while they are.
    pub fn hot(&self) -> Option<&str> {
        self.hot.as_deref()
    }

    /// The memory figures a start would be admitted on now: the actor sets them, freshly
    /// read, before each event that could start an engine.
    pub fn set_memory(&mut self, memory: MemoryCheck) {
        self.memory = memory;
    }

    /// How long at most a start waits, after an engine exited, for its memory to come back
    /// (`memory.return_timeout`); zero: no wait.
    pub fn set_memory_return(&mut self, within: Duration) {
        self.memory_return = within;
    }

    /// Whether a start waits for the last engine's memory to come back.
    pub fn held_for_memory(&self) -> bool {
        self.held
    }

    /// The state clients see: a start held for memory is a start.
    pub fn state(&self) -> State {
        match self.phase {
            Phase::Stopped if self.held => State::Starting,
            _ => self.phase.state(),
        }
    }

    /// Whether the next event could start an engine (no engine is starting or serving).
    pub fn could_start(&self) -> bool {
        !matches!(
            self.phase,
            Phase::Starting { .. } | Phase::Restoring { .. } | Phase::Ready { .. }
        )
    }

    /// Critically hot: no engine starts (see [`Event::Heat`]).
    pub fn is_hot(&self) -> bool {
        self.hot.is_some()
    }

    pub fn phase(&self) -> &Phase {
        &self.phase
    }
    pub fn profile(&self) -> &str {
        &self.profile
    }
    pub fn leases(&self) -> u32 {
        self.leases
    }
    pub fn waiting(&self) -> usize {
        self.waiters.len()
    }
    pub fn failures(&self) -> u32 {
        self.failures
    }
    pub fn last_failure(&self) -> Option<&EngineFailure> {
        self.last_failure.as_ref()
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }
    /// Set by the actor for the engine kind of the profile it spawns.
    pub fn set_interrupt_grace(&mut self, grace: Option<Duration>) {
        self.interrupt_grace = grace;
    }
    /// Set by the actor, with the spawn, from the profile of the engine it spawns: how long
    /// after its stop signal it is killed; `None`: `stop_timeout`.
    pub fn set_stop_grace(&mut self, grace: Option<Duration>) {
        self.stop_grace = grace;
    }
    /// Set by the actor, with the spawn, from the profile of the engine it spawns.
    pub fn set_kv_steps(&mut self, kv: Option<KvSteps>) {
        self.kv = kv;
    }

    /// The generation an [`Event::Acquire`] would be granted on at once, with nothing else
    /// to do (no waiter, no start, no refusal): while this holds, leases may be given
    /// without asking the rules each time, and reported after as one [`Event::Passed`].
    pub fn grants_at_once(&self) -> Option<Gen> {
        match self.phase {
            Phase::Ready { gen, .. }
                if !self.shutting_down && self.hot.is_none() && self.waiters.is_empty() =>
            {
                Some(gen)
            }
            _ => None,
        }
    }

    /// When the engine will be stopped for idleness, if it is ready and idle.
    pub fn idle_deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Ready { .. } if self.leases == 0 => {
                Some(self.idle_since + self.limits.idle_timeout)
            }
            _ => None,
        }
    }

    /// The next instant at which a [`Event::Tick`] may change something.
    pub fn next_deadline(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Stopped => self.settling.filter(|_| self.held),
            Phase::Starting { deadline, .. }
            | Phase::Restoring { deadline, .. }
            | Phase::Saving { deadline, .. } => Some(*deadline),
            Phase::Ready { .. } => self.idle_deadline(),
            Phase::Draining { deadline, .. } => *deadline,
            Phase::Stopping {
                interrupt_at,
                kill_at,
                ..
            } => match (interrupt_at, kill_at) {
                (Some(a), Some(b)) => Some(*a.min(b)),
                (a, b) => a.or(*b),
            },
            Phase::Backoff { until } => Some(*until),
        }
    }

    /// Applies one event at time `now` and returns what the actor must do.
    pub fn step(&mut self, event: Event, now: Instant) -> Vec<Effect> {
        let mut fx = Vec::new();
        match event {
            Event::Acquire { waiter } => self.acquire(waiter, now, &mut fx),
            Event::Cancel { waiter } => self.waiters.retain(|w| *w != waiter),
            Event::Release { gen } => self.release(gen, now, &mut fx),
            Event::Served { .. } => self.served(),
            Event::Passed {
                gen,
                held,
                idle_from,
                served,
            } => {
                if self.phase.gen() != Some(gen) {
                    return fx; // the gate opens on a ready engine only, and closes first
                }
                self.leases += held;
                if served {
                    self.served();
                }
                if let Some(t) = idle_from.filter(|_| self.leases == 0) {
                    self.idle_since = self.idle_since.max(t);
                }
            }
            Event::Ready { gen } => self.ready(gen, now, &mut fx),
            Event::Exited {
                gen,
                failure,
                spawned,
            } => self.exited(gen, failure, spawned, now, &mut fx),
            Event::Tick => self.tick(now, &mut fx),
            Event::Start => self.start(now, &mut fx),
            Event::Stop { now: at_once } => self.stop(at_once, now, &mut fx),
            Event::SetProfile { profile } => self.set_profile(profile, now, &mut fx),
            Event::Shutdown => self.shutdown(now, &mut fx),
            Event::Heat { message, drain } => self.heat(message, drain, now, &mut fx),
            Event::Cooled => self.cooled(now, &mut fx),
            Event::KvRestored { gen } => self.restored(gen, now, &mut fx),
            Event::KvSaved { gen } => self.saved(gen, now, &mut fx),
            Event::MemorySettled => self.settled(now, &mut fx),
        }
        fx
    }

    /// The last engine's memory is back (or will not come back): a held start goes ahead,
    /// admitted on the figures of now.
    fn settled(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        self.settling = None;
        if std::mem::take(&mut self.held) && self.phase == Phase::Stopped {
            self.begin_start(now, fx);
        }
    }

    /// Cool again: a drain the heat began (the engine still serving its last requests) is
    /// called off, and the engine serves as before.
    fn cooled(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        self.hot = None;
        if std::mem::take(&mut self.heat_drain) {
            self.call_off_drain(now, fx);
        }
    }

    /// A drain toward an idle stop that has not signalled yet goes back to serving, and the
    /// waiters get their leases. Nothing happens in any other phase.
    fn call_off_drain(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        if let Phase::Draining {
            gen,
            profile,
            then: Then::Idle,
            ..
        } = &self.phase
        {
            let (gen, profile) = (*gen, profile.clone());
            self.back_to_ready(gen, profile, now, fx);
        }
    }

    fn heat(
        &mut self,
        message: String,
        drain: Option<Duration>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        self.hot = Some(message.clone());
        self.refuse_waiters(Refusal::TooHot { message }, fx);
        self.held = false;
        match &mut self.phase {
            Phase::Starting { gen, profile, .. } | Phase::Restoring { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                self.signal_stop(gen, profile, Then::Idle, now, fx);
            }
            Phase::Ready { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                let deadline = drain.map(|d| now + d);
                self.heat_drain = self.leases > 0;
                self.stop_or_drain(gen, profile, Then::Idle, deadline, now, fx);
            }
            Phase::Draining { deadline, .. } => {
                if let Some(d) = drain {
                    let cap = now + d;
                    *deadline = Some(deadline.map_or(cap, |old| old.min(cap)));
                }
            }
            Phase::Backoff { .. } => self.phase = Phase::Stopped,
            // Too hot to serve: a stop called off for a request goes on.
            Phase::Saving { then, .. } if *then == Then::Serve => *then = Then::Idle,
            Phase::Stopped | Phase::Saving { .. } | Phase::Stopping { .. } => {}
        }
    }

    fn served(&mut self) {
        if self.unserved_death.is_some() {
            self.unserved_death = None;
            self.failures = 0;
            self.last_failure = None;
        }
    }

    fn acquire(&mut self, waiter: WaiterId, now: Instant, fx: &mut Vec<Effect>) {
        if self.shutting_down {
            fx.push(Effect::Refuse {
                waiters: vec![waiter],
                why: Refusal::ShuttingDown,
            });
            return;
        }
        if let Some(message) = &self.hot {
            fx.push(Effect::Refuse {
                waiters: vec![waiter],
                why: Refusal::TooHot {
                    message: message.clone(),
                },
            });
            return;
        }
        match &self.phase {
            Phase::Ready { gen, .. } => {
                let gen = *gen;
                self.leases += 1;
                fx.push(Effect::Grant {
                    gen,
                    waiters: vec![waiter],
                });
            }
            Phase::Backoff { until } => {
                let retry_after = until.saturating_duration_since(now);
                let last = self.last_failure.clone();
                fx.push(Effect::Refuse {
                    waiters: vec![waiter],
                    why: Refusal::Backoff { retry_after, last },
                });
            }
            Phase::Stopping {
                then: Then::Backoff,
                ..
            } => {
                let retry_after = self.backoff_delay();
                let last = self.last_failure.clone();
                fx.push(Effect::Refuse {
                    waiters: vec![waiter],
                    why: Refusal::Backoff { retry_after, last },
                });
            }
            _ if self.waiters.len() >= self.limits.max_waiting => {
                let max_waiting = self.limits.max_waiting;
                fx.push(Effect::Refuse {
                    waiters: vec![waiter],
                    why: Refusal::QueueFull { max_waiting },
                });
            }
            Phase::Stopped => {
                self.waiters.push_back(waiter);
                self.begin_start(now, fx);
            }
            Phase::Starting { .. }
            | Phase::Restoring { .. }
            | Phase::Draining { .. }
            | Phase::Saving { .. }
            | Phase::Stopping { .. } => {
                self.waiters.push_back(waiter);
                if let Phase::Saving { then, .. } = &mut self.phase {
                    // A stop whose save runs is called off: the save ends, and the same
                    // engine serves this request (a restart would reload the model).
                    if *then == Then::Idle {
                        *then = Then::Serve;
                    }
                }
            }
        }
    }

    fn release(&mut self, gen: Gen, now: Instant, fx: &mut Vec<Effect>) {
        if self.phase.gen() != Some(gen) || self.leases == 0 {
            return; // a lease on an engine that is already gone
        }
        self.leases -= 1;
        if self.leases > 0 {
            return;
        }
        self.idle_since = now;
        if let Phase::Draining {
            gen, profile, then, ..
        } = &self.phase
        {
            let (gen, profile, then) = (*gen, profile.clone(), *then);
            self.planned_stop(gen, profile, then, now, fx);
        }
    }

    fn ready(&mut self, gen: Gen, now: Instant, fx: &mut Vec<Effect>) {
        let Phase::Starting {
            gen: g, profile, ..
        } = &self.phase
        else {
            return;
        };
        if *g != gen {
            return;
        }
        let profile = profile.clone();
        // A crash loop's count stands until a response is delivered (see `Event::Served`).
        if self.unserved_death.is_none() {
            self.failures = 0;
            self.last_failure = None;
        }
        match self.kv {
            Some(kv) => {
                self.phase = Phase::Restoring {
                    gen,
                    profile: profile.clone(),
                    deadline: now + kv.restore_timeout,
                };
                fx.push(Effect::RestoreKv { gen, profile });
            }
            None => self.serve(gen, profile, now, fx),
        }
    }

    /// The engine of `gen` serves for the first time: idle time counts from now.
    fn serve(&mut self, gen: Gen, profile: String, now: Instant, fx: &mut Vec<Effect>) {
        self.idle_since = now;
        self.back_to_ready(gen, profile, now, fx);
    }

    /// The engine of `gen` serves (again): waiters get their leases.
    fn back_to_ready(&mut self, gen: Gen, profile: String, now: Instant, fx: &mut Vec<Effect>) {
        self.phase = Phase::Ready {
            gen,
            profile,
            since: now,
        };
        self.grant_waiters(gen, fx);
    }

    /// The restore is over, or (from `tick`) took too long: the engine serves either way,
    /// with what it has.
    fn restored(&mut self, gen: Gen, now: Instant, fx: &mut Vec<Effect>) {
        if let Phase::Restoring {
            gen: g, profile, ..
        } = &self.phase
        {
            if *g == gen {
                let profile = profile.clone();
                self.serve(gen, profile, now, fx);
            }
        }
    }

    /// The save is over, or (from `tick`) took too long: the stop goes on with the signal.
    fn saved(&mut self, gen: Gen, now: Instant, fx: &mut Vec<Effect>) {
        if let Phase::Saving {
            gen: g,
            profile,
            then,
            ..
        } = &self.phase
        {
            if *g == gen {
                let (profile, then) = (profile.clone(), *then);
                if then == Then::Serve {
                    self.serve(gen, profile, now, fx);
                } else {
                    self.signal_stop(gen, profile, then, now, fx);
                }
            }
        }
    }

    fn exited(
        &mut self,
        gen: Gen,
        failure: EngineFailure,
        spawned: bool,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if self.phase.gen() != Some(gen) {
            return;
        }
        self.leases = 0;
        // Its memory comes back some time after the exit (amdgpu frees GTT late): the next
        // start waits for it, not the figures of this instant. A start that spawned nothing
        // took none.
        let waits = spawned && !self.memory_return.is_zero();
        self.settling = waits.then(|| now + self.memory_return);
        match &self.phase {
            Phase::Starting { .. } => {
                self.failures += 1;
                self.last_failure = Some(failure.clone());
                self.refuse_waiters(Refusal::StartFailed(failure), fx);
                if self.shutting_down {
                    self.finish_exit(fx);
                } else {
                    self.phase = Phase::Backoff {
                        until: now + self.backoff_delay(),
                    };
                }
            }
            Phase::Restoring { .. } | Phase::Ready { .. } => {
                // Died on its own (or on the restore: the actor sets that checkpoint aside).
                // In-flight requests see their connection fail (502). The next request starts
                // a fresh engine, unless it died like this before with nothing served since:
                // then it backs off as a failed start does.
                let again = self
                    .unserved_death
                    .is_some_and(|t| now.saturating_duration_since(t) <= CRASH_WINDOW);
                self.unserved_death = Some(now);
                if again && !self.shutting_down {
                    self.failures += 1;
                    let failure = EngineFailure {
                        summary: format!(
                            "{}; it died twice within {} with no response delivered in \
                             between, so dsv4d backs off before it starts it again",
                            failure.summary,
                            crate::config::format_duration(CRASH_WINDOW)
                        ),
                        tail: failure.tail,
                    };
                    self.last_failure = Some(failure.clone());
                    let retry_after = self.backoff_delay();
                    self.refuse_waiters(
                        Refusal::Backoff {
                            retry_after,
                            last: Some(failure),
                        },
                        fx,
                    );
                    self.phase = Phase::Backoff {
                        until: now + retry_after,
                    };
                    return;
                }
                self.last_failure = Some(failure);
                self.phase = Phase::Stopped;
                if !self.waiters.is_empty() {
                    self.begin_start(now, fx);
                }
            }
            Phase::Draining { then, .. }
            | Phase::Saving { then, .. }
            | Phase::Stopping { then, .. } => {
                let then = *then;
                self.after_stop(then, now, fx);
            }
            Phase::Stopped | Phase::Backoff { .. } => {}
        }
    }

    fn tick(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        match &mut self.phase {
            Phase::Starting {
                gen,
                profile,
                deadline,
            } if now >= *deadline => {
                let (gen, profile) = (*gen, profile.clone());
                self.failures += 1;
                let timeout = self.limits.start_timeout;
                self.last_failure = Some(EngineFailure {
                    summary: format!(
                        "the engine was not ready within engine.start_timeout ({})",
                        crate::config::format_duration(timeout)
                    ),
                    tail: Vec::new(),
                });
                self.refuse_waiters(
                    Refusal::StartTimeout {
                        timeout,
                        tail: Vec::new(),
                    },
                    fx,
                );
                let then = if self.shutting_down {
                    Then::Exit
                } else {
                    Then::Backoff
                };
                self.signal_stop(gen, profile, then, now, fx);
            }
            Phase::Restoring { gen, deadline, .. } if now >= *deadline => {
                let gen = *gen;
                self.restored(gen, now, fx);
            }
            Phase::Ready { gen, profile, .. }
                if self.leases == 0 && now >= self.idle_since + self.limits.idle_timeout =>
            {
                let (gen, profile) = (*gen, profile.clone());
                self.planned_stop(gen, profile, Then::Idle, now, fx);
            }
            Phase::Saving { gen, deadline, .. } if now >= *deadline => {
                let gen = *gen;
                self.saved(gen, now, fx);
            }
            Phase::Draining {
                gen,
                profile,
                then,
                deadline: Some(d),
            } if now >= *d => {
                let (gen, profile, then) = (*gen, profile.clone(), *then);
                self.signal_stop(gen, profile, then, now, fx);
            }
            Phase::Stopping {
                gen,
                interrupt_at,
                kill_at,
                ..
            } => {
                let gen = *gen;
                if interrupt_at.is_some_and(|t| now >= t) {
                    *interrupt_at = None;
                    fx.push(Effect::Signal { gen, sig: Sig::Int });
                }
                if kill_at.is_some_and(|t| now >= t) {
                    *kill_at = None;
                    fx.push(Effect::Signal {
                        gen,
                        sig: Sig::Kill,
                    });
                }
            }
            Phase::Backoff { until } if now >= *until => {
                self.phase = Phase::Stopped;
            }
            Phase::Stopped if self.held && self.settling.is_none_or(|t| now >= t) => {
                self.settled(now, fx);
            }
            _ => {}
        }
    }

    fn start(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        if self.shutting_down {
            return;
        }
        match &mut self.phase {
            Phase::Stopped | Phase::Backoff { .. } => self.begin_start(now, fx),
            // A stop that had not signalled yet is called off.
            Phase::Draining {
                then: Then::Idle, ..
            } => self.call_off_drain(now, fx),
            Phase::Saving { then, .. } if *then == Then::Idle => *then = Then::Serve,
            Phase::Stopping { then, .. } if *then == Then::Idle => *then = Then::Restart,
            _ => {}
        }
    }

    fn stop(&mut self, at_once: bool, now: Instant, fx: &mut Vec<Effect>) {
        match &mut self.phase {
            Phase::Stopped => {
                if std::mem::take(&mut self.held) {
                    self.refuse_waiters(Refusal::StartCancelled, fx);
                }
            }
            Phase::Backoff { .. } => self.phase = Phase::Stopped,
            Phase::Starting { gen, profile, .. } | Phase::Restoring { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                self.refuse_waiters(Refusal::StartCancelled, fx);
                self.signal_stop(gen, profile, Then::Idle, now, fx);
            }
            Phase::Ready { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                if self.leases == 0 {
                    self.planned_stop(gen, profile, Then::Idle, now, fx);
                } else if at_once {
                    self.signal_stop(gen, profile, Then::Idle, now, fx);
                } else {
                    self.phase = Phase::Draining {
                        gen,
                        profile,
                        then: Then::Idle,
                        deadline: None,
                    };
                }
            }
            Phase::Draining {
                gen, profile, then, ..
            }
            | Phase::Saving {
                gen, profile, then, ..
            } => {
                if matches!(*then, Then::Restart | Then::Serve) {
                    *then = Then::Idle;
                }
                if at_once {
                    let (gen, profile, then) = (*gen, profile.clone(), *then);
                    self.signal_stop(gen, profile, then, now, fx);
                }
            }
            Phase::Stopping { then, .. } => {
                if *then == Then::Restart {
                    *then = Then::Idle;
                }
            }
        }
    }

    fn set_profile(&mut self, profile: String, now: Instant, fx: &mut Vec<Effect>) {
        self.profile = profile;
        let profile_now = self.profile.clone();
        match &mut self.phase {
            Phase::Stopped => {}
            Phase::Backoff { .. } => {
                // A new profile deserves a fresh try.
                self.failures = 0;
                self.unserved_death = None;
                self.phase = Phase::Stopped;
            }
            Phase::Starting { gen, profile, .. } | Phase::Restoring { gen, profile, .. } => {
                if *profile != profile_now {
                    let (gen, profile) = (*gen, profile.clone());
                    self.signal_stop(gen, profile, Then::Restart, now, fx);
                }
            }
            Phase::Ready { gen, profile, .. } => {
                if *profile != profile_now {
                    let (gen, profile) = (*gen, profile.clone());
                    if self.leases == 0 {
                        self.planned_stop(gen, profile, Then::Restart, now, fx);
                    } else {
                        self.phase = Phase::Draining {
                            gen,
                            profile,
                            then: Then::Restart,
                            deadline: None,
                        };
                    }
                }
            }
            Phase::Draining {
                gen, profile, then, ..
            }
            | Phase::Saving {
                gen, profile, then, ..
            } => {
                // (Back to a saving engine: the save goes on beside the requests.)
                if *then == Then::Restart && *profile == profile_now {
                    // Switched back before the drain ended: keep the running engine.
                    let (gen, profile) = (*gen, profile.clone());
                    self.back_to_ready(gen, profile, now, fx);
                } else if *then == Then::Serve && *profile == profile_now {
                    // The save called off for a request goes on to serve it.
                } else if *then == Then::Idle {
                    // Stop requested: the new profile applies at the next start.
                } else {
                    *then = Then::Restart;
                }
            }
            Phase::Stopping { .. } => {}
        }
    }

    fn shutdown(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        self.refuse_waiters(Refusal::ShuttingDown, fx);
        self.held = false;
        match &mut self.phase {
            Phase::Stopped | Phase::Backoff { .. } => self.finish_exit(fx),
            Phase::Starting { gen, profile, .. } | Phase::Restoring { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                self.signal_stop(gen, profile, Then::Exit, now, fx);
            }
            Phase::Ready { gen, profile, .. } => {
                let (gen, profile) = (*gen, profile.clone());
                let deadline = Some(now + self.limits.stop_timeout);
                self.stop_or_drain(gen, profile, Then::Exit, deadline, now, fx);
            }
            Phase::Draining { then, deadline, .. } => {
                *then = Then::Exit;
                let cap = now + self.limits.stop_timeout;
                *deadline = Some(deadline.map_or(cap, |d| d.min(cap)));
            }
            // The save is bounded by its own timeout, which the stop's budget includes.
            Phase::Saving { then, .. } | Phase::Stopping { then, .. } => *then = Then::Exit,
        }
    }

    // ---- helpers ------------------------------------------------------------------------

    fn begin_start(&mut self, now: Instant, fx: &mut Vec<Effect>) {
        if let Some(message) = self.hot.clone() {
            self.phase = Phase::Stopped;
            self.refuse_waiters(Refusal::TooHot { message }, fx);
            return;
        }
        // The last engine's memory is still coming back: the start waits for it (waiters
        // stay queued), bounded by `memory_return`.
        if let Some(until) = self.settling {
            if now < until {
                self.phase = Phase::Stopped;
                self.held = true;
                return;
            }
            self.settling = None;
        }
        self.held = false;
        // Admission: a start that would not fit is refused, not tried; it is not a failed
        // start (no backoff), so the next request tries again with the figures of then.
        if let Some(short) = self.memory.shortfall() {
            self.phase = Phase::Stopped;
            let profile = self.profile.clone();
            fx.push(Effect::NotAdmitted {
                profile: profile.clone(),
                short,
            });
            self.refuse_waiters(Refusal::NotEnoughMemory { profile, short }, fx);
            return;
        }
        let gen = self.next_gen;
        self.next_gen += 1;
        self.leases = 0;
        let profile = self.profile.clone();
        self.phase = Phase::Starting {
            gen,
            profile: profile.clone(),
            deadline: now + self.limits.start_timeout,
        };
        fx.push(Effect::Spawn { gen, profile });
    }

    /// A ready engine stops now when no lease is held, else drains first (until `deadline`,
    /// when there is one).
    fn stop_or_drain(
        &mut self,
        gen: Gen,
        profile: String,
        then: Then,
        deadline: Option<Instant>,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        if self.leases == 0 {
            self.planned_stop(gen, profile, then, now, fx);
        } else {
            self.phase = Phase::Draining {
                gen,
                profile,
                then,
                deadline,
            };
        }
    }

    /// A serving engine that holds no lease stops: with KV checkpoints on, it saves its cache
    /// first (see [`Phase::Saving`]), else it gets the signal now.
    fn planned_stop(
        &mut self,
        gen: Gen,
        profile: String,
        then: Then,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        match self.kv {
            Some(kv) => {
                self.phase = Phase::Saving {
                    gen,
                    profile: profile.clone(),
                    then,
                    deadline: now + kv.save_timeout,
                };
                fx.push(Effect::SaveKv { gen, profile });
            }
            None => self.signal_stop(gen, profile, then, now, fx),
        }
    }

    fn signal_stop(
        &mut self,
        gen: Gen,
        profile: String,
        then: Then,
        now: Instant,
        fx: &mut Vec<Effect>,
    ) {
        let stop = self.stop_grace.unwrap_or(self.limits.stop_timeout);
        let interrupt_at = self.interrupt_grace.filter(|g| *g < stop).map(|g| now + g);
        self.phase = Phase::Stopping {
            gen,
            profile,
            then,
            interrupt_at,
            kill_at: Some(now + stop),
        };
        fx.push(Effect::Signal {
            gen,
            sig: Sig::Term,
        });
    }

    fn after_stop(&mut self, then: Then, now: Instant, fx: &mut Vec<Effect>) {
        self.phase = Phase::Stopped;
        match then {
            Then::Exit => self.finish_exit(fx),
            Then::Restart => self.begin_start(now, fx),
            Then::Idle | Then::Serve if !self.waiters.is_empty() => self.begin_start(now, fx),
            Then::Idle | Then::Serve => {}
            Then::Backoff => {
                let retry_after = self.backoff_delay();
                let last = self.last_failure.clone();
                self.refuse_waiters(Refusal::Backoff { retry_after, last }, fx);
                self.phase = Phase::Backoff {
                    until: now + retry_after,
                };
            }
        }
    }

    fn finish_exit(&mut self, fx: &mut Vec<Effect>) {
        self.refuse_waiters(Refusal::ShuttingDown, fx);
        self.phase = Phase::Stopped;
        fx.push(Effect::Exit);
    }

    fn grant_waiters(&mut self, gen: Gen, fx: &mut Vec<Effect>) {
        if self.waiters.is_empty() {
            return;
        }
        let waiters: Vec<_> = self.waiters.drain(..).collect();
        self.leases += waiters.len() as u32;
        fx.push(Effect::Grant { gen, waiters });
    }

    fn refuse_waiters(&mut self, why: Refusal, fx: &mut Vec<Effect>) {
        if self.waiters.is_empty() {
            return;
        }
        let waiters = self.waiters.drain(..).collect();
        fx.push(Effect::Refuse { waiters, why });
    }

    fn backoff_delay(&self) -> Duration {
        let exp = self.failures.saturating_sub(1).min(16);
        BACKOFF_BASE.saturating_mul(1 << exp).min(BACKOFF_MAX)
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
