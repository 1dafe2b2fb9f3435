//! `GET /metrics`: the supervisor's own figures and the host's latest sample, in the
//! OpenMetrics text format (which Prometheus reads), through `prometheus-client`.
//!
//! Owns: the metric names and what each is drawn from. Must not: reach the engine; a scraper
//! polling every few seconds must neither start an idle engine nor keep it running. Each
//! scrape builds its registry from snapshots (the lifecycle's status, the request
//! statistics, the monitor's latest sample), so that nothing here holds state of its own.
//! A figure the host does not report has no line.

use dsv4_client::kv::KvStatus;
use dsv4_client::telemetry::{Sample, Sensor, ThrottleKind};
use dsv4_client::words::Phase;
use dsv4_client::{Hold, InProgress, PowerStatus, State, ThermalStatus, WorkerStatus};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::lifecycle::Status;
use crate::observe::stats::{ApiProtocol, Report, Summary};

/// What `GET /metrics` answers with.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProfileLabel {
    profile: String,
}

/// An API by its name (`ApiProtocol::as_str`): three values, whatever the requests.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProtocolLabel {
    protocol: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SensorLabel {
    sensor: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SensorName {
    sensor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LevelLabel {
    level: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

/// The temperature family's help: each sensor's label and where it is read.
fn temperature_help() -> String {
    let sensors: Vec<String> = Sensor::ALL
        .iter()
        .map(|s| format!("{} ({})", s.label(), s.about().source))
        .collect();
    format!("Temperatures: {}.", sensors.join(", "))
}

/// Registers `metric` under `name` and hands it back to be set.
fn add<
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Clone
        + Send
        + Sync
        + std::fmt::Debug
        + 'static,
>(
    reg: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    // prometheus-client ends each help text with a full stop of its own.
    reg.register(name, help.trim_end_matches('.'), metric.clone());
    metric
}

/// What is under way: the requests in flight, and the boxes the engine spans.
#[derive(Debug, Default, Clone, Copy)]
pub struct Live<'a> {
    pub in_progress: &'a [InProgress],
    /// This box's engine's workers (a coordinator's).
    pub workers: &'a [WorkerStatus],
    /// The coordinators that hold this box.
    pub holds: &'a [Hold],
}

pub fn render(
    status: &Status,
    requests: &Report,
    sample: Option<&Sample>,
    power: &PowerStatus,
    thermal: &ThermalStatus,
    kv: &KvStatus,
    live: Live,
) -> String {
    let mut reg = Registry::default();
    engine(&mut reg, status);
    request_metrics(&mut reg, requests);
    in_progress_metrics(&mut reg, live.in_progress);
    box_metrics(&mut reg, live.workers, live.holds);
    host(&mut reg, sample);
    power_metrics(&mut reg, power);
    kv_metrics(&mut reg, kv);
    let levels = add(
        &mut reg,
        "dsv4_thermal_level",
        "Thermal level per sensor: 0 normal, 1 warn, 2 critical.",
        Family::<SensorName, Gauge>::default(),
    );
    for s in &thermal.sensors {
        let n = i64::from(s.level.number());
        levels
            .get_or_create(&SensorName {
                sensor: s.sensor.clone(),
            })
            .set(n);
    }
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}

fn kv_metrics(reg: &mut Registry, kv: &KvStatus) {
    let bytes = add(
        reg,
        "dsv4_kv_checkpoint_bytes",
        "Bytes of the newest KV checkpoint each profile saved.",
        Family::<ProfileLabel, Gauge>::default(),
    );
    let save = add(
        reg,
        "dsv4_kv_save_seconds",
        "How long the last KV checkpoint save of each profile took.",
        Family::<ProfileLabel, FloatGauge>::default(),
    );
    let restore = add(
        reg,
        "dsv4_kv_restore_seconds",
        "How long the last KV checkpoint restore of each profile took.",
        Family::<ProfileLabel, FloatGauge>::default(),
    );
    let reused = add(
        reg,
        "dsv4_kv_restore_reused_tokens",
        "Of each profile's last KV checkpoint restore, the tokens the engine took from the \
         cache for the first request that shared them.",
        Family::<ProfileLabel, Gauge>::default(),
    );
    for p in &kv.profiles {
        let label = ProfileLabel {
            profile: p.profile.clone(),
        };
        let on_disk = p.checkpoint.as_ref().map_or(p.dir_bytes, |c| c.bytes);
        bytes
            .get_or_create(&label)
            .set(i64::try_from(on_disk).unwrap_or(i64::MAX));
        if let Some(step) = &p.last_save {
            save.get_or_create(&label).set(step.seconds);
        }
        if let Some(step) = &p.last_restore {
            restore.get_or_create(&label).set(step.seconds);
            if let Some(c) = &step.check {
                reused
                    .get_or_create(&label)
                    .set(i64::try_from(c.reused).unwrap_or(i64::MAX));
            }
        }
    }
    add(
        reg,
        "dsv4_kv_restore_misses",
        "KV checkpoint restores the engine did not use: the first request that shared the \
         restored tokens had less than half of them taken from the cache.",
        Counter::<u64>::default(),
    )
    .inc_by(kv.restore_misses_total);
    // OpenMetrics adds `_total` to a counter's samples.
    add(
        reg,
        "dsv4_kv_restored_tokens",
        "Tokens that KV checkpoint restores put back into engines (each restore counted once).",
        Counter::<u64>::default(),
    )
    .inc_by(kv.restored_tokens_total);
}

fn power_metrics(reg: &mut Registry, power: &PowerStatus) {
    add(
        reg,
        "dsv4_power_profile_held",
        "1 while dsv4d holds a power-profiles-daemon profile for the engine.",
        Gauge::<i64>::default(),
    )
    .set(i64::from(power.held));
    let levels = add(
        reg,
        "dsv4_gpu_performance_level",
        "The GPU's power_dpm_force_performance_level: 1 for the current one.",
        Family::<LevelLabel, Gauge>::default(),
    );
    if let Some(level) = &power.gpu_level {
        levels
            .get_or_create(&LevelLabel {
                level: level.to_string(),
            })
            .set(1);
    }
}

fn engine(reg: &mut Registry, status: &Status) {
    let states = add(
        reg,
        "dsv4_engine_state",
        "Engine lifecycle state: 1 for the current one.",
        Family::<StateLabel, Gauge>::default(),
    );
    for s in State::ALL {
        states
            .get_or_create(&StateLabel { state: s.as_str() })
            .set(i64::from(status.state == s));
    }
    let profile = add(
        reg,
        "dsv4_active_profile",
        "The active profile: 1 for it.",
        Family::<ProfileLabel, Gauge>::default(),
    );
    profile
        .get_or_create(&ProfileLabel {
            profile: status.profile.clone(),
        })
        .set(1);
    let int = |reg: &mut Registry, name: &str, help: &str, v: u64| {
        add(reg, name, help, Gauge::<i64>::default()).set(i64::try_from(v).unwrap_or(i64::MAX));
    };
    int(
        reg,
        "dsv4_in_flight_requests",
        "Requests holding a lease on the engine.",
        u64::from(status.in_flight),
    );
    int(
        reg,
        "dsv4_waiting_requests",
        "Requests waiting for the engine to be ready.",
        status.waiting as u64,
    );
    int(
        reg,
        "dsv4_start_failures",
        "Consecutive failed engine starts.",
        u64::from(status.failures),
    );
    int(
        reg,
        "dsv4_engine_generation",
        "Engines started since the daemon started.",
        status.generation.unwrap_or(0),
    );
}

/// The requests in flight by phase (every phase, 0 included), and the tokens of the
/// prefills under way as far as their engines tell.
fn in_progress_metrics(reg: &mut Registry, in_progress: &[InProgress]) {
    let phases = add(
        reg,
        "dsv4_requests_in_progress",
        "Requests in flight by phase: waiting, loading, prefill, decoding, ending.",
        Family::<PhaseLabel, Gauge>::default(),
    );
    for phase in Phase::ALL {
        let n = in_progress.iter().filter(|r| r.phase == *phase).count();
        phases
            .get_or_create(&PhaseLabel {
                phase: phase.as_str(),
            })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    let tokens = add(
        reg,
        "dsv4_prefill_tokens",
        "New prompt tokens of the prefills under way whose engine tells how far they got: \
         done so far, and in all.",
        Family::<StateLabel, Gauge>::default(),
    );
    let prefills = in_progress
        .iter()
        .filter(|r| r.phase == Phase::Prefill)
        .filter_map(|r| r.prefill.as_ref());
    let (done, total) = prefills.fold((0u64, 0u64), |(d, t), p| {
        (d.saturating_add(p.done), t.saturating_add(p.total))
    });
    for (state, v) in [("done", done), ("total", total)] {
        tokens
            .get_or_create(&StateLabel { state })
            .set(i64::try_from(v).unwrap_or(i64::MAX));
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabel {
    #[prometheus(flatten)]
    host: BoxLabel,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BoxLabel {
    r#box: String,
}

/// The states a worker's hold goes through, as `/status` names them.
const WORKER_STATES: [&str; 5] = ["connecting", "waking", "loading", "serving", "lost"];

/// A coordinator's workers, each in one state (1) and not in the others (0), with their
/// engines' load time; and how many coordinators hold this box.
fn box_metrics(reg: &mut Registry, workers: &[WorkerStatus], holds: &[Hold]) {
    let states = add(
        reg,
        "dsv4_worker_state",
        "Each worker box of this box's engine: 1 for its state (connecting, waking, loading, \
         serving, lost), 0 for the others.",
        Family::<WorkerLabel, Gauge>::default(),
    );
    let loads = add(
        reg,
        "dsv4_worker_load_seconds",
        "How long each worker box's engine took to be ready, once it was.",
        Family::<BoxLabel, FloatGauge>::default(),
    );
    for w in workers {
        let host = BoxLabel {
            r#box: w.host.clone(),
        };
        for state in WORKER_STATES {
            let label = WorkerLabel {
                host: host.clone(),
                state,
            };
            states
                .get_or_create(&label)
                .set(i64::from(w.state == state));
        }
        if let Some(s) = w.load_seconds {
            loads.get_or_create(&host).set(s);
        }
    }
    worker_samples(reg, workers);
    add(
        reg,
        "dsv4_holds",
        "Coordinators on other boxes that hold this box's profile.",
        Gauge::<i64>::default(),
    )
    .set(i64::try_from(holds.len()).unwrap_or(i64::MAX));
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BoxSensorLabel {
    r#box: String,
    sensor: &'static str,
}

/// What each worker box last said of itself: its GTT in use, temperatures and SoC power.
fn worker_samples(reg: &mut Registry, workers: &[WorkerStatus]) {
    let gtt = add(
        reg,
        "dsv4_worker_gtt_used_bytes",
        "Each worker box's GTT in use, as it last said.",
        Family::<BoxLabel, Gauge>::default(),
    );
    let temperatures = add(
        reg,
        "dsv4_worker_temperature_celsius",
        "Each worker box's temperatures by sensor (as dsv4_temperature_celsius), as it last \
         said.",
        Family::<BoxSensorLabel, FloatGauge>::default(),
    );
    let power = add(
        reg,
        "dsv4_worker_power_watts",
        "Each worker box's SoC power (as dsv4_power_watts{source=\"soc\"}), as it last said.",
        Family::<BoxLabel, FloatGauge>::default(),
    );
    for w in workers {
        let Some(s) = &w.telemetry else { continue };
        let host = BoxLabel {
            r#box: w.host.clone(),
        };
        let used = s.gpu.as_ref().and_then(|g| g.memory.gtt_used);
        if let Some(used) = used {
            gtt.get_or_create(&host)
                .set(i64::try_from(used).unwrap_or(i64::MAX));
        }
        for (sensor, v) in s.temperatures.read() {
            let label = BoxSensorLabel {
                r#box: w.host.clone(),
                sensor: sensor.label(),
            };
            temperatures.get_or_create(&label).set(v);
        }
        if let Some(soc) = s.power.soc {
            power.get_or_create(&host).set(soc);
        }
    }
}

/// The counters of the requests, each by profile and, in a family of its own (so that a sum
/// over either counts each request once), by API.
const REQUEST_COUNTERS: [(&str, &str); 4] = [
    (
        "requests",
        "Finished requests whose answers told their tokens",
    ),
    ("prompt_tokens", "New (uncached) prompt tokens"),
    (
        "cached_prompt_tokens",
        "Prompt tokens served from the engine's cache",
    ),
    ("generated_tokens", "Generated tokens"),
];

fn counter_values(t: &Summary) -> [u64; 4] {
    [
        t.requests,
        t.prompt_tokens,
        t.cached_tokens,
        t.generated_tokens,
    ]
}

const REQUEST_RATES: [(&str, &str); 3] = [
    (
        "decode_tokens_per_second",
        "Token-weighted decode rate over all requests with times",
    ),
    (
        "prefill_tokens_per_second",
        "Token-weighted prefill rate over all requests with times",
    ),
    (
        "long_prompt_prefill_tokens_per_second",
        "Token-weighted prefill rate, prompts of 1024+ new tokens",
    ),
];

fn rate_values(t: &Summary) -> [Option<f64>; 3] {
    [t.decode_tok_s, t.prefill_tok_s, t.long_prompt_prefill_tok_s]
}

fn request_metrics(reg: &mut Registry, requests: &Report) {
    // Counters: OpenMetrics names them without `_total` and adds it to each sample.
    for (which, (name, help)) in REQUEST_COUNTERS.into_iter().enumerate() {
        let family = add(
            reg,
            &format!("dsv4_{name}"),
            &format!("{help}, by profile."),
            Family::<ProfileLabel, Counter>::default(),
        );
        for (profile, t) in &requests.by_profile {
            family
                .get_or_create(&ProfileLabel {
                    profile: profile.clone(),
                })
                .inc_by(counter_values(t)[which]);
        }
    }
    for (i, (name, help)) in REQUEST_RATES.into_iter().enumerate() {
        let family = add(
            reg,
            &format!("dsv4_{name}"),
            &format!("{help}, by profile."),
            Family::<ProfileLabel, FloatGauge>::default(),
        );
        for (profile, t) in &requests.by_profile {
            if let Some(v) = rate_values(t)[i] {
                family
                    .get_or_create(&ProfileLabel {
                        profile: profile.clone(),
                    })
                    .set(v);
            }
        }
    }
    api_metrics(reg, requests);
}

/// The same figures by API (`protocol`: openai, anthropic, responses): each counter with all
/// three (0 for an API without requests), each rate where known, and the requests that
/// dsv4d's clock timed (their answers had no engine timings: their rates are the clock's).
fn api_metrics(reg: &mut Registry, requests: &Report) {
    let none = Summary::default();
    let totals = ApiProtocol::ALL.map(|p| {
        let label = ProtocolLabel {
            protocol: p.as_str(),
        };
        (label, requests.by_protocol.get(&p).unwrap_or(&none))
    });
    for (which, (name, help)) in REQUEST_COUNTERS.into_iter().enumerate() {
        let family = add(
            reg,
            &format!("dsv4_api_{name}"),
            &format!("{help}, by API."),
            Family::<ProtocolLabel, Counter>::default(),
        );
        for (label, t) in &totals {
            family.get_or_create(label).inc_by(counter_values(t)[which]);
        }
    }
    let clock = add(
        reg,
        "dsv4_api_clock_timed_requests",
        "Requests timed by dsv4d's clock (their answers had no engine timings), by API.",
        Family::<ProtocolLabel, Counter>::default(),
    );
    for (label, t) in &totals {
        clock.get_or_create(label).inc_by(t.clock_timed_requests);
    }
    for (i, (name, help)) in REQUEST_RATES.into_iter().enumerate() {
        let family = add(
            reg,
            &format!("dsv4_api_{name}"),
            &format!("{help}, by API (dsv4d's clock where the engine gave no timings)."),
            Family::<ProtocolLabel, FloatGauge>::default(),
        );
        for (label, t) in &totals {
            if let Some(v) = rate_values(t)[i] {
                family.get_or_create(label).set(v);
            }
        }
    }
}

/// A gauge without labels, registered only when `value` is known: a figure the host does
/// not report has no family at all (an unset gauge would read 0, a false figure).
fn gauge_opt(reg: &mut Registry, name: &str, help: &str, value: Option<f64>) {
    if let Some(v) = value {
        add(reg, name, help, FloatGauge::default()).set(v);
    }
}

fn host(reg: &mut Registry, sample: Option<&Sample>) {
    let none = Sample::default();
    let s = sample.unwrap_or(&none);
    let gpu = s.gpu.as_ref();
    let bytes = |v: Option<u64>| v.map(|b| b as f64);
    let figures = [
        (
            "dsv4_gtt_used_bytes",
            "GPU memory in GTT (system RAM mapped for the GPU) in use.",
            bytes(gpu.and_then(|g| g.memory.gtt_used)),
        ),
        (
            "dsv4_gtt_total_bytes",
            "GTT the GPU may use (ttm.pages_limit x 4096 on an APU).",
            bytes(gpu.and_then(|g| g.memory.gtt_total)),
        ),
        (
            "dsv4_vram_used_bytes",
            "GPU memory in VRAM (on an APU, the firmware's carve-out) in use.",
            bytes(gpu.and_then(|g| g.memory.vram_used)),
        ),
        (
            "dsv4_vram_total_bytes",
            "VRAM of the GPU.",
            bytes(gpu.and_then(|g| g.memory.vram_total)),
        ),
        (
            "dsv4_memory_total_bytes",
            "MemTotal of /proc/meminfo.",
            bytes(s.memory.map(|m| m.total)),
        ),
        (
            "dsv4_memory_available_bytes",
            "MemAvailable of /proc/meminfo: what a new workload can take without swapping.",
            bytes(s.memory.map(|m| m.available)),
        ),
        (
            "dsv4_swap_total_bytes",
            "SwapTotal of /proc/meminfo.",
            bytes(s.memory.map(|m| m.swap_total)),
        ),
        (
            "dsv4_swap_free_bytes",
            "SwapFree of /proc/meminfo.",
            bytes(s.memory.map(|m| m.swap_free)),
        ),
        (
            "dsv4_gpu_busy_ratio",
            "gpu_busy_percent as a ratio (0 to 1).",
            gpu.and_then(|g| g.busy_percent).map(|p| p / 100.0),
        ),
        (
            "dsv4_engine_rss_bytes",
            "Resident memory of the engine process (its GTT is counted above).",
            bytes(s.engine.map(|e| e.rss_bytes)),
        ),
        (
            "dsv4_throttling",
            "1 when the hardware throttled in the last sampling interval.",
            s.throttle
                .supported
                .then_some(f64::from(u8::from(s.throttle.active))),
        ),
        (
            "dsv4_sample_timestamp_seconds",
            "Unix time of the latest sample of the host.",
            sample.map(|s| s.at),
        ),
    ];
    for (name, help, value) in figures {
        gauge_opt(reg, name, help, value);
    }
    sensors(reg, s);
    engine_cpu(reg, s);
}

/// The host's labelled families: temperatures, power, memory pressure, throttling.
fn sensors(reg: &mut Registry, s: &Sample) {
    let temperatures = add(
        reg,
        "dsv4_temperature_celsius",
        &temperature_help(),
        Family::<SensorLabel, FloatGauge>::default(),
    );
    for (sensor, v) in s.temperatures.read() {
        temperatures
            .get_or_create(&SensorLabel {
                sensor: sensor.label(),
            })
            .set(v);
    }
    let p = &s.power;
    let power = add(
        reg,
        "dsv4_power_watts",
        "Power: soc (amdgpu hwmon; on an APU the whole chip), socket, apu and gfx \
         (gpu_metrics).",
        Family::<SourceLabel, FloatGauge>::default(),
    );
    for (source, v) in [
        ("soc", p.soc),
        ("socket", p.socket),
        ("apu", p.apu),
        ("gfx", p.gfx),
    ] {
        if let Some(v) = v {
            power.get_or_create(&SourceLabel { source }).set(v);
        }
    }
    let pressure = add(
        reg,
        "dsv4_memory_pressure_ratio",
        "Share of the last 10 s in which some (or all) tasks waited for memory (PSI avg10).",
        Family::<KindLabel, FloatGauge>::default(),
    );
    if let Some(psi) = s.pressure {
        for (kind, v) in [("some", psi.some_avg10), ("full", psi.full_avg10)] {
            pressure.get_or_create(&KindLabel { kind }).set(v / 100.0);
        }
    }
    let throttle = add(
        reg,
        "dsv4_throttle_seconds",
        "Seconds in which the hardware throttled, by kind, since the daemon started.",
        Family::<KindLabel, FloatCounter>::default(),
    );
    if s.throttle.supported {
        for kind in ThrottleKind::ALL {
            throttle
                .get_or_create(&KindLabel {
                    kind: kind.as_str(),
                })
                .inc_by(s.throttle.seconds.get(kind));
        }
    }
}

/// The engine process's CPU time.
fn engine_cpu(reg: &mut Registry, s: &Sample) {
    let cpu = add(
        reg,
        "dsv4_engine_cpu_seconds",
        "CPU time (user and system) of the engine process.",
        Family::<KindLabel, FloatCounter>::default(),
    );
    if let Some(e) = s.engine {
        cpu.get_or_create(&KindLabel { kind: "all" })
            .inc_by(e.cpu_ms as f64 / 1000.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::stats::{Stats, Timings};
    use dsv4_client::telemetry::*;
    use dsv4_client::words::ThermalLevel;

    #[test]
    fn kv_checkpoint_figures_are_exported() {
        use dsv4_client::kv::{KvCheckpoint, KvProfile, KvStep, RestoreCheck};
        let kv = KvStatus {
            profiles: vec![KvProfile {
                profile: "320k".into(),
                checkpoint: Some(KvCheckpoint {
                    bytes: 1234,
                    ..KvCheckpoint::default()
                }),
                last_save: Some(KvStep {
                    seconds: 2.5,
                    ..KvStep::default()
                }),
                last_restore: Some(KvStep {
                    seconds: 0.75,
                    check: Some(RestoreCheck {
                        reused: 2799,
                        shared: 2800,
                        ..RestoreCheck::default()
                    }),
                    ..KvStep::default()
                }),
                ..KvProfile::default()
            }],
            restored_tokens_total: 2802,
            restore_misses_total: 3,
        };
        let text = render(
            &Status::stopped("320k"),
            &Stats::default().report(0),
            None,
            &PowerStatus::default(),
            &ThermalStatus::default(),
            &kv,
            Live::default(),
        );
        let got = lines(&text);
        for line in [
            "dsv4_kv_checkpoint_bytes{profile=\"320k\"} 1234",
            "dsv4_kv_save_seconds{profile=\"320k\"} 2.5",
            "dsv4_kv_restore_seconds{profile=\"320k\"} 0.75",
            "dsv4_kv_restored_tokens_total 2802",
            "dsv4_kv_restore_reused_tokens{profile=\"320k\"} 2799",
            "dsv4_kv_restore_misses_total 3",
        ] {
            assert!(got.contains(&line), "no {line} in\n{text}");
        }
    }

    #[test]
    fn requests_in_flight_are_counted_by_phase_with_their_prefill_tokens() {
        use dsv4_client::PrefillProgress;
        let flight = |phase, prefill: Option<(u64, u64)>| InProgress {
            id: 1,
            path: "/v1/chat/completions".into(),
            stream: true,
            profile: None,
            age_s: 1.0,
            phase,
            waiting_for: None,
            loading_s: None,
            loading_about_s: None,
            prefill: prefill.map(|(done, total)| PrefillProgress {
                done,
                total,
                cached: 7,
                rate: None,
                left_s: None,
            }),
            tokens: 0,
        };
        let render_with = |flights: &[InProgress]| {
            render(
                &Status::stopped("320k"),
                &Stats::default().report(0),
                None,
                &PowerStatus::default(),
                &ThermalStatus::default(),
                &KvStatus::default(),
                Live {
                    in_progress: flights,
                    ..Live::default()
                },
            )
        };
        let text = render_with(&[
            flight(Phase::Prefill, Some((4096, 262_144))),
            flight(Phase::Prefill, Some((100, 1000))),
            // A prefill its engine does not tell: counted, with no tokens.
            flight(Phase::Prefill, None),
            flight(Phase::Waiting, None),
            flight(Phase::Decoding, None),
        ]);
        let got = lines(&text);
        for line in [
            "# HELP dsv4_requests_in_progress Requests in flight by phase: waiting, loading, \
             prefill, decoding, ending.",
            "# TYPE dsv4_requests_in_progress gauge",
            "dsv4_requests_in_progress{phase=\"waiting\"} 1",
            "dsv4_requests_in_progress{phase=\"loading\"} 0",
            "dsv4_requests_in_progress{phase=\"prefill\"} 3",
            "dsv4_requests_in_progress{phase=\"decoding\"} 1",
            "dsv4_requests_in_progress{phase=\"ending\"} 0",
            "# TYPE dsv4_prefill_tokens gauge",
            "dsv4_prefill_tokens{state=\"done\"} 4196",
            "dsv4_prefill_tokens{state=\"total\"} 263144",
        ] {
            assert!(got.contains(&line), "missing {line:?} in\n{text}");
        }
        // None in flight: every phase at 0, and no tokens.
        let text = render_with(&[]);
        let got = lines(&text);
        for phase in Phase::ALL {
            let line = format!("dsv4_requests_in_progress{{phase=\"{phase}\"}} 0");
            assert!(got.contains(&line.as_str()), "missing {line:?} in\n{text}");
        }
        assert!(
            got.contains(&"dsv4_prefill_tokens{state=\"done\"} 0"),
            "{text}"
        );
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    #[test]
    fn a_coordinators_workers_and_a_workers_holds_are_gauges() {
        let worker = |host: &str, state: &str, load: Option<f64>| WorkerStatus {
            host: host.into(),
            at: format!("{host}:8090"),
            profile: "rpc".into(),
            state: state.into(),
            since: 0.0,
            load_seconds: load,
            error: None,
            telemetry: None,
            thermal: None,
        };
        let mut said = Sample {
            gpu: Some(dsv4_client::telemetry::Gpu {
                memory: dsv4_client::telemetry::GpuMemory {
                    gtt_used: Some(40 << 30),
                    ..Default::default()
                },
                ..Default::default()
            }),
            ..Sample::default()
        };
        said.temperatures
            .set(dsv4_client::telemetry::Sensor::Edge, Some(61.5));
        said.power.soc = Some(85.0);
        let workers = [
            WorkerStatus {
                telemetry: Some(said),
                ..worker("10.77.0.2", "serving", Some(1.5))
            },
            worker("10.77.0.3", "waking", None),
        ];
        let holds = [Hold {
            from: "10.77.0.9".into(),
            profile: "rpc".into(),
            since: 0.0,
        }];
        let live = Live {
            workers: &workers,
            holds: &holds,
            ..Live::default()
        };
        let text = render(
            &Status::stopped("320k"),
            &Stats::default().report(0),
            None,
            &PowerStatus::default(),
            &ThermalStatus::default(),
            &KvStatus::default(),
            live,
        );
        let got = lines(&text);
        for line in [
            "dsv4_worker_state{box=\"10.77.0.2\",state=\"serving\"} 1",
            "dsv4_worker_state{box=\"10.77.0.2\",state=\"lost\"} 0",
            "dsv4_worker_state{box=\"10.77.0.3\",state=\"waking\"} 1",
            "dsv4_worker_state{box=\"10.77.0.3\",state=\"serving\"} 0",
            "dsv4_worker_load_seconds{box=\"10.77.0.2\"} 1.5",
            "dsv4_worker_gtt_used_bytes{box=\"10.77.0.2\"} 42949672960",
            "dsv4_worker_temperature_celsius{box=\"10.77.0.2\",sensor=\"edge\"} 61.5",
            "dsv4_worker_power_watts{box=\"10.77.0.2\"} 85.0",
            "dsv4_holds 1",
        ] {
            assert!(got.contains(&line), "{line} not in\n{text}");
        }
        assert!(!text.contains("dsv4_worker_load_seconds{box=\"10.77.0.3\"}"));
        assert!(!text.contains("dsv4_worker_power_watts{box=\"10.77.0.3\"}"));
    }

    #[test]
    fn renders_state_and_per_profile_counters() {
        let stats = Stats::default();
        let t = Timings {
            cache_n: 5,
            prompt_n: 2000,
            prompt_ms: 10_000.0,
            predicted_n: 100,
            predicted_ms: 10_000.0,
        };
        stats.record("320k", "/v1/chat/completions", &t, 20_000.0, None);
        let mut status = Status::stopped("320k");
        status.state = State::Ready;
        status.engine_profile = Some("320k".into());
        status.engine_pid = Some(7);
        status.generation = Some(2);
        status.in_flight = 1;
        let text = render(
            &status,
            &stats.report(0),
            None,
            &PowerStatus::default(),
            &ThermalStatus::default(),
            &KvStatus::default(),
            Live::default(),
        );
        let got = lines(&text);
        for line in [
            "dsv4_engine_state{state=\"ready\"} 1",
            "dsv4_engine_state{state=\"stopped\"} 0",
            "dsv4_active_profile{profile=\"320k\"} 1",
            "dsv4_in_flight_requests 1",
            "dsv4_engine_generation 2",
            "dsv4_requests_total{profile=\"320k\"} 1",
            "dsv4_prompt_tokens_total{profile=\"320k\"} 2000",
            "dsv4_cached_prompt_tokens_total{profile=\"320k\"} 5",
            "dsv4_generated_tokens_total{profile=\"320k\"} 100",
            "dsv4_decode_tokens_per_second{profile=\"320k\"} 10.0",
            "dsv4_long_prompt_prefill_tokens_per_second{profile=\"320k\"} 200.0",
            "# TYPE dsv4_generated_tokens counter",
            "# EOF",
        ] {
            assert!(got.contains(&line), "missing {line:?} in\n{text}");
        }
        assert!(
            got.contains(&"# HELP dsv4_in_flight_requests Requests holding a lease on the engine."),
            "{text}"
        );
        // No sample of the host yet: no figures of it.
        assert!(!text.contains("dsv4_gtt_used_bytes"), "{text}");
        assert!(!text.contains("dsv4_throttle_seconds_total{"), "{text}");
    }

    #[test]
    fn request_figures_are_given_by_api_as_well_with_three_apis_at_most() {
        use crate::observe::stats::{Figures, Times};
        let stats = Stats::default();
        let figures = |protocol, prompt_n, times| Figures {
            protocol,
            prompt_n,
            cache_n: 3,
            predicted_n: 20,
            times,
        };
        let clock = Times::Clock {
            prompt_ms: 1000.0,
            decode_ms: 2000.0,
        };
        let t = Timings {
            cache_n: 0,
            prompt_n: 2000,
            prompt_ms: 10_000.0,
            predicted_n: 100,
            predicted_ms: 10_000.0,
        };
        stats.record("320k", "/v1/chat/completions", &t, 1.0, None);
        stats.record(
            "64k",
            "/v1/messages",
            &figures(ApiProtocol::Anthropic, 40, clock),
            1.0,
            None,
        );
        stats.record(
            "64k",
            "/v1/messages",
            &figures(ApiProtocol::Anthropic, 60, Times::Unknown),
            1.0,
            None,
        );
        let text = render(
            &Status::stopped("320k"),
            &stats.report(0),
            None,
            &PowerStatus::default(),
            &ThermalStatus::default(),
            &KvStatus::default(),
            Live::default(),
        );
        let got = lines(&text);
        for line in [
            "# TYPE dsv4_api_requests counter",
            "# HELP dsv4_api_requests Finished requests whose answers told their tokens, by API.",
            "dsv4_api_requests_total{protocol=\"openai\"} 1",
            "dsv4_api_requests_total{protocol=\"anthropic\"} 2",
            // An API without requests is counted at 0.
            "dsv4_api_requests_total{protocol=\"responses\"} 0",
            "dsv4_api_prompt_tokens_total{protocol=\"anthropic\"} 100",
            "dsv4_api_cached_prompt_tokens_total{protocol=\"anthropic\"} 6",
            "dsv4_api_generated_tokens_total{protocol=\"anthropic\"} 40",
            "dsv4_api_generated_tokens_total{protocol=\"openai\"} 100",
            "dsv4_api_clock_timed_requests_total{protocol=\"anthropic\"} 1",
            "dsv4_api_clock_timed_requests_total{protocol=\"openai\"} 0",
            // The clocked request's rates (the plain one has no times).
            "dsv4_api_decode_tokens_per_second{protocol=\"anthropic\"} 10.0",
            "dsv4_api_prefill_tokens_per_second{protocol=\"anthropic\"} 40.0",
            "dsv4_api_decode_tokens_per_second{protocol=\"openai\"} 10.0",
            "dsv4_api_long_prompt_prefill_tokens_per_second{protocol=\"openai\"} 200.0",
            // By profile, as before: each request counted once there too.
            "dsv4_requests_total{profile=\"320k\"} 1",
            "dsv4_requests_total{profile=\"64k\"} 2",
        ] {
            assert!(got.contains(&line), "missing {line:?} in\n{text}");
        }
        // No rate where none is known.
        assert!(!text.contains("dsv4_api_decode_tokens_per_second{protocol=\"responses\"}"));
        assert!(
            !text.contains("_per_second{protocol=\"anthropic\"} 0"),
            "{text}"
        );
        // The label set is bounded: the three APIs, in every family of them.
        let mut protocols: Vec<&str> = got
            .iter()
            .filter(|l| l.starts_with("dsv4_api_"))
            .filter_map(|l| l.split("protocol=\"").nth(1)?.split('"').next())
            .collect();
        protocols.sort_unstable();
        protocols.dedup();
        assert_eq!(protocols, ["anthropic", "openai", "responses"], "{text}");
        for family in [
            "dsv4_api_requests_total{",
            "dsv4_api_prompt_tokens_total{",
            "dsv4_api_cached_prompt_tokens_total{",
            "dsv4_api_generated_tokens_total{",
            "dsv4_api_clock_timed_requests_total{",
        ] {
            let n = got.iter().filter(|l| l.starts_with(family)).count();
            assert_eq!(n, 3, "{family}\n{text}");
        }
    }

    #[test]
    fn renders_the_hosts_figures() {
        let sample = Sample {
            at: 1_700_000_000.5,
            memory: Some(Memory {
                total: 128,
                available: 37,
                swap_total: 8,
                swap_free: 7,
            }),
            pressure: Some(Pressure {
                some_avg10: 1.25,
                full_avg10: 0.5,
                ..Pressure::default()
            }),
            gpu: Some(Gpu {
                card: "card1".into(),
                memory: GpuMemory {
                    gtt_used: Some(81),
                    gtt_total: Some(112),
                    ..GpuMemory::default()
                },
                busy_percent: Some(97.0),
                ..Gpu::default()
            }),
            temperatures: [(Sensor::Edge, 73.0), (Sensor::Tctl, 74.25)]
                .into_iter()
                .collect(),
            power: PowerDraw {
                soc: Some(69.6),
                ..PowerDraw::default()
            },
            throttle: Throttle {
                supported: true,
                active: true,
                kinds: vec![ThrottleKind::Thermal],
                since: None,
                seconds: ThrottleSeconds {
                    thermal: 3.0,
                    ..ThrottleSeconds::default()
                },
            },
            engine: Some(EngineProcess {
                pid: 9,
                rss_bytes: 20 << 20,
                cpu_ms: 1500,
            }),
        };
        let power = PowerStatus {
            held: true,
            gpu_level: Some(dsv4_client::words::GpuLevel::Auto),
            ..PowerStatus::default()
        };
        let text = render(
            &Status::stopped("320k"),
            &Stats::default().report(0),
            Some(&sample),
            &power,
            &ThermalStatus {
                level: ThermalLevel::Warn,
                sensors: vec![dsv4_client::SensorThermal {
                    sensor: "edge".into(),
                    level: ThermalLevel::Warn,
                    since: None,
                    peak: Some(86.0),
                }],
                ..ThermalStatus::default()
            },
            &KvStatus::default(),
            Live::default(),
        );
        let got = lines(&text);
        for line in [
            "dsv4_gtt_used_bytes 81.0",
            "dsv4_gtt_total_bytes 112.0",
            "dsv4_memory_available_bytes 37.0",
            "dsv4_swap_free_bytes 7.0",
            "dsv4_temperature_celsius{sensor=\"edge\"} 73.0",
            "dsv4_temperature_celsius{sensor=\"tctl\"} 74.25",
            "dsv4_power_watts{source=\"soc\"} 69.6",
            "dsv4_gpu_busy_ratio 0.97",
            "dsv4_throttle_seconds_total{kind=\"thermal\"} 3.0",
            "dsv4_throttle_seconds_total{kind=\"power\"} 0.0",
            "dsv4_throttling 1.0",
            "dsv4_memory_pressure_ratio{kind=\"some\"} 0.0125",
            "dsv4_memory_pressure_ratio{kind=\"full\"} 0.005",
            "dsv4_engine_rss_bytes 20971520.0",
            "dsv4_engine_cpu_seconds_total{kind=\"all\"} 1.5",
            "# TYPE dsv4_throttle_seconds counter",
            "dsv4_power_profile_held 1",
            "dsv4_thermal_level{sensor=\"edge\"} 1",
            "dsv4_gpu_performance_level{level=\"auto\"} 1",
        ] {
            assert!(got.contains(&line), "missing {line:?} in\n{text}");
        }
        // Absent figures have no line.
        assert!(!text.contains("sensor=\"gfx\""), "{text}");
        assert!(!text.contains("dsv4_vram_used_bytes"), "{text}");
    }
}
