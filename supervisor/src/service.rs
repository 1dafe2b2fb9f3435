//! What systemd hears from the daemon (`sd_notify(3)`), all of it from here: `READY=1` once
//! the listener, the configuration and the bus name are in place; `STATUS=`, a one-line
//! summary that follows the state; `WATCHDOG=1`, sent only after the lifecycle actor has
//! answered a ping, so that a hung actor gets the daemon restarted; `EXTEND_TIMEOUT_USEC=`
//! while a slow engine stop (a drain, a ds4 KV save) runs at shutdown; and `STOPPING=1`.
//!
//! Owns: those messages. Must not: say anything that is not so (READY before the bus name,
//! a watchdog ping for an actor that does not answer). Without `NOTIFY_SOCKET` (not under
//! systemd) every message is dropped.

use std::time::Duration;

use dsv4_client::telemetry::Sample;
use dsv4_client::{EngineStatus, State};
use sd_notify::NotifyState;

use crate::lifecycle::Handle;
use crate::monitor::Telemetry;

/// The least time between two `STATUS=` lines (each request moves the in-flight count).
const STATUS_GAP: Duration = Duration::from_secs(1);

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!("telling systemd failed: {e}");
    }
}

/// The one-line summary: `engine ready (320k), 1 request in flight, GTT 81.4 GiB, 73 C`.
pub fn status_line(e: &EngineStatus, sample: Option<&Sample>) -> String {
    let mut line = match (e.state, e.engine_profile.as_deref()) {
        (State::Stopped, _) => "engine stopped".to_string(),
        (state, Some(p)) => format!("engine {state} ({p})"),
        (state, None) => format!("engine {state}"),
    };
    if e.in_flight > 0 {
        let requests = if e.in_flight == 1 {
            "request"
        } else {
            "requests"
        };
        line.push_str(&format!(", {} {requests} in flight", e.in_flight));
    }
    if e.waiting > 0 {
        line.push_str(&format!(", {} waiting", e.waiting));
    }
    if let Some(s) = sample {
        if let Some(gtt) = s.gpu.as_ref().and_then(|g| g.gtt_used) {
            line.push_str(&format!(
                ", GTT {:.1} GiB",
                gtt as f64 / (1u64 << 30) as f64
            ));
        }
        if let Some(t) = s.temperatures.edge {
            line.push_str(&format!(", {t:.0} C"));
        }
    }
    line
}

/// `READY=1` with the first status line.
pub fn ready(e: &EngineStatus) {
    send(&[
        NotifyState::Ready,
        NotifyState::Status(&status_line(e, None)),
    ]);
}

/// `STOPPING=1`, and room for the engine's stop: `extend` more than systemd's own stop
/// timeout may allow (a drain of in-flight requests, then ds4's KV save).
pub fn stopping(extend: Duration) {
    let usec = u32::try_from(extend.as_micros()).unwrap_or(u32::MAX);
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping: draining requests, then stopping the engine"),
        NotifyState::ExtendTimeoutUsec(usec),
    ]);
}

/// Keeps `STATUS=` following the state and the latest sample, and, when systemd asks for
/// it (`WATCHDOG_USEC`), pings the watchdog at half its period, each time only after the
/// lifecycle actor answered.
pub fn spawn(lifecycle: Handle, telemetry: Telemetry) {
    let mut status = lifecycle.watch_status();
    let mut samples = telemetry.watch();
    tokio::spawn(async move {
        let mut last = String::new();
        loop {
            let line = {
                let sample = samples.borrow_and_update().clone();
                status_line(&status.borrow_and_update(), sample.as_deref())
            };
            if line != last {
                send(&[NotifyState::Status(&line)]);
                last = line;
            }
            tokio::time::sleep(STATUS_GAP).await;
            tokio::select! {
                r = status.changed() => if r.is_err() { return },
                r = samples.changed() => if r.is_err() { return },
            }
        }
    });
    if let Some(period) = sd_notify::watchdog_enabled() {
        tracing::info!(
            "watchdog: every {:.1} s, after the lifecycle actor answers",
            period.as_secs_f64() / 2.0
        );
        tokio::spawn(async move {
            // A fixed beat: a slow answer does not push the next ping toward the deadline.
            let mut beat = tokio::time::interval(period / 2);
            beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                beat.tick().await;
                let answered = tokio::time::timeout(period / 4, lifecycle.ping()).await;
                if matches!(answered, Ok(true)) {
                    send(&[NotifyState::Watchdog]);
                } else {
                    tracing::error!("the lifecycle actor did not answer: no watchdog ping");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_client::telemetry::{Gpu, Temperatures};

    #[test]
    fn the_status_line_says_the_state_the_requests_and_the_hardware() {
        let mut e = EngineStatus::stopped("320k");
        assert_eq!(status_line(&e, None), "engine stopped");
        e.state = State::Ready;
        e.engine_profile = Some("320k".into());
        e.in_flight = 1;
        let sample = Sample {
            gpu: Some(Gpu {
                gtt_used: Some(87_400_000_000),
                ..Gpu::default()
            }),
            temperatures: Temperatures {
                edge: Some(73.2),
                ..Temperatures::default()
            },
            ..Sample::default()
        };
        assert_eq!(
            status_line(&e, Some(&sample)),
            "engine ready (320k), 1 request in flight, GTT 81.4 GiB, 73 C"
        );
        e.in_flight = 3;
        e.waiting = 2;
        e.state = State::Starting;
        assert_eq!(
            status_line(&e, None),
            "engine starting (320k), 3 requests in flight, 2 waiting"
        );
    }
}
