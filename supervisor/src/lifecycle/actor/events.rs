//! The actor's inbox: commands from handles and internal messages, turned into events for the
//! rules.

use std::sync::Arc;

use dsv4_client::AlertKind;
use dsv4_engine::procs::{PortHolder, Stranger};
use dsv4_engine::ExitReport;
use nix::sys::signal::Signal;
use tokio::sync::watch;
use tokio::time::Instant;

use super::memory::{memory_comes_back, Prewarm};
use super::messages::{Command, Internal, PortLook};
use super::{Actor, Engine, Reply, PORT_TRIES};
use crate::lifecycle::state::{EngineFailure, Event, Gen, Phase, Then};
use crate::lifecycle::{ControlError, ERROR_TAIL_LINES};

impl Actor {
    pub(super) async fn command(&mut self, c: Command) -> Option<Event> {
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
            Command::SuspendKv { profile, reply } => {
                self.kv_suspended = profile;
                // The engine that runs now, if it is of that profile, is marked at once:
                // nothing a validation does reaches a checkpoint.
                self.mark_validated();
                let _ = reply.send(());
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
        }
    }

    /// When the active profile is no longer configured (its file was deleted or renamed),
    /// `default_profile` becomes the active one, as at start-up, remembered in `state_dir`
    /// as `SetProfile` does, with an alert: else every later start would fail until someone
    /// picked a profile. A running engine of the old profile is drained and replaced, as
    /// after `SetProfile`.
    pub(super) fn fall_back_if_gone(&mut self) -> Option<Event> {
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

    pub(super) fn internal_event(&mut self, i: Internal) -> Option<Event> {
        match i {
            Internal::Release { gen, served } => {
                if served {
                    // Before the release, as when they were two messages. The rules only
                    // count it (a crash loop ends): nothing to carry out, nothing to publish.
                    let effects = self.machine.step(Event::Served { gen }, Instant::now());
                    debug_assert!(effects.is_empty(), "Served asked for {effects:?}");
                }
                Some(Event::Release { gen })
            }
            Internal::Cancel { waiter } => {
                self.waiters.remove(&waiter);
                Some(Event::Cancel { waiter })
            }
            Internal::Ready { gen } => Some(Event::Ready { gen }),
            Internal::Identified { gen, status } => {
                self.identified(gen, status);
                None
            }
            Internal::PortTaken { gen, pid, stranger } => {
                self.port_taken(gen, pid, stranger);
                None
            }
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
            Internal::Exited { gen, report, port } => self.exited(gen, report, port),
            Internal::Held { gen, holds } => self.workers_held(gen, holds),
            Internal::Holding { gen, what } => {
                self.holding_says(gen, what);
                None
            }
            Internal::WorkerLost { gen, why } => {
                self.worker_lost(gen, why);
                None
            }
        }
    }

    /// A stranger holds the port of engine `gen` (`pid`): it is ended, to start again on
    /// another port.
    fn port_taken(&mut self, gen: Gen, pid: u32, stranger: Stranger) {
        if let Some(e) = self
            .engine
            .as_mut()
            .filter(|e| e.shared.gen == gen && e.shared.pid == pid)
        {
            tracing::warn!(
                pid,
                "{stranger}, not by the engine: ending the engine, to start it on another port"
            );
            e.port_taken = Some(stranger);
            e.child.signal(Signal::SIGKILL);
        }
    }

    /// Engine `gen` exited (`report`): started again on another port when a stranger had its
    /// port, else its memory watched on its way back, its end told, and the rules told.
    fn exited(&mut self, gen: Gen, report: ExitReport, port: PortLook) -> Option<Event> {
        // Before it was ready, with no stranger seen on its port yet: it may have found the
        // port taken itself (llama-server: "couldn't bind"). That is a look at /proc, done off
        // the actor's turn; the exit is taken up again after it.
        if let (PortLook::NotYet, Some(e), Phase::Starting { .. }) = (
            &port,
            self.engine.as_ref().filter(|e| e.shared.gen == gen),
            self.machine.phase(),
        ) {
            if e.port_taken.is_none() {
                let port = e.shared.upstream.port();
                let mark: Arc<str> = e.child.mark().unwrap_or("").into();
                let internal = self.internal.clone();
                tokio::spawn(async move {
                    let stranger = match super::probe::holder(port, mark).await {
                        PortHolder::Other(s) => Some(s),
                        _ => None,
                    };
                    let port = PortLook::Done(stranger);
                    let _ = internal.send(Internal::Exited { gen, report, port });
                });
                return None;
            }
        }
        let mut engine = self.engine.take_if(|e| e.shared.gen == gen);
        // An engine that could not have its port, before it was ready: once more on another
        // port, a few times, as if nothing had happened.
        let mut taken = None;
        if let (Some(e), Phase::Starting { .. }) = (&mut engine, self.machine.phase()) {
            taken = e.port_taken.take();
            if let PortLook::Done(found) = port {
                taken = taken.or(found);
            }
        }
        if let (Some(stranger), Some(e)) = (&taken, &engine) {
            let tries = e.port_tries + 1;
            let profile = e.shared.profile.clone();
            if tries < PORT_TRIES {
                tracing::warn!(
                    pid = e.shared.pid,
                    "{stranger}; the engine ({report}) starts again on another port"
                );
                // Its key file and group record go before the next engine's are made; its
                // workers stay held for the next.
                if let Some(holds) = engine.as_mut().and_then(|e| e.holds.take()) {
                    self.keep_holds(gen, &profile, holds);
                }
                drop(engine.take());
                return self.spawn_attempt(gen, &profile, tries);
            }
        }
        if let Some(e) = &engine {
            self.own_save_report(e);
            self.watch_memory_return(e);
        }
        let failure = self.tell_exit(engine.as_ref(), &report, taken.as_ref());
        Some(Event::Exited {
            gen,
            failure,
            spawned: engine.is_some(),
        })
    }

    /// The memory the engine `e` held, watched on its way back (the next start waits for it).
    fn watch_memory_return(&mut self, e: &Engine) {
        let (sysroot, alerts) = (self.sysroot.clone(), self.alerts.clone());
        let (before, profile) = (e.memory_before, e.shared.profile.clone());
        let within = self.config.supervisor.memory.return_timeout;
        let internal = self.internal.clone();
        let settled = move || {
            let _ = internal.send(Internal::MemorySettled);
        };
        let (next_tx, next) = watch::channel(false);
        self.next_spawned = Some(next_tx);
        let prewarm = self.prewarm_for(e);
        let next_for_prewarm = next.clone();
        tokio::spawn(async move {
            memory_comes_back(sysroot, before, profile, within, alerts, settled, next).await;
            if let Some(p) = prewarm {
                p.start(next_for_prewarm);
            }
        });
    }

    /// The model of `e` to read back into the page cache once its memory is back: with
    /// `engine.prewarm`, after a stop that leaves the engine stopped (the idle stop, an
    /// operator's), not one for heat.
    fn prewarm_for(&self, e: &Engine) -> Option<Prewarm> {
        let stays_stopped = matches!(
            self.machine.phase(),
            Phase::Stopping {
                then: Then::Idle,
                ..
            }
        );
        let settings = &self.config.supervisor;
        (settings.engine.prewarm && stays_stopped && !self.machine.is_hot()).then(|| Prewarm {
            files: crate::config::load_files(&e.spawned),
            sysroot: self.sysroot.clone(),
            reserve: settings.memory.reserve,
            profile: e.spawned.name.clone(),
        })
    }

    /// An engine's end, told in the journal (and, when it was serving, as an alert), and as
    /// the rules get it: `taken`, the stranger on its port when that is why it ended.
    fn tell_exit(
        &self,
        engine: Option<&Engine>,
        report: &ExitReport,
        taken: Option<&Stranger>,
    ) -> EngineFailure {
        let tail = engine
            .map(|e| e.shared.output.last(ERROR_TAIL_LINES))
            .unwrap_or_default();
        let pid = engine.map(|e| e.shared.pid).unwrap_or(0);
        // Killed while the OOM killer's count in our cgroup went up: say so.
        let oom = engine.and_then(|e| {
            let before = e.oom_kills_before?;
            let (file, now) = crate::host::hw::cgroup::oom_kills(&self.sysroot)?;
            (report.signal.is_some() && now > before).then(|| {
                format!(
                    "out of memory: the kernel's OOM killer ended it ({} in {file} went from \
                     {before} to {now})",
                    "oom_kill"
                )
            })
        });
        let lost = engine.and_then(|e| e.lost.clone());
        let report = [oom, lost]
            .into_iter()
            .flatten()
            .fold(report.to_string(), |report, why| format!("{report}; {why}"));
        let summary = match self.machine.phase() {
            Phase::Starting { .. } if taken.is_some() => {
                format!(
                    "the engine could not have its port, {PORT_TRIES} times in a row: the last \
                     time {}; it exited before it was ready ({report})",
                    taken.map(ToString::to_string).unwrap_or_default()
                )
            }
            Phase::Starting { .. } => format!("the engine exited before it was ready ({report})"),
            Phase::Restoring { .. }
            | Phase::Ready { .. }
            | Phase::Draining { .. }
            | Phase::Saving { .. } => format!("the engine exited unexpectedly ({report})"),
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
        EngineFailure { summary, tail }
    }
}
