//! The host below the service: the kernel and its firmware against what Strix Halo users
//! report, amdgpu's resets and faults in this boot's log, the IOMMU, the GTT ceiling and the
//! BIOS carve-out.
//!
//! Follows: `/proc/sys/kernel/osrelease`, `/proc/cmdline`, `/sys/module/ttm/parameters/
//! pages_limit` (pages of 4096 bytes) and `/sys/module/amdgpu/parameters/gttsize` (MiB, -1
//! for the default), `/sys/class/iommu/`, dpkg's status file and pacman's local database for
//! the linux-firmware version, and amdgpu's own messages (`GPU reset begin!`, `GPU
//! reset(N) succeeded!`/`failed`, `MES failed to respond`, `[gfxhub] page fault`, `ring ...
//! timeout`). Owns: these checks, on a sysroot and a kernel log given to it. Must not: need
//! more than read access; a log it cannot read is said, not guessed.

use std::path::Path;
use std::time::Duration;

use crate::host::hw::{amdgpu, meminfo};
use crate::host::sysroot::SysRoot;

use super::{Check, RunError};

/// How long `journalctl` may take.
const JOURNAL_LIMIT: Duration = Duration::from_secs(20);
/// The first kernel Strix Halo users report as good.
const GOOD_KERNEL: (u32, u32, u32) = (6, 18, 4);
/// A linux-firmware release reported broken on Strix Halo.
const BAD_FIRMWARE: &str = "20251125";
const KYUZ0: &str = "kyuz0/amd-strix-halo-toolboxes (README)";
const PAGE: u64 = 4096;
const GIB: u64 = 1 << 30;

/// This boot's kernel log, or why it could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelLog {
    Text(String),
    Unreadable(String),
}

/// This boot's kernel messages, from the journal (`journalctl -k -b 0`); a caller outside
/// the journal's readers gets them said to be unreadable, with the reason.
pub async fn read_log() -> KernelLog {
    let mut cmd = tokio::process::Command::new("journalctl");
    cmd.args(["-k", "-b", "0", "-o", "short-monotonic", "--no-pager", "-q"]);
    match super::run_bounded(cmd, JOURNAL_LIMIT).await {
        Err(RunError::Spawn(e)) => KernelLog::Unreadable(format!("cannot run journalctl: {e}")),
        Err(RunError::Timeout) => KernelLog::Unreadable(format!(
            "journalctl did not answer within {}",
            dsv4_client::duration::format(JOURNAL_LIMIT)
        )),
        Err(RunError::Wait(e)) => KernelLog::Unreadable(format!("journalctl: {e}")),
        Ok(ran) => {
            let err = ran.stderr.trim().to_string();
            if !ran.status.success() {
                KernelLog::Unreadable(format!(
                    "journalctl -k failed: {}",
                    if err.is_empty() {
                        ran.status.to_string()
                    } else {
                        err
                    }
                ))
            } else if ran.stdout.trim().is_empty() {
                KernelLog::Unreadable(if err.is_empty() {
                    "journalctl -k gave no kernel messages for this boot (no permission to read \
                     the system journal?)"
                        .to_string()
                } else {
                    err
                })
            } else {
                KernelLog::Text(ran.stdout)
            }
        }
    }
}

/// A saved log (dmesg or journal output).
pub fn read_log_file(path: &Path) -> KernelLog {
    match std::fs::read(path) {
        Ok(bytes) => KernelLog::Text(String::from_utf8_lossy(&bytes).into_owned()),
        Err(e) => KernelLog::Unreadable(format!("cannot read {}: {e}", path.display())),
    }
}

/// Every host check, in order.
pub fn checks(root: &SysRoot, log: &KernelLog) -> Vec<Check> {
    let card = amdgpu::Card::find(root);
    vec![
        version(root),
        firmware(root),
        gpu_errors(log),
        iommu(root),
        gtt_limit(root, card.as_ref()),
        carve_out(root, card.as_ref()),
    ]
}

/// `6.18.5-arch1-1` -> (6, 18, 5); `6.19-rc3` -> (6, 19, 0).
pub fn kernel_version(release: &str) -> Option<(u32, u32, u32)> {
    let numeric: String = release
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let mut parts = numeric.split('.').filter(|p| !p.is_empty());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    let patch = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    Some((major, minor, patch))
}

fn version(root: &SysRoot) -> Check {
    let id = "kernel.version";
    let Ok(release) = root.read("/proc/sys/kernel/osrelease") else {
        return Check::skip(id, "cannot read /proc/sys/kernel/osrelease");
    };
    let release = release.trim();
    match kernel_version(release) {
        None => Check::skip(id, format!("cannot tell the version of kernel {release:?}")),
        Some(v) if v >= GOOD_KERNEL => Check::ok(id, format!("kernel {release}")),
        Some(_) => Check::warn(
            id,
            format!(
                "kernel {release} is older than 6.18.4, the first Strix Halo users report as \
                 good"
            ),
            "install 6.18.4 or later (on Debian, from backports: `sudo apt install -t \
             trixie-backports linux-image-amd64`)",
        )
        .source(KYUZ0),
    }
}

