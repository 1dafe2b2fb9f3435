//! The power policy against the real thing: power-profiles-daemon and polkitd on a private
//! system bus (`DBUS_SYSTEM_BUS_ADDRESS`), and the cpufreq and GPU files of a fixture copy.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dsv4_client::State;
use nix::sys::signal::Signal;
use zbus::zvariant::OwnedValue;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);
const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";
pub(crate) const POLICIES: &str = "sys/devices/system/cpu/cpufreq";
const PPD: (&str, &str, &str) = (
    "net.hadess.PowerProfiles",
    "/net/hadess/PowerProfiles",
    "net.hadess.PowerProfiles",
);

/// A private bus of the system type with a real power-profiles-daemon (its placeholder
/// driver: power-saver and balanced; or with [`SystemBus::with_platform_profile`], its
/// platform_profile driver on a fixture ACPI platform profile, which has performance too)
/// and polkitd, which lets root hold and switch profiles.
pub(crate) struct SystemBus {
    dir: TempDir,
    pub(crate) address: String,
    children: Vec<Child>,
    conn: zbus::Connection,
}

impl SystemBus {
    pub(crate) async fn start() -> SystemBus {
        SystemBus::start_with(false).await
    }

    /// With the ACPI platform profile of a mini PC that has one (`low-power`, `balanced`,
    /// `performance`), which power-profiles-daemon drives.
    pub(crate) async fn with_platform_profile() -> SystemBus {
        SystemBus::start_with(true).await
    }

