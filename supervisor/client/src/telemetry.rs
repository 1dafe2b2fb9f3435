//! What the daemon measures of the host: one [`Sample`] every `monitor.interval`, and the
//! per-request [`Resources`] drawn from them.
//!
//! Every group is optional, and so is every figure in it: a machine without an AMD GPU, a
//! kernel without PSI or a driver without `gpu_metrics` leaves those absent (`null` in JSON),
//! never wrong or zero.

use serde::{Deserialize, Serialize};

/// One reading of the host.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Unix time (s) it was taken.
    pub at: f64,
    /// `/proc/meminfo`.
    pub memory: Option<Memory>,
    /// `/proc/pressure/memory`.
    pub pressure: Option<Pressure>,
    /// The AMD GPU's sysfs files.
    pub gpu: Option<Gpu>,
    #[serde(default)]
    pub temperatures: Temperatures,
    #[serde(default)]
    pub power: PowerDraw,
    #[serde(default)]
    pub throttle: Throttle,
    /// The engine's process, while one runs.
    pub engine: Option<EngineProcess>,
}

/// Bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    pub total: u64,
    pub available: u64,
    pub swap_total: u64,
    pub swap_free: u64,
}

impl Memory {
    pub fn swap_used(&self) -> u64 {
        self.swap_total.saturating_sub(self.swap_free)
    }
}

/// Memory pressure: percent of the last 10 s in which some (or all) tasks waited for memory,
/// and the totals in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Pressure {
    pub some_avg10: f64,
    pub full_avg10: f64,
    pub some_total_us: u64,
    pub full_total_us: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// `card1`.
    pub card: String,
    /// Its GTT and VRAM, used and total (in JSON as fields of the `gpu` object).
    #[serde(flatten)]
    pub memory: GpuMemory,
    /// The memory an engine's model lives in ([`GpuMemory::pool`]), for readers of the JSON;
    /// `None` when neither total is known.
    #[serde(default)]
    pub pool: Option<MemoryPool>,
    pub busy_percent: Option<f64>,
    /// `power_dpm_force_performance_level`: auto, low, high, manual, profile_*.
    pub performance_level: Option<crate::words::GpuLevel>,
}

/// The GPU's memory, in bytes (amdgpu's `mem_info_{gtt,vram}_{used,total}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuMemory {
    pub gtt_used: Option<u64>,
    pub gtt_total: Option<u64>,
    pub vram_used: Option<u64>,
    pub vram_total: Option<u64>,
}

impl GpuMemory {
    /// The memory an engine's model lives in (see [`MemoryPool::of`]).
    pub fn pool(&self) -> Option<MemoryPool> {
        MemoryPool::of(self.vram_total, self.gtt_total)
    }

    /// The used and total bytes of the pool the model lives in, when known.
    pub fn pool_figures(&self) -> Option<(MemoryPool, Option<u64>, Option<u64>)> {
        Some(match self.pool()? {
            MemoryPool::Gtt => (MemoryPool::Gtt, self.gtt_used, self.gtt_total),
            MemoryPool::Vram => (MemoryPool::Vram, self.vram_used, self.vram_total),
        })
    }

    /// The used bytes of the pool the model lives in.
    pub fn pool_used(&self) -> Option<u64> {
        self.pool_figures()?.1
    }
}

/// The memory figures a start is admitted on: MemAvailable and the GPU's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryFigures {
    pub available: Option<u64>,
    pub gpu: GpuMemory,
}

/// The GPU memory an engine's model is allocated from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemoryPool {
    /// System RAM mapped for the GPU (an APU with the usual small carve-out: Strix Halo's
    /// 512 MiB of VRAM and up to ~112 GiB of GTT).
    Gtt,
    /// The firmware's carve-out (an APU set to, say, 96 GiB of VRAM in its BIOS): the
    /// runtimes allocate device memory there first, and system RAM is that much smaller.
    Vram,
}

impl MemoryPool {
    /// VRAM when the carve-out is at least as large as the GTT, else GTT; `None` when no
    /// total is known.
    pub fn of(vram_total: Option<u64>, gtt_total: Option<u64>) -> Option<MemoryPool> {
        match (vram_total, gtt_total) {
            (Some(v), Some(g)) if v >= g => Some(MemoryPool::Vram),
            (Some(_), None) => Some(MemoryPool::Vram),
            (_, Some(_)) => Some(MemoryPool::Gtt),
            (None, None) => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MemoryPool::Gtt => "GTT",
            MemoryPool::Vram => "VRAM",
        }
    }
}

/// A temperature sensor dsv4 reads. Everything known of one is in [`Sensor::about`]: adding
/// a sensor is a variant, its description there, and the reader that fills it in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Sensor {
    Edge,
    Tctl,
    CcdMax,
    Gfx,
    Soc,
}