/// The linux-firmware packages dsv4 looks for, by package manager.
const FIRMWARE_PACKAGES: [&str; 3] = [
    "firmware-amd-graphics",
    "linux-firmware",
    "amd-gpu-firmware",
];

/// `(package, version)` of each installed firmware package in dpkg's status file.
pub fn dpkg_firmware(status: &str) -> Vec<(String, String)> {
    status
        .split("\n\n")
        .filter_map(|stanza| {
            let field = |name: &str| {
                stanza.lines().find_map(|l| {
                    l.strip_prefix(name)
                        .and_then(|r| r.strip_prefix(':'))
                        .map(|v| v.trim().to_string())
                })
            };
            let package = field("Package")?;
            let installed = field("Status").is_some_and(|s| s.ends_with(" installed"));
            (installed && FIRMWARE_PACKAGES.contains(&package.as_str()))
                .then(|| Some((package, field("Version")?)))
                .flatten()
        })
        .collect()
}

/// `(package, version)` of each linux-firmware package in pacman's local database
/// (`linux-firmware-20251125.abc-1`, `linux-firmware-amdgpu-20251125.abc-1`).
pub fn pacman_firmware(entries: &[String]) -> Vec<(String, String)> {
    entries
        .iter()
        .filter_map(|e| {
            // name-version-release: the last two dash-separated parts are the version.
            let mut parts = e.rsplitn(3, '-');
            let release = parts.next()?;
            let version = parts.next()?;
            let name = parts.next()?;
            (name == "linux-firmware" || name.starts_with("linux-firmware-amd"))
                .then(|| (name.to_string(), format!("{version}-{release}")))
        })
        .collect()
}

fn firmware(root: &SysRoot) -> Check {
    let id = "kernel.firmware";
    let mut found = root
        .read("/var/lib/dpkg/status")
        .map(|s| dpkg_firmware(&s))
        .unwrap_or_default();
    found.extend(pacman_firmware(&root.list("/var/lib/pacman/local")));
    if found.is_empty() {
        return Check::skip(
            id,
            "could not tell the linux-firmware version (no dpkg or pacman record of it)",
        );
    }
    let shown: Vec<String> = found.iter().map(|(p, v)| format!("{p} {v}")).collect();
    if found.iter().any(|(_, v)| v.contains(BAD_FIRMWARE)) {
        Check::warn(
            id,
            format!(
                "{}: linux-firmware {BAD_FIRMWARE} is reported broken on Strix Halo",
                shown.join(", ")
            ),
            format!("install another linux-firmware than {BAD_FIRMWARE} (an older or a newer one)"),
        )
        .source(KYUZ0)
    } else {
        Check::ok(id, shown.join(", "))
    }
}

/// The kinds of amdgpu trouble, by what the driver writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Trouble {
    Reset,
    Mes,
    PageFault,
    Timeout,
}

impl Trouble {
    fn name(self) -> &'static str {
        match self {
            Trouble::Reset => "GPU resets",
            Trouble::Mes => "MES errors",
            Trouble::PageFault => "GPU page faults",
            Trouble::Timeout => "ring timeouts",
        }
    }
}

/// What an amdgpu line of the kernel log reports, if it is trouble.
pub fn trouble(line: &str) -> Option<Trouble> {
    let l = line.to_ascii_lowercase();
    if !l.contains("amdgpu") {
        return None;
    }
    if l.contains("mes failed to respon") || l.contains("mes ring buffer is full") {
        Some(Trouble::Mes)
    } else if l.contains("gpu reset") || l.contains("gpu recovery") || l.contains("mode2 reset") {
        Some(Trouble::Reset)
    } else if l.contains("page fault") || l.contains("protection_fault") {
        Some(Trouble::PageFault)
    } else if (l.contains("ring ") && l.contains("timeout")) || l.contains("job timed out") {
        Some(Trouble::Timeout)
    } else {
        None
    }
}

