//! The gate: leases on the ready engine given without a turn of the lifecycle actor.
//!
//! While the rules would grant any request at once ([`Machine::grants_at_once`]: the
//! engine is ready, nobody waits, no drain, no heat, no shutdown), the actor opens the gate
//! on that engine. A request then takes its lease here, and gives it back here, under one
//! short lock: two messages, two turns of the actor and two status publications fewer per
//! request (about a sixth of dsv4d's own CPU per proxied request, callgrind).
//!
//! The actor closes the gate before it handles anything, and tells the rules in one
//! [`Event::Passed`] what it did meanwhile: how many of its leases are still out (the rules
//! count them from then on), when the last one came back (idle time counts from there), and
//! whether one was served. So every rule sees the leases as if each had come through the
//! actor. A lease taken through a gate since closed no longer belongs to it (each opening
//! has its own epoch) and goes back to the actor as any other.
//!
//! Owns: the leases it gave while open, and the status' per-request figures meanwhile.
//!
//! [`Machine::grants_at_once`]: super::state::Machine::grants_at_once
//! [`Event::Passed`]: super::state::Event::Passed

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
// The clock tests can pause; the std clock is banned in this crate (supervisor/clippy.toml).
use tokio::time::Instant;

use super::engine_ref::EngineRef;
use super::state::{Event, Gen};

/// The status as the actor publishes it (see `actor::Status`).
type Status = dsv4_client::EngineStatus;

pub struct Gate {
    inner: Mutex<Inner>,
    status: watch::Sender<Status>,
    figures: Figures,
}

#[derive(Default)]
struct Inner {
    open: Option<Open>,
    /// Counts the openings: a lease knows the one it came through.
    epoch: u64,
}

/// What the gate holds while it is open.
struct Open {
    engine: Arc<EngineRef>,
    /// Leases the rules granted themselves, still out when it opened.
    base_leases: u32,
    /// When the rules would stop the engine for idleness, as it opened.
    base_idle: Option<Instant>,
    idle_timeout: Duration,
    held: u32,
    idle_from: Option<Instant>,
    served: bool,
}

/// A lease the gate gave: where to give it back.
#[derive(Debug, Clone)]
pub struct Ticket {
    gate: Arc<Gate>,
    epoch: u64,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").finish_non_exhaustive()
    }
}

