//! Wall-clock time as the status documents carry it: seconds (or milliseconds) since the Unix
//! epoch. The one place both the daemon and `dsv4ctl` take it from.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, with their fraction; 0 for a clock set before 1970.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Milliseconds since the Unix epoch; 0 for a clock set before 1970.
pub fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_and_milliseconds_agree_and_are_after_2020() {
        let (s, ms) = (unix_now(), unix_millis());
        assert!(s > 1_577_836_800.0, "{s}");
        assert!((s * 1000.0 - ms as f64).abs() < 5_000.0, "{s} {ms}");
    }
}
