//! The CPU's frequency policy without power-profiles-daemon: the governor and the
//! energy-performance preference of each cpufreq policy whose driver takes one (amd-pstate
//! or intel_pstate in active mode); policies of other drivers are left as they are.
//!
//! Follows: Documentation/admin-guide/pm/cpufreq.rst (`/sys/devices/system/cpu/cpufreq/
//! policyN/scaling_governor`) and Documentation/admin-guide/pm/amd-pstate.rst
//! (`energy_performance_preference`, `energy_performance_available_preferences`; the
//! preference cannot be changed while the governor is `performance`, so the governor goes
//! first). Owns: reading what is there, writing the target, and writing back exactly what
//! was read. Must not: decide when (the power task does), or stop at the first policy that
//! fails: every policy is tried and every failure reported.

use serde::{Deserialize, Serialize};

use super::sysfs::{Request, Writer};
use crate::config::CpuPolicy;
use crate::host::sysroot::SysRoot;

const POLICIES: &str = "/sys/devices/system/cpu/cpufreq";

/// One policy's settings, as read or to write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySettings {
    /// `policy0`.
    pub policy: String,
    pub governor: String,
    /// `None` where the driver has no EPP.
    pub epp: Option<String>,
}

/// The governor and preference for a CPU policy of the configuration; `None` for `keep`.
pub fn target(cpu: CpuPolicy) -> Option<(&'static str, &'static str)> {
    match cpu {
        CpuPolicy::PowerSaver => Some(("powersave", "power")),
        CpuPolicy::Balanced => Some(("powersave", "balance_performance")),
        CpuPolicy::Performance => Some(("performance", "performance")),
        CpuPolicy::Keep => None,
    }
}

fn dir(policy: &str) -> String {
    format!("{POLICIES}/{policy}")
}

/// The policies this machine has, with what they are set to now.
pub fn read(root: &SysRoot) -> Vec<PolicySettings> {
    root.list(POLICIES)
        .into_iter()
        .filter(|n| {
            n.strip_prefix("policy")
                .is_some_and(|i| i.parse::<u32>().is_ok())
        })
        .filter_map(|policy| {
            let d = dir(&policy);
            let governor = root.read(&format!("{d}/scaling_governor")).ok()?;
            let epp = root
                .read(&format!("{d}/energy_performance_preference"))
                .ok()
                .map(|e| e.trim().to_string());
            Some(PolicySettings {
                policy,
                governor: governor.trim().to_string(),
                epp,
            })
        })
        .collect()
}

/// Whether the governor files can be written (the `auto` method's test for cpufreq).
pub fn writable(root: &SysRoot) -> bool {
    let policies = read(root);
    !policies.is_empty()
        && policies.iter().all(|p| {
            let path = root.path(&format!("{}/scaling_governor", dir(&p.policy)));
            nix::unistd::access(&path, nix::unistd::AccessFlags::W_OK).is_ok()
        })
}

/// The writes that make each policy of `settings` what it says, in order, one list per
/// policy; only what differs from `now`. The preference cannot be changed while the
/// governor is `performance` (amd-pstate answers EBUSY), so toward `performance` it goes
/// first, under the governor still in place; otherwise the governor goes first.
pub fn plan(now: &[PolicySettings], settings: &[PolicySettings]) -> Vec<Vec<Request>> {
    settings
        .iter()
        .map(|s| {
            let current = now.iter().find(|p| p.policy == s.policy);
            let governor = current
                .is_none_or(|c| c.governor != s.governor)
                .then(|| Request::governor(&s.policy, &s.governor));
            let epp = s.epp.as_ref().and_then(|epp| {
                let differs = current.is_none_or(|c| c.epp.as_ref() != Some(epp));
                differs.then(|| Request::epp(&s.policy, epp))
            });
            if s.governor == "performance" {
                // Under a governor that is already performance, the preference is fixed.
                let was_performance = current.is_some_and(|c| c.governor == "performance");
                let epp = epp.filter(|_| !was_performance);
                epp.into_iter().chain(governor).collect()
            } else {
                governor.into_iter().chain(epp).collect()
            }
        })
        .filter(|writes: &Vec<Request>| !writes.is_empty())
        .collect()
}

