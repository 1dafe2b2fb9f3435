//! Does each profile fit in this machine's memory, and with what margin?
//!
//! The daemon's own admission rule ([`MemoryCheck::shortfall`]) judges, on the figures it
//! reads before a start ([`crate::host::hw::memory_now`]: `MemAvailable` less `CmaFree`, and
//! the GPU's GTT and VRAM) and the need it charges ([`need::of`]: `planned_memory`, else the
//! estimate from the model's files, its context and batch flags). Owns: saying so per
//! profile. Must not: keep a second copy of the rule.

use crate::config::Config;
use crate::host::hw::meminfo;
use crate::host::sysroot::SysRoot;
use crate::lifecycle::need;
use crate::lifecycle::state::MemoryCheck;

use super::Check;

pub fn checks(config: &Config, root: &SysRoot) -> Vec<Check> {
    let gib = dsv4_client::units::format_gib;
    let now = crate::host::hw::memory_now(root);
    let swap = meminfo::read(root).map(|m| m.swap_total);
    let reserve = config.supervisor.memory.reserve;
    let mut out = Vec::new();
    for profile in config.profiles.values() {
        let need = need::of(profile);
        let check = MemoryCheck {
            planned: need.charged(),
            estimated: need.planned.is_none(),
            reserve,
            now,
        };
        if check.planned.is_none() {
            out.push(
                Check::skip(
                    "memory.fit",
                    "its need is not known (no planned_memory, and the model could not be read)",
                )
                .profile(&profile.name),
            );
            continue;
        }
        let gpu = now.gpu;
        let gtt_free = match (gpu.gtt_used, gpu.gtt_total) {
            (Some(u), Some(t)) => Some(t.saturating_sub(u)),
            _ => None,
        };
        let mut figures = vec![format!("needs {}", need.describe())];
        if let Some(a) = now.available {
            figures.push(format!("{} available (MemAvailable less CmaFree)", gib(a)));
        }
        if let (Some(free), Some(total)) = (gtt_free, gpu.gtt_total) {
            figures.push(format!("GTT {} free of {}", gib(free), gib(total)));
        }
        figures.push(format!("reserve {}", gib(reserve)));
        if let Some(s) = swap {
            figures.push(format!("swap {}", gib(s)));
        }
        let check = match check.shortfall() {
            Some(short) => Check::fail(
                "memory.fit",
                format!("{}: {}", short.describe(&profile.name), figures.join(", ")),
                "lower the profile's context or ubatch, or a quantized kv_cache; raise the GTT \
                 ceiling (ttm.pages_limit, see memory.gtt_limit); or stop what else holds \
                 memory. A running engine counts: check with `dsv4ctl stop` first",
            ),
            None => Check::ok(
                "memory.fit",
                format!(
                    "fits{}: {}",
                    check
                        .margin()
                        .map_or(String::new(), |m| format!(" with {} to spare", gib(m))),
                    figures.join(", ")
                ),
            ),
        };
        out.push(check.profile(&profile.name));
    }
    out
}
