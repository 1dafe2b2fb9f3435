//! `dsv4ctl start --wait`: deciding, from one `Status()` after another, whether the engine
//! is ready, still on its way, or failed to start.

use std::time::Duration;

use dsv4_client::Status;

/// How long a state left over from before `Start()` (`stopped`, `backoff`) is taken as not
/// yet updated rather than as the answer.
pub const GRACE: Duration = Duration::from_secs(5);

/// What one look at the status says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not ready yet.
    Waiting,
    Ready,
    /// The engine did not start: the reason, for `engine failed to start: <reason>`.
    Failed(String),
}

/// Follows the states after a `Start()`.
#[derive(Debug)]
pub struct StartWait {
    /// `failures` and `last_error` before the `Start()`, to tell a new failure from an old one.
    before: (u32, Option<String>),
    /// Whether a state with an engine (starting, ready, draining, stopping) was seen.
    seen_engine: bool,
}

impl StartWait {
    pub fn new(before: &Status) -> StartWait {
        StartWait {
            before: (before.failures, before.last_error.clone()),
            seen_engine: false,
        }
    }

    /// One look at the status, `elapsed` after the `Start()`.
    pub fn observe(&mut self, s: &Status, elapsed: Duration) -> Step {
        let last_error = s
            .last_error
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty());
        // A failure recorded after the Start (or any state change after it) is an answer;
        // a failure from before it may just not be replaced yet.
        let news = self.seen_engine
            || s.failures != self.before.0
            || s.last_error != self.before.1
            || elapsed >= GRACE;
        match s.state.as_str() {
            "ready" => Step::Ready,
            "starting" | "draining" | "stopping" => {
                self.seen_engine = true;
                Step::Waiting
            }
            "backoff" if news => Step::Failed(
                last_error
                    .unwrap_or("the daemon backs off after a failed start")
                    .to_string(),
            ),
            "stopped" if news => Step::Failed(match last_error {
                Some(e) => e.to_string(),
                None if self.seen_engine => "the engine was stopped before it was ready".into(),
                None => "the daemon did not start it (the state stayed stopped)".into(),
            }),
            _ => Step::Waiting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(state: &str, failures: u32, last_error: Option<&str>) -> Status {
        Status {
            state: state.into(),
            profile: "320k".into(),
            engine_profile: None,
            engine_pid: None,
            generation: None,
            in_flight: 0,
            waiting: 0,
            idle_deadline: None,
            ready_since: None,
            failures,
            last_error: last_error.map(str::to_string),
            restart_pending: false,
            requests: Default::default(),
        }
    }

    const T: Duration = Duration::from_millis(100);

    #[test]
    fn starting_then_ready() {
        let mut w = StartWait::new(&st("stopped", 0, None));
        assert_eq!(w.observe(&st("starting", 0, None), T), Step::Waiting);
        assert_eq!(w.observe(&st("ready", 0, None), T * 5), Step::Ready);
    }

    #[test]
    fn already_ready() {
        let mut w = StartWait::new(&st("ready", 0, None));
        assert_eq!(w.observe(&st("ready", 0, None), T), Step::Ready);
    }

    #[test]
    fn backoff_after_starting_fails_with_the_error() {
        let mut w = StartWait::new(&st("stopped", 0, None));
        assert_eq!(w.observe(&st("starting", 0, None), T), Step::Waiting);
        assert_eq!(w.observe(&st("stopping", 1, None), T * 2), Step::Waiting);
        assert_eq!(
            w.observe(&st("backoff", 1, Some("exited with status 1")), T * 3),
            Step::Failed("exited with status 1".into())
        );
    }

    #[test]
    fn a_new_failure_counts_even_if_starting_was_never_seen() {
        let mut w = StartWait::new(&st("backoff", 1, Some("old")));
        assert_eq!(
            w.observe(&st("backoff", 2, Some("old")), T),
            Step::Failed("old".into())
        );
        let mut w = StartWait::new(&st("stopped", 0, Some("old")));
        assert_eq!(
            w.observe(&st("stopped", 0, Some("new")), T),
            Step::Failed("new".into())
        );
    }

    #[test]
    fn a_stale_state_is_not_taken_for_the_answer_at_once() {
        let mut w = StartWait::new(&st("stopped", 0, Some("old crash")));
        assert_eq!(
            w.observe(&st("stopped", 0, Some("old crash")), T),
            Step::Waiting
        );
        assert_eq!(
            w.observe(&st("starting", 0, Some("old crash")), T * 2),
            Step::Waiting
        );
        assert_eq!(
            w.observe(&st("ready", 0, Some("old crash")), T * 3),
            Step::Ready
        );

        let mut w = StartWait::new(&st("backoff", 1, Some("old")));
        assert_eq!(w.observe(&st("backoff", 1, Some("old")), T), Step::Waiting);
        assert_eq!(
            w.observe(&st("backoff", 1, Some("old")), GRACE),
            Step::Failed("old".into())
        );
    }

    #[test]
    fn stopped_for_good() {
        let mut w = StartWait::new(&st("stopped", 0, None));
        assert_eq!(w.observe(&st("stopped", 0, None), T), Step::Waiting);
        assert_eq!(
            w.observe(&st("stopped", 0, None), GRACE),
            Step::Failed("the daemon did not start it (the state stayed stopped)".into())
        );

        let mut w = StartWait::new(&st("stopped", 0, None));
        assert_eq!(w.observe(&st("starting", 0, None), T), Step::Waiting);
        assert_eq!(
            w.observe(&st("stopped", 0, None), T * 2),
            Step::Failed("the engine was stopped before it was ready".into())
        );

        let mut w = StartWait::new(&st("stopped", 0, None));
        assert_eq!(w.observe(&st("starting", 0, None), T), Step::Waiting);
        assert_eq!(
            w.observe(&st("stopped", 0, Some("killed by signal 9")), T * 2),
            Step::Failed("killed by signal 9".into())
        );
    }
}
