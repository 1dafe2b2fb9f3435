//! A real systemd as PID 1 of its own namespaces (`tests/systemd/ns`), for the tests of the
//! units: booting it on a unit folder, running commands inside, and the folder's base (the
//! boot's special units stubbed, journald and the exit path from this machine's systemd).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use super::PATIENCE;

/// The checkout.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `cmd`, which must succeed; its standard output.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The .deb of this checkout (a debug build, `packaging/deb/build --debug`), built once per
/// test process for every test that needs it (compressing it takes minutes on a busy machine).
pub fn deb() -> &'static str {
    static DEB: std::sync::OnceLock<(tempfile::TempDir, String)> = std::sync::OnceLock::new();
    let (_, path) = DEB.get_or_init(|| {
        let out = super::temp_dir("deb");
        let path = run(Command::new(repo().join("packaging/deb/build"))
            .arg("--debug")
            .arg(out.path()))
        .trim()
        .to_string();
        (out, path)
    });
    path
}

/// A booted systemd, stopped on drop.
pub struct Ns {
    pid: String,
    cgroup: String,
    /// It has a network namespace of its own (`nsenter -n` reaches it).
    net: bool,
}

impl Ns {
    /// Boots `target` from the unit folder `units`, its console in `log`; with `net`, in a
    /// network namespace of its own with only loopback up.
    pub fn boot(units: &Path, target: &str, log: &Path, net: bool) -> Ns {
        let mut cmd = Command::new(repo().join("tests/systemd/ns"));
        cmd.arg("start").arg(units).arg(target).arg(log);
        if net {
            cmd.arg("--net");
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut words = text.split_whitespace();
        let (Some(pid), Some(cgroup)) = (words.next(), words.next()) else {
            panic!(
                "systemd did not boot: {}\n{}",
                String::from_utf8_lossy(&out.stderr),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        };
        Ns {
            pid: pid.into(),
            cgroup: cgroup.into(),
            net,
        }
    }

    /// The PID of its systemd, as this machine sees it (its namespaces are that process's).
    pub fn pid(&self) -> &str {
        &self.pid
    }

    /// `sh -c script` inside the namespaces.
    pub fn sh(&self, script: &str) -> Output {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &self.pid, "-m", "-p"]);
        if self.net {
            cmd.arg("-n");
        }
        cmd.args(["sh", "-c", script]).output().unwrap()
    }

    /// What `script` printed, trimmed.
    pub fn out(&self, script: &str) -> String {
        let o = self.sh(script);
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    pub fn active(&self, unit: &str) -> String {
        self.out(&format!("systemctl is-active {unit}"))
    }

    /// The journal's last lines, for a failure's message.
    pub fn journal(&self) -> String {
        self.out("journalctl --no-pager -n 120")
    }

    /// Waits until `unit` is `want` (`active`, `inactive`), for PATIENCE.
    pub fn wait_active(&self, unit: &str, want: &str) {
        self.wait(&format!("{unit} {want}"), || self.active(unit) == want);
    }

    /// Waits until `until` holds, for PATIENCE.
    pub fn wait(&self, what: &str, mut until: impl FnMut() -> bool) {
        let t = Instant::now();
        while !until() {
            assert!(
                t.elapsed() < PATIENCE,
                "{what}: not within {PATIENCE:?}\n{}",
                self.journal()
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
    }
}

/// Makes `units` (below `w`) a folder systemd boots from: the boot's special units stubbed,
/// journald and the exit path copied from this machine's systemd with `more` of its units,
/// and `test.target`, which wants journald, `dbus.socket` and `dsv4.socket`.
pub fn base_units(w: &Path, more: &[&str]) -> PathBuf {
    let units = w.join("units");
    std::fs::create_dir_all(&units).unwrap();
    let system = Path::new("/lib/systemd/system");
    let host = [
        "exit.target",
        "systemd-exit.service",
        "shutdown.target",
        "umount.target",
        "final.target",
        "systemd-journald.service",
        "systemd-journald.socket",
        "systemd-journald-dev-log.socket",
        "systemd-journald-audit.socket",
    ];
    for u in host.iter().chain(more) {
        std::fs::copy(system.join(u), units.join(u))
            .unwrap_or_else(|e| panic!("{}: {e}", system.join(u).display()));
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
    units
}