impl Gate {
    pub fn new(status: watch::Sender<Status>, figures: Figures) -> Self {
        Gate {
            inner: Mutex::default(),
            status,
            figures,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing under this lock can panic half-way; a poisoned lock holds whole figures.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens on `engine` (the rules' ready engine, granting at once), with the rules'
    /// own figures as they stand.
    pub fn open(
        &self,
        engine: Arc<EngineRef>,
        base_leases: u32,
        base_idle: Option<Instant>,
        idle_timeout: Duration,
    ) {
        let mut inner = self.lock();
        inner.epoch += 1;
        inner.open = Some(Open {
            engine,
            base_leases,
            base_idle,
            idle_timeout,
            held: 0,
            idle_from: None,
            served: false,
        });
    }

    /// Closes it; what it did while open, for the rules (`None`: it was closed, or did
    /// nothing).
    pub fn close(&self) -> Option<Event> {
        let open = self.lock().open.take()?;
        (open.held > 0 || open.idle_from.is_some() || open.served).then_some(Event::Passed {
            gen: open.engine.gen,
            held: open.held,
            idle_from: open.idle_from,
            served: open.served,
        })
    }

    /// A lease on the ready engine, if the gate is open.
    pub fn enter(self: &Arc<Self>) -> Option<(Arc<EngineRef>, Ticket)> {
        let mut inner = self.lock();
        let epoch = inner.epoch;
        let open = inner.open.as_mut()?;
        open.held += 1;
        let engine = open.engine.clone();
        self.show(open);
        let ticket = Ticket {
            gate: self.clone(),
            epoch,
        };
        Some((engine, ticket))
    }

    /// Publishes the per-request figures with the gate's leases, as the actor would have.
    /// Called under the lock, so figures go out in the order they changed.
    fn show(&self, open: &Open) {
        let in_flight = open.base_leases + open.held;
        let idle = match (in_flight, open.base_idle, open.idle_from) {
            (0, Some(base), Some(from)) => Some(base.max(from + open.idle_timeout)),
            (0, base, _) => base,
            _ => None,
        };
        let idle_deadline = idle.and_then(unix_time);
        // Held without waking the state's watchers; the figures' watchers are told.
        self.status.send_if_modified(|s| {
            s.in_flight = in_flight;
            s.idle_deadline = idle_deadline;
            false
        });
        self.figures.tell();
    }
}

/// The signal that the per-request figures of the status moved (the figures themselves are
/// in the status). Told once until a watcher takes note: the watchers look at most every
/// second or so, and telling them at every request and its end cost a lock and eight
/// notifies each (about 1,700 instructions a request, callgrind).
#[derive(Debug, Clone)]
pub struct Figures {
    tx: watch::Sender<u64>,
    /// Told since a watcher last took note.
    told: Arc<AtomicBool>,
}

impl Default for Figures {
    fn default() -> Self {
        Figures {
            tx: watch::Sender::new(0),
            told: Arc::default(),
        }
    }
}

impl Figures {
    /// The figures moved (they are in the status already).
    pub fn tell(&self) {
        if self.tx.receiver_count() > 0 && !self.told.swap(true, Ordering::AcqRel) {
            self.tx.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// A new watcher, which has seen nothing yet: the next move is told (a watcher gone
    /// without taking note leaves the flag set, and the new one would never hear).
    pub fn watch(&self) -> FiguresWatch {
        let rx = self.tx.subscribe();
        self.told.store(false, Ordering::Release);
        FiguresWatch {
            rx,
            told: self.told.clone(),
        }
    }
}

/// Wakes when the per-request figures moved.
pub struct FiguresWatch {
    rx: watch::Receiver<u64>,
    told: Arc<AtomicBool>,
}

impl FiguresWatch {
    /// Resolves when the figures moved since the last [`borrow_and_update`]; `Err` once the
    /// lifecycle is gone.
    ///
    /// [`borrow_and_update`]: Self::borrow_and_update
    pub async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        self.rx.changed().await
    }

    /// Takes note: call it before reading the status, so that a later move is told again.
    pub fn borrow_and_update(&mut self) {
        self.rx.borrow_and_update();
        self.told.store(false, Ordering::Release);
    }
}

impl Ticket {
    /// Gives the lease back; `false` when the gate it came through has closed since (the
    /// rules count it now: the actor must be told).
    pub fn give_back(&self, served: bool) -> bool {
        let mut inner = self.gate.lock();
        let epoch = inner.epoch;
        let Some(open) = inner.open.as_mut().filter(|_| epoch == self.epoch) else {
            return false;
        };
        open.held -= 1;
        open.served |= served;
        if open.held == 0 {
            open.idle_from = Some(Instant::now());
        }
        self.gate.show(open);
        true
    }
}

/// A deadline on the lifecycle's clock as unix time (s), as the status says it.
pub fn unix_time(deadline: Instant) -> Option<f64> {
    let left = deadline.saturating_duration_since(Instant::now());
    (SystemTime::now() + left)
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}

/// Which engine the gate would open on now: the rules' answer, checked against the engine
/// the actor holds.
pub fn opens_on(rules: Option<Gen>, engine: Option<&Arc<EngineRef>>) -> Option<Arc<EngineRef>> {
    let engine = engine?;
    (rules? == engine.gen).then(|| engine.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    /// Whether `changed` resolves at once.
    fn moved(w: &mut FiguresWatch) -> bool {
        let changed = std::pin::pin!(w.changed());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        changed.poll(&mut cx).is_ready()
    }

    #[test]
    fn the_figures_are_told_once_until_a_watcher_takes_note() {
        let figures = Figures::default();
        // Nobody watches: nothing to tell.
        figures.tell();
        let (mut a, mut b) = (figures.watch(), figures.watch());
        assert!(!moved(&mut a));
        for _ in 0..100 {
            figures.tell();
        }
        assert_eq!(*a.rx.borrow(), 1, "told once for a hundred moves");
        assert!(moved(&mut a) && moved(&mut b));
        a.borrow_and_update();
        assert!(!moved(&mut a));
        // Noted: the next move is told, to both.
        figures.tell();
        assert!(moved(&mut a) && moved(&mut b));
        b.borrow_and_update();
        a.borrow_and_update();
        assert!(!moved(&mut a) && !moved(&mut b));
        // Told, then every watcher gone without taking note: a new one still hears the next.
        figures.tell();
        drop((a, b));
        let mut c = figures.watch();
        figures.tell();
        assert!(moved(&mut c));
    }
}
