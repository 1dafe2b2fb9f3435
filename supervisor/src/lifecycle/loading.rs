//! The engine that loads, as the requests waiting for it are told: which profile, since when,
//! and how long its last loads took (`crate::host::load_times`).
//!
//! Owns: [`Loading`] and its words. The actor publishes it from the spawn until the engine
//! serves or the start ends; the record of how long the load took is written then.

use std::time::Duration;

use tokio::time::Instant;

/// An engine on its way to serving.
#[derive(Debug, Clone, PartialEq)]
pub struct Loading {
    pub profile: String,
    /// Its spawn (the first of a start that moved to another port).
    pub since: Instant,
    /// What this profile's last loads took (their median); `None` before its first.
    pub about: Option<Duration>,
}

impl Loading {
    /// `dsv4 loading 320k: 23 s of about 54 s`, `elapsed` into the load; the first load of a
    /// profile says only the seconds.
    pub fn describe(&self, elapsed: Duration) -> String {
        let mut text = format!("dsv4 loading {}: {} s", self.profile, elapsed.as_secs());
        if let Some(about) = self.about {
            text.push_str(&format!(" of about {} s", about.as_secs_f64().round()));
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
        };
        assert_eq!(
            l.describe(Duration::from_millis(23_900)),
            "dsv4 loading 320k: 23 s of about 54 s"
        );
        l.about = None;
        assert_eq!(l.describe(Duration::from_secs(3)), "dsv4 loading 320k: 3 s");
    }
}
