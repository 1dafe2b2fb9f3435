//! Power: what power-profiles-daemon will do to the GPU in power-saver, the platform profile
//! it picks, and a dry run of the privileged path that sets the GPU's level.
//!
//! Follows: power-profiles-daemon's D-Bus properties (`Version` from 0.20, `Actions`, and
//! `ActionsInfo` from 0.30, where actions can be turned off with `powerprofilesctl
//! configure-action`). Its `amdgpu_dpm` action puts the GPU on `low` in power-saver, which
//! the seeds measured to cut decode from 16.02 to 12.59 tok/s; and from 0.20 its
//! platform-profile driver lowers the ACPI `platform_profile` in power-saver. Owns: these
//! checks. Must not: hold a profile, or leave the GPU at another level than it found.

use crate::config::{Config, GpuPolicy, PowerMethod};
use crate::host::sysroot::SysRoot;
use crate::policy::power::gpu;
use crate::policy::power::ppd::Ppd;
use crate::policy::power::sysfs::{Request, Writer};

use super::Check;

const PLATFORM_PROFILE: &str = "/sys/firmware/acpi/platform_profile";
const PLATFORM_CHOICES: &str = "/sys/firmware/acpi/platform_profile_choices";

/// The checks; `bus` is the system bus when there is one.
pub async fn checks(config: &Config, root: &SysRoot, bus: Option<zbus::Connection>) -> Vec<Check> {
    let mut out = Vec::new();
    // `auto` (None) uses power-profiles-daemon when it is there.
    let uses_ppd = matches!(
        config.supervisor.power.method,
        None | Some(PowerMethod::Ppd)
    );
    let ppd = match &bus {
        Some(conn) => Ppd::find(conn).await.ok().flatten(),
        None => None,
    };
    out.push(match (&bus, &ppd) {
        (None, _) => Check::skip(
            "power.ppd",
            "no system bus: power-profiles-daemon could not be asked",
        ),
        (Some(_), None) if config.supervisor.power.method == Some(PowerMethod::Ppd) => Check::fail(
            "power.ppd",
            "power.method is ppd, but no power-profiles-daemon is on the system bus",
            "install and start power-profiles-daemon, or set power.method to auto (cpufreq \
             when it is absent)",
        ),
        (Some(_), None) => Check::ok(
            "power.ppd",
            "no power-profiles-daemon on the system bus: power-saver is set through cpufreq",
        ),
        (Some(_), Some(ppd)) => ppd_check(ppd, config, uses_ppd).await,
    });
    out.push(platform_profile(root, ppd.is_some() && uses_ppd));
    out.push(gpu_helper(config, root, bus).await);
    out
}

async fn ppd_check(ppd: &Ppd, config: &Config, uses_ppd: bool) -> Check {
    let version = ppd.version().await.ok();
    let actions = ppd.actions().await.unwrap_or_default();
    let enabled = ppd.actions_enabled().await.ok();
    let shown_version = version.unwrap_or_else(|| "before 0.20 (no Version property)".into());
    let dpm = actions.iter().any(|a| a == "amdgpu_dpm");
    let dpm_on = dpm
        && enabled
            .as_ref()
            .and_then(|list| list.iter().find(|(n, _)| n == "amdgpu_dpm"))
            .and_then(|(_, on)| *on)
            .unwrap_or(true);
    let found = format!(
        "power-profiles-daemon {shown_version} ({}), actions: {}",
        ppd.service,
        if actions.is_empty() {
            "none".to_string()
        } else {
            actions.join(", ")
        }
    );
    if !dpm_on || !uses_ppd {
        return Check::ok("power.ppd", found);
    }
    let ours = match config.supervisor.power.gpu {
        GpuPolicy::Keep => "power.gpu is keep, so the GPU stays there",
        _ => {
            "dsv4 then sets power.gpu's level through dsv4-sysfs@, but the action sets low \
              again at each profile change"
        }
    };
    Check::warn(
        "power.ppd",
        format!(
            "{found}: its amdgpu_dpm action is on and puts the GPU on low in power-saver, \
             which cut decode from 16.02 to 12.59 tok/s on Strix Halo; {ours}"
        ),
        if enabled.is_some() {
            "`sudo powerprofilesctl configure-action --disable amdgpu_dpm`".to_string()
        } else {
            "power-profiles-daemon 0.30 or later can turn it off (`powerprofilesctl \
             configure-action --disable amdgpu_dpm`); with this one, set power.cpu to \
             balanced, or power.method to cpufreq"
                .to_string()
        },
    )
    .source("the user's measurements; power-profiles-daemon's amdgpu_dpm action")
}

