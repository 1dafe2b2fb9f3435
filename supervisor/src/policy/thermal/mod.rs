//! The thermal policy: follows the monitor's samples through the rules (`rules.rs`), and for
//! each event logs it, sends it out as the D-Bus signal `ThermalEvent`, shows it in the
//! status, and acts as `thermal.on_critical` says.
//!
//! Owns: the rules' state and the status it publishes. Must not: refuse requests or stop the
//! engine itself: it tells the lifecycle (`Heat`, `Cooled`), whose rules do both.

pub mod rules;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4_client::telemetry::Sensor;
use dsv4_client::words::ThermalSignal;
use dsv4_client::{SensorThermal, ThermalStatus};
use tokio::sync::{broadcast, watch};

use crate::config::{Config, OnCritical, ThermalSettings};
use crate::lifecycle::Handle;
use crate::observe::monitor::Telemetry;

pub use rules::{Level, ThermalEvent, Thresholds};

/// With `on_critical: stop`, how long in-flight requests may go on before the engine stops.
pub const STOP_DRAIN: Duration = Duration::from_secs(10);

/// Events not yet taken by a slow listener.
const BACKLOG: usize = 32;

/// One event as it goes out on D-Bus (and to the dashboard).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Signal {
    pub level: ThermalSignal,
    pub sensor: String,
    pub celsius: f64,
    pub message: String,
}

/// The policy's outputs: its status and its signals. Cheap to clone.
#[derive(Clone)]
pub struct ThermalPolicy {
    status: watch::Receiver<ThermalStatus>,
    signals: broadcast::Sender<Signal>,
    /// The events that still stand (a sensor above normal, throttling under way), by what
    /// they are about: a listener that comes later (the D-Bus interface, once the daemon has
    /// its name) hears them first, so a machine hot at the daemon's start is announced.
    standing: Arc<Mutex<BTreeMap<&'static str, Signal>>>,
}

impl ThermalPolicy {
    /// A policy that never sees a sample (for tests and tools that need a handle).
    pub fn none() -> ThermalPolicy {
        let (_, status) = watch::channel(ThermalStatus::default());
        ThermalPolicy {
            status,
            signals: broadcast::channel(1).0,
            standing: Default::default(),
        }
    }

    pub fn status(&self) -> ThermalStatus {
        self.status.borrow().clone()
    }

    /// The events that still stand, then every event from now on: nothing is missed
    /// between the two, since events are recorded and sent under the same lock.
    pub fn subscribe(&self) -> (Vec<Signal>, broadcast::Receiver<Signal>) {
        let standing = self.standing.lock().unwrap_or_else(|p| p.into_inner());
        (
            standing.values().cloned().collect(),
            self.signals.subscribe(),
        )
    }
}

fn thresholds(t: &ThermalSettings) -> Thresholds {
    Thresholds {
        warn: t.warn,
        critical: t.critical,
        hysteresis: t.hysteresis,
    }
}

/// The signal for an event.
fn signal(e: &ThermalEvent, t: &Thresholds) -> Signal {
    let (level, sensor, celsius) = match e {
        ThermalEvent::Level {
            sensor,
            level,
            celsius,
            ..
        } => (ThermalSignal::from(*level), sensor.label(), *celsius),
        ThermalEvent::StillCritical { sensor, celsius } => {
            (ThermalSignal::Critical, sensor.label(), *celsius)
        }
        ThermalEvent::ThrottleStart { .. } => (ThermalSignal::Throttling, "throttle", f64::NAN),
        ThermalEvent::ThrottleEnd { .. } => (ThermalSignal::ThrottlingEnded, "throttle", f64::NAN),
        ThermalEvent::Lost { sensor, .. } => (ThermalSignal::Normal, sensor.label(), f64::NAN),
    };
    Signal {
        level,
        sensor: sensor.into(),
        celsius,
        message: rules::describe(e, t),
    }
}

/// What `on_critical` does, in words, for the status and the messages.
fn action(on: OnCritical) -> &'static str {
    match on {
        OnCritical::Notify => "only notifies (thermal.on_critical: notify)",
        OnCritical::StopWhenIdle => {
            "new requests refused, the engine stopped once no request is in flight"
        }
        OnCritical::Stop => {
            "requests refused, the engine stopped (in-flight requests cut after 10 s)"
        }
    }
}

