//! The units under a real systemd: systemd 252 as PID 1 of its own namespaces
//! (`tests/systemd/ns`), with the project's `dsv4.socket` and `dsv4.service` (binary and
//! configuration paths pointed at this build and a test's configuration, the service user
//! left out: the test machine has none), a D-Bus system bus started by that systemd, and
//! the project's D-Bus activation file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::support::*;

const DSV4D: &str = env!("CARGO_BIN_EXE_dsv4d-under-test");
const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A booted systemd, stopped on drop.
struct Ns {
    pid: String,
    cgroup: String,
    dir: PathBuf,
}

impl Ns {
    fn boot(units: &Path, target: &str, dir: &Path) -> Ns {
        let log = dir.join("console.log");
        let out = Command::new(repo().join("tests/systemd/ns"))
            .arg("start")
            .arg(units)
            .arg(target)
            .arg(&log)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut words = text.split_whitespace();
        let (Some(pid), Some(cgroup)) = (words.next(), words.next()) else {
            panic!(
                "systemd did not boot: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        };
        Ns {
            pid: pid.into(),
            cgroup: cgroup.into(),
            dir: dir.to_path_buf(),
        }
    }

    /// `sh -c script` inside the namespaces.
    fn sh(&self, script: &str) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.pid, "-m", "-p", "sh", "-c", script])
            .output()
            .unwrap()
    }

    fn out(&self, script: &str) -> String {
        let o = self.sh(script);
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    fn active(&self, unit: &str) -> String {
        self.out(&format!("systemctl is-active {unit}"))
    }

    fn wait_active(&self, unit: &str, want: &str, within: Duration) {
        let t = Instant::now();
        loop {
            let now = self.active(unit);
            if now == want {
                return;
            }
            assert!(
                t.elapsed() < within,
                "{unit} is {now}, not {want}:\n{}",
                self.out("journalctl --no-pager -n 60")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("tests/systemd/ns"))
            .args(["stop", &self.pid, &self.cgroup])
            .output();
        let _ = &self.dir;
    }
}

/// The unit folder: stubs of the boot's special units, journald and the exit path from the
/// host's systemd, a D-Bus system bus, and the project's units for this build.
fn unit_folder(w: &Path, port: u16, config: &Path) -> PathBuf {
    let units = w.join("units");
    let services = w.join("dbus-services");
    std::fs::create_dir_all(&units).unwrap();
    std::fs::create_dir_all(&services).unwrap();
    for u in [
        "exit.target",
        "systemd-exit.service",
        "shutdown.target",
        "umount.target",
        "final.target",
        "systemd-journald.service",
        "systemd-journald.socket",
        "systemd-journald-dev-log.socket",
        "systemd-journald-audit.socket",
    ] {
        std::fs::copy(Path::new("/lib/systemd/system").join(u), units.join(u)).unwrap();
    }
    for u in [
        "sysinit.target",
        "basic.target",
        "sockets.target",
        "timers.target",
        "paths.target",
        "slices.target",
        "syslog.socket",
        "network.target",
    ] {
        std::fs::write(
            units.join(u),
            format!("[Unit]\nDescription=stub {u}\nDefaultDependencies=no\n"),
        )
        .unwrap();
    }
    std::fs::write(
        units.join("test.target"),
        "[Unit]\nDescription=the test\nWants=systemd-journald.service systemd-journald.socket \
         systemd-journald-dev-log.socket dbus.socket dsv4.socket\n",
    )
    .unwrap();
    let bus_conf = w.join("system.conf");
    std::fs::write(
        &bus_conf,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig><type>system</type><listen>unix:path=/run/dbus/system_bus_socket</listen>
<auth>EXTERNAL</auth><servicedir>{}</servicedir>
<policy context="default"><allow user="*"/><allow own="*"/><allow send_type="method_call"/>
<allow send_type="signal"/><allow send_type="method_return"/><allow send_type="error"/>
<allow receive_type="method_call"/><allow receive_type="signal"/>
<allow receive_type="method_return"/><allow receive_type="error"/></policy></busconfig>"#,
            services.display()
        ),
    )
    .unwrap();
    std::fs::write(
        units.join("dbus.socket"),
        "[Unit]\nDefaultDependencies=no\n[Socket]\nListenStream=/run/dbus/system_bus_socket\n",
    )
    .unwrap();
    std::fs::write(
        units.join("dbus.service"),
        format!(
            "[Unit]\nDefaultDependencies=no\nRequires=dbus.socket\n[Service]\n\
             ExecStart=/usr/bin/dbus-daemon --config-file={} --address=systemd: --nofork \
             --nopidfile --systemd-activation\n",
            bus_conf.display()
        ),
    )
    .unwrap();
    let shipped = repo().join("units");
    let activation = std::fs::read_to_string(shipped.join("io.github.dsv4.Supervisor1.service"))
        .unwrap()
        .replace("User=dsv4", "User=root");
    std::fs::write(
        services.join("io.github.dsv4.Supervisor1.service"),
        activation,
    )
    .unwrap();
    let socket = std::fs::read_to_string(shipped.join("dsv4.socket"))
        .unwrap()
        .replace(
            "ListenStream=127.0.0.1:8080",
            &format!("ListenStream=127.0.0.1:{port}"),
        );
    std::fs::write(units.join("dsv4.socket"), socket).unwrap();
    let service: String = std::fs::read_to_string(shipped.join("dsv4.service"))
        .unwrap()
        .lines()
        .filter(|l| {
            !["User=", "Group=", "SupplementaryGroups="]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .map(|l| match l {
            l if l.starts_with("ExecStart=") => {
                format!("ExecStart={DSV4D} --config {}", config.display())
            }
            // The build (and so this test's folder) may itself be below /tmp, which a
            // private /tmp would hide from the service; the shipped unit keeps it.
            "PrivateTmp=yes" => "PrivateTmp=no".to_string(),
            "WatchdogSec=30s" => format!(
                "WatchdogSec=3s\nEnvironment=DSV4_TEST_FAULTS=stall-actor-on-sigusr2\n\
                 Environment=DSV4_LOG=debug\nReadWritePaths={}",
                w.display()
            ),
            l => l.to_string(),
        })
        .map(|l| l + "\n")
        .collect();
    std::fs::write(units.join("dsv4.service"), service).unwrap();
    units
}

/// A chat request on a connection of its own; its status, 0 when none came.
fn chat_status(port: u16) -> u16 {
    chat_on_fresh_connection(([127, 0, 0, 1], port).into()).unwrap_or(0)
}

#[test]
fn the_units_under_a_real_systemd() {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).unwrap();
    let w = tempfile::Builder::new()
        .prefix("dsv4-systemd-")
        .tempdir_in(base)
        .unwrap();
    let conf = w.path().join("conf");
    std::fs::create_dir_all(conf.join("logs")).unwrap();
    let setup = Setup::default()
        .top_level("exit_when_idle", "2s")
        .engine("idle_timeout", "1s");
    let config = setup.write(&conf, &conf.join("logs/fake-engine.log"));
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let units = unit_folder(w.path(), port, &config);
    let ns = Ns::boot(&units, "test.target", w.path());

    // Listening, with nothing running.
    ns.wait_active("dsv4.socket", "active", PATIENCE);
    assert_eq!(ns.active("dsv4.service"), "inactive");
    // A request activates the service and is served.
    let first_answer = chat_status(port);
    assert_eq!(
        first_answer,
        200,
        "{}",
        ns.out("journalctl --no-pager -n 80")
    );
    assert_eq!(ns.active("dsv4.service"), "active");
    let status = ns.out("systemctl show -p StatusText --value dsv4.service");
    assert!(status.starts_with("engine "), "{status:?}");
    let first = ns.out("systemctl show -p MainPID --value dsv4.service");

    // Idle: the service goes, the socket stays, and the next request brings it back.
    ns.wait_active("dsv4.service", "inactive", PATIENCE);
    assert_eq!(ns.active("dsv4.socket"), "active");
    assert_eq!(chat_status(port), 200);
    let second = ns.out("systemctl show -p MainPID --value dsv4.service");
    assert_ne!(first, second);

    // Requests in a loop across several idle exits: every one answered.
    let mut answered = 0;
    let mut exits = 0;
    for _ in 0..5 {
        for _ in 0..40 {
            if chat_status(port) == 200 {
                answered += 1;
            }
        }
        ns.wait_active("dsv4.service", "inactive", PATIENCE);
        exits += 1;
    }
    assert_eq!((answered, exits), (200, 5));

    // dsv4ctl reaches the daemon on the namespace's system bus.
    assert_eq!(chat_status(port), 200);
    let o = ns.sh(&format!("{DSV4CTL} status"));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && text.contains("state"),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // A stalled lifecycle actor stops the watchdog pings: systemd restarts the service.
    let restarts = ns.out("systemctl show -p NRestarts --value dsv4.service");
    ns.out("systemctl kill --kill-whom=main -s SIGUSR2 dsv4.service");
    let t = Instant::now();
    while ns.out("systemctl show -p NRestarts --value dsv4.service") == restarts {
        assert!(
            t.elapsed() < PATIENCE,
            "no restart after the watchdog:\n{}",
            ns.out("journalctl --no-pager -u dsv4 -n 40")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let journal = ns.out("journalctl --no-pager -u dsv4");
    assert!(journal.contains("Watchdog timeout"), "{journal}");

    // D-Bus activation: a call to the name starts the service.
    ns.out("systemctl stop dsv4.service");
    ns.wait_active("dsv4.service", "inactive", PATIENCE);
    let o = ns.sh(
        "busctl --system call io.github.dsv4.Supervisor1 /io/github/dsv4/Supervisor1 \
         io.github.dsv4.Supervisor1 Status",
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(ns.active("dsv4.service"), "active");

    // Its log is in the journal.
    let journal = ns.out("journalctl --no-pager -u dsv4");
    assert!(
        journal.contains("listening on socket-activated fd 3 (api)"),
        "{journal}"
    );
}