/// The profile power-profiles-daemon's platform driver picks for power-saver: the first of
/// `low-power`, `quiet`, `cool` the firmware offers.
pub fn power_saver_platform(choices: &str) -> Option<&str> {
    let offered: Vec<&str> = choices.split_whitespace().collect();
    ["low-power", "quiet", "cool"]
        .into_iter()
        .find(|c| offered.contains(c))
}

fn platform_profile(root: &SysRoot, ppd_holds: bool) -> Check {
    let id = "power.platform_profile";
    let (Ok(now), Ok(choices)) = (root.read(PLATFORM_PROFILE), root.read(PLATFORM_CHOICES)) else {
        return Check::skip(id, "no ACPI platform_profile on this machine");
    };
    let (now, choices) = (now.trim(), choices.trim());
    let picked = power_saver_platform(choices);
    match (ppd_holds, picked) {
        (true, Some(p)) => Check::ok(
            id,
            format!(
                "{now} now (choices: {choices}); power-saver sets {p}, which lowers the whole \
                 SoC's limits, the GPU's too: `dsv4ctl validate` measures what it costs"
            ),
        ),
        (true, None) => Check::ok(
            id,
            format!("{now} now (choices: {choices}); power-saver leaves it alone"),
        ),
        (false, _) => Check::ok(
            id,
            format!("{now} (choices: {choices}); dsv4 does not change it (cpufreq is set instead)"),
        ),
    }
}

/// Writes the level the GPU already has through `dsv4-sysfs@` and reads it back.
async fn gpu_helper(config: &Config, root: &SysRoot, bus: Option<zbus::Connection>) -> Check {
    let id = "power.gpu_helper";
    if config.supervisor.power.gpu == GpuPolicy::Keep {
        return Check::ok(id, "power.gpu is keep: dsv4 never sets the GPU's level");
    }
    let Some(file) = gpu::level_file(root) else {
        return Check::skip(id, "no AMD GPU level file under /sys/class/drm");
    };
    let Some(level) = gpu::read(root, &file) else {
        return Check::fail(
            id,
            format!("cannot read {}", root.path(&file).display()),
            "check that the amdgpu driver is loaded",
        );
    };
    let Some(bus) = bus else {
        return Check::skip(id, "no system bus: the helper could not be started");
    };
    let has_systemd = match zbus::fdo::DBusProxy::new(&bus).await {
        Ok(dbus) => match zbus::names::BusName::try_from("org.freedesktop.systemd1") {
            Ok(name) => dbus.name_has_owner(name).await.unwrap_or(false),
            Err(_) => false,
        },
        Err(_) => false,
    };
    if !has_systemd {
        return Check::skip(
            id,
            "no systemd on the system bus: the helper could not be started",
        );
    }
    let Some(card) = gpu::card_of(&file) else {
        return Check::skip(id, format!("{file} is not a card's level file"));
    };
    let req = Request::gpu_level(card, level.as_str());
    let writer = Writer::with_bus(root.clone(), Some(bus));
    let fix = "reinstall the package (it ships the polkit rule 50-dsv4.rules and \
               dsv4-sysfs@.service), then see `journalctl -u 'dsv4-sysfs@*'`";
    match writer.write_through_helper(&req).await {
        Err(e) => Check::fail(
            id,
            format!(
                "writing {level} (the level it has) through {}: {e}",
                req.unit()
            ),
            fix,
        ),
        Ok(()) => match gpu::read(root, &file) {
            Some(back) if back == level => Check::ok(
                id,
                format!(
                    "{} wrote {level}, the level it had, and it reads back",
                    req.unit()
                ),
            ),
            back => Check::fail(
                id,
                format!(
                    "{} ran, but the level reads {} where {level} was written",
                    req.unit(),
                    back.map_or("nothing".to_string(), |b| b.to_string())
                ),
                fix,
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_power_saver_platform_profile() {
        assert_eq!(
            power_saver_platform("low-power balanced performance"),
            Some("low-power")
        );
        assert_eq!(
            power_saver_platform("quiet balanced performance"),
            Some("quiet")
        );
        assert_eq!(power_saver_platform("balanced performance"), None);
    }
}
