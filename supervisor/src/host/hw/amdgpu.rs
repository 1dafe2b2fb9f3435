//! The AMD GPU: its memory (VRAM and GTT), how busy it is, its performance level, and its
//! hwmon sensors (edge temperature, power).
//!
//! Follows: Documentation/gpu/amdgpu/thermal.rst and driver-misc.rst (`mem_info_vram_total`,
//! `mem_info_vram_used`, `mem_info_gtt_total`, `mem_info_gtt_used` in bytes;
//! `gpu_busy_percent`; `power_dpm_force_performance_level`; the hwmon interface `temp1_input`
//! "edge" in millidegrees, `power1_average` or `power1_input` in microwatts, which on an APU
//! is the whole SoC), and Documentation/hwmon/sysfs-interface.rst for the units. Owns:
//! finding the card (the first `cardN` under `/sys/class/drm` whose `device/vendor` is
//! 0x1002) and its `amdgpu` hwmon once, then reading them. Must not: fail over a file the
//! driver or this machine does not have: that figure is absent.
//!
//! On Strix Halo the VRAM is only the firmware's carve-out; with the usual 512 MiB of it the
//! engine's memory is GTT, capped by `ttm.pages_limit`. Set to a large carve-out in the BIOS
//! (96 GiB, say), the model lives in VRAM instead: [`GpuMemory::pool`] tells which.

use dsv4_client::telemetry::{Gpu, GpuMemory};

use crate::host::hw::gpu_metrics::{self, DecodeError, Metrics};
use crate::host::sysroot::SysRoot;

const DRM: &str = "/sys/class/drm";
const AMD: &str = "0x1002";

/// The card found, by its system paths.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Card {
    /// `card1`.
    pub name: String,
    /// `/sys/class/drm/card1/device`.
    pub device: String,
    /// Its `amdgpu` hwmon folder, when it has one.
    pub hwmon: Option<String>,
}

/// `cardN` (not a connector such as `card1-eDP-1`), by its number.
fn card_number(name: &str) -> Option<u32> {
    name.strip_prefix("card")?.parse().ok()
}

impl Card {
    /// The first AMD card, if this machine has one.
    pub fn find(root: &SysRoot) -> Option<Card> {
        let mut cards: Vec<(u32, String)> = root
            .list(DRM)
            .into_iter()
            .filter_map(|n| Some((card_number(&n)?, n)))
            .collect();
        cards.sort();
        cards.into_iter().find_map(|(_, name)| {
            let device = format!("{DRM}/{name}/device");
            let vendor = root.read(&format!("{device}/vendor")).ok()?;
            if !vendor.trim().eq_ignore_ascii_case(AMD) {
                return None;
            }
            let hwmon_dir = format!("{device}/hwmon");
            let hwmon = root.list(&hwmon_dir).into_iter().find_map(|h| {
                let dir = format!("{hwmon_dir}/{h}");
                let name = root.read(&format!("{dir}/name")).ok()?;
                (name.trim() == "amdgpu").then_some(dir)
            });
            Some(Card {
                name,
                device,
                hwmon,
            })
        })
    }

    fn number(&self, root: &SysRoot, file: &str) -> Option<u64> {
        root.value(&format!("{}/{file}", self.device)).ok()
    }

    /// Memory, busy and the performance level.
    /// Its GTT and VRAM, used and total.
    pub fn memory(&self, root: &SysRoot) -> GpuMemory {
        GpuMemory {
            gtt_used: self.number(root, "mem_info_gtt_used"),
            gtt_total: self.number(root, "mem_info_gtt_total"),
            vram_used: self.number(root, "mem_info_vram_used"),
            vram_total: self.number(root, "mem_info_vram_total"),
        }
    }

    pub fn read(&self, root: &SysRoot) -> Gpu {
        let level = root
            .read(&format!(
                "{}/power_dpm_force_performance_level",
                self.device
            ))
            .ok()
            .map(|l| l.trim().to_string())
            .filter(|l| !l.is_empty() && l.len() <= 32);
        let memory = self.memory(root);
        Gpu {
            card: self.name.clone(),
            memory,
            pool: memory.pool(),
            busy_percent: self
                .number(root, "gpu_busy_percent")
                .filter(|p| *p <= 100)
                .map(|p| p as f64),
            performance_level: level.map(|l| dsv4_client::words::GpuLevel::read(&l)),
        }
    }

    fn hwmon_value(&self, root: &SysRoot, file: &str) -> Option<i64> {
        root.value(&format!("{}/{file}", self.hwmon.as_ref()?)).ok()
    }

    /// The edge temperature (°C).
    pub fn edge_celsius(&self, root: &SysRoot) -> Option<f64> {
        self.hwmon_value(root, "temp1_input")
            .map(|m| m as f64 / 1000.0)
    }

    /// The power the hwmon reports (W): the whole SoC on an APU; `power1_average` where
    /// there is one, else `power1_input`, and which.
    pub fn power_watts(
        &self,
        root: &SysRoot,
    ) -> Option<(f64, dsv4_client::telemetry::PowerSource)> {
        use dsv4_client::telemetry::PowerSource;
        [PowerSource::Average, PowerSource::Input]
            .into_iter()
            .find_map(|source| {
                let uw = self.hwmon_value(root, source.file())?;
                Some((uw, source))
            })
            .filter(|(uw, _)| *uw >= 0)
            .map(|(uw, source)| (uw as f64 / 1_000_000.0, source))
    }

    /// The `gpu_metrics` table: `None` when the card has none, else what it decodes to.
    pub fn metrics(&self, root: &SysRoot) -> Option<Result<Metrics, DecodeError>> {
        let bytes = root
            .read_bytes(&format!("{}/gpu_metrics", self.device))
            .ok()?;
        Some(gpu_metrics::decode(&bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_names() {
        assert_eq!(card_number("card1"), Some(1));
        assert_eq!(card_number("card10"), Some(10));
        assert_eq!(card_number("card1-eDP-1"), None);
        assert_eq!(card_number("renderD128"), None);
    }
}
