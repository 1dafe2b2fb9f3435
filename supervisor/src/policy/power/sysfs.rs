//! The power policy's writes to sysfs, and the one privileged path that makes them on a box
//! where dsv4d may not.
//!
//! dsv4d runs as the unprivileged `dsv4` user under a hardened unit: the files it sets (the
//! GPU's `power_dpm_force_performance_level`, each cpufreq policy's `scaling_governor` and
//! `energy_performance_preference`) are root-owned 0644, and `ProtectSystem=strict` with
//! `ProtectKernelTunables=yes` keeps `/sys` read-only to it. So a write it cannot make
//! itself goes to `dsv4-sysfs@INSTANCE.service`, a root oneshot template unit that dsv4d
//! starts through systemd's D-Bus API (`StartUnit`), and that polkit lets the `dsv4` user
//! start and nothing else (`units/50-dsv4.rules`). Its instance name is the whole request
//! (`gpu:card1:auto`, `governor:policy0:powersave`, `epp:policy0:power`): a card or policy
//! by name (no path), and a value that the helper checks against the kernel's own list
//! before it writes (`dsv4-sysfs`, `supervisor/src/bin/dsv4-sysfs.rs`). pkexec, which
//! GameMode uses for the same file, cannot work under `NoNewPrivileges=yes`; a udev rule
//! would make the files writable by a group for good, not only for this.
//!
//! Owns: the request (its parse, its check, its file) and the writer that makes it, direct
//! or through the unit. Must not: decide what to write or when (the power task does).

use std::sync::Arc;
use std::time::Duration;

use crate::host::sysroot::SysRoot;
use crate::host::units;

/// The template unit, `dsv4-sysfs@INSTANCE.service`.
pub const UNIT_PREFIX: &str = "dsv4-sysfs@";
pub const UNIT_SUFFIX: &str = ".service";

/// The helper's exit code for a request it refused (sysexits' EX_USAGE)...
pub const EXIT_REFUSED: i32 = 64;
/// ...and for a write that failed (EX_IOERR).
pub const EXIT_WRITE_FAILED: i32 = 74;

/// The GPU's performance levels, as Documentation/gpu/amdgpu/thermal.rst lists them.
pub const GPU_LEVELS: [&str; 9] = [
    "auto",
    "low",
    "high",
    "manual",
    "profile_standard",
    "profile_min_sclk",
    "profile_min_mclk",
    "profile_peak",
    "perf_determinism",
];

const DRM: &str = "/sys/class/drm";
const CPUFREQ: &str = "/sys/devices/system/cpu/cpufreq";
const AMD: &str = "0x1002";

/// Which file a request writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `cardN`'s `power_dpm_force_performance_level`.
    GpuLevel { card: String },
    /// `policyN`'s `scaling_governor`.
    Governor { policy: String },
    /// `policyN`'s `energy_performance_preference`.
    Epp { policy: String },
}

/// One write: a file, by the name of its card or policy, and the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub target: Target,
    pub value: String,
}

