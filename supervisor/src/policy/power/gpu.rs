//! The GPU's performance level: `power_dpm_force_performance_level` of the AMD card.
//!
//! Follows: Documentation/gpu/amdgpu/thermal.rst (`auto`, `low`, `high`, `manual`,
//! `profile_standard`, ...: `auto` lets the driver pick clocks by load, `low` pins them
//! down). Owns: reading and writing the level, and the rules for when to write it: at the
//! engine's start, whenever it drifts while the engine runs (power-profiles-daemon's
//! `amdgpu_dpm` action sets `low` in power-saver on AMD machines, which costs up to 40% of
//! decode speed), and back at the stop unless the user changed it meanwhile. Must not:
//! touch anything but that one file.

use dsv4_client::words::GpuLevel;

use super::sysfs::{Request, Writer};
use crate::config::GpuPolicy;
use crate::host::sysroot::SysRoot;

/// The level a policy asks for; `None` for `keep`.
pub fn wanted(gpu: GpuPolicy) -> Option<GpuLevel> {
    match gpu {
        GpuPolicy::Auto => Some(GpuLevel::Auto),
        GpuPolicy::Low => Some(GpuLevel::Low),
        GpuPolicy::High => Some(GpuLevel::High),
        GpuPolicy::Keep => None,
    }
}

/// The file, for the card found under `root`.
pub fn level_file(root: &SysRoot) -> Option<String> {
    let card = crate::host::hw::amdgpu::Card::find(root)?;
    Some(format!("{}/power_dpm_force_performance_level", card.device))
}

pub fn read(root: &SysRoot, file: &str) -> Option<GpuLevel> {
    let text = root.read(file).ok()?;
    (!text.trim().is_empty()).then(|| GpuLevel::read(&text))
}

/// The card a level file belongs to: `card1` of
/// `/sys/class/drm/card1/device/power_dpm_force_performance_level`.
pub fn card_of(file: &str) -> Option<&str> {
    let rest = file.strip_prefix("/sys/class/drm/")?;
    let (card, tail) = rest.split_once('/')?;
    (tail == "device/power_dpm_force_performance_level").then_some(card)
}

/// Writes `level` to the card's file: itself, or through the `dsv4-sysfs@` unit where dsv4d
/// may not (see [`super::sysfs`]); the error says what was tried and what is missing.
pub async fn write(writer: &Writer, file: &str, level: &GpuLevel) -> Result<(), String> {
    let Some(card) = card_of(file) else {
        return Err(format!(
            "cannot set the GPU's performance level to {level}: {file} is not a card's level file"
        ));
    };
    writer
        .write(&Request::gpu_level(card, level.as_str()))
        .await
        .map_err(|e| format!("cannot set the GPU's performance level to {level}: {e}"))
}

/// What to do at the stop: restore `found` (the level at the start) when the level is
/// still the one dsv4d set; leave it when the user (or something else) changed it since.
pub fn restore_at_stop<'a>(
    found: &'a GpuLevel,
    set: &GpuLevel,
    now: Option<&GpuLevel>,
) -> Option<&'a GpuLevel> {
    (now == Some(set) && found != set).then_some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_card_comes_from_its_level_file_only() {
        for (file, want) in [
            (
                "/sys/class/drm/card1/device/power_dpm_force_performance_level",
                Some("card1"),
            ),
            ("/sys/class/drm/card1/device/vendor", None),
            ("/etc/passwd", None),
        ] {
            assert_eq!(card_of(file), want, "{file}");
        }
    }

    #[test]
    fn a_stop_restores_only_what_dsv4d_set() {
        // (found at the start, set by dsv4d, now) -> what to write back
        use GpuLevel::{Auto, High, Low};
        for (found, set, now, want) in [
            (Low, Auto, Some(Auto), Some(Low)),
            (Auto, Auto, Some(Auto), None),
            // The user chose high meanwhile: left alone.
            (Low, Auto, Some(High), None),
            (Low, Auto, None, None),
        ] {
            assert_eq!(
                restore_at_stop(&found, &set, now.as_ref()),
                want.as_ref(),
                "{found} {set} {now:?}"
            );
        }
        assert_eq!(wanted(GpuPolicy::Auto), Some(GpuLevel::Auto));
        assert_eq!(wanted(GpuPolicy::Keep), None);
    }
}
