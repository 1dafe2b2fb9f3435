//! `dsv4ctl notify-agent`: desktop notifications for a user, from the daemon's signals.
//!
//! Owns: a connection to the daemon's bus (the system bus, for the system service) on which
//! it listens to `ThermalEvent`, `Alert` and (with `--states`) `StateChanged`, and one to the
//! user's session bus, on which it calls `org.freedesktop.Notifications.Notify`. A system
//! service cannot reach a desktop's session bus; this small per-user process, run by the
//! user unit `dsv4-notify.service`, carries the signals over. Must not: act on the daemon,
//! or stop over a missing daemon or notification server: the signals are matched by the
//! daemon's well-known name, so a daemon that starts later, or restarts, is heard as soon as
//! it is back; a notification server that is not there is logged and asked again at the
//! next event.

use std::collections::HashMap;

use dsv4_client::telemetry::Sensor;
use dsv4_client::words::ThermalSignal;
use dsv4_client::{AlertKind, Bus, State};
use futures_util::StreamExt;
use zbus::zvariant::Value;

use crate::error::Failure;

/// The app name notifications carry.
const APP: &str = "dsv4";

/// One notification to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Note {
    /// What it replaces if shown already (`thermal`, an alert kind, `state`).
    pub topic: String,
    pub summary: String,
    pub body: String,
    pub icon: &'static str,
    /// 0 low, 1 normal, 2 critical.
    pub urgency: u8,
}

/// Which part of the machine a sensor measures; a sensor of a newer daemon's is named as it
/// came.
fn part(sensor: &str) -> String {
    match sensor.parse::<Sensor>() {
        Ok(s) => s.about().part.to_string(),
        Err(()) => format!("sensor {sensor}"),
    }
}

/// The notification for a `ThermalEvent`; `action`: what dsv4d does about it, when known.
pub fn thermal(
    level: &str,
    sensor: &str,
    celsius: f64,
    message: &str,
    action: Option<&str>,
) -> Note {
    let what = part(sensor);
    // A word from a newer daemon is shown as it came.
    let (summary, icon, urgency) = match level.parse::<ThermalSignal>() {
        Ok(ThermalSignal::Warn) => (format!("{what} hot: {celsius:.0} C"), "dialog-warning", 1),
        Ok(ThermalSignal::Critical) => (
            format!("{what} critically hot: {celsius:.0} C"),
            "dialog-error",
            2,
        ),
        // A sensor that stopped reading is dropped to normal without a temperature.
        Ok(ThermalSignal::Normal) if !celsius.is_finite() => (
            format!("{what} temperature: no reading"),
            "dialog-warning",
            1,
        ),
        Ok(ThermalSignal::Normal) => (
            format!("{what} temperature back to normal: {celsius:.0} C"),
            "dialog-information",
            0,
        ),
        Ok(ThermalSignal::Throttling) => (
            "the hardware is throttling".to_string(),
            "dialog-warning",
            1,
        ),
        Ok(ThermalSignal::ThrottlingEnded) => (
            "the hardware stopped throttling".to_string(),
            "dialog-information",
            0,
        ),
        Err(_) => (format!("thermal event: {level}"), "dialog-information", 1),
    };
    let mut body = capitalized(message);
    if !body.ends_with('.') {
        body.push('.');
    }
    if let Some(a) = action {
        body.push_str(&format!(" dsv4d: {a}."));
    }
    Note {
        topic: "thermal".into(),
        summary: format!("dsv4: {summary}"),
        body,
        icon,
        urgency,
    }
}