/// `prefix` followed by a number (`card1`, `policy0`), nothing else.
fn numbered(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|n| !n.is_empty() && n.len() <= 4 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A sysfs word: lower-case letters, digits and `_`, as every value of these files is.
fn word(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 32
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

impl Request {
    pub fn gpu_level(card: &str, level: &str) -> Request {
        Request {
            target: Target::GpuLevel { card: card.into() },
            value: level.into(),
        }
    }

    pub fn governor(policy: &str, governor: &str) -> Request {
        Request {
            target: Target::Governor {
                policy: policy.into(),
            },
            value: governor.into(),
        }
    }

    pub fn epp(policy: &str, epp: &str) -> Request {
        Request {
            target: Target::Epp {
                policy: policy.into(),
            },
            value: epp.into(),
        }
    }

    /// The request an instance name stands for; the error says what is wrong with it.
    pub fn parse(instance: &str) -> Result<Request, String> {
        let bad = |why: &str| format!("bad request {instance:?}: {why}");
        let mut parts = instance.split(':');
        let (Some(kind), Some(name), Some(value), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("want KIND:NAME:VALUE (gpu:card1:auto, governor:policy0:powersave, epp:policy0:power)"));
        };
        if !word(value) {
            return Err(bad("the value must be a lower-case sysfs word"));
        }
        let target = match kind {
            "gpu" if numbered(name, "card") => Target::GpuLevel { card: name.into() },
            "governor" if numbered(name, "policy") => Target::Governor {
                policy: name.into(),
            },
            "epp" if numbered(name, "policy") => Target::Epp {
                policy: name.into(),
            },
            "gpu" => return Err(bad("a GPU is named cardN")),
            "governor" | "epp" => return Err(bad("a cpufreq policy is named policyN")),
            _ => return Err(bad("the kind is gpu, governor or epp")),
        };
        Ok(Request {
            target,
            value: value.into(),
        })
    }

    /// The unit instance that carries it.
    pub fn instance(&self) -> String {
        let (kind, name) = match &self.target {
            Target::GpuLevel { card } => ("gpu", card),
            Target::Governor { policy } => ("governor", policy),
            Target::Epp { policy } => ("epp", policy),
        };
        format!("{kind}:{name}:{}", self.value)
    }

    /// `dsv4-sysfs@INSTANCE.service`.
    pub fn unit(&self) -> String {
        format!("{UNIT_PREFIX}{}{UNIT_SUFFIX}", self.instance())
    }

    /// The system path of the file it writes.
    pub fn file(&self) -> String {
        match &self.target {
            Target::GpuLevel { card } => {
                format!("{DRM}/{card}/device/power_dpm_force_performance_level")
            }
            Target::Governor { policy } => format!("{CPUFREQ}/{policy}/scaling_governor"),
            Target::Epp { policy } => {
                format!("{CPUFREQ}/{policy}/energy_performance_preference")
            }
        }
    }

    /// Whether the machine allows it: an AMD card and one of the kernel's levels; a governor
    /// or preference that the policy lists as available. This is the helper's guard.
    pub fn check(&self, root: &SysRoot) -> Result<(), String> {
        let listed = |file: String, what: &str| -> Result<(), String> {
            let text = root
                .read(&file)
                .map_err(|e| format!("cannot check {what} {:?}: {e}", self.value))?;
            if text.split_whitespace().any(|w| w == self.value) {
                Ok(())
            } else {
                Err(format!(
                    "{what} {:?} is not one of {} ({})",
                    self.value,
                    root.path(&file).display(),
                    text.trim()
                ))
            }
        };
        match &self.target {
            Target::GpuLevel { card } => {
                let vendor_file = format!("{DRM}/{card}/device/vendor");
                let vendor = root
                    .read(&vendor_file)
                    .map_err(|e| format!("cannot check the GPU: {e}"))?;
                if !vendor.trim().eq_ignore_ascii_case(AMD) {
                    return Err(format!(
                        "{card} is not an AMD GPU ({} says {})",
                        root.path(&vendor_file).display(),
                        vendor.trim()
                    ));
                }
                if !GPU_LEVELS.contains(&self.value.as_str()) {
                    return Err(format!(
                        "{:?} is not a GPU performance level ({})",
                        self.value,
                        GPU_LEVELS.join(", ")
                    ));
                }
                Ok(())
            }
            Target::Governor { policy } => listed(
                format!("{CPUFREQ}/{policy}/scaling_available_governors"),
                "the governor",
            ),
            Target::Epp { policy } => listed(
                format!("{CPUFREQ}/{policy}/energy_performance_available_preferences"),
                "the energy-performance preference",
            ),
        }
    }

    /// Writes it here and now, with its newline as sysfs shows it (the kernel ignores it).
    pub fn write_direct(&self, root: &SysRoot) -> std::io::Result<()> {
        std::fs::write(root.path(&self.file()), format!("{}\n", self.value))
    }
}

/// Whether a direct write failed for want of rights (and so the helper may do it).
fn denied(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc_errno::EACCES | libc_errno::EPERM | libc_errno::EROFS)
    )
}

mod libc_errno {
    pub const EPERM: i32 = nix::errno::Errno::EPERM as i32;
    pub const EACCES: i32 = nix::errno::Errno::EACCES as i32;
    pub const EROFS: i32 = nix::errno::Errno::EROFS as i32;
}

/// The helper's template unit, `dsv4-sysfs@.service`.
pub fn template_unit() -> String {
    format!("{UNIT_PREFIX}{UNIT_SUFFIX}")
}

/// How long a helper run may take before dsv4d gives up on it.
const HELPER_TIMEOUT: Duration = Duration::from_secs(30);

