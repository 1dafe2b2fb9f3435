//! What every request handler reaches: the [`Ctx`], the daemon's [`Parts`] the API serves
//! from with what only the API has.

use tokio::sync::watch;

use std::sync::Arc;

use crate::http::auth::KeyCache;
use crate::http::connections::{Activity, Connections};
use crate::http::intake;
use crate::parts::Parts;

/// What every request handler needs.
pub struct Ctx {
    /// The parts the control interface serves from too (lifecycle, configuration,
    /// statistics, telemetry, policies, validation, actions).
    pub parts: Parts,
    /// The API keys of the configuration in force (`api.api_keys_file`), read on first use.
    pub api_keys: KeyCache,
    /// The keys of the dashboard's actions (`api.admin_keys_file`), read on first use.
    pub admin_keys: KeyCache,
    /// The request bodies held at once (`api.max_buffered`).
    pub bodies: Arc<intake::Budget>,
    /// The open client connections.
    pub connections: Connections,
    /// When a connection or request last came in (`exit_when_idle`).
    pub activity: Activity,
    /// Set once dsv4d stops serving: event streams end (their exchanges would never).
    pub closing: watch::Sender<bool>,
    /// The alerts raised, for the dashboard.
    pub alerts: crate::lifecycle::alert::Alerts,
    /// The dashboard's event streams open (`api.max_event_streams`).
    pub watchers: crate::http::watchers::Watchers,
}
