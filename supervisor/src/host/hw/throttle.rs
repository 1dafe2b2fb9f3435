//! Throttling over time: from each `gpu_metrics` reading to "throttling now, of these kinds,
//! since then, for so many seconds in all".
//!
//! Owns: the previous residency counters and the running totals. Must not: read anything
//! (it is handed each reading) or decide what to do about throttling (the thermal policy
//! does). Pure, so that it is table-tested.
//!
//! v3.0 counters only ever grow: a rise between two readings means throttling of that kind
//! in the interval between them, which counts whole; a fall (the firmware reset them) starts
//! counting afresh. v2.x bits say "throttling now": the interval up to the reading counts.

use dsv4_client::telemetry::{Throttle, ThrottleKind, ThrottleSeconds};

use super::gpu_metrics::ThrottleReading;

/// Longest interval one reading may count: after a suspend or a stalled daemon, a rise says
/// nothing about how long it lasted.
const MAX_INTERVAL: f64 = 60.0;

/// v3.0's counters in their order: prochot, spl, fppt, sppt, thm_core, thm_gfx, thm_soc.
const RESIDENCY_KINDS: [ThrottleKind; 7] = [
    ThrottleKind::Prochot,
    ThrottleKind::Power,
    ThrottleKind::Power,
    ThrottleKind::Power,
    ThrottleKind::Thermal,
    ThrottleKind::Thermal,
    ThrottleKind::Thermal,
];

#[derive(Debug, Clone, Default)]
pub struct Tracker {
    last_at: Option<f64>,
    counters: Option<[u32; 7]>,
    since: Option<f64>,
    seconds: ThrottleSeconds,
}

