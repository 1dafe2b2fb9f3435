//! `dsv4d --doctor` and `dsv4ctl doctor` on fixture trees shaped like a Strix Halo box: a
//! healthy one where every check is ok, and one failure at a time, where exactly that check
//! says so with its fix. The engine is the real llama-server with the tiny model, the
//! power-profiles-daemon the real one on a private system bus (or, for the amdgpu_dpm
//! action this machine's daemon is too old to have, one that answers its properties as a
//! 0.2x daemon does). The installed package under a real systemd is in `installed.rs`.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use dsv4_client::doctor::{Check, Closed, Fix, Verdict};

use crate::power::SystemBus;
use crate::support::*;

const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");
const NO_BUS: &str = "unix:path=/nonexistent/dsv4-no-bus";

/// A machine: its sysroot, configuration and kernel log, all below one folder.
struct Machine {
    dir: TempDir,
}

impl Machine {
    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }
    fn config(&self) -> PathBuf {
        self.dir.path().join("etc/supervisor.yaml")
    }
    fn profile(&self) -> PathBuf {
        self.dir.path().join("etc/profiles/tiny.yaml")
    }
    fn model(&self) -> PathBuf {
        self.dir.path().join("models/tiny.gguf")
    }
    fn log(&self) -> PathBuf {
        self.dir.path().join("kernel.log")
    }

    /// The profile, with `more` YAML lines.
    fn write_profile(&self, more: &str) {
        let (server, _) = real::engine();
        std::fs::write(
            self.profile(),
            format!(
                "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\nparallel: 1\n{more}",
                server.display(),
                self.model().display()
            ),
        )
        .unwrap();
    }
}

fn cp_a(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(format!("{}/.", from.display()))
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A healthy Strix Halo box: the strix-halo sysfs tree, the doctor's overlay (kernel,
/// firmware, GTT settings, IOMMU, a clean kernel log), the GPU's device nodes open to all, a
/// platform profile, and one profile of the real engine.
fn healthy() -> Machine {
    let m = Machine {
        dir: temp_dir("doctor"),
    };
    let root = m.root();
    std::fs::create_dir_all(&root).unwrap();
    cp_a(&fixture_tree("strix-halo"), &root);
    let overlay = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/doctor/healthy");
    cp_a(&overlay, &root);
    std::fs::rename(root.join("kernel.log"), m.log()).unwrap();
    for node in ["dev/kfd", "dev/dri/renderD128", "dev/dri/card1"] {
        write(&root.join(node), "");
        std::fs::set_permissions(root.join(node), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let (_, model) = real::engine();
    std::fs::create_dir_all(m.model().parent().unwrap()).unwrap();
    std::fs::copy(&model, m.model()).unwrap();
    write(
        &m.config(),
        &format!(
            "profiles_dir: profiles\ndefault_profile: tiny\nstate_dir: {}\n\
             memory: {{ reserve: 1GiB }}\n",
            m.dir.path().join("state").display()
        ),
    );
    std::fs::create_dir_all(m.dir.path().join("state")).unwrap();
    std::fs::create_dir_all(m.profile().parent().unwrap()).unwrap();
    m.write_profile("extra_args: [--no-webui, -ub, \"256\"]\n");
    m
}

/// `dsv4d --doctor` on `m`, with `bus` as the system bus.
fn doctor(m: &Machine, bus: &str) -> (Output, Vec<Check>) {
    let out = Command::new(DSV4D)
        .arg("--doctor")
        .arg("--config")
        .arg(m.config())
        .arg("--sysroot")
        .arg(m.root())
        .arg("--kernel-log")
        .arg(m.log())
        .env("DBUS_SYSTEM_BUS_ADDRESS", bus)
        .env("DSV4_LOG", "off")
        .stdin(Stdio::null())
        .output_within(HANG);
    let checks = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no checks ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, checks)
}

/// The same, off the test's runtime thread (a D-Bus service of the test answers meanwhile).
async fn doctor_async(m: &Machine, bus: &str) -> (Output, Vec<Check>) {
    let (config, root, log, bus) = (m.config(), m.root(), m.log(), bus.to_string());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(DSV4D)
            .arg("--doctor")
            .arg("--config")
            .arg(config)
            .arg("--sysroot")
            .arg(root)
            .arg("--kernel-log")
            .arg(log)
            .env("DBUS_SYSTEM_BUS_ADDRESS", bus)
            .env("DSV4_LOG", "off")
            .stdin(Stdio::null())
            .output_within(HANG)
    })
    .await
    .unwrap();
    let checks = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no checks ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    (out, checks)
}

