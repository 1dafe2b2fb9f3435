//! Alerts: what a desktop user should hear about, raised anywhere in the daemon and sent out
//! as `Alert(kind, message)` on D-Bus (which `dsv4ctl notify-agent` turns into notifications).
//!
//! Owns: the channel alerts travel on. Must not: decide what is alarming; the part that sees
//! the event raises it (the reloader a rejected configuration, the lifecycle actor an engine
//! that died while serving).

use dsv4_client::AlertKind;
use tokio::sync::broadcast;

/// Alerts not yet taken by a slow listener; older ones are dropped first.
const BACKLOG: usize = 16;

#[derive(Debug, Clone, PartialEq)]
pub struct Alert {
    pub kind: AlertKind,
    pub message: String,
}

/// Where alerts are raised; cheap to clone. Raising with nobody listening (no bus) is fine.
#[derive(Debug, Clone)]
pub struct Alerts(broadcast::Sender<Alert>);

impl Default for Alerts {
    fn default() -> Self {
        Alerts(broadcast::channel(BACKLOG).0)
    }
}

impl Alerts {
    /// Sends the alert to whoever listens (the caller logs it as it sees fit).
    /// Sends an alert. Its message may hold an engine's output, which can echo a client's
    /// text: control characters are taken out before it goes on the bus.
    pub fn raise(&self, kind: AlertKind, message: impl Into<String>) {
        let message = message.into();
        let message = match dsv4_client::text::printable(&message) {
            std::borrow::Cow::Borrowed(_) => message,
            std::borrow::Cow::Owned(clean) => clean,
        };
        let _ = self.0.send(Alert { kind, message });
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Alert> {
        self.0.subscribe()
    }
}
