//! The engine that loads, as the requests waiting for it are told: which profile, since when,
//! and how long its last loads took (`crate::host::load_times`).
//!
//! Owns: [`Loading`] and its words. The actor publishes it from the spawn until the engine
//! serves or the start ends; the record of how long the load took is written then.

use std::time::Duration;

use dsv4_client::duration::{brief, whole_seconds};
use tokio::time::Instant;

/// An engine on its way to serving.
#[derive(Debug, Clone, PartialEq)]
pub struct Loading {
    pub profile: String,
    /// Its spawn (the first of a start that moved to another port).
    pub since: Instant,
    /// What this profile's last loads took (their median); `None` before its first.
    pub about: Option<Duration>,
    /// The shortest and the longest of them.
    pub past: Option<(Duration, Duration)>,
    /// What the start waits for before its engine spawns (its workers: `waiting for
    /// 10.77.0.2 (12s)`); `None` once the engine loads.
    pub waiting_for: Option<String>,
}

impl Loading {
    /// `dsv4 loading 320k: 23s of about 54s`, `elapsed` into the load (whole seconds: the
    /// words are written at each tick); where the last loads varied (the longest more than
    /// half again the shortest, a warm load against a cold one), their range instead:
    /// `dsv4 loading 320k: 20s, past loads 240ms-45s`. The first load of a profile says only
    /// the seconds.
    pub fn describe(&self, elapsed: Duration) -> String {
        if let Some(what) = &self.waiting_for {
            return format!("dsv4 loading {}: {what}", self.profile);
        }
        let mut text = format!(
            "dsv4 loading {}: {}",
            self.profile,
            brief(whole_seconds(elapsed))
        );
        match (self.past, self.about) {
            (Some((low, high)), _) if high.as_secs_f64() > 1.5 * low.as_secs_f64() + 0.5 => {
                text.push_str(&format!(", past loads {}-{}", brief(low), brief(high)));
            }
            (_, Some(about)) => {
                text.push_str(&format!(" of about {}", brief(whole_seconds(about))));
            }
            _ => {}
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_load_says_its_seconds_and_the_estimate_when_there_is_one() {
        let mut l = Loading {
            profile: "320k".into(),
            since: Instant::now(),
            about: Some(Duration::from_millis(53_600)),
            past: None,
            waiting_for: None,
        };
        assert_eq!(
            l.describe(Duration::from_millis(23_400)),
            "dsv4 loading 320k: 23s of about 54s"
        );
        // Loads that varied: their range, not a median that fits none of them.
        l.past = Some((Duration::from_millis(240), Duration::from_millis(45_400)));
        assert_eq!(
            l.describe(Duration::from_secs(20)),
            "dsv4 loading 320k: 20s, past loads 240ms-45s"
        );
        // Close enough: the median.
        l.past = Some((Duration::from_millis(52_000), Duration::from_millis(56_000)));
        assert_eq!(
            l.describe(Duration::from_millis(23_400)),
            "dsv4 loading 320k: 23s of about 54s"
        );
        // A tick a hair before the second: rounded, not cut.
        assert_eq!(
            l.describe(Duration::from_millis(23_999)),
            "dsv4 loading 320k: 24s of about 54s"
        );
        l.about = None;
        l.past = None;
        assert_eq!(l.describe(Duration::from_secs(3)), "dsv4 loading 320k: 3s");
        // Before its engine spawns, what the start waits for: its workers.
        l.waiting_for = Some("waiting for 10.77.0.2 (12s)".into());
        assert_eq!(
            l.describe(Duration::from_secs(12)),
            "dsv4 loading 320k: waiting for 10.77.0.2 (12s)"
        );
    }
}
