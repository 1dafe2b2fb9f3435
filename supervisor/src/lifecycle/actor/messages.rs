//! The messages the actor takes: commands from handles, and what its own tasks (the engine's
//! exit, the probe, the KV steps, the memory watch) and the leases it gives out tell it. The
//! inbox (`events.rs`) turns them into events for the rules.

use std::time::Duration;

use dsv4_engine::procs;
use dsv4_engine::ExitReport;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::lifecycle::gate::Ticket;
use crate::lifecycle::state::{Gen, WaiterId};
use crate::lifecycle::EngineRef;
use crate::lifecycle::{ControlError, Refused};

/// Whether an engine that exited before it was ready has had its port looked at: another
/// process may have held it.
#[derive(Debug)]
pub(super) enum PortLook {
    NotYet,
    Done(Option<procs::Stranger>),
}

pub(super) enum Command {
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
    /// Engines of this profile (a validation's) neither restore nor save; `None` ends that.
    SuspendKv {
        profile: Option<String>,
        reply: oneshot::Sender<()>,
    },
}

#[derive(Debug)]
pub(super) enum Internal {
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
    /// The identity of the engine of `gen`, read once it served.
    Identified {
        gen: Gen,
        status: Box<dsv4_client::identity::IdentityStatus>,
    },
    /// Another process listens on the port the engine of `gen` (first process `pid`) was
    /// given: the engine is ended and started again on another port.
    PortTaken {
        gen: Gen,
        pid: u32,
        stranger: dsv4_engine::procs::Stranger,
    },
    Exited {
        gen: Gen,
        report: ExitReport,
        port: PortLook,
    },
    /// The KV restore (`restore`) or save of generation `gen` is over.
    KvDone {
        gen: Gen,
        restore: bool,
    },
    /// The memory of the engine that exited last came back, or will not (said already).
    MemorySettled,
    /// The workers of the start of `gen` are held, or why one could not be.
    Held {
        gen: Gen,
        holds: Result<crate::lifecycle::workers::Holds, String>,
    },
    /// What the start of `gen` waits for while its workers are held.
    Holding {
        gen: Gen,
        what: String,
    },
    /// A worker of the engine of `gen` went away: why, naming the box.
    WorkerLost {
        gen: Gen,
        why: String,
    },
}

/// The right to send one request to the engine; the engine is not stopped while any lease is
/// held. Dropping it tells the actor, so idle time counts from the last lease released.
#[derive(Debug)]
pub struct Lease {
    pub engine: Arc<EngineRef>,
    pub(super) release: mpsc::UnboundedSender<Internal>,
    /// Given by the gate (see [`crate::lifecycle::gate`]): given back there while it is open.
    pub(super) ticket: Option<Ticket>,
    pub(super) served: bool,
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
        if let Some(ticket) = &self.ticket {
            if ticket.give_back(self.served) {
                return;
            }
        }
        let _ = self.release.send(Internal::Release {
            gen: self.engine.gen,
            served: self.served,
        });
    }
}
