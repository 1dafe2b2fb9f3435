//! The daemon's standing parts that both of its faces serve from: the HTTP API (its `Ctx`)
//! and the D-Bus control interface. One bundle, built once by `dsv4d`, cloned into each.
//!
//! Owns: nothing of its own; every handle in it is cheap to clone and owned by its
//! subsystem. Must not: grow what only one face needs (the connections, the API keys, the
//! control group stay with their face).

use std::sync::Arc;

use dsv4_client::Status;
use tokio::sync::watch;

use crate::actions::Actions;
use crate::config::Config;
use crate::lifecycle::Handle;
use crate::observe::flights::Flights;
use crate::observe::monitor::Telemetry;
use crate::observe::stats::Stats;
use crate::policy::power::PowerPolicy;
use crate::policy::thermal::ThermalPolicy;
use crate::validate::Validator;

/// What the API and the control interface both reach.
#[derive(Clone)]
pub struct Parts {
    pub lifecycle: Handle,
    /// The configuration in force; a reload replaces it (read it per request or call).
    pub config: watch::Receiver<Arc<Config>>,
    /// The request statistics.
    pub stats: Stats,
    /// The monitor's samples of the host.
    pub telemetry: Telemetry,
    /// The power policy's status.
    pub power: PowerPolicy,
    /// The thermal policy's status.
    pub thermal: ThermalPolicy,
    /// Validation runs: while one holds the engine, requests wait at its gate.
    pub validator: Validator,
    /// What an operator may do: the D-Bus methods and the dashboard's actions call the same.
    pub actions: Actions,
    /// The requests in flight, each with its phase.
    pub flights: Flights,
    /// The coordinators on other boxes that hold this box's profile.
    pub holders: crate::lifecycle::holders::Holders,
}

impl Parts {
    /// The status document (`GET /status`, D-Bus `Status()`): the lifecycle's status with the
    /// request statistics (the last few requests in full).
    pub async fn status_document(&self) -> Status {
        let engine = self.lifecycle.status();
        let in_progress = self.in_progress(engine.state);
        let hold = self.config.borrow().supervisor.canary.hold;
        Status {
            engine,
            requests: self.stats.report(5),
            telemetry: self.telemetry.latest().map(|s| (*s).clone()),
            power: Some(self.power.status()),
            thermal: Some(self.thermal.status()),
            kv: Some(self.lifecycle.kv().status().await),
            limits: Some(crate::host::open_file_limits()),
            in_progress,
            holds: self.holders.list(),
            workers: self.lifecycle.workers(),
            canary: self.validator.checks().shown(hold),
        }
    }

    /// The requests in flight, each with its phase, the lifecycle being in `state`.
    pub fn in_progress(&self, state: dsv4_client::State) -> Vec<dsv4_client::InProgress> {
        let loading = self.lifecycle.loading();
        self.flights
            .in_progress(loading.as_ref(), state, self.validator.running())
    }
}
