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
    pub power: Power,
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
    pub gtt_used: Option<u64>,
    pub gtt_total: Option<u64>,
    pub vram_used: Option<u64>,
    pub vram_total: Option<u64>,
    /// The memory an engine's model lives in (see [`MemoryPool::of`]); `None` when neither
    /// total is known.
    #[serde(default)]
    pub pool: Option<MemoryPool>,
    pub busy_percent: Option<f64>,
    /// `power_dpm_force_performance_level`: auto, low, high, manual, profile_*.
    pub performance_level: Option<crate::words::GpuLevel>,
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

impl Gpu {
    /// The used and total bytes of the pool the model lives in, when known.
    pub fn pool_figures(&self) -> Option<(MemoryPool, Option<u64>, Option<u64>)> {
        Some(match self.pool? {
            MemoryPool::Gtt => (MemoryPool::Gtt, self.gtt_used, self.gtt_total),
            MemoryPool::Vram => (MemoryPool::Vram, self.vram_used, self.vram_total),
        })
    }
}

/// Degrees Celsius.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Temperatures {
    /// The GPU's edge sensor (amdgpu hwmon `temp1`).
    pub edge: Option<f64>,
    /// The CPU's control temperature (k10temp `Tctl`).
    pub tctl: Option<f64>,
    /// The hottest CCD (k10temp `Tccd*`).
    pub ccd_max: Option<f64>,
    /// From `gpu_metrics`: the GFX block and the SoC.
    pub gfx: Option<f64>,
    pub soc: Option<f64>,
}

/// Watts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Power {
    /// The SoC, as the amdgpu hwmon reports it (`power1_average`; on an APU the whole chip).
    pub soc: Option<f64>,
    /// From `gpu_metrics`: the socket, the APU and the GFX block.
    pub socket: Option<f64>,
    pub apu: Option<f64>,
    pub gfx: Option<f64>,
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
}