fn capitalized(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// The notification for an `Alert`.
pub fn alert(kind: AlertKind, message: &str) -> Note {
    let summary = match kind {
        AlertKind::Config => "the configuration was not applied",
        AlertKind::Engine => "the engine crashed",
        AlertKind::Memory => "memory",
        AlertKind::Power => "power settings",
        AlertKind::Request => "a long request",
        AlertKind::Worker => "a worker box",
        AlertKind::Kv => "a KV restore did nothing",
        AlertKind::Canary => "the engine's answers changed",
        AlertKind::Other => "alert",
    };
    // A long request's news is good more often than not; a worker box that cooled is news too.
    let failed = match kind {
        AlertKind::Request => message.contains(" failed "),
        AlertKind::Worker => !message.contains(": back to normal"),
        _ => true,
    };
    Note {
        topic: kind.as_str().into(),
        summary: format!("dsv4: {summary}"),
        body: capitalized(message),
        icon: if failed {
            "dialog-warning"
        } else {
            "dialog-information"
        },
        urgency: 1,
    }
}

/// The notification for a state change worth one (`--states`): ready, stopped.
pub fn state(state: State, profile: &str) -> Option<Note> {
    let summary = match state {
        State::Ready => format!("engine ready ({profile})"),
        State::Stopped => "engine stopped".to_string(),
        _ => return None,
    };
    Some(Note {
        topic: "state".into(),
        summary: format!("dsv4: {summary}"),
        body: String::new(),
        icon: "dialog-information",
        urgency: 0,
    })
}

/// The session bus and the ids of the bubbles shown, by topic.
#[derive(Default)]
struct Desktop {
    session: Option<zbus::Connection>,
    /// Whether the notification server reads markup in bodies (`body-markup`), asked once
    /// per connection.
    markup: Option<bool>,
    shown: HashMap<String, u32>,
}

/// Whether the server on `conn` lists `body-markup` among its capabilities.
async fn reads_markup(conn: &zbus::Connection) -> bool {
    let reply = conn
        .call_method(
            Some("org.freedesktop.Notifications"),
            "/org/freedesktop/Notifications",
            Some("org.freedesktop.Notifications"),
            "GetCapabilities",
            &(),
        )
        .await;
    // Unknown: escaped, which a server that shows text as it is shows with its entities.
    reply
        .and_then(|r| r.body().deserialize::<Vec<String>>())
        .map_or(true, |caps| caps.iter().any(|c| c == "body-markup"))
}

impl Desktop {
    async fn notify(&mut self, note: Note) {
        if self.session.is_none() {
            match zbus::Connection::session().await {
                Ok(c) => self.session = Some(c),
                Err(e) => {
                    eprintln!(
                        "dsv4ctl: notify-agent: no session bus ({e}); {}",
                        note.summary
                    );
                    return;
                }
            }
        }
        let Some(conn) = self.session.clone() else {
            return;
        };
        // The body may hold an engine's output, which can echo a client's text: it is text,
        // never markup (links, images) or control characters.
        let markup = match self.markup {
            Some(m) => m,
            None => *self.markup.insert(reads_markup(&conn).await),
        };
        let text = match markup {
            true => dsv4_client::text::markup_escaped(&note.body),
            false => dsv4_client::text::printable(&note.body).into_owned(),
        };
        let summary = dsv4_client::text::printable(&note.summary).into_owned();
        let replaces = self.shown.get(&note.topic).copied().unwrap_or(0);
        let mut hints: HashMap<&str, Value> = HashMap::new();
        hints.insert("urgency", Value::U8(note.urgency));
        let body = (
            APP,
            replaces,
            note.icon,
            summary.as_str(),
            text.as_str(),
            Vec::<&str>::new(),
            hints,
            -1i32,
        );
        let reply = conn
            .call_method(
                Some("org.freedesktop.Notifications"),
                "/org/freedesktop/Notifications",
                Some("org.freedesktop.Notifications"),
                "Notify",
                &body,
            )
            .await;
        match reply.and_then(|r| r.body().deserialize::<u32>()) {
            Ok(id) => {
                self.shown.insert(note.topic, id);
            }
            Err(e) => {
                // No notification server now (or the session went away): said, and the
                // next event asks again.
                eprintln!(
                    "dsv4ctl: notify-agent: cannot show {:?}: {e}; will try again at the next event",
                    note.summary
                );
                if matches!(e, zbus::Error::InputOutput(_)) {
                    self.session = None;
                }
                // Another server may take the name: ask it again.
                self.markup = None;
            }
        }
    }
}

pub async fn run(bus: Bus, states: bool) -> Result<(), Failure> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Session => zbus::connection::Builder::session(),
    };
    let conn = builder
        .map_err(|e| Failure::Unreachable(format!("cannot connect to the {bus} bus: {e}")))?
        .build()
        .await
        .map_err(|e| Failure::Unreachable(format!("cannot connect to the {bus} bus: {e}")))?;
    let proxy = dsv4_client::Supervisor1Proxy::builder(&conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .map_err(|e| Failure::Failed(format!("the proxy: {e}")))?;
    let subscribe = |what: &str, e: zbus::Error| {
        Failure::Failed(format!("cannot subscribe to {what} on the {bus} bus: {e}"))
    };
    let mut thermal_events = proxy
        .receive_thermal_event()
        .await
        .map_err(|e| subscribe("ThermalEvent", e))?;
    let mut alerts = proxy
        .receive_alert()
        .await
        .map_err(|e| subscribe("Alert", e))?;
    let mut changes = proxy
        .receive_lifecycle_changed()
        .await
        .map_err(|e| subscribe("StateChanged", e))?;
    eprintln!(
        "dsv4ctl: notify-agent: listening to dsv4d on the {bus} bus{}",
        if states { " (with engine states)" } else { "" }
    );
    let mut desktop = Desktop::default();
    // Only a cold start's `ready` is news, not every return to it.
    let mut last_state: Option<State> = None;
    loop {
        let note = tokio::select! {
            Some(e) = thermal_events.next() => {
                let Ok(a) = e.args() else { continue };
                // What dsv4d does about it, from its status (absent from an older daemon).
                let action = match a.level.parse() {
                    Ok(ThermalSignal::Critical) => proxy
                        .status()
                        .await
                        .ok()
                        .and_then(|s| serde_json::from_str::<dsv4_client::Status>(&s).ok())
                        .and_then(|s| s.thermal?.action),
                    _ => None,
                };
                Some(thermal(a.level, a.sensor, a.celsius, a.message, action.as_deref()))
            }
            Some(a) = alerts.next() => {
                let Ok(a) = a.args() else { continue };
                Some(alert(a.kind, a.message))
            }
            Some(c) = changes.next() => {
                let Ok(a) = c.args() else { continue };
                let s = a.state;
                let was = last_state.replace(s);
                match (states, s, was) {
                    (true, State::Ready, Some(State::Starting)) | (true, State::Stopped, Some(State::Stopping)) => {
                        state(s, a.profile)
                    }
                    _ => None,
                }
            }
            else => return Ok(()),
        };
        if let Some(n) = note {
            desktop.notify(n).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thermal_notes_say_the_temperature_and_escalate() {
        let n = thermal(
            "warn",
            "edge",
            86.4,
            "edge temperature 86.4 C: hot (at or above 85 C)",
            None,
        );
        assert_eq!(n.summary, "dsv4: GPU hot: 86 C");
        assert_eq!(n.body, "Edge temperature 86.4 C: hot (at or above 85 C).");
        assert_eq!(
            (n.urgency, n.icon, n.topic.as_str()),
            (1, "dialog-warning", "thermal")
        );
        let n = thermal(
            "critical",
            "tctl",
            96.0,
            "tctl temperature 96.0 C: critical",
            Some("requests refused"),
        );
        assert_eq!(n.summary, "dsv4: CPU critically hot: 96 C");
        assert!(n.body.ends_with(" dsv4d: requests refused."), "{}", n.body);
        assert_eq!(n.urgency, 2);
        assert_eq!(thermal("normal", "edge", 78.0, "m", None).urgency, 0);
        let lost = thermal("normal", "edge", f64::NAN, "no reading", None);
        assert_eq!(lost.summary, "dsv4: GPU temperature: no reading");
        // Each sensor says its own part; one this version does not know is named.
        assert_eq!(
            thermal("warn", "soc", 86.0, "m", None).summary,
            "dsv4: SoC hot: 86 C"
        );
        assert_eq!(
            thermal("warn", "hotspot", 86.0, "m", None).summary,
            "dsv4: sensor hotspot hot: 86 C"
        );
        assert_eq!(
            alert(AlertKind::Memory, "not enough memory").summary,
            "dsv4: memory"
        );
        // A long request's end is news; its failure is a warning, as other alerts are.
        let done = alert(
            AlertKind::Request,
            "4,096-token prefill done in 12m, decode started",
        );
        assert_eq!(
            (done.summary.as_str(), done.icon),
            ("dsv4: a long request", "dialog-information")
        );
        let failed = alert(
            AlertKind::Request,
            "request 3 (prefill) failed after 2h: the engine exited",
        );
        assert_eq!(failed.icon, "dialog-warning");
        assert_eq!(alert(AlertKind::Memory, "m").icon, "dialog-warning");
        let hot = alert(
            AlertKind::Worker,
            "worker box 10.77.0.2: edge temperature 91.0 C: hot (at or above 85 C)",
        );
        assert_eq!(
            (hot.summary.as_str(), hot.icon, hot.topic.as_str()),
            ("dsv4: a worker box", "dialog-warning", "worker")
        );
        let cooled = alert(
            AlertKind::Worker,
            "worker box 10.77.0.2: edge temperature 79.0 C: back to normal (below 80 C)",
        );
        assert_eq!(cooled.icon, "dialog-information");
        assert!(state(State::Draining, "320k").is_none());
        assert_eq!(
            state(State::Ready, "320k").unwrap().summary,
            "dsv4: engine ready (320k)"
        );
    }
}