impl Tracker {
    /// The state after a reading taken at `at` (unix s); `None`: no throttling information.
    pub fn update(&mut self, reading: Option<ThrottleReading>, at: f64) -> Throttle {
        let interval = self
            .last_at
            .map(|last| (at - last).clamp(0.0, MAX_INTERVAL))
            .unwrap_or(0.0);
        self.last_at = Some(at);
        let mut kinds: Vec<ThrottleKind> = match reading {
            None => {
                self.counters = None;
                self.since = None;
                return Throttle {
                    seconds: self.seconds,
                    ..Throttle::default()
                };
            }
            Some(ThrottleReading::Residency(now)) => {
                let rose = match self.counters {
                    Some(before) => (0..7)
                        .filter(|i| now[*i] > before[*i])
                        .map(|i| RESIDENCY_KINDS[i])
                        .collect(),
                    None => Vec::new(),
                };
                self.counters = Some(now);
                rose
            }
            Some(ThrottleReading::Bits(bits)) => {
                self.counters = None;
                [
                    (bits & 0xFFFF, ThrottleKind::Power),
                    ((bits >> 16) & 0xFFFF, ThrottleKind::Current),
                    ((bits >> 32) & 0xFFFF, ThrottleKind::Thermal),
                    (bits >> 48, ThrottleKind::Other),
                ]
                .into_iter()
                .filter(|(set, _)| *set != 0)
                .map(|(_, kind)| kind)
                .collect()
            }
        };
        kinds.sort();
        kinds.dedup();
        for kind in &kinds {
            self.seconds.add(*kind, interval);
        }
        let active = !kinds.is_empty();
        self.since = match (active, self.since) {
            (true, Some(since)) => Some(since),
            // From the start of the interval in which it was first seen.
            (true, None) => Some(at - interval),
            (false, _) => None,
        };
        Throttle {
            supported: true,
            active,
            kinds,
            since: self.since,
            seconds: self.seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ThrottleKind::*;

    fn res(spl: u32, thm_gfx: u32, prochot: u32) -> Option<ThrottleReading> {
        Some(ThrottleReading::Residency([
            prochot, spl, 0, 0, 0, thm_gfx, 0,
        ]))
    }

    /// A reading at a time, and what the tracker should say after it.
    struct Row {
        reading: Option<ThrottleReading>,
        at: f64,
        active: bool,
        kinds: &'static [ThrottleKind],
        since: Option<f64>,
        /// Seconds of thermal, power and prochot throttling in all.
        seconds: (f64, f64, f64),
    }

    const fn row(
        counters: (u32, u32, u32),
        at: f64,
        active: bool,
        kinds: &'static [ThrottleKind],
        since: Option<f64>,
        seconds: (f64, f64, f64),
    ) -> Row {
        let (spl, thm_gfx, prochot) = counters;
        Row {
            reading: Some(ThrottleReading::Residency([
                prochot, spl, 0, 0, 0, thm_gfx, 0,
            ])),
            at,
            active,
            kinds,
            since,
            seconds,
        }
    }

    #[test]
    fn residency_counters_rising_are_throttling_in_that_interval() {
        let mut t = Tracker::default();
        let none = (0.0, 0.0, 0.0);
        let table = [
            // The first reading has nothing to compare with.
            row((40, 3, 0), 100.0, false, &[], None, none),
            row((40, 3, 0), 101.0, false, &[], None, none),
            row(
                (41, 3, 0),
                102.0,
                true,
                &[Power],
                Some(101.0),
                (0.0, 1.0, 0.0),
            ),
            row(
                (45, 9, 0),
                103.0,
                true,
                &[Thermal, Power],
                Some(101.0),
                (1.0, 2.0, 0.0),
            ),
            row((45, 9, 0), 104.0, false, &[], None, (1.0, 2.0, 0.0)),
            row(
                (45, 9, 2),
                114.0,
                true,
                &[Prochot],
                Some(104.0),
                (1.0, 2.0, 10.0),
            ),
            // A reset (counters fell): counted afresh, no throttling.
            row((0, 0, 0), 115.0, false, &[], None, (1.0, 2.0, 10.0)),
            // A long gap counts at most a minute.
            row(
                (0, 1, 0),
                415.0,
                true,
                &[Thermal],
                Some(355.0),
                (61.0, 2.0, 10.0),
            ),
        ];
        for (i, r) in table.into_iter().enumerate() {
            let s = t.update(r.reading, r.at);
            assert!(s.supported, "{i}");
            assert_eq!(
                (s.active, s.kinds.as_slice(), s.since),
                (r.active, r.kinds, r.since),
                "row {i}"
            );
            let secs = (s.seconds.thermal, s.seconds.power, s.seconds.prochot);
            assert_eq!(secs, r.seconds, "row {i}");
        }
    }

    #[test]
    fn v2_bits_are_throttling_now() {
        let mut t = Tracker::default();
        let bits = |b: u64| Some(ThrottleReading::Bits(b));
        let s = t.update(bits(1 << 33), 10.0);
        assert_eq!(
            (s.active, s.kinds.as_slice(), s.since),
            (true, &[Thermal][..], Some(10.0))
        );
        assert_eq!(s.seconds.thermal, 0.0);
        let s = t.update(bits((1 << 33) | 1 | (1 << 20) | (1 << 50)), 12.0);
        assert_eq!(s.kinds, [Thermal, Power, Current, Other]);
        assert_eq!(
            (s.since, s.seconds.thermal, s.seconds.power),
            (Some(10.0), 2.0, 2.0)
        );
        let s = t.update(bits(0), 13.0);
        assert!(!s.active && s.since.is_none());
        assert_eq!(s.seconds.total(), 2.0);
    }

    #[test]
    fn no_reading_is_unsupported_and_keeps_the_totals() {
        let mut t = Tracker::default();
        t.update(res(1, 0, 0), 1.0);
        t.update(res(2, 0, 0), 2.0);
        let s = t.update(None, 3.0);
        assert!(!s.supported && !s.active);
        assert_eq!(s.seconds.power, 1.0);
        // A table that comes back starts comparing afresh.
        let s = t.update(res(9, 0, 0), 4.0);
        assert!(!s.active);
    }
}