/// Writes `settings` to each policy, as [`plan`] orders it. A policy stops at its first
/// failure, and the others go on: every failure is returned, with its file.
pub async fn apply(writer: &Writer, settings: &[PolicySettings]) -> Vec<String> {
    let now = read(writer.root());
    let mut problems = Vec::new();
    for writes in plan(&now, settings) {
        for w in writes {
            if let Err(e) = writer.write(&w).await {
                problems.push(e);
                break;
            }
        }
    }
    problems
}

/// The cpufreq drivers whose energy preference dsv4 sets, as power-profiles-daemon does:
/// amd-pstate in active mode (`amd-pstate-epp`) and intel_pstate in active mode. Under the
/// others (acpi-cpufreq, amd-pstate in passive or guided mode, `intel_cpufreq`), the
/// `powersave` governor pins the CPUs at their lowest frequency, so they are left alone.
pub const EPP_DRIVERS: [&str; 2] = ["amd-pstate-epp", "intel_pstate"];

/// What the policies found become under a CPU policy of the configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    /// The policies dsv4 sets, with what it sets them to.
    pub set: Vec<PolicySettings>,
    /// The policies left as they are, with their driver (`?` when it cannot be read).
    pub left: Vec<(String, String)>,
}

impl Targets {
    /// The status note for the policies left alone, if any.
    pub fn left_note(&self) -> Option<String> {
        if self.left.is_empty() {
            return None;
        }
        let list: Vec<String> = self
            .left
            .iter()
            .map(|(policy, driver)| format!("{policy} ({driver})"))
            .collect();
        Some(format!(
            "{} left as {}: only {} in active mode take an energy preference, and the powersave governor would pin the others at their lowest frequency",
            list.join(", "),
            if self.left.len() == 1 { "it is" } else { "they are" },
            EPP_DRIVERS.join(" or "),
        ))
    }
}

