//! The CPU's temperatures from `k10temp`: Tctl (the control temperature the firmware acts on)
//! and the CCDs' (Tccd1 .. Tccd8).
//!
//! Follows: Documentation/hwmon/k10temp.rst and Documentation/hwmon/sysfs-interface.rst
//! (`/sys/class/hwmon/hwmonN/name`, `tempM_label`, `tempM_input` in millidegrees). Owns:
//! finding the `k10temp` hwmon and its labelled inputs once, then reading them. Must not:
//! fail where there is no such sensor (another vendor's CPU, a VM): the figures are absent.
//! AMD has no Intel-style `thermal_throttle` counters; CPU throttling shows in gpu_metrics.

use crate::host::sysroot::SysRoot;

const HWMON: &str = "/sys/class/hwmon";

/// The k10temp inputs found, by their system paths.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct K10temp {
    pub tctl: Option<String>,
    pub ccds: Vec<String>,
}

impl K10temp {
    pub fn find(root: &SysRoot) -> Option<K10temp> {
        root.list(HWMON).into_iter().find_map(|h| {
            let dir = format!("{HWMON}/{h}");
            let name = root.read(&format!("{dir}/name")).ok()?;
            if name.trim() != "k10temp" {
                return None;
            }
            let mut found = K10temp {
                tctl: None,
                ccds: Vec::new(),
            };
            for file in root.list(&dir) {
                let Some(n) = file
                    .strip_prefix("temp")
                    .and_then(|f| f.strip_suffix("_label"))
                else {
                    continue;
                };
                let label = root.read(&format!("{dir}/{file}")).unwrap_or_default();
                let input = format!("{dir}/temp{n}_input");
                match label.trim() {
                    "Tctl" => found.tctl = Some(input),
                    l if l.starts_with("Tccd") => found.ccds.push(input),
                    _ => {}
                }
            }
            Some(found)
        })
    }

    fn celsius(root: &SysRoot, input: &str) -> Option<f64> {
        root.value::<i64>(input).ok().map(|m| m as f64 / 1000.0)
    }

    /// Tctl (°C).
    pub fn tctl(&self, root: &SysRoot) -> Option<f64> {
        Self::celsius(root, self.tctl.as_ref()?)
    }

    /// The hottest CCD (°C).
    pub fn ccd_max(&self, root: &SysRoot) -> Option<f64> {
        self.ccds
            .iter()
            .filter_map(|i| Self::celsius(root, i))
            .reduce(f64::max)
    }
}