    /// The fixture's ACPI platform profile file, as power-profiles-daemon last wrote it.
    pub(crate) fn platform_profile(&self) -> String {
        let file = self
            .dir
            .path()
            .join("umock/sys/firmware/acpi/platform_profile");
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    async fn start_with(platform_profile: bool) -> SystemBus {
        let dir = temp_dir("system-bus");
        // polkitd drops to its own user: the socket's folder must be traversable.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let socket = dir.path().join("bus.sock");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            format!(
                r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>system</type><listen>unix:path={}</listen><auth>EXTERNAL</auth>
<policy context="default"><allow user="*"/><allow own="*"/>
<allow send_type="method_call"/><allow send_type="signal"/><allow send_type="method_return"/>
<allow send_type="error"/><allow receive_type="method_call"/><allow receive_type="signal"/>
<allow receive_type="method_return"/><allow receive_type="error"/></policy></busconfig>"#,
                socket.display()
            ),
        )
        .unwrap();
        let bus = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .arg("--nofork")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dbus-daemon");
        let address = format!("unix:path={}", socket.display());
        let t = Instant::now();
        while !socket.exists() {
            assert!(t.elapsed() < PATIENCE, "dbus-daemon did not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        let umock = dir.path().join("umock");
        std::fs::create_dir_all(&umock).unwrap();
        if platform_profile {
            let acpi = umock.join("sys/firmware/acpi");
            std::fs::create_dir_all(&acpi).unwrap();
            let choices = "low-power balanced performance\n";
            std::fs::write(acpi.join("platform_profile_choices"), choices).unwrap();
            std::fs::write(acpi.join("platform_profile"), "balanced\n").unwrap();
        }
        let ppd = Command::new("/usr/libexec/power-profiles-daemon")
            .env("DBUS_SYSTEM_BUS_ADDRESS", &address)
            // Keeps its state file out of /var/lib (and its sysfs lookups in the folder).
            .env("UMOCKDEV_DIR", &umock)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("power-profiles-daemon (apt-get install power-profiles-daemon)");
        let polkit = Command::new("/usr/lib/polkit-1/polkitd")
            .arg("--no-debug")
            .env("DBUS_SYSTEM_BUS_ADDRESS", &address)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("polkitd (apt-get install polkitd)");
        let conn = zbus::connection::Builder::address(address.as_str())
            .unwrap()
            .build()
            .await
            .unwrap();
        let b = SystemBus {
            dir,
            address,
            children: vec![bus, ppd, polkit],
            conn,
        };
        for name in [PPD.0, "org.freedesktop.PolicyKit1"] {
            b.wait_name(name).await;
        }
        b
    }

    async fn wait_name(&self, name: &str) {
        let dbus = zbus::fdo::DBusProxy::new(&self.conn).await.unwrap();
        let t = Instant::now();
        loop {
            let n = zbus::names::BusName::try_from(name).unwrap();
            if dbus.name_has_owner(n).await.unwrap_or(false) {
                return;
            }
            assert!(t.elapsed() < PATIENCE, "{name} never came on the bus");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn ppd(&self) -> zbus::Proxy<'static> {
        zbus::proxy::Builder::new(&self.conn)
            .destination(PPD.0)
            .unwrap()
            .path(PPD.1)
            .unwrap()
            .interface(PPD.2)
            .unwrap()
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await
            .unwrap()
    }

    pub(crate) async fn active(&self) -> String {
        self.ppd()
            .await
            .get_property("ActiveProfile")
            .await
            .unwrap()
    }

    /// The applications holding a profile, and the profile each holds.
    pub(crate) async fn holds(&self) -> Vec<(String, String)> {
        let holds: Vec<HashMap<String, OwnedValue>> = self
            .ppd()
            .await
            .get_property("ActiveProfileHolds")
            .await
            .unwrap();
        holds
            .into_iter()
            .map(|h| {
                let text = |k: &str| {
                    h.get(k)
                        .and_then(|v| String::try_from(v.try_clone().ok()?).ok())
                        .unwrap_or_default()
                };
                (text("ApplicationId"), text("Profile"))
            })
            .collect()
    }

    pub(crate) async fn wait_active(&self, want: &str, within: Duration) {
        let t = Instant::now();
        loop {
            let now = self.active().await;
            if now == want {
                return;
            }
            assert!(t.elapsed() < within, "ActiveProfile is {now}, not {want}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for SystemBus {
    fn drop(&mut self) {
        for c in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = &self.dir;
    }
}

/// Waits until the GPU level file `level` reads `want`; `what` says what did not happen.
pub(crate) async fn wait_level(level: &Path, want: &str, what: &str, d: &Daemon) {
    let t = Instant::now();
    while std::fs::read_to_string(level).unwrap() != format!("{want}\n") {
        assert!(t.elapsed() < PATIENCE, "{what}:\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn on_system_bus(bus: &SystemBus) -> Setup {
    Setup::default()
        .top_level("power", "{ method: auto }")
        .daemon_env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
}

/// No system bus at all: a path where none listens.
fn without_system_bus(setup: Setup) -> Setup {
    setup.top_level("power", "{ method: auto }").daemon_env(
        "DBUS_SYSTEM_BUS_ADDRESS",
        "unix:path=/nonexistent/dsv4-no-bus",
    )
}

async fn chat_ok(d: &Daemon) {
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
}

async fn power_status(d: &Daemon) -> serde_json::Value {
    d.status().await["power"].clone()
}

pub(crate) async fn wait_power(d: &Daemon, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
    let t = Instant::now();
    loop {
        let p = power_status(d).await;
        if ok(&p) {
            return;
        }
        assert!(
            t.elapsed() < PATIENCE,
            "power status never {what}: {p}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn power_saver_is_held_while_the_engine_runs_and_given_back_at_the_idle_stop() {
    let bus = SystemBus::start().await;
    assert_eq!(bus.active().await, "balanced");
    // The default idle timeout: the engine stays while the hold is checked.
    let d = Daemon::start(&on_system_bus(&bus));
    chat_ok(&d).await;
    bus.wait_active("power-saver", PATIENCE).await;
    assert_eq!(
        bus.holds().await,
        [("dsv4d".to_string(), "power-saver".to_string())]
    );
    wait_power(&d, "held", |p| p["held"] == true).await;
    let p = power_status(&d).await;
    assert_eq!(p["method"], "ppd", "{p}");
    assert_eq!(
        p["cpu"], "power-saver held through net.hadess.PowerProfiles",
        "{p}"
    );
    let (_, _, metrics) = d.send("GET", "/metrics", &[], None).await;
    assert!(
        metrics
            .as_str()
            .unwrap()
            .contains("dsv4_power_profile_held 1\n"),
        "{metrics}"
    );
    // The idle stop gives the user's profile back.
    live_stop(&d).await;
    bus.wait_active("balanced", PATIENCE).await;
    assert!(bus.holds().await.is_empty());
    wait_power(&d, "released", |p| p["held"] == false).await;
    d.log_with(&["power: method ppd"]).await;
    assert_eq!(
        d.log().matches("power: method ppd").count(),
        1,
        "{}",
        d.log()
    );
}

/// A daemon on `bus` whose engine runs, with power-saver held.
async fn holding(bus: &SystemBus) -> Daemon {
    let d = Daemon::start(&on_system_bus(bus));
    chat_ok(&d).await;
    bus.wait_active("power-saver", PATIENCE).await;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_gives_the_profile_back_by_itself() {
    let bus = SystemBus::start().await;
    let d = holding(&bus).await;
    d.signal(Signal::SIGKILL);
    bus.wait_active("balanced", PATIENCE).await;
    assert!(bus.holds().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_chosen_by_hand_while_held_is_shown_and_not_undone() {
    let bus = SystemBus::start().await;
    let d = holding(&bus).await;
    wait_power(&d, "held", |p| p["held"] == true).await;
    // The user switches back by hand (as root, which polkit allows).
    bus.ppd()
        .await
        .set_property("ActiveProfile", "balanced")
        .await
        .unwrap();
    wait_power(&d, "released by the user", |p| {
        p["held"] == false
            && p["cpu_note"]
                .as_str()
                .is_some_and(|n| n.contains("the user chose another power profile"))
    })
    .await;
    tokio::time::sleep(SEC).await;
    assert_eq!(bus.active().await, "balanced", "dsv4d took it back");
    assert!(bus.holds().await.is_empty());
    d.log_with(&["the user chose another power profile"]).await;
    // Still shown after the engine stops, until the next start.
    live_stop(&d).await;
    let p = power_status(&d).await;
    assert!(
        p["cpu_note"].as_str().unwrap().contains("the user chose"),
        "{p}"
    );
}

/// Stops the engine of a daemon without a control bus: a reload (SIGHUP) shortens its idle
/// timeout to a second.
async fn live_stop(d: &Daemon) {
    let path = d.dir().join("supervisor.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("{text}engine:\n  idle_timeout: 1s\n")).unwrap();
    d.signal(Signal::SIGHUP);
    d.wait_state(State::Stopped, PATIENCE).await;
}

/// The bytes of every file under the fixture's cpufreq folder.
pub(crate) fn cpufreq_files(tree: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files = Vec::new();
    for policy in std::fs::read_dir(tree.join(POLICIES)).unwrap().flatten() {
        for f in std::fs::read_dir(policy.path()).unwrap().flatten() {
            files.push((f.path(), std::fs::read(f.path()).unwrap()));
        }
    }
    files.sort();
    files
}

pub(crate) fn read(tree: &Path, file: &str) -> String {
    std::fs::read_to_string(tree.join(file))
        .unwrap()
        .trim()
        .to_string()
}

fn cpufreq_setup(tree: &Path) -> Setup {
    without_system_bus(Setup::default().args(&["--sysroot", tree.to_str().unwrap()]))
        .engine("idle_timeout", "1s")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ppd_cpufreq_is_set_for_the_run_and_restored_byte_for_byte() {
    let tree = fixture_copy("strix-halo");
    let before = cpufreq_files(tree.path());
    let d = Daemon::start(&cpufreq_setup(tree.path()));
    chat_ok(&d).await;
    wait_power(&d, "applied", |p| p["cpu"].is_string()).await;
    for i in 0..3 {
        assert_eq!(
            read(
                tree.path(),
                &format!("{POLICIES}/policy{i}/scaling_governor")
            ),
            "powersave"
        );
    }
    // policy3 is acpi-cpufreq: powersave would pin it at its lowest frequency.
    assert_eq!(
        read(tree.path(), &format!("{POLICIES}/policy3/scaling_governor")),
        "schedutil"
    );
    for i in 0..3 {
        let epp = read(
            tree.path(),
            &format!("{POLICIES}/policy{i}/energy_performance_preference"),
        );
        assert_eq!(epp, "power", "policy{i}");
    }
    let p = power_status(&d).await;
    assert_eq!(p["method"], "cpufreq", "{p}");
    assert_eq!(
        p["cpu"], "governor powersave on 3 policies, EPP power on 3",
        "{p}"
    );
    assert!(
        p["cpu_note"]
            .as_str()
            .is_some_and(|n| n.starts_with("policy3 (acpi-cpufreq) left as it is")),
        "{p}"
    );
    assert!(d.dir().join("state/power-restore.json").exists());
    d.wait_state(State::Stopped, PATIENCE).await;
    wait_power(&d, "given back", |p| p["cpu"].is_null()).await;
    assert_eq!(cpufreq_files(tree.path()), before);
    assert!(!d.dir().join("state/power-restore.json").exists());
    d.log_with(&["power: method cpufreq"]).await;
    assert_eq!(
        d.log().matches("power: method cpufreq").count(),
        1,
        "{}",
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_daemons_cpufreq_changes_are_given_back_at_its_next_start() {
    let tree = fixture_copy("strix-halo");
    let before = cpufreq_files(tree.path());
    let setup = cpufreq_setup(tree.path()).engine("idle_timeout", "10m");
    let d = Daemon::start(&setup);
    chat_ok(&d).await;
    wait_power(&d, "applied", |p| p["cpu"].is_string()).await;
    assert_ne!(cpufreq_files(tree.path()), before);
    let dir = d.kill_and_keep_dir().await;
    assert_ne!(
        cpufreq_files(tree.path()),
        before,
        "restored without a daemon"
    );
    let d = Daemon::start_in(&setup, dir);
    let t = Instant::now();
    while cpufreq_files(tree.path()) != before {
        assert!(
            t.elapsed() < PATIENCE,
            "not restored at the start:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.log_with(&["giving back the settings a previous dsv4d changed"])
        .await;
    // The record goes once everything in it is given back: after the files.
    let record = d.dir().join("state/power-restore.json");
    while record.exists() {
        assert!(
            t.elapsed() < PATIENCE,
            "{} kept:\n{}",
            record.display(),
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_on_low_is_set_to_auto_for_the_engine_with_an_alert_and_back_after() {
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let level = tree
        .path()
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    std::fs::write(&level, "low\n").unwrap();
    let d = Daemon::start(
        &cpufreq_setup(tree.path())
            .session_bus(&session)
            .engine("idle_timeout", "3s")
            .top_level("monitor", "{ interval: 100ms, idle_interval: 1s }"),
    );
    let mut alerts = alert_stream(&session, &d).await;
    chat_ok(&d).await;
    let alert = tokio::time::timeout(PATIENCE, futures_util::StreamExt::next(&mut alerts))
        .await
        .unwrap_or_else(|_| panic!("no Alert\n{}", d.log()))
        .unwrap();
    let args = alert.args().unwrap();
    assert_eq!(args.kind, dsv4_client::AlertKind::Power);
    assert!(
        args.message.contains("performance level was low, not auto")
            && args
                .message
                .contains("it goes back to low when the engine stops"),
        "{}",
        args.message
    );
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "auto\n");
    let p = power_status(&d).await;
    assert_eq!(p["gpu_level"], "auto", "{p}");
    // Something sets it low while the engine runs (as PPD's amdgpu_dpm action does): set
    // back at the next sample.
    std::fs::write(&level, "low\n").unwrap();
    wait_level(&level, "auto", "not set back", &d).await;
    // The stop gives the user's level back.
    d.wait_state(State::Stopped, PATIENCE).await;
    wait_level(&level, "low", "not given back", &d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_level_that_cannot_be_written_is_said_clearly_and_the_engine_serves() {
    let tree = fixture_copy("strix-halo");
    let level = tree
        .path()
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    std::fs::write(&level, "low\n").unwrap();
    std::fs::set_permissions(&level, std::os::unix::fs::PermissionsExt::from_mode(0o444)).unwrap();
    // Root without CAP_DAC_OVERRIDE, as a service user would be: the file is read-only.
    // One engine run throughout: the note is said once in it.
    let setup = cpufreq_setup(tree.path())
        .engine("idle_timeout", "10m")
        .listen_flag()
        .wrapper(&["setpriv", "--bounding-set=-dac_override", "--inh-caps=-all"]);
    let d = Daemon::start(&setup);
    chat_ok(&d).await;
    wait_power(&d, "the GPU's note", |p| p["gpu_note"].is_string()).await;
    let p = power_status(&d).await;
    let note = p["gpu_note"].as_str().unwrap();
    assert!(
        note.starts_with("cannot set the GPU's performance level to auto: writing ")
            && note.contains("Permission denied")
            && note.contains("dsv4-sysfs@gpu:card1:auto.service"),
        "{note}"
    );
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "low\n");
    chat_ok(&d).await;
    // Said once, not at every sample.
    d.log_with(&["cannot set the GPU's performance level to auto"])
        .await;
    tokio::time::sleep(2500 * Duration::from_millis(1)).await;
    let said = d
        .log()
        .matches("cannot set the GPU's performance level to auto")
        .count();
    assert_eq!(said, 1, "{}", d.log());
    assert!(!d.log().contains("panicked"), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_ppd_and_no_cpufreq_nothing_is_touched_and_one_line_says_why() {
    let d = Daemon::start(&without_system_bus(
        Setup::default().args(&["--sysroot", fixture_tree("bare").to_str().unwrap()]),
    ));
    chat_ok(&d).await;
    wait_power(&d, "decided", |p| p["method"] == "none").await;
    let log = d.log_with(&["power: method"]).await;
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("power: method"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(
            "power: method none (no power-profiles-daemon on the system bus, and no cpufreq \
             policy under"
        ),
        "{}",
        lines[0]
    );
    let p = power_status(&d).await;
    assert!(p["cpu"].is_null(), "{p}");
    assert!(!d.dir().join("state/power-restore.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_governor_changed_by_hand_during_the_run_is_left_as_chosen() {
    let tree = fixture_copy("strix-halo");
    let before = cpufreq_files(tree.path());
    let d = Daemon::start(&cpufreq_setup(tree.path()));
    chat_ok(&d).await;
    wait_power(&d, "applied", |p| p["cpu"].is_string()).await;
    // The user picks schedutil for policy2 while the engine runs.
    let by_hand = tree.path().join(POLICIES).join("policy2/scaling_governor");
    std::fs::write(&by_hand, "schedutil-by-hand\n").unwrap();
    d.wait_state(State::Stopped, PATIENCE).await;
    wait_power(&d, "given back", |p| p["cpu"].is_null()).await;
    assert_eq!(
        std::fs::read_to_string(&by_hand).unwrap(),
        "schedutil-by-hand\n"
    );
    // The user took that policy over: all of it stays as it is; the others are given back.
    let taken = by_hand.parent().unwrap();
    let others: Vec<_> = cpufreq_files(tree.path())
        .into_iter()
        .filter(|(p, _)| !p.starts_with(taken))
        .collect();
    let want: Vec<_> = before
        .into_iter()
        .filter(|(p, _)| !p.starts_with(taken))
        .collect();
    assert_eq!(others, want);
    d.log_with(&["policy2 was changed by hand meanwhile"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_to_give_back_from_before_a_reboot_are_dropped() {
    let tree = fixture_copy("strix-halo");
    let before = cpufreq_files(tree.path());
    let setup = cpufreq_setup(tree.path());
    let dir = temp_dir("daemon");
    // What a daemon of another boot left: policy0 was powersave with EPP power.
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let left = serde_json::json!({
        "cpufreq": [{"policy": "policy0", "governor": "performance", "epp": "performance"}],
        "cpufreq_set": [{"policy": "policy0", "governor": "powersave", "epp": "balance_performance"}],
        "gpu": null,
        "boot": "a-boot-long-gone",
    });
    std::fs::write(state.join("power-restore.json"), left.to_string()).unwrap();
    let d = Daemon::start_in(&setup, dir);
    let t = Instant::now();
    while d.dir().join("state/power-restore.json").exists() {
        assert!(t.elapsed() < PATIENCE, "{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cpufreq_files(tree.path()), before);
    d.log_with(&["is from before a reboot"]).await;
}