/// Event `e` (told as `s`) in the journal, and in what stands now (`standing`: by sensor,
/// and `throttle`), which a new D-Bus listener hears first.
fn stand(standing: &Mutex<BTreeMap<&'static str, Signal>>, e: &ThermalEvent, s: &Signal) {
    match e {
        ThermalEvent::Level {
            level: Level::Normal,
            ..
        }
        | ThermalEvent::ThrottleEnd { .. } => tracing::info!("thermal: {}", s.message),
        _ => tracing::warn!("thermal: {}", s.message),
    }
    let mut now = standing.lock().unwrap_or_else(|p| p.into_inner());
    match e {
        ThermalEvent::Level {
            sensor,
            level: Level::Normal,
            ..
        }
        | ThermalEvent::Lost { sensor, .. } => {
            now.remove(sensor.label());
        }
        ThermalEvent::Level { sensor, .. } | ThermalEvent::StillCritical { sensor, .. } => {
            now.insert(sensor.label(), s.clone());
        }
        ThermalEvent::ThrottleStart { .. } => {
            now.insert("throttle", s.clone());
        }
        ThermalEvent::ThrottleEnd { .. } => {
            now.remove("throttle");
        }
    }
}

/// The status the rules' `state` shows (`critical`: with `on_critical`'s action).
fn status_of(
    state: &rules::ThermalRules,
    critical: bool,
    on_critical: OnCritical,
) -> ThermalStatus {
    let sensors = state
        .sensors
        .iter()
        .map(|(sensor, s)| SensorThermal {
            sensor: sensor.label().to_string(),
            level: s.level,
            since: s.since,
            peak: s.peak,
        })
        .collect();
    ThermalStatus {
        level: state.level(),
        sensors,
        throttling_since: state.throttling_since,
        action: critical.then(|| action(on_critical).to_string()),
    }
}

/// Starts the policy on the current runtime.
pub fn spawn(
    config: watch::Receiver<Arc<Config>>,
    telemetry: Telemetry,
    lifecycle: Handle,
) -> ThermalPolicy {
    let (status_tx, status) = watch::channel(ThermalStatus {
        level: Level::Normal,
        ..ThermalStatus::default()
    });
    let signals = broadcast::channel(BACKLOG).0;
    let out = signals.clone();
    let standing: Arc<Mutex<BTreeMap<&'static str, Signal>>> = Default::default();
    let record = standing.clone();
    tokio::spawn(async move {
        let mut samples = telemetry.watch();
        let mut state = rules::ThermalRules::default();
        // Whether the lifecycle was told it is too hot.
        let mut hot = false;
        while samples.changed().await.is_ok() {
            let Some(sample) = samples.borrow_and_update().clone() else {
                continue;
            };
            let cfg = config.borrow().supervisor.thermal.clone();
            let t = thresholds(&cfg);
            let kinds: Vec<String> = sample
                .throttle
                .kinds
                .iter()
                .map(|k| k.as_str().to_string())
                .collect();
            let throttled = sample.throttle.active.then_some(kinds.as_slice());
            for e in state.step(&t, &sample.temperatures, throttled, sample.at) {
                let s = signal(&e, &t);
                stand(&record, &e, &s);
                let _ = out.send(s);
            }
            let critical = state.level() == Level::Critical;
            let acts = cfg.on_critical != OnCritical::Notify;
            if critical && acts && !hot {
                hot = true;
                let (sensor, peak) = state.hottest().unwrap_or((Sensor::Edge, f64::NAN));
                let message = format!("{sensor} at {peak:.1} C, critical at {:.0} C", t.critical);
                let drain = (cfg.on_critical == OnCritical::Stop).then_some(STOP_DRAIN);
                tracing::warn!("thermal: {message}: {}", action(cfg.on_critical));
                lifecycle.heat(Some((message, drain))).await;
            } else if hot && (!critical || !acts) {
                hot = false;
                if critical {
                    // A reload made on_critical notify: nothing is refused any more.
                    tracing::info!("thermal: on_critical is notify now: requests are served again");
                } else {
                    tracing::info!("thermal: cooled down: requests are served again");
                }
                lifecycle.heat(None).await;
            }
            status_tx.send_replace(status_of(&state, critical, cfg.on_critical));
        }
    });
    ThermalPolicy {
        status,
        signals,
        standing,
    }
}