/// What a sensor is, for JSON, metrics, the status and notifications.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SensorAbout {
    /// Its key in JSON and its `sensor` label in metrics and signals.
    pub label: &'static str,
    /// How the status and `dsv4ctl top` name it.
    pub shown: &'static str,
    /// The part of the machine it measures, as notifications say it.
    pub part: &'static str,
    /// Where it is read, for the metrics' help.
    pub source: &'static str,
    /// Whether the thermal rules (`thermal.warn`, `thermal.critical`) watch it.
    pub watched: bool,
}

impl Sensor {
    /// Every sensor, in the order JSON, metrics and the status list them.
    pub const ALL: [Sensor; 5] = [
        Sensor::Edge,
        Sensor::Tctl,
        Sensor::CcdMax,
        Sensor::Gfx,
        Sensor::Soc,
    ];

    pub const fn about(self) -> SensorAbout {
        let (label, shown, part, source, watched) = match self {
            Sensor::Edge => ("edge", "edge", "GPU", "amdgpu hwmon temp1", true),
            Sensor::Tctl => ("tctl", "Tctl", "CPU", "k10temp Tctl", true),
            Sensor::CcdMax => ("ccd_max", "CCD", "CPU", "k10temp, the hottest Tccd", false),
            Sensor::Gfx => ("gfx", "GFX", "GPU", "gpu_metrics, the GFX block", false),
            Sensor::Soc => ("soc", "SoC", "SoC", "gpu_metrics, the SoC", false),
        };
        SensorAbout {
            label,
            shown,
            part,
            source,
            watched,
        }
    }

    pub const fn label(self) -> &'static str {
        self.about().label
    }

    /// The sensors the thermal rules watch.
    pub fn watched() -> impl Iterator<Item = Sensor> {
        Sensor::ALL.into_iter().filter(|s| s.about().watched)
    }

    const fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Sensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl std::str::FromStr for Sensor {
    type Err = ();

    fn from_str(s: &str) -> Result<Sensor, ()> {
        Sensor::ALL.into_iter().find(|x| x.label() == s).ok_or(())
    }
}

/// Degrees Celsius, by sensor. In JSON an object keyed by each sensor's label, `null` where
/// it was not read; labels a newer daemon adds are skipped when read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Temperatures([Option<f64>; Sensor::ALL.len()]);

impl Temperatures {
    pub fn get(&self, sensor: Sensor) -> Option<f64> {
        self.0[sensor.index()]
    }

    pub fn set(&mut self, sensor: Sensor, celsius: Option<f64>) {
        self.0[sensor.index()] = celsius;
    }

    /// The sensors read, with their temperatures.
    pub fn read(&self) -> impl Iterator<Item = (Sensor, f64)> + '_ {
        Sensor::ALL
            .into_iter()
            .filter_map(|s| Some((s, self.get(s)?)))
    }
}

impl FromIterator<(Sensor, f64)> for Temperatures {
    fn from_iter<I: IntoIterator<Item = (Sensor, f64)>>(iter: I) -> Temperatures {
        let mut t = Temperatures::default();
        for (s, c) in iter {
            t.set(s, Some(c));
        }
        t
    }
}

impl Serialize for Temperatures {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(Sensor::ALL.len()))?;
        for s in Sensor::ALL {
            map.serialize_entry(s.label(), &self.get(s))?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Temperatures {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let map = std::collections::BTreeMap::<String, Option<f64>>::deserialize(deserializer)?;
        let mut t = Temperatures::default();
        for (label, celsius) in map {
            if let Ok(s) = label.parse::<Sensor>() {
                t.set(s, celsius);
            }
        }
        Ok(t)
    }
}

/// Watts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PowerDraw {
    /// The SoC, as the amdgpu hwmon reports it (`power1_average`; on an APU the whole chip).
    pub soc: Option<f64>,
    /// The file `soc` was read from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soc_source: Option<PowerSource>,
    /// From `gpu_metrics`: the socket, the APU and the GFX block.
    pub socket: Option<f64>,
    pub apu: Option<f64>,
    pub gfx: Option<f64>,
}

/// Which of the amdgpu hwmon's files a power figure was read from: `power1_average` (the
/// firmware's average over its own window) where the driver has it, else `power1_input`
/// (the instant reading). On an APU either is the whole SoC, CPU cores included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PowerSource {
    #[serde(rename = "power1_average")]
    Average,
    #[serde(rename = "power1_input")]
    Input,
}

impl PowerSource {
    /// The file's name.
    pub fn file(self) -> &'static str {
        match self {
            PowerSource::Average => "power1_average",
            PowerSource::Input => "power1_input",
        }
    }
}