fn gpu_errors(log: &KernelLog) -> Check {
    let id = "kernel.gpu_errors";
    let text = match log {
        KernelLog::Unreadable(why) => {
            return Check::skip(
                id,
                format!(
                    "could not look for amdgpu resets: {why}; run `sudo dsv4ctl doctor`, or \
                     join the adm group"
                ),
            )
        }
        KernelLog::Text(t) => t,
    };
    let mut counts = std::collections::BTreeMap::new();
    let mut first = None;
    let mut lines = 0usize;
    for line in text.lines() {
        lines += 1;
        if let Some(t) = trouble(line) {
            *counts.entry(t).or_insert(0usize) += 1;
            first.get_or_insert(line.trim());
        }
    }
    let Some(first) = first else {
        return Check::ok(
            id,
            format!(
                "no amdgpu resets, MES errors or GPU faults since boot ({} kernel lines read)",
                dsv4_client::units::thousands(lines as u64)
            ),
        );
    };
    let said: Vec<String> = counts
        .iter()
        .map(|(t, n)| format!("{n} {}", t.name()))
        .collect();
    let quoted: String = first.chars().take(200).collect();
    Check::fail(
        id,
        format!("since boot: {}; first: {quoted}", said.join(", ")),
        "see `journalctl -k -b`; Strix Halo users report fewer false resets with \
         `amdgpu.lockup_timeout=20000` and fewer MES hangs with `amd_iommu=off` (which \
         disables the NPU) on the kernel command line",
    )
    .source("defilantech/LLMKube PR #886; antirez/ds4 STRIXHALO.md; ROCm #5724, #6598")
}

/// The value of `name=` on the kernel command line.
fn cmdline_value<'a>(cmdline: &'a str, name: &str) -> Option<&'a str> {
    cmdline
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v)
        .next_back()
}

fn iommu(root: &SysRoot) -> Check {
    let id = "host.iommu";
    let cmdline = root.read("/proc/cmdline").unwrap_or_default();
    let units = root.list("/sys/class/iommu");
    let off_by = ["amd_iommu", "iommu"]
        .into_iter()
        .find(|k| cmdline_value(&cmdline, k) == Some("off"));
    let found = match (off_by, units.is_empty()) {
        (Some(k), _) => {
            format!("IOMMU off ({k}=off): reported to stop MES hangs, but the NPU is off with it")
        }
        (None, false) => format!(
            "IOMMU on ({}); amd_iommu=off is reported to stop MES hangs, but disables the NPU",
            units.join(", ")
        ),
        (None, true) => "no IOMMU is active".to_string(),
    };
    Check::ok(id, found).source("antirez/ds4 STRIXHALO.md")
}

fn gtt_limit(root: &SysRoot, card: Option<&amdgpu::Card>) -> Check {
    let id = "memory.gtt_limit";
    let Some(card) = card else {
        return Check::skip(id, "no AMD GPU found under /sys/class/drm");
    };
    let gib = dsv4_client::units::format_gib;
    let cmdline = root.read("/proc/cmdline").unwrap_or_default();
    let pages: Option<u64> = root
        .value("/sys/module/ttm/parameters/pages_limit")
        .ok()
        .or_else(|| cmdline_value(&cmdline, "ttm.pages_limit")?.parse().ok());
    let gttsize: Option<i64> = root
        .value("/sys/module/amdgpu/parameters/gttsize")
        .ok()
        .or_else(|| cmdline_value(&cmdline, "amdgpu.gttsize")?.parse().ok())
        .filter(|v| *v != -1);
    let total = card.memory(root).gtt_total;
    let mem_total = meminfo::read(root).map(|m| m.total);
    let (Some(total), Some(mem_total)) = (total, mem_total) else {
        return Check::skip(id, "the GPU or /proc/meminfo does not say the GTT's size");
    };
    let mut found = format!("GTT {} of {} of RAM", gib(total), gib(mem_total));
    if let Some(p) = pages {
        found += &format!(", ttm.pages_limit {p} ({})", gib(p * PAGE));
    }
    let source = "noamsto/nix-amd-ai #42; antirez/ds4 STRIXHALO.md";
    if let (Some(size), Some(_)) = (gttsize, pages) {
        return Check::warn(
            id,
            format!("{found}, and amdgpu.gttsize {size} MiB as well: amdgpu.gttsize is deprecated"),
            "keep only ttm.pages_limit on the kernel command line (remove amdgpu.gttsize)",
        )
        .source(source);
    }
    if total < mem_total / 4 * 3 {
        let want = mem_total.saturating_sub(8 * GIB) / PAGE;
        return Check::warn(
            id,
            format!("{found}: less than three quarters of RAM can go to the GPU"),
            format!(
                "add `ttm.pages_limit={want}` ({}, all but 8 GiB) to the kernel command line \
                 (GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub, then `sudo update-grub` and \
                 a reboot)",
                gib(want * PAGE)
            ),
        )
        .source(source);
    }
    Check::ok(id, found)
}