/// The checks that warned or failed, by id.
fn problems(checks: &[Check]) -> BTreeMap<String, &Check> {
    checks
        .iter()
        .filter(|c| c.verdict >= Verdict::Warn)
        .map(|c| (c.id.clone(), c))
        .collect()
}

fn shown(checks: &[Check]) -> String {
    serde_json::to_string_pretty(checks).unwrap()
}

fn find<'a>(checks: &'a [Check], id: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.id == id)
        .unwrap_or_else(|| panic!("no {id} in {}", shown(checks)))
}

/// Exactly `id` went wrong, with `verdict`, and its fix says `fix_says`: the check, for the
/// caller to look at further.
fn only<'a>(checks: &'a [Check], id: &str, verdict: Verdict, fix_says: &str) -> &'a Check {
    let p = problems(checks);
    assert_eq!(
        p.keys().collect::<Vec<_>>(),
        [id],
        "exactly {id} should say so: {}",
        shown(checks)
    );
    let c = p[id];
    assert_eq!(c.verdict, verdict, "{}", shown(checks));
    let fix = c.fix.as_deref().unwrap_or_default();
    assert!(fix.contains(fix_says), "{id}'s fix: {fix}");
    c
}

/// Makes `path` closed to the one running the checks, as a folder of another user is: owned
/// by nobody with `mode` when this is root, else with its owner bits cleared (the bits are
/// read for the owner alone then).
fn close(path: &Path, mode: u32) {
    if nix::unistd::geteuid().is_root() {
        nix::unistd::chown(path, Some(65534.into()), Some(65534.into())).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    } else {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o077)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_strix_halo_box_passes_every_check() {
    let bus = SystemBus::start().await;
    let m = healthy();
    let (out, checks) = doctor_async(&m, &bus.address).await;
    assert!(out.status.success(), "{}", shown(&checks));
    assert!(problems(&checks).is_empty(), "{}", shown(&checks));
    // Only the helper's dry run cannot run here: there is no systemd on this bus.
    let skipped: Vec<&str> = checks
        .iter()
        .filter(|c| c.verdict == Verdict::Skip)
        .map(|c| c.id.as_str())
        .collect();
    assert_eq!(skipped, ["power.gpu_helper"], "{}", shown(&checks));
    for (id, says) in [
        ("files.command", "runs"),
        ("files.model", "readable"),
        ("gpu.devices", "/dev/kfd"),
        ("engine.flags", "every flag"),
        ("engine.model", "GGUF v3"),
        ("memory.fit", "fits with"),
        ("power.ppd", "power-profiles-daemon"),
        ("power.platform_profile", "low-power"),
    ] {
        let c = find(&checks, id);
        assert!(c.found.contains(says), "{id}: {}", c.found);
    }
}

#[test]
fn a_model_in_a_closed_home_is_named_with_both_fixes() {
    let m = healthy();
    let home = m.dir.path().join("home/ada");
    let models = home.join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::rename(m.model(), models.join("tiny.gguf")).unwrap();
    std::fs::write(
        m.profile(),
        std::fs::read_to_string(m.profile()).unwrap().replace(
            &m.model().display().to_string(),
            &models.join("tiny.gguf").display().to_string(),
        ),
    )
    .unwrap();
    close(&home, 0o700);
    let (out, checks) = doctor(&m, NO_BUS);
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    // Only the model's check, and the configuration's load where the loader's own look at
    // the file is refused as well (root's is not: the bits are read for the service user).
    let p = problems(&checks);
    assert!(p.contains_key("files.model"), "{}", shown(&checks));
    assert!(
        p.keys().all(|k| k == "files.model" || k == "config.load"),
        "{}",
        shown(&checks)
    );
    let c = p["files.model"];
    assert!(
        c.found
            .contains(&format!("the folder {} is", home.display())),
        "{}",
        c.found
    );
    let fix = c.fix.as_deref().unwrap();
    assert!(fix.contains("/var/lib/dsv4/models"), "{fix}");
    assert!(fix.contains("sudo dsv4ctl doctor --fix"), "{fix}");
    // The fix is data: the closed folder and the file; dsv4ctl composes the drop-in.
    let fix = c.fixable.as_ref().unwrap();
    assert_eq!(
        fix,
        &Fix::Paths {
            closed: vec![Closed {
                folder: home.clone(),
                file: models.join("tiny.gguf"),
            }]
        }
    );
    let text = fix.drop_in().unwrap();
    assert!(
        text.contains(&format!("TemporaryFileSystem=\"{}:ro\"\n", home.display())),
        "{text}"
    );
    assert!(
        text.contains(&format!("BindReadOnlyPaths=\"{}\"\n", models.display())),
        "{text}"
    );
}

#[test]
fn device_nodes_of_a_group_the_service_lacks_fail_with_the_group_drop_in() {
    let m = healthy();
    close(&m.root().join("dev/kfd"), 0o660);
    let (out, checks) = doctor(&m, NO_BUS);
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    let c = only(
        &checks,
        "gpu.devices",
        Verdict::Fail,
        "SupplementaryGroups=",
    );
    assert!(c.found.contains("/dev/kfd"), "{}", c.found);
    let fix = c.fixable.as_ref().unwrap();
    assert!(
        matches!(fix, Fix::Groups { groups } if !groups.is_empty()),
        "{fix:?}"
    );
    assert!(fix.drop_in().unwrap().contains("SupplementaryGroups="));
}

#[test]
fn a_model_larger_than_the_gtt_does_not_fit_by_the_admission_rule() {
    let m = healthy();
    // The tiny model's header, and a file as large as 120 GiB of weights (sparse).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.model())
        .unwrap();
    f.set_len(120 << 30).unwrap();
    let (out, checks) = doctor(&m, NO_BUS);
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    let c = only(&checks, "memory.fit", Verdict::Fail, "ttm.pages_limit");
    assert!(c.found.contains("not enough"), "{}", c.found);
    assert!(c.found.contains("estimated"), "{}", c.found);
    assert!(c.found.contains("weights 120.0 GiB"), "{}", c.found);
}

#[test]
fn an_extra_arg_the_engine_does_not_know_fails_the_flags_check() {
    let m = healthy();
    m.write_profile("extra_args: [--no-webui, --no-such-flag, \"3\"]\n");
    let (out, checks) = doctor(&m, NO_BUS);
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    let c = only(
        &checks,
        "engine.flags",
        Verdict::Fail,
        "remove --no-such-flag",
    );
    assert!(c.found.contains("--no-such-flag"), "{}", c.found);
    assert!(!c.found.contains("--no-webui"), "{}", c.found);
}

#[test]
fn a_truncated_model_fails_its_header_check() {
    let m = healthy();
    let bytes = std::fs::read(m.model()).unwrap();
    std::fs::write(m.model(), &bytes[..600]).unwrap();
    let (out, checks) = doctor(&m, NO_BUS);
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    let c = only(&checks, "engine.model", Verdict::Fail, "download");
    assert!(c.found.contains("truncated"), "{}", c.found);
}

#[test]
fn an_amdgpu_reset_in_the_kernel_log_fails_its_check() {
    let m = healthy();
    let broken =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/doctor/broken/kernel-reset.log");
    std::fs::copy(broken, m.log()).unwrap();
    let (out, checks) = doctor(&m, NO_BUS);
    assert_eq!(out.status.code(), Some(1), "{}", shown(&checks));
    only(
        &checks,
        "kernel.gpu_errors",
        Verdict::Fail,
        "amdgpu.lockup_timeout",
    );
}

/// Answers power-profiles-daemon's properties as a 0.2x daemon with the amdgpu_dpm action
/// does (this machine's daemon predates the action).
struct NewerPpd;

#[zbus::interface(name = "org.freedesktop.UPower.PowerProfiles")]
impl NewerPpd {
    #[zbus(property)]
    fn version(&self) -> String {
        "0.23".into()
    }
    #[zbus(property)]
    fn actions(&self) -> Vec<String> {
        vec!["trickle_charge".into(), "amdgpu_dpm".into()]
    }
    #[zbus(property)]
    fn active_profile(&self) -> String {
        "balanced".into()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ppd_with_its_amdgpu_dpm_action_is_a_warning_with_the_way_out() {
    let bus = PrivateBus::start();
    let _ppd = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .name("org.freedesktop.UPower.PowerProfiles")
        .unwrap()
        .serve_at("/org/freedesktop/UPower/PowerProfiles", NewerPpd)
        .unwrap()
        .build()
        .await
        .unwrap();
    let m = healthy();
    let (out, checks) = doctor_async(&m, &bus.address).await;
    assert!(out.status.success(), "{}", shown(&checks));
    let c = only(
        &checks,
        "power.ppd",
        Verdict::Warn,
        "configure-action --disable amdgpu_dpm",
    );
    assert!(c.found.contains("0.23"), "{}", c.found);
    assert!(c.found.contains("12.59 tok/s"), "{}", c.found);
}

fn dsv4ctl_doctor(m: &Machine, more: &[&str]) -> Output {
    Command::new(DSV4CTL)
        .args(["doctor", "--no-sandbox", "--config"])
        .arg(m.config())
        .arg("--sysroot")
        .arg(m.root())
        .arg("--kernel-log")
        .arg(m.log())
        .args(more)
        .env("DSV4D", DSV4D)
        .env("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
        .env("DSV4_LOG", "off")
        .stdin(Stdio::null())
        .output_within(HANG)
}

#[test]
fn dsv4ctl_doctor_prints_a_line_per_check_with_the_fix_and_exits_by_the_worst() {
    let m = healthy();
    let out = dsv4ctl_doctor(&m, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines().last().unwrap().ends_with(" 0 failed"),
        "{text}"
    );
    // Run as the caller, it says the service's checks did not run in the sandbox.
    assert!(
        text.lines()
            .any(|l| l.starts_with("WARN  service.sandbox") && l.contains("--no-sandbox")),
        "{text}"
    );

    let bytes = std::fs::read(m.model()).unwrap();
    std::fs::write(m.model(), &bytes[..600]).unwrap();
    let out = dsv4ctl_doctor(&m, &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let at = text
        .lines()
        .position(|l| l.starts_with("FAIL  engine.model [tiny]"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        text.lines().nth(at + 1).unwrap().starts_with("      fix: "),
        "{text}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("engine.model failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = dsv4ctl_doctor(&m, &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let checks: Vec<Check> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(find(&checks, "engine.model").verdict, Verdict::Fail);
    assert_eq!(find(&checks, "service.sandbox").verdict, Verdict::Warn);
}

/// One change to a healthy box, and the one check it must turn: (what, the change, the
/// check, its verdict, words of its fix).
type Breakage = (
    &'static str,
    fn(&Machine),
    &'static str,
    Verdict,
    &'static str,
);

#[test]
fn each_other_breakage_turns_exactly_its_check() {
    let table: [Breakage; 7] = [
        (
            "an unknown key",
            |m| {
                let text = std::fs::read_to_string(m.config()).unwrap();
                std::fs::write(m.config(), format!("{text}bogus_key: 1\n")).unwrap();
            },
            "config.load",
            Verdict::Fail,
            "dsv4ctl config check",
        ),
        (
            "a state folder of another user",
            |m| close(&m.dir.path().join("state"), 0o700),
            "files.state_dir",
            Verdict::Fail,
            "chown dsv4:dsv4",
        ),
        (
            "no /dev/kfd",
            |m| std::fs::remove_file(m.root().join("dev/kfd")).unwrap(),
            "gpu.kfd",
            Verdict::Warn,
            "Vulkan build",
        ),
        (
            "an engine build missing a library",
            |m| {
                let script = m.dir.path().join("bin/llama-server");
                write(
                    &script,
                    "#!/bin/sh\necho 'llama-server: error while loading shared libraries: \
                     libggml-hip.so: cannot open shared object file: No such file or directory' \
                     >&2\nexit 127\n",
                );
                std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
                let text = std::fs::read_to_string(m.profile()).unwrap();
                let (server, _) = real::engine();
                std::fs::write(
                    m.profile(),
                    text.replace(&server.display().to_string(), &script.display().to_string()),
                )
                .unwrap();
            },
            "engine.runs",
            Verdict::Fail,
            "LD_LIBRARY_PATH",
        ),
        (
            "a GTT of half the RAM",
            |m| {
                let dev = m
                    .root()
                    .join("sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0");
                std::fs::write(dev.join("mem_info_gtt_total"), format!("{}\n", 62u64 << 30))
                    .unwrap();
                std::fs::remove_file(m.root().join("sys/module/ttm/parameters/pages_limit"))
                    .unwrap();
                write(
                    &m.root().join("proc/cmdline"),
                    "BOOT_IMAGE=/vmlinuz ro quiet\n",
                );
            },
            "memory.gtt_limit",
            Verdict::Warn,
            "ttm.pages_limit=",
        ),
        (
            "an old kernel",
            |m| {
                write(
                    &m.root().join("proc/sys/kernel/osrelease"),
                    "6.12.48+deb13-amd64\n",
                )
            },
            "kernel.version",
            Verdict::Warn,
            "6.18.4 or later",
        ),
        (
            "the firmware reported broken",
            |m| {
                let status = m.root().join("var/lib/dpkg/status");
                let text = std::fs::read_to_string(&status).unwrap();
                std::fs::write(&status, text.replace("20251111-1", "20251125-1")).unwrap();
            },
            "kernel.firmware",
            Verdict::Warn,
            "20251125",
        ),
    ];
    for (what, change, id, verdict, fix) in table {
        let m = healthy();
        change(&m);
        let (out, checks) = doctor(&m, NO_BUS);
        let failed = verdict == Verdict::Fail;
        assert_eq!(out.status.success(), !failed, "{what}: {}", shown(&checks));
        let p = problems(&checks);
        assert_eq!(
            p.keys().collect::<Vec<_>>(),
            [id],
            "{what}: {}",
            shown(&checks)
        );
        assert_eq!(p[id].verdict, verdict, "{what}");
        let f = p[id].fix.as_deref().unwrap_or_default();
        assert!(f.contains(fix), "{what}: {f}");
    }
}

/// Without `state_dir` in the file, the state folder is the one systemd made for the unit
/// (`$STATE_DIRECTORY`, from `StateDirectory=`): what the service would use, as the doctor's
/// check of it shows.
#[test]
fn without_state_dir_the_units_state_directory_is_used() {
    let m = healthy();
    let text = std::fs::read_to_string(m.config()).unwrap();
    let text: String = text
        .lines()
        .filter(|l| !l.starts_with("state_dir:"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(m.config(), text).unwrap();
    let state = m.dir.path().join("systemd-state");
    std::fs::create_dir_all(&state).unwrap();
    let out = Command::new(DSV4D)
        .args(["--doctor", "--part", "service", "--config"])
        .arg(m.config())
        .arg("--sysroot")
        .arg(m.root())
        .env("STATE_DIRECTORY", format!("{}:/elsewhere", state.display()))
        .env("DBUS_SYSTEM_BUS_ADDRESS", NO_BUS)
        .env("DSV4_LOG", "off")
        .stdin(Stdio::null())
        .output_within(HANG);
    let checks: Vec<Check> = serde_json::from_slice(&out.stdout).unwrap();
    let c = find(&checks, "files.state_dir");
    assert_eq!(c.found, format!("{} is writable", state.display()));
}

/// The probe's way of forging the service's answer: an engine program that, asked for its
/// `--version` by the service's check, writes a list of checks into its parent's standard
/// output and kills the parent. `--fix` takes nothing from it: the run did not end as the
/// doctor ends, so its output is refused whole, and nothing is written anywhere.
#[test]
fn a_forged_answer_writes_nothing() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("not run: --fix writes as root only");
        return;
    }
    let m = healthy();
    let units = m.dir.path().join("units");
    std::fs::create_dir_all(&units).unwrap();
    let outside = m.dir.path().join("outside");
    let forged = [
        // The old shape: a unit, a file name and its text, walking out of the unit folder.
        format!(
            r#"[{{"id":"gpu.devices","verdict":"fail","found":"x","drop_in":{{"unit":"../../../{}","name":"x.conf","text":"[Service]\nUser=root\n"}}}}]"#,
            outside.display()
        ),
        // The new shape at its worst: a folder and a file it does not hold, and root's group.
        r#"[{"id":"files.model","verdict":"fail","found":"x","fixable":{"kind":"paths","closed":[{"folder":"/","file":"/etc/shadow"}]}},{"id":"gpu.devices","verdict":"fail","found":"x","fixable":{"kind":"groups","groups":["root"]}}]"#.to_string(),
    ];
    for (kill, json) in [true, false]
        .into_iter()
        .flat_map(|k| forged.iter().map(move |j| (k, j)))
    {
        let program = m.dir.path().join("forge");
        let kill_line = if kill { "kill -9 \"$PPID\"\n" } else { "" };
        write(
            &program,
            &format!(
                "#!/bin/sh\nif [ \"$1\" = --version ]; then\n  printf '%s' '{json}' > /proc/$PPID/fd/1\n  {kill_line}fi\nexit 0\n"
            ),
        );
        std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
        let profile = std::fs::read_to_string(m.profile()).unwrap();
        let (server, _) = real::engine();
        std::fs::write(
            m.profile(),
            profile.replace(
                &server.display().to_string(),
                &program.display().to_string(),
            ),
        )
        .unwrap();
        let unit_dir = units.display().to_string();
        let out = dsv4ctl_doctor(&m, &["--fix", "--unit-dir", &unit_dir]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_ne!(out.status.code(), Some(0), "kill {kill}: {err}");
        let expected = if kill {
            "not as the doctor ends"
        } else {
            "is not a list of checks"
        };
        assert!(err.contains(expected), "kill {kill}: {err}");
        let written: Vec<_> = walk(&units);
        assert!(written.is_empty(), "kill {kill}: {written:?}");
        assert!(!outside.exists(), "kill {kill}");
        std::fs::write(m.profile(), profile).unwrap();
    }
}

/// Every file below `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