/// Why the hardware held itself back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThrottleKind {
    /// A temperature limit (v3.0 `thm_core`, `thm_gfx`, `thm_soc`; v2.x bits 32-47).
    Thermal,
    /// A power limit (v3.0 `spl`, `fppt`, `sppt`; v2.x bits 0-15).
    Power,
    /// A current limit (v2.x bits 16-31).
    Current,
    /// The platform asserted PROCHOT (v3.0).
    Prochot,
    /// Anything else the firmware reports (v2.x bits 48-63).
    Other,
}

impl ThrottleKind {
    pub const ALL: [ThrottleKind; 5] = [
        ThrottleKind::Thermal,
        ThrottleKind::Power,
        ThrottleKind::Current,
        ThrottleKind::Prochot,
        ThrottleKind::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ThrottleKind::Thermal => "thermal",
            ThrottleKind::Power => "power",
            ThrottleKind::Current => "current",
            ThrottleKind::Prochot => "prochot",
            ThrottleKind::Other => "other",
        }
    }
}

/// Seconds of throttling by kind, counted since the daemon started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ThrottleSeconds {
    pub thermal: f64,
    pub power: f64,
    pub current: f64,
    pub prochot: f64,
    pub other: f64,
}

impl ThrottleSeconds {
    pub fn get(&self, kind: ThrottleKind) -> f64 {
        match kind {
            ThrottleKind::Thermal => self.thermal,
            ThrottleKind::Power => self.power,
            ThrottleKind::Current => self.current,
            ThrottleKind::Prochot => self.prochot,
            ThrottleKind::Other => self.other,
        }
    }

    pub fn add(&mut self, kind: ThrottleKind, seconds: f64) {
        let slot = match kind {
            ThrottleKind::Thermal => &mut self.thermal,
            ThrottleKind::Power => &mut self.power,
            ThrottleKind::Current => &mut self.current,
            ThrottleKind::Prochot => &mut self.prochot,
            ThrottleKind::Other => &mut self.other,
        };
        *slot += seconds;
    }

    /// Seconds in which any kind throttled is not the sum (kinds overlap); this is the most
    /// any one kind had, a floor for it.
    pub fn total(&self) -> f64 {
        ThrottleKind::ALL
            .iter()
            .map(|k| self.get(*k))
            .fold(0.0, f64::max)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Throttle {
    /// Whether this machine reports throttling at all (an AMD APU's `gpu_metrics`).
    pub supported: bool,
    /// Throttling in the interval up to this sample.
    pub active: bool,
    pub kinds: Vec<ThrottleKind>,
    /// Unix time (s) since which it has been throttling without a break.
    pub since: Option<f64>,
    pub seconds: ThrottleSeconds,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineProcess {
    pub pid: u32,
    pub rss_bytes: u64,
    /// User and system CPU time, milliseconds.
    pub cpu_ms: u64,
}

/// What a request's span cost, from the samples taken during it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// Samples it is drawn from.
    pub samples: u32,
    pub edge_mean_c: Option<f64>,
    pub edge_max_c: Option<f64>,
    pub soc_power_mean_w: Option<f64>,
    pub gtt_peak_bytes: Option<u64>,
    pub available_min_bytes: Option<u64>,
    /// Seconds in which some kind of throttling was seen.
    pub throttle_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_sample_is_all_absent_in_json() {
        let v = serde_json::to_value(Sample::default()).unwrap();
        assert_eq!(v["memory"], serde_json::Value::Null);
        assert_eq!(v["gpu"], serde_json::Value::Null);
        assert_eq!(v["temperatures"]["edge"], serde_json::Value::Null);
        assert_eq!(v["throttle"]["supported"], false);
        let back: Sample = serde_json::from_value(v).unwrap();
        assert_eq!(back, Sample::default());
        assert_eq!(
            serde_json::to_string(&ThrottleKind::Prochot).unwrap(),
            "\"prochot\""
        );
    }

    /// Temperatures go out keyed by label with every sensor present, and come back whatever
    /// a daemon sent: nulls, missing sensors and labels this version does not know.
    #[test]
    fn temperatures_are_keyed_by_label_both_ways() {
        let t: Temperatures = [(Sensor::Edge, 38.0), (Sensor::Soc, 41.5)]
            .into_iter()
            .collect();
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"edge":38.0,"tctl":null,"ccd_max":null,"gfx":null,"soc":41.5}"#
        );
        for (json, want) in [
            (r#"{"edge":38.0,"soc":41.5}"#, t),
            (r#"{"edge":38.0,"tctl":null,"soc":41.5,"hotspot":90.0}"#, t),
            ("{}", Temperatures::default()),
        ] {
            assert_eq!(
                serde_json::from_str::<Temperatures>(json).unwrap(),
                want,
                "{json}"
            );
        }
        for s in Sensor::ALL {
            assert_eq!(s.label().parse::<Sensor>(), Ok(s));
        }
        assert_eq!(
            Sensor::watched().collect::<Vec<_>>(),
            [Sensor::Edge, Sensor::Tctl]
        );
    }
}
