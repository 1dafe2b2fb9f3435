//! The thermal rules: from the monitor's samples to thermal events, each one transition.
//!
//! Owns: each sensor's level (normal, warn, critical) with hysteresis, the throttling state,
//! and when a critical level was last announced. Must not: read anything, act, or announce
//! the same level twice in a row: it turns samples into [`ThermalEvent`]s, and the daemon
//! logs, signals and acts on them. Pure, so that it is table-tested.
//!
//! A level is reached when a sensor's temperature reaches its threshold (`thermal.warn`,
//! `thermal.critical`), and it clears only once the temperature is below that threshold less
//! `thermal.hysteresis`: noise around a threshold makes one event, not a stream of them.
//! While critical, a reminder goes out every [`REMINDER`]. Throttling starts with the first
//! sample that saw it, and ends after [`QUIET`] without any.

use std::collections::BTreeMap;

use dsv4_client::telemetry::{Sensor, Temperatures};
use serde::{Deserialize, Serialize};

/// How often a critical level is announced again while it holds.
pub const REMINDER: f64 = 300.0;
/// How long without throttling ends a throttling episode.
pub const QUIET: f64 = 30.0;
/// How long a hot sensor may give no reading before its level is dropped: a sensor that
/// went away must not keep requests refused for ever.
pub const LOST: f64 = 60.0;

/// A sensor's level: the client crate's word, which the status and the signals carry.
pub use dsv4_client::words::ThermalLevel as Level;

/// The thresholds, from `thermal:`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub warn: f64,
    pub critical: f64,
    pub hysteresis: f64,
}

/// What changed.
#[derive(Debug, Clone, PartialEq)]
pub enum ThermalEvent {
    /// `sensor` went to `level` (up or down), at `celsius`.
    Level {
        sensor: Sensor,
        level: Level,
        from: Level,
        celsius: f64,
    },
    /// Still critical: the reminder.
    StillCritical { sensor: Sensor, celsius: f64 },
    /// The hardware started throttling, for these reasons.
    ThrottleStart { kinds: Vec<String> },
    /// No throttling for [`QUIET`] seconds; `seconds`: how long the episode lasted.
    ThrottleEnd { seconds: f64 },
    /// A sensor above normal gave no reading for [`LOST`] seconds: its level is dropped.
    Lost { sensor: Sensor, from: Level },
}

/// One sensor's state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SensorState {
    pub level: Level,
    /// Unix time (s) since when it is at this level.
    pub since: Option<f64>,
    /// The highest temperature at this level (or above normal) since it was reached.
    pub peak: Option<f64>,
    #[serde(skip)]
    announced: f64,
    /// When it last gave a reading.
    #[serde(skip)]
    seen: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ThermalRules {
    /// The watched sensors' states (see [`Sensor::watched`]).
    pub sensors: BTreeMap<Sensor, SensorState>,
    /// Throttling since (unix s), while an episode lasts.
    pub throttling_since: Option<f64>,
    last_throttled: f64,
}

impl ThermalRules {
    /// The highest level of any sensor.
    pub fn level(&self) -> Level {
        self.sensors
            .values()
            .map(|s| s.level)
            .max()
            .unwrap_or_default()
    }

    /// The sensor at the highest level and its peak, for messages.
    pub fn hottest(&self) -> Option<(Sensor, f64)> {
        self.sensors
            .iter()
            .filter(|(_, s)| s.level > Level::Normal)
            .max_by(|a, b| a.1.level.cmp(&b.1.level))
            .and_then(|(sensor, s)| Some((*sensor, s.peak?)))
    }

    /// The events of a sample taken at `at`: the watched sensors' temperatures (one not
    /// measured changes nothing), and whether it saw throttling.
    pub fn step(
        &mut self,
        t: &Thresholds,
        temps: &Temperatures,
        throttled: Option<&[String]>,
        at: f64,
    ) -> Vec<ThermalEvent> {
        let mut events = Vec::new();
        for sensor in Sensor::watched() {
            let s = self.sensors.entry(sensor).or_default();
            let Some(c) = temps.get(sensor).filter(|c| c.is_finite()) else {
                if s.level > Level::Normal && at - s.seen >= LOST {
                    events.push(ThermalEvent::Lost {
                        sensor,
                        from: s.level,
                    });
                    *s = SensorState::default();
                }
                continue;
            };
            s.seen = at;
            let level = next_level(s.level, c, t);
            if level != s.level {
                events.push(ThermalEvent::Level {
                    sensor,
                    level,
                    from: s.level,
                    celsius: c,
                });
                s.level = level;
                s.since = Some(at);
                s.peak = (level > Level::Normal).then_some(c);
                s.announced = at;
            } else {
                if level > Level::Normal {
                    s.peak = Some(s.peak.map_or(c, |p| p.max(c)));
                }
                if level == Level::Critical && at - s.announced >= REMINDER {
                    s.announced = at;
                    events.push(ThermalEvent::StillCritical { sensor, celsius: c });
                }
            }
        }
        match (throttled, self.throttling_since) {
            (Some(kinds), None) => {
                self.throttling_since = Some(at);
                self.last_throttled = at;
                events.push(ThermalEvent::ThrottleStart {
                    kinds: kinds.to_vec(),
                });
            }
            (Some(_), Some(_)) => self.last_throttled = at,
            (None, Some(since)) if at - self.last_throttled >= QUIET => {
                self.throttling_since = None;
                events.push(ThermalEvent::ThrottleEnd {
                    seconds: self.last_throttled - since,
                });
            }
            _ => {}
        }
        events
    }
}