/// What `found` becomes under `cpu`: on the policies of an [`EPP_DRIVERS`] driver with an
/// energy preference, the target governor and the target preference (where it is offered);
/// the other policies are left alone.
pub fn targeted(root: &SysRoot, found: &[PolicySettings], cpu: CpuPolicy) -> Targets {
    let Some((governor, epp)) = target(cpu) else {
        return Targets::default();
    };
    let mut targets = Targets::default();
    for p in found {
        let d = dir(&p.policy);
        let driver = root
            .read(&format!("{d}/scaling_driver"))
            .map(|d| d.trim().to_string())
            .unwrap_or_else(|_| "?".to_string());
        if !EPP_DRIVERS.contains(&driver.as_str()) || p.epp.is_none() {
            targets.left.push((p.policy.clone(), driver));
            continue;
        }
        let available = root
            .read(&format!("{d}/energy_performance_available_preferences"))
            .unwrap_or_default();
        let offered = available.split_whitespace().any(|a| a == epp) || available.is_empty();
        targets.set.push(PolicySettings {
            policy: p.policy.clone(),
            governor: governor.to_string(),
            epp: Some(
                if offered {
                    epp
                } else {
                    p.epp.as_deref().unwrap_or(epp)
                }
                .to_string(),
            ),
        });
    }
    targets
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four policies: two of amd-pstate in active mode (one under `performance`), one of
    /// acpi-cpufreq and one of amd-pstate in passive mode.
    fn tree() -> (tempfile::TempDir, SysRoot) {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("sys/devices/system/cpu/cpufreq");
        for (i, driver, gov, epp) in [
            (
                0,
                "amd-pstate-epp",
                "powersave",
                Some("balance_performance"),
            ),
            (1, "amd-pstate-epp", "performance", Some("performance")),
            (2, "acpi-cpufreq", "schedutil", None),
            (3, "amd-pstate", "schedutil", None),
        ] {
            let p = base.join(format!("policy{i}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("scaling_driver"), format!("{driver}\n")).unwrap();
            std::fs::write(p.join("scaling_governor"), format!("{gov}\n")).unwrap();
            if let Some(e) = epp {
                std::fs::write(p.join("energy_performance_preference"), format!("{e}\n")).unwrap();
                std::fs::write(
                    p.join("energy_performance_available_preferences"),
                    "default performance balance_performance balance_power power \n",
                )
                .unwrap();
            }
        }
        std::fs::write(base.join("boost"), "1\n").unwrap();
        let root = SysRoot::new(dir.path()).unwrap();
        (dir, root)
    }

    #[tokio::test]
    async fn power_saver_then_back_exactly() {
        let (_dir, root) = tree();
        let w = Writer::with_bus(root.clone(), None);
        let found = read(&root);
        assert_eq!(found.len(), 4);
        assert_eq!(found[1].governor, "performance");
        assert_eq!(found[2].epp, None);
        let want = targeted(&root, &found, CpuPolicy::PowerSaver);
        assert_eq!(
            want.left,
            [
                ("policy2".to_string(), "acpi-cpufreq".to_string()),
                ("policy3".to_string(), "amd-pstate".to_string())
            ]
        );
        assert!(want.left_note().unwrap().starts_with(
            "policy2 (acpi-cpufreq), policy3 (amd-pstate) left as they are: only amd-pstate-epp or intel_pstate in active mode"
        ));
        assert!(apply(&w, &want.set).await.is_empty());
        let now = read(&root);
        assert_eq!(now[0].governor, "powersave");
        assert_eq!(now[1].governor, "powersave");
        assert_eq!(now[0].epp.as_deref(), Some("power"));
        assert_eq!(now[1].epp.as_deref(), Some("power"));
        // The others would be pinned at their lowest frequency by powersave: not touched.
        assert_eq!(now[2..], found[2..]);
        assert!(apply(&w, &found).await.is_empty());
        assert_eq!(read(&root), found);
        assert_eq!(targeted(&root, &found, CpuPolicy::Keep), Targets::default());
    }

    #[tokio::test]
    async fn failures_name_the_file_and_the_rest_go_on() {
        let (dir, root) = tree();
        let w = Writer::with_bus(root.clone(), None);
        let found = read(&root);
        // policy1's governor cannot be written: a folder in its place.
        let gov = dir
            .path()
            .join("sys/devices/system/cpu/cpufreq/policy1/scaling_governor");
        std::fs::remove_file(&gov).unwrap();
        std::fs::create_dir(&gov).unwrap();
        let problems = apply(&w, &targeted(&root, &found, CpuPolicy::PowerSaver).set).await;
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].contains("policy1/scaling_governor"),
            "{problems:?}"
        );
        assert_eq!(read(&root)[0].governor, "powersave");
    }

    #[test]
    fn the_plan_orders_governor_and_preference_as_amd_pstate_needs() {
        let p = |gov: &str, epp: Option<&str>| PolicySettings {
            policy: "policy0".into(),
            governor: gov.into(),
            epp: epp.map(String::from),
        };
        let g = |v: &str| Request::governor("policy0", v);
        let e = |v: &str| Request::epp("policy0", v);
        for (now, want, writes) in [
            // From performance to power-saver: the governor first, then the preference.
            (
                p("performance", Some("performance")),
                p("powersave", Some("power")),
                vec![g("powersave"), e("power")],
            ),
            // Toward performance: the preference first, under the governor in place.
            (
                p("powersave", Some("power")),
                p("performance", Some("performance")),
                vec![e("performance"), g("performance")],
            ),
            // Already performance: its preference is fixed, only nothing to do.
            (
                p("performance", Some("performance")),
                p("performance", Some("balance_performance")),
                vec![],
            ),
            // Only what differs.
            (
                p("powersave", Some("balance_power")),
                p("powersave", Some("power")),
                vec![e("power")],
            ),
            (
                p("schedutil", None),
                p("powersave", None),
                vec![g("powersave")],
            ),
            (
                p("powersave", Some("power")),
                p("powersave", Some("power")),
                vec![],
            ),
        ] {
            let got = plan(std::slice::from_ref(&now), std::slice::from_ref(&want));
            let got: Vec<Request> = got.into_iter().flatten().collect();
            assert_eq!(got, writes, "{now:?} -> {want:?}");
        }
    }
}
