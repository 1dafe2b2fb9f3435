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

use dsv4_client::telemetry::{Sample, Sensor};
use dsv4_client::{EngineStatus, State};
use sd_notify::NotifyState;

use crate::lifecycle::Handle;
use crate::observe::monitor::Telemetry;

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
        if let Some(gtt) = s.gpu.as_ref().and_then(|g| g.memory.gtt_used) {
            line.push_str(&format!(", GTT {}", dsv4_client::units::format_gib(gtt)));
        }
        if let Some(t) = s.temperatures.get(Sensor::Edge) {
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

/// The longest extension sent at once: well inside `EXTEND_TIMEOUT_USEC`'s u32 of
/// microseconds (71 minutes), and renewed at half of it.
const EXTEND_STEP: Duration = Duration::from_secs(10 * 60);

/// When to send `EXTEND_TIMEOUT_USEC=` for a stop that may take `budget`, with extensions of
/// at most `step`: (after how long, the extension in microseconds). Each extension runs
/// from its sending, so each next one goes out at half the one before, and the last reaches
/// the end of the budget.
pub fn extensions(budget: Duration, step: Duration) -> Vec<(Duration, u32)> {
    let step = step.min(Duration::from_micros(u32::MAX.into()));
    let mut out = Vec::new();
    let mut at = Duration::ZERO;
    loop {
        let left = budget.saturating_sub(at);
        let this = left.min(step);
        out.push((at, u32::try_from(this.as_micros()).unwrap_or(u32::MAX)));
        if this == left {
            return out;
        }
        at += (step / 2).max(Duration::from_millis(1));
    }
}

/// `STOPPING=1`, and room for the engine's stop: `budget` more than systemd's own stop
/// timeout may allow (a drain of in-flight requests, then the KV checkpoint's save, which
/// may take longer than one extension can say). The extensions go on being sent until the
/// budget ends or the returned task is aborted (the stop is over).
pub fn stopping(budget: Duration) -> tokio::task::JoinHandle<()> {
    let mut plan = extensions(budget, EXTEND_STEP).into_iter();
    let first = plan.next().map_or(0, |(_, usec)| usec);
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("stopping: draining requests, then stopping the engine"),
        NotifyState::ExtendTimeoutUsec(first),
    ]);
    let start = tokio::time::Instant::now();
    tokio::spawn(async move {
        for (at, usec) in plan {
            tokio::time::sleep_until(start + at).await;
            send(&[NotifyState::ExtendTimeoutUsec(usec)]);
        }
    })
}

/// Keeps `STATUS=` following the state and the latest sample, and, when systemd asks for
/// it (`WATCHDOG_USEC`), pings the watchdog at half its period, each time only after the
/// lifecycle actor answered.
pub fn spawn(lifecycle: Handle, telemetry: Telemetry) {
    let mut status = lifecycle.watch_status();
    let mut figures = lifecycle.watch_figures();
    let mut samples = telemetry.watch();
    tokio::spawn(async move {
        let mut last = String::new();
        loop {
            let line = {
                figures.borrow_and_update();
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
                r = figures.changed() => if r.is_err() { return },
                r = samples.changed() => if r.is_err() { return },
            }
        }
    });
    if let Some(period) = sd_notify::watchdog_enabled() {
        tracing::info!(
            "watchdog: every {}, after the lifecycle actor answers",
            dsv4_client::duration::format(period / 2)
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
    #[test]
    fn a_long_stop_is_extended_in_steps_that_never_run_out() {
        let step = EXTEND_STEP;
        for budget in [
            Duration::ZERO,
            Duration::from_secs(70),
            step,
            step + Duration::from_secs(1),
            // Past what one u32 of microseconds can say (71 min 35 s).
            Duration::from_secs(3 * 3600),
        ] {
            let plan = extensions(budget, step);
            let mut covered = Duration::ZERO;
            for (i, &(at, usec)) in plan.iter().enumerate() {
                assert!(at <= covered, "{budget:?}: a gap before #{i} at {at:?}");
                assert!(Duration::from_micros(usec.into()) <= step, "{budget:?}");
                covered = covered.max(at + Duration::from_micros(usec.into()));
            }
            assert_eq!(covered, budget, "{budget:?}: {plan:?}");
        }
        // One u32 cannot hold 3 hours; 10-minute steps renewed every 5 minutes can.
        assert_eq!(extensions(Duration::from_secs(3 * 3600), step).len(), 35);
    }

    use super::*;
    use dsv4_client::telemetry::{Gpu, GpuMemory};

    #[test]
    fn the_status_line_says_the_state_the_requests_and_the_hardware() {
        let mut e = EngineStatus::stopped("320k");
        assert_eq!(status_line(&e, None), "engine stopped");
        e.state = State::Ready;
        e.engine_profile = Some("320k".into());
        e.in_flight = 1;
        let sample = Sample {
            gpu: Some(Gpu {
                memory: GpuMemory {
                    gtt_used: Some(87_400_000_000),
                    ..GpuMemory::default()
                },
                ..Gpu::default()
            }),
            temperatures: [(Sensor::Edge, 73.2)].into_iter().collect(),
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
