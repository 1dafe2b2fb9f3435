//! The GPU's performance level: `power_dpm_force_performance_level` of the AMD card.
//!
//! Follows: Documentation/gpu/amdgpu/thermal.rst (`auto`, `low`, `high`, `manual`,
//! `profile_standard`, ...: `auto` lets the driver pick clocks by load, `low` pins them
//! down). Owns: reading and writing the level, and the rules for when to write it: at the
//! engine's start, whenever it drifts while the engine runs (power-profiles-daemon's
//! `amdgpu_dpm` action sets `low` in power-saver on AMD machines, which costs up to 40% of
//! decode speed), and back at the stop unless the user changed it meanwhile. Must not:
//! touch anything but that one file.

use crate::config::GpuPolicy;
use crate::sysroot::SysRoot;

/// The level a policy asks for; `None` for `keep`.
pub fn wanted(gpu: GpuPolicy) -> Option<&'static str> {
    match gpu {
        GpuPolicy::Auto => Some("auto"),
        GpuPolicy::Low => Some("low"),
        GpuPolicy::High => Some("high"),
        GpuPolicy::Keep => None,
    }
}

/// The file, for the card found under `root`.
pub fn level_file(root: &SysRoot) -> Option<String> {
    let card = crate::hw::amdgpu::Card::find(root)?;
    Some(format!("{}/power_dpm_force_performance_level", card.device))
}

pub fn read(root: &SysRoot, file: &str) -> Option<String> {
    let level = root.read(file).ok()?.trim().to_string();
    (!level.is_empty()).then_some(level)
}

/// Writes `level`; the error says what is missing when it is a permission.
pub fn write(root: &SysRoot, file: &str, level: &str) -> Result<(), String> {
    let path = root.path(file);
    // With its newline, as sysfs shows it (the kernel ignores it).
    std::fs::write(&path, format!("{level}\n")).map_err(|e| {
        let why = if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!(
                "{e}: dsv4d's user needs write access to it (a udev rule giving the group \
                 video write access, or run dsv4d as root; under systemd also \
                 ReadWritePaths=/sys/class/drm)"
            )
        } else {
            e.to_string()
        };
        format!(
            "cannot set the GPU's performance level to {level}: writing {}: {why}",
            path.display()
        )
    })
}

/// What to do at the stop: restore `found` (the level at the start) when the level is
/// still the one dsv4d set; leave it when the user (or something else) changed it since.
pub fn restore_at_stop<'a>(found: &'a str, set: &str, now: Option<&str>) -> Option<&'a str> {
    (now == Some(set) && found != set).then_some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_restores_only_what_dsv4d_set() {
        // (found at the start, set by dsv4d, now) -> what to write back
        for (found, set, now, want) in [
            ("low", "auto", Some("auto"), Some("low")),
            ("auto", "auto", Some("auto"), None),
            // The user chose high meanwhile: left alone.
            ("low", "auto", Some("high"), None),
            ("low", "auto", None, None),
        ] {
            assert_eq!(
                restore_at_stop(found, set, now),
                want,
                "{found} {set} {now:?}"
            );
        }
        assert_eq!(wanted(GpuPolicy::Auto), Some("auto"));
        assert_eq!(wanted(GpuPolicy::Keep), None);
    }
}
