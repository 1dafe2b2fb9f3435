//! The way in to the actor: what the rest of the daemon calls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dsv4_engine::OutputTail;
use tokio::sync::{mpsc, oneshot, watch};

use super::messages::{Command, Internal, Lease};
use crate::lifecycle::gate::Gate;
use crate::lifecycle::state::{Refusal, WaiterId};
use crate::lifecycle::{ControlError, Refused, Status};

/// The way in to the actor; cheap to clone.
#[derive(Clone)]
pub struct Handle {
    pub(super) commands: mpsc::Sender<Command>,
    pub(super) internal: mpsc::UnboundedSender<Internal>,
    pub(super) status: watch::Receiver<Status>,
    pub(super) figures: crate::lifecycle::gate::Figures,
    pub(super) next_waiter: Arc<AtomicU64>,
    pub(super) log: OutputTail,
    pub(super) kv: crate::kv::Book,
    pub(super) gate: Arc<Gate>,
    pub(super) loading: watch::Receiver<Option<crate::lifecycle::loading::Loading>>,
    pub(super) workers: crate::lifecycle::workers::WorkerBook,
    pub(super) alerts: crate::lifecycle::alert::Alerts,
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

impl Handle {
    /// The worker boxes of the engine that starts or runs (its profile's `workers:`).
    pub fn workers(&self) -> Vec<dsv4_client::WorkerStatus> {
        self.workers.list()
    }

    /// The KV checkpoint steps' record.
    pub fn kv(&self) -> &crate::kv::Book {
        &self.kv
    }

    /// Where alerts are raised (the notify agent's and `/status`'s).
    pub fn alerts(&self) -> &crate::lifecycle::alert::Alerts {
        &self.alerts
    }

    /// Waits until the engine is ready (starting it if needed) and takes a lease on it.
    pub async fn acquire(&self) -> Result<Lease, Refused> {
        // While the engine serves and nobody waits, through the gate, without the actor.
        if let Some((engine, ticket)) = self.gate.enter() {
            return Ok(Lease {
                engine,
                release: self.internal.clone(),
                ticket: Some(ticket),
                served: false,
            });
        }
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

    /// Engines of `profile` (a validation's) neither restore nor save a KV checkpoint from
    /// now on, the one running included; `None` ends that. Resolves once it is in force.
    pub async fn suspend_kv(&self, profile: Option<&str>) {
        let (reply, rx) = oneshot::channel();
        let profile = profile.map(String::from);
        if self
            .commands
            .send(Command::SuspendKv { profile, reply })
            .await
            .is_ok()
        {
            let _ = rx.await;
        }
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

    /// `read` of the status in place, for what needs a part of it: a copy of the whole
    /// status, the engine's identity in it, was about 3,000 instructions of a proxied
    /// request's 60,000. `read` must not wait (the status is locked while it runs).
    pub fn with_status<T>(&self, read: impl FnOnce(&Status) -> T) -> T {
        read(&self.status.borrow())
    }

    /// The status's state (a request's path reads it).
    pub fn state(&self) -> dsv4_client::State {
        self.with_status(|s| s.state)
    }

    /// The profile the engine runs, or starts next.
    pub fn profile(&self) -> String {
        self.with_status(|s| s.profile.clone())
    }

    /// The engine that loads now, if one does.
    pub fn loading(&self) -> Option<crate::lifecycle::loading::Loading> {
        self.loading.borrow().clone()
    }

    /// The status, its watchers woken when anything but the per-request figures changes
    /// (`borrow` always gives the latest figures; see [`watch_figures`](Self::watch_figures)).
    pub fn watch_status(&self) -> watch::Receiver<Status> {
        self.status.clone()
    }

    /// Changes when the per-request figures of the status (`in_flight`, `waiting`,
    /// `idle_deadline`) changed and nothing else did.
    pub fn watch_figures(&self) -> crate::lifecycle::gate::FiguresWatch {
        self.figures.watch()
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