/// A sensor's next level at `c`: up at a threshold, down only below it less the hysteresis.
fn next_level(now: Level, c: f64, t: &Thresholds) -> Level {
    let up = if c >= t.critical {
        Level::Critical
    } else if c >= t.warn {
        Level::Warn
    } else {
        Level::Normal
    };
    if up >= now {
        return up;
    }
    // Going down: each level holds until below its threshold less the hysteresis.
    let holds = |threshold: f64| c >= threshold - t.hysteresis;
    match now {
        Level::Critical if holds(t.critical) => Level::Critical,
        Level::Critical | Level::Warn if holds(t.warn) => Level::Warn,
        _ => Level::Normal,
    }
}

/// The event in words, with the temperature, for logs, signals and notifications.
pub fn describe(e: &ThermalEvent, t: &Thresholds) -> String {
    match e {
        ThermalEvent::Level {
            sensor,
            level,
            from,
            celsius,
        } => match (level, from) {
            (Level::Critical, _) => format!(
                "{sensor} temperature {celsius:.1} C: critical (at or above {:.0} C)",
                t.critical
            ),
            (Level::Warn, Level::Normal) => format!(
                "{sensor} temperature {celsius:.1} C: hot (at or above {:.0} C)",
                t.warn
            ),
            (Level::Warn, _) => {
                format!("{sensor} temperature {celsius:.1} C: down from critical, still hot")
            }
            (Level::Normal, _) => format!(
                "{sensor} temperature {celsius:.1} C: back to normal (below {:.0} C)",
                t.warn - t.hysteresis
            ),
        },
        ThermalEvent::StillCritical { sensor, celsius } => {
            format!("{sensor} temperature {celsius:.1} C: still critical")
        }
        ThermalEvent::ThrottleStart { kinds } => {
            format!("the hardware is throttling ({})", kinds.join(", "))
        }
        ThermalEvent::ThrottleEnd { seconds } => {
            format!(
                "the hardware stopped throttling (it lasted {})",
                dsv4_client::duration::brief_secs(*seconds)
            )
        }
        ThermalEvent::Lost { sensor, from } => format!(
            "{sensor} temperature: no reading for {} while {}; its level is dropped \
             until it reads again",
            dsv4_client::duration::brief_secs(LOST),
            from.as_str()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Thresholds = Thresholds {
        warn: 85.0,
        critical: 95.0,
        hysteresis: 5.0,
    };

    /// A sample's temperatures: edge and Tctl.
    fn temps(edge: Option<f64>, tctl: Option<f64>) -> Temperatures {
        let mut t = Temperatures::default();
        t.set(Sensor::Edge, edge);
        t.set(Sensor::Tctl, tctl);
        t
    }

    /// Feeds the edge temperatures, one second apart; the levels announced.
    fn edge(readings: &[f64]) -> Vec<(Level, f64)> {
        let mut m = ThermalRules::default();
        let mut out = Vec::new();
        for (i, c) in readings.iter().enumerate() {
            for e in m.step(&T, &temps(Some(*c), None), None, i as f64) {
                if let ThermalEvent::Level { level, celsius, .. } = e {
                    out.push((level, celsius));
                }
            }
        }
        out
    }

    #[test]
    fn levels_rise_at_thresholds_and_clear_below_them_less_the_hysteresis() {
        use Level::*;
        for (temps, want) in [
            (&[70.0, 84.9, 85.0][..], vec![(Warn, 85.0)]),
            // Noise around a threshold: one event.
            (&[84.0, 85.1, 84.5, 85.3, 82.0, 86.0], vec![(Warn, 85.1)]),
            // Clears only below 80.
            (&[86.0, 80.0, 79.9], vec![(Warn, 86.0), (Normal, 79.9)]),
            (
                &[96.0, 94.0, 90.5, 89.9],
                vec![(Critical, 96.0), (Warn, 89.9)],
            ),
            // Straight from critical to normal.
            (&[96.0, 60.0], vec![(Critical, 96.0), (Normal, 60.0)]),
            (&[70.0, 95.0, 99.0, 96.0], vec![(Critical, 95.0)]),
        ] {
            assert_eq!(edge(temps), want, "{temps:?}");
        }
    }

    #[test]
    fn a_critical_level_is_recalled_every_few_minutes_and_its_peak_kept() {
        let mut m = ThermalRules::default();
        let mut reminders = 0;
        for i in 0..=700 {
            let c = 95.0 + f64::from(i % 3);
            for e in m.step(&T, &temps(Some(c), None), None, f64::from(i)) {
                if matches!(e, ThermalEvent::StillCritical { .. }) {
                    reminders += 1;
                }
            }
        }
        // At 300 s and 600 s.
        assert_eq!(reminders, 2);
        assert_eq!(m.sensors[&Sensor::Edge].peak, Some(97.0));
        assert_eq!(m.sensors[&Sensor::Edge].since, Some(0.0));
        assert_eq!(m.hottest(), Some((Sensor::Edge, 97.0)));
    }

    #[test]
    fn several_sensors_each_have_their_level() {
        let mut m = ThermalRules::default();
        let e = m.step(&T, &temps(Some(86.0), Some(96.0)), None, 0.0);
        assert_eq!(e.len(), 2);
        assert_eq!(m.level(), Level::Critical);
        assert_eq!(m.hottest(), Some((Sensor::Tctl, 96.0)));
        // An unmeasured sensor changes nothing.
        assert!(m.step(&T, &temps(None, None), None, 1.0).is_empty());
        let e = m.step(&T, &temps(Some(86.0), Some(70.0)), None, 2.0);
        assert_eq!(
            e,
            [ThermalEvent::Level {
                sensor: Sensor::Tctl,
                level: Level::Normal,
                from: Level::Critical,
                celsius: 70.0
            }]
        );
        assert_eq!(m.level(), Level::Warn);
    }

    #[test]
    fn throttling_starts_at_once_and_ends_after_a_quiet_interval() {
        let mut m = ThermalRules::default();
        let thermal = vec!["thermal".to_string()];
        let mut log = Vec::new();
        for (at, throttled) in [
            (0.0, false),
            (1.0, true),
            (2.0, true),
            (3.0, false),
            (20.0, true),
            (49.0, false),
            (51.0, false),
        ] {
            let kinds = throttled.then_some(thermal.as_slice());
            for e in m.step(&T, &temps(None, None), kinds, at) {
                log.push((at, e));
            }
        }
        assert_eq!(
            log,
            [
                (
                    1.0,
                    ThermalEvent::ThrottleStart {
                        kinds: thermal.clone()
                    }
                ),
                // Quiet from 20 s on; ended once 30 s passed.
                (51.0, ThermalEvent::ThrottleEnd { seconds: 19.0 }),
            ]
        );
    }

    #[test]
    fn a_hot_sensor_that_stops_reading_is_dropped_after_a_while() {
        let mut m = ThermalRules::default();
        m.step(&T, &temps(Some(97.0), None), None, 0.0);
        assert_eq!(m.level(), Level::Critical);
        assert!(m.step(&T, &temps(None, None), None, 59.0).is_empty());
        let e = m.step(&T, &temps(None, None), None, 60.0);
        assert_eq!(
            e,
            [ThermalEvent::Lost {
                sensor: Sensor::Edge,
                from: Level::Critical
            }]
        );
        assert_eq!(m.level(), Level::Normal);
        assert!(describe(&e[0], &T).starts_with("edge temperature: no reading for 1m while"));
        // A cool sensor that stops reading says nothing.
        assert!(m.step(&T, &temps(None, None), None, 200.0).is_empty());
    }

    #[test]
    fn events_say_the_temperature() {
        let e = ThermalEvent::Level {
            sensor: Sensor::Edge,
            level: Level::Critical,
            from: Level::Warn,
            celsius: 96.25,
        };
        assert_eq!(
            describe(&e, &T),
            "edge temperature 96.2 C: critical (at or above 95 C)"
        );
        let e = ThermalEvent::Level {
            sensor: Sensor::Edge,
            level: Level::Normal,
            from: Level::Warn,
            celsius: 78.0,
        };
        assert_eq!(
            describe(&e, &T),
            "edge temperature 78.0 C: back to normal (below 80 C)"
        );
    }
}
