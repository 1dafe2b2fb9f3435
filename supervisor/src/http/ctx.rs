//! What every request handler reaches: the [`Ctx`] (the daemon's parts the API serves from)
//! and the status document made from them.

use dsv4_client::Status;
use tokio::sync::watch;

use std::sync::Arc;

use crate::config::Config;
use crate::http::auth::KeyCache;
use crate::http::connections::{Activity, Connections};
use crate::http::intake;
use crate::lifecycle::Handle;
use crate::observe::monitor::Telemetry;
use crate::observe::stats::Stats;
use crate::policy::power::Power;
use crate::policy::thermal::Thermal;

/// What every request handler needs.
pub struct Ctx {
    pub lifecycle: Handle,
    /// The configuration in force; a reload replaces it (read it per request).
    pub config: watch::Receiver<Arc<Config>>,
    pub stats: Stats,
    /// The monitor's samples of the host.
    pub telemetry: Telemetry,
    /// The power policy's status.
    pub power: Power,
    /// The thermal policy's status.
    pub thermal: Thermal,
    /// The API keys of the configuration in force (`api.api_keys_file`), read on first use.
    pub api_keys: KeyCache,
    /// The keys of the dashboard's actions (`api.admin_keys_file`), read on first use.
    pub admin_keys: KeyCache,
    /// What the dashboard's actions call: the same as the D-Bus methods.
    pub actions: crate::actions::Actions,
    /// The request bodies held at once (`api.max_buffered`).
    pub bodies: Arc<intake::Budget>,
    /// The open client connections.
    pub connections: Connections,
    /// When a connection or request last came in (`exit_when_idle`).
    pub activity: Activity,
    /// Validation runs: while one holds the engine, requests wait at its gate.
    pub validator: crate::validate::Validator,
    /// Set once dsv4d stops serving: event streams end (their exchanges would never).
    pub closing: watch::Sender<bool>,
    /// The alerts raised, for the dashboard.
    pub alerts: crate::lifecycle::alert::Alerts,
    /// The dashboard's event streams open (`api.max_event_streams`).
    pub watchers: crate::http::watchers::Watchers,
}

impl Ctx {
    /// The `GET /status` document, as it stands.
    pub async fn status_document(&self) -> Status {
        status_document(
            &self.lifecycle,
            &self.stats,
            &self.telemetry,
            &self.power,
            &self.thermal,
        )
        .await
    }
}

/// The status document (`GET /status`, D-Bus `Status()`): the lifecycle's status with the
/// request statistics (the last few requests in full).
pub async fn status_document(
    lifecycle: &Handle,
    stats: &Stats,
    telemetry: &Telemetry,
    power: &Power,
    thermal: &Thermal,
) -> Status {
    Status {
        engine: lifecycle.status(),
        requests: stats.report(5),
        telemetry: telemetry.latest().map(|s| (*s).clone()),
        power: Some(power.status()),
        thermal: Some(thermal.status()),
        kv: Some(lifecycle.kv().status().await),
        limits: Some(crate::http::connections::limits()),
    }
}
