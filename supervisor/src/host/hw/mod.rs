//! The host's hardware, read below the daemon's [`SysRoot`]: one reader per source, and the
//! [`Sampler`] that takes one [`Sample`] from all of them.
//!
//! Owns: which devices this machine has (found once, looked for again while missing) and
//! what carries over between samples (throttle counters, the engine's process view). Must
//! not: spawn processes, scan every process, or fail: what is not there is absent, and a
//! sample is always taken. Each reader cites the kernel document it follows.

pub mod amdgpu;
pub mod cgroup;
pub mod gpu_metrics;
pub mod hwmon;
pub mod meminfo;
pub mod process;
pub mod psi;
pub mod throttle;

use std::time::Duration;

// Outside a runtime (the sampler's thread) this is the std clock.
use tokio::time::Instant;

use dsv4_client::telemetry::{GpuMemory, MemoryFigures, PowerDraw, Sample, Sensor, Temperatures};

use crate::host::sysroot::SysRoot;

/// How often devices not found are looked for again (a driver loaded after the daemon).
const LOOK_AGAIN: Duration = Duration::from_secs(60);

/// Reads the [`MemoryFigures`] a start is admitted on (the card is looked for each time: this
/// is for the rare moments an engine starts or stops, not for sampling).
///
/// What is available is `MemAvailable` less `CmaFree`: the contiguous-allocation area counts
/// as free, but only movable pages may use it, and the GPU's pinned buffers are not movable
/// (Strix Halo deployments admit on the same figure).
pub fn memory_now(root: &SysRoot) -> MemoryFigures {
    MemoryFigures {
        available: meminfo::admissible(root),
        gpu: amdgpu::Card::find(root).map_or_else(GpuMemory::default, |c| c.memory(root)),
    }
}

pub struct Sampler {
    root: SysRoot,
    card: Option<amdgpu::Card>,
    k10temp: Option<hwmon::K10temp>,
    looked_at: Option<Instant>,
    throttle: throttle::Tracker,
    process: process::ProcessReader,
    /// The last `gpu_metrics` problem logged, so that it is logged once, not every second.
    metrics_problem: Option<String>,
}

impl Sampler {
    pub fn new(root: SysRoot) -> Sampler {
        Sampler {
            root,
            card: None,
            k10temp: None,
            looked_at: None,
            throttle: throttle::Tracker::default(),
            process: process::ProcessReader::default(),
            metrics_problem: None,
        }
    }

    pub fn root(&self) -> &SysRoot {
        &self.root
    }

    fn look_for_devices(&mut self) {
        let missing = self.card.is_none() || self.k10temp.is_none();
        let due = self.looked_at.is_none_or(|t| t.elapsed() >= LOOK_AGAIN);
        if !(missing && due) {
            return;
        }
        self.looked_at = Some(Instant::now());
        if self.card.is_none() {
            self.card = amdgpu::Card::find(&self.root);
            if let Some(c) = &self.card {
                tracing::info!(
                    "AMD GPU {} at {}{}",
                    c.name,
                    self.root.path(&c.device).display(),
                    if c.hwmon.is_some() {
                        ""
                    } else {
                        " (no amdgpu hwmon)"
                    }
                );
            }
        }
        if self.k10temp.is_none() {
            self.k10temp = hwmon::K10temp::find(&self.root);
        }
    }

    /// One sample, at unix time `at`, of the host and of the engine process `engine`.
    pub fn sample(&mut self, engine: Option<u32>, at: f64) -> Sample {
        self.look_for_devices();
        let root = &self.root;
        let mut temperatures = Temperatures::default();
        let mut power = PowerDraw::default();
        let mut throttle_reading = None;
        let gpu = self.card.as_ref().map(|card| {
            temperatures.set(Sensor::Edge, card.edge_celsius(root));
            (power.soc, power.soc_source) = card.power_watts(root).unzip();
            match card.metrics(root) {
                Some(Ok(m)) => {
                    temperatures.set(Sensor::Gfx, m.gfx_celsius);
                    temperatures.set(Sensor::Soc, m.soc_celsius);
                    power.socket = m.socket_watts;
                    power.apu = m.apu_watts;
                    power.gfx = m.gfx_watts;
                    throttle_reading = m.throttle;
                    self.metrics_problem = None;
                }
                Some(Err(e)) => {
                    let problem = e.to_string();
                    if self.metrics_problem.as_deref() != Some(problem.as_str()) {
                        tracing::warn!(
                            "{problem}: its temperatures, power and throttling are not read"
                        );
                        self.metrics_problem = Some(problem);
                    }
                }
                None => {}
            }
            card.read(root)
        });
        if let Some(k) = &self.k10temp {
            temperatures.set(Sensor::Tctl, k.tctl(root));
            temperatures.set(Sensor::CcdMax, k.ccd_max(root));
        }
        let engine = match engine {
            Some(pid) => self.process.read(pid),
            None => {
                self.process.clear();
                None
            }
        };
        Sample {
            at,
            memory: meminfo::read(root),
            pressure: psi::read(root),
            gpu,
            temperatures,
            power,
            throttle: self.throttle.update(throttle_reading, at),
            engine,
        }
    }
}

#[cfg(test)]
mod captured;
#[cfg(test)]
mod tests;