fn carve_out(root: &SysRoot, card: Option<&amdgpu::Card>) -> Check {
    let id = "host.vram_carveout";
    let Some(card) = card else {
        return Check::skip(id, "no AMD GPU found under /sys/class/drm");
    };
    let m = card.memory(root);
    let Some(vram) = m.vram_total else {
        return Check::skip(id, "the GPU does not say its VRAM size");
    };
    let size = dsv4_client::units::format_size(vram);
    let found = match m.pool() {
        Some(dsv4_client::telemetry::MemoryPool::Vram) => format!(
            "{size} carve-out in the BIOS: the model lives in VRAM, and system RAM is that much \
             smaller"
        ),
        _ => format!("{size} carve-out: the model goes in GTT"),
    };
    Check::ok(id, found).source(KYUZ0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions() {
        assert_eq!(kernel_version("6.18.5-arch1-1"), Some((6, 18, 5)));
        assert_eq!(kernel_version("6.12.48+deb13-amd64"), Some((6, 12, 48)));
        assert_eq!(kernel_version("6.19-rc3"), Some((6, 19, 0)));
        assert_eq!(kernel_version("6.18.4"), Some((6, 18, 4)));
        assert_eq!(kernel_version("banana"), None);
        assert!(kernel_version("6.18.3-1").unwrap() < GOOD_KERNEL);
        assert!(kernel_version("6.18.4-1").unwrap() >= GOOD_KERNEL);
    }

    #[test]
    fn firmware_records() {
        let status = "Package: firmware-amd-graphics\nStatus: install ok installed\n\
                      Version: 20251125-1\n\nPackage: linux-firmware\nStatus: deinstall ok \
                      config-files\nVersion: 1\n\nPackage: bash\nStatus: install ok installed\n\
                      Version: 5.2\n";
        assert_eq!(
            dpkg_firmware(status),
            [("firmware-amd-graphics".into(), "20251125-1".into())]
        );
        let local: Vec<String> = [
            "linux-firmware-20251111.1a2b-1",
            "linux-firmware-amdgpu-20251111.1a2b-1",
            "linux-6.18.5-1",
            "linux-firmware-whence-20251111.1a2b-1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            pacman_firmware(&local),
            [
                ("linux-firmware".to_string(), "20251111.1a2b-1".to_string()),
                (
                    "linux-firmware-amdgpu".to_string(),
                    "20251111.1a2b-1".to_string()
                )
            ]
        );
    }

    #[test]
    fn amdgpu_trouble_by_its_words() {
        for (line, want) in [
            (
                "[ 812.1] kernel: amdgpu 0000:c5:00.0: amdgpu: MES failed to respond to msg=REMOVE_QUEUE",
                Some(Trouble::Mes),
            ),
            (
                "[ 812.2] kernel: amdgpu 0000:c5:00.0: amdgpu: GPU reset begin!",
                Some(Trouble::Reset),
            ),
            (
                "[ 812.3] kernel: amdgpu 0000:c5:00.0: amdgpu: GPU reset(1) failed",
                Some(Trouble::Reset),
            ),
            (
                "[ 9.1] kernel: amdgpu 0000:c5:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:24 vmid:3 pasid:32770)",
                Some(Trouble::PageFault),
            ),
            (
                "[ 9.2] kernel: [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx_0.0.0 timeout, signaled seq=1, emitted seq=3",
                Some(Trouble::Timeout),
            ),
            (
                "[ 2.0] kernel: amdgpu 0000:c5:00.0: amdgpu: SMU is initialized successfully!",
                None,
            ),
            ("[ 2.0] kernel: usb 1-1: reset high-speed USB device", None),
        ] {
            assert_eq!(trouble(line), want, "{line}");
        }
        let c = gpu_errors(&KernelLog::Text(
            "a amdgpu: fine\nb amdgpu: GPU reset begin!\nc amdgpu: MES failed to respond to msg=X\n"
                .into(),
        ));
        assert_eq!(c.verdict, super::super::Verdict::Fail);
        assert!(
            c.found.contains("1 GPU resets, 1 MES errors"),
            "{}",
            c.found
        );
        assert!(
            c.found.contains("first: b amdgpu: GPU reset begin!"),
            "{}",
            c.found
        );
        let c = gpu_errors(&KernelLog::Unreadable("no permission".into()));
        assert_eq!(c.verdict, super::super::Verdict::Skip);
        assert!(c.found.contains("no permission"), "{}", c.found);
    }

    #[test]
    fn the_command_line() {
        let c = "BOOT_IMAGE=/vmlinuz ro quiet ttm.pages_limit=29360128 amd_iommu=off";
        assert_eq!(cmdline_value(c, "ttm.pages_limit"), Some("29360128"));
        assert_eq!(cmdline_value(c, "amd_iommu"), Some("off"));
        assert_eq!(cmdline_value(c, "iommu"), None);
    }
}
