//! Alerts: what a desktop user should hear about, raised anywhere in the daemon and sent out
//! as `Alert(kind, message)` on D-Bus (which `dsv4ctl notify-agent` turns into notifications).
//!
//! Owns: the channel alerts travel on. Must not: decide what is alarming; the part that sees
//! the event raises it (the reloader a rejected configuration, the lifecycle actor an engine
//! that died while serving).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use dsv4_client::AlertKind;
use serde::Serialize;
use tokio::sync::broadcast;

/// Alerts not yet taken by a slow listener; older ones are dropped first.
const BACKLOG: usize = 16;
/// The latest alerts kept for those who come later (the dashboard).
const KEPT: usize = 20;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    pub kind: AlertKind,
    pub message: String,
    /// Unix time (s) it was raised.
    pub at: f64,
}

/// Where alerts are raised; cheap to clone. Raising with nobody listening (no bus) is fine.
#[derive(Debug, Clone)]
pub struct Alerts {
    sender: broadcast::Sender<Alert>,
    recent: Arc<Mutex<VecDeque<Alert>>>,
}

impl Default for Alerts {
    fn default() -> Self {
        Alerts {
            sender: broadcast::channel(BACKLOG).0,
            recent: Arc::default(),
        }
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
        let alert = Alert {
            kind,
            message,
            at: dsv4_client::clock::unix_now(),
        };
        {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() == KEPT {
                recent.pop_front();
            }
            recent.push_back(alert.clone());
        }
        let _ = self.sender.send(alert);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Alert> {
        self.sender.subscribe()
    }

    /// The latest alerts (at most 20), oldest first, and a receiver of those after them.
    pub fn recent_and_subscribe(&self) -> (Vec<Alert>, broadcast::Receiver<Alert>) {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        (recent.iter().cloned().collect(), self.sender.subscribe())
    }
}
