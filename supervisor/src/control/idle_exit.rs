//! Exiting when idle (`exit_when_idle`), under socket activation: the daemon goes once the
//! engine has been stopped that long and nothing came in meanwhile (no connection, no
//! request, no D-Bus call), and systemd, which keeps the listening socket, starts it again
//! at the next connection.
//!
//! Owns: the record of the last activity, and the decision. Must not: lose a connection:
//! it decides only while no client connection is open, and the proxy then stops accepting
//! before anything else, so a client that connects from then on waits in the socket's
//! backlog (which stays with systemd) for the next instance.

use std::time::Duration;

use dsv4_client::State;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::http::connections::{Activity, Connections};
use crate::lifecycle::Status;

/// Whether the daemon may exit now: no engine, nothing waiting or in flight, no client
/// connection, and both the engine's stop and the last activity at least `after` ago.
pub fn may_exit(
    status: &Status,
    stopped_for: Duration,
    quiet_for: Duration,
    open_connections: usize,
    after: Duration,
) -> bool {
    status.state == State::Stopped
        && status.waiting == 0
        && status.in_flight == 0
        && open_connections == 0
        && stopped_for >= after
        && quiet_for >= after
}

/// Resolves once the daemon may exit (see [`may_exit`]).
pub async fn due(
    after: Duration,
    mut lifecycle: watch::Receiver<Status>,
    activity: Activity,
    connections: Connections,
) {
    let check = (after / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    let mut stopped_since = Instant::now();
    let mut was_stopped = true;
    loop {
        tokio::select! {
            r = lifecycle.changed() => if r.is_err() { return std::future::pending().await },
            () = tokio::time::sleep(check) => {}
        }
        let status = lifecycle.borrow_and_update().clone();
        let stopped = status.state == State::Stopped;
        if stopped && !was_stopped {
            stopped_since = Instant::now();
        }
        was_stopped = stopped;
        if may_exit(
            &status,
            stopped_since.elapsed(),
            activity.quiet_for(),
            connections.open(),
            after,
        ) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_stopped_quiet_daemon_without_connections_may_exit() {
        let after = Duration::from_secs(60);
        let long = Duration::from_secs(61);
        let short = Duration::from_secs(10);
        let stopped = Status::stopped("320k");
        assert!(may_exit(&stopped, long, long, 0, after));
        assert!(!may_exit(&stopped, short, long, 0, after));
        assert!(!may_exit(&stopped, long, short, 0, after));
        assert!(!may_exit(&stopped, long, long, 1, after));
        let mut ready = stopped.clone();
        ready.state = State::Ready;
        assert!(!may_exit(&ready, long, long, 0, after));
        let mut backoff = stopped.clone();
        backoff.state = State::Backoff;
        assert!(!may_exit(&backoff, long, long, 0, after));
        let mut waiting = stopped;
        waiting.waiting = 1;
        assert!(!may_exit(&waiting, long, long, 0, after));
    }

    #[tokio::test(start_paused = true)]
    async fn activity_resets_the_quiet_time() {
        let a = Activity::default();
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(a.quiet_for() >= Duration::from_secs(5));
        a.touch();
        assert!(a.quiet_for() < Duration::from_millis(10));
    }
}