/// Makes the power policy's writes: itself where it may, else through the helper unit.
#[derive(Clone)]
pub struct Writer {
    root: SysRoot,
    /// The power policy's one connection to the system bus (for power-profiles-daemon and
    /// the helper): connected on first need, and again after a failed try.
    bus: Arc<tokio::sync::Mutex<Option<zbus::Connection>>>,
    /// Whether to connect at all (a writer given no bus never does).
    connect: bool,
}

impl Writer {
    /// A writer that connects to the system bus (`DBUS_SYSTEM_BUS_ADDRESS` is honoured) on
    /// first need.
    pub fn new(root: SysRoot) -> Writer {
        Writer {
            root,
            bus: Arc::default(),
            connect: true,
        }
    }

    /// A writer that asks the helper on `bus`, or on none.
    pub fn with_bus(root: SysRoot, bus: Option<zbus::Connection>) -> Writer {
        Writer {
            root,
            bus: Arc::new(tokio::sync::Mutex::new(bus)),
            connect: false,
        }
    }

    pub fn root(&self) -> &SysRoot {
        &self.root
    }

    /// The system bus, shared by everything the power policy asks there.
    pub async fn system_bus(&self) -> Result<zbus::Connection, String> {
        let mut slot = self.bus.lock().await;
        if let Some(c) = &*slot {
            return Ok(c.clone());
        }
        if !self.connect {
            return Err("no system bus".into());
        }
        let conn = zbus::Connection::system()
            .await
            .map_err(|e| format!("no system bus ({e})"))?;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    async fn bus(&self) -> Option<zbus::Connection> {
        self.system_bus().await.ok()
    }

    /// Whether the helper unit is installed where systemd can start it.
    pub async fn helper_installed(&self) -> bool {
        let Some(bus) = self.bus().await else {
            return false;
        };
        let Ok(manager) = units::manager(&bus).await else {
            return false;
        };
        let template = template_unit();
        let state: zbus::Result<String> = manager.call("GetUnitFileState", &(template,)).await;
        state.is_ok()
    }

    /// Writes `req` through the helper unit only, never directly: the doctor's dry run of
    /// the privileged path. The error says why it failed.
    pub async fn write_through_helper(&self, req: &Request) -> Result<(), String> {
        let bus = self.system_bus().await?;
        run_helper(&bus, req).await
    }

    /// Writes `req`; the error names the file, the value and each way that was tried.
    pub async fn write(&self, req: &Request) -> Result<(), String> {
        let path = self.root.path(&req.file());
        let direct = {
            let (root, r) = (self.root.clone(), req.clone());
            tokio::task::spawn_blocking(move || r.write_direct(&root))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
        };
        let e = match direct {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let what = format!("writing {:?} to {}", req.value, path.display());
        if !denied(&e) {
            return Err(format!("{what}: {e}"));
        }
        let Some(bus) = self.bus().await else {
            return Err(format!(
                "{what}: {e}, and there is no system bus to ask {} for it",
                req.unit()
            ));
        };
        match run_helper(&bus, req).await {
            Ok(()) => {
                tracing::debug!(
                    "power: {} wrote {:?} to {}",
                    req.unit(),
                    req.value,
                    path.display()
                );
                Ok(())
            }
            Err(why) => Err(format!("{what}: {e}; through {}: {why}", req.unit())),
        }
    }
}

/// Starts the helper unit for `req` and waits for its job (for [`HELPER_TIMEOUT`]); the
/// error says why it failed.
async fn run_helper(bus: &zbus::Connection, req: &Request) -> Result<(), String> {
    let unit = req.unit();
    let meaning = |code| match code {
        EXIT_REFUSED => Some("it refused the request"),
        EXIT_WRITE_FAILED => Some("its write failed"),
        _ => None,
    };
    units::start_and_wait(bus, &unit, HELPER_TIMEOUT)
        .await
        .map_err(|e| e.describe(&unit, &format!("{UNIT_PREFIX}*{UNIT_SUFFIX}"), meaning))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instances_parse_only_as_requests_of_known_shape() {
        for (instance, want) in [
            ("gpu:card1:auto", Ok(Request::gpu_level("card1", "auto"))),
            (
                "gpu:card0:profile_peak",
                Ok(Request::gpu_level("card0", "profile_peak")),
            ),
            (
                "governor:policy12:powersave",
                Ok(Request::governor("policy12", "powersave")),
            ),
            (
                "epp:policy0:balance_power",
                Ok(Request::epp("policy0", "balance_power")),
            ),
            ("gpu:card1", Err("want KIND:NAME:VALUE")),
            ("gpu:card1:auto:x", Err("want KIND:NAME:VALUE")),
            ("gpu:../../etc:auto", Err("a GPU is named cardN")),
            ("gpu:card1-eDP-1:auto", Err("a GPU is named cardN")),
            ("gpu:card:auto", Err("a GPU is named cardN")),
            (
                "governor:cpu0:powersave",
                Err("a cpufreq policy is named policyN"),
            ),
            ("epp:policy0:Power", Err("lower-case sysfs word")),
            ("epp:policy0:", Err("lower-case sysfs word")),
            ("epp:policy0:a b", Err("lower-case sysfs word")),
            ("boost:policy0:1", Err("the kind is gpu, governor or epp")),
        ] {
            match (Request::parse(instance), want) {
                (Ok(got), Ok(want)) => {
                    assert_eq!(got, want, "{instance}");
                    assert_eq!(got.instance(), instance, "round trip");
                }
                (Err(got), Err(want)) => assert!(got.contains(want), "{instance}: {got}"),
                (got, want) => panic!("{instance}: {got:?}, want {want:?}"),
            }
        }
        assert_eq!(
            Request::gpu_level("card1", "auto").unit(),
            "dsv4-sysfs@gpu:card1:auto.service"
        );
    }

    /// An AMD card1 (and a card0 of another vendor) and one policy with EPP.
    fn tree() -> (tempfile::TempDir, SysRoot) {
        let dir = tempfile::tempdir().unwrap();
        let sys = dir.path().join("sys");
        for (card, vendor) in [("card0", "0x8086"), ("card1", "0x1002")] {
            let d = sys.join("class/drm").join(card).join("device");
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(d.join("power_dpm_force_performance_level"), "low\n").unwrap();
        }
        let p = sys.join("devices/system/cpu/cpufreq/policy0");
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(p.join("scaling_governor"), "performance\n").unwrap();
        std::fs::write(
            p.join("scaling_available_governors"),
            "performance powersave\n",
        )
        .unwrap();
        std::fs::write(p.join("energy_performance_preference"), "performance\n").unwrap();
        std::fs::write(
            p.join("energy_performance_available_preferences"),
            "default performance balance_performance balance_power power \n",
        )
        .unwrap();
        let root = SysRoot::new(dir.path()).unwrap();
        (dir, root)
    }

    #[test]
    fn the_guard_allows_only_what_the_kernel_lists() {
        let (_dir, root) = tree();
        for (req, want) in [
            (Request::gpu_level("card1", "auto"), Ok(())),
            (Request::gpu_level("card1", "low"), Ok(())),
            (
                Request::gpu_level("card1", "turbo"),
                Err("not a GPU performance level"),
            ),
            (
                Request::gpu_level("card0", "auto"),
                Err("card0 is not an AMD GPU"),
            ),
            (
                Request::gpu_level("card7", "auto"),
                Err("cannot check the GPU"),
            ),
            (Request::governor("policy0", "powersave"), Ok(())),
            (
                Request::governor("policy0", "schedutil"),
                Err("is not one of"),
            ),
            (Request::epp("policy0", "power"), Ok(())),
            (Request::epp("policy0", "max"), Err("is not one of")),
            (Request::epp("policy3", "power"), Err("cannot check")),
        ] {
            match (req.check(&root), want) {
                (Ok(()), Ok(())) => {}
                (Err(got), Err(want)) => assert!(got.contains(want), "{req:?}: {got}"),
                (got, want) => panic!("{req:?}: {got:?}, want {want:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_writer_writes_what_it_may_itself_and_says_what_it_could_not() {
        let (dir, root) = tree();
        let w = Writer::with_bus(root.clone(), None);
        w.write(&Request::gpu_level("card1", "auto")).await.unwrap();
        let level = dir
            .path()
            .join("sys/class/drm/card1/device/power_dpm_force_performance_level");
        assert_eq!(std::fs::read_to_string(&level).unwrap(), "auto\n");
        // A file that is not there: the error names it, and no helper is asked.
        let e = w
            .write(&Request::governor("policy9", "powersave"))
            .await
            .unwrap_err();
        assert!(e.contains("policy9/scaling_governor"), "{e}");
        assert!(!e.contains("dsv4-sysfs@"), "{e}");
    }
}
