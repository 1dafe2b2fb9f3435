//! The units under a real systemd: systemd 252 as PID 1 of its own namespaces
//! (`tests/systemd/ns`), with the project's `dsv4.socket` and `dsv4.service` (binary and
//! configuration paths pointed at this build and a test's configuration, the service user
//! left out: the test machine has none), a D-Bus system bus started by that systemd, and
//! the project's D-Bus activation file.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::support::ns::{base_units, repo, Ns};
use crate::support::*;

const DSV4D: &str = env!("CARGO_BIN_EXE_dsv4d-under-test");
const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

/// The unit folder: stubs of the boot's special units, journald and the exit path from the
/// host's systemd, a D-Bus system bus, and the project's units for this build.
fn unit_folder(w: &Path, port: u16, config: &Path) -> PathBuf {
    let units = base_units(w, &[]);
    let services = w.join("dbus-services");
    std::fs::create_dir_all(&services).unwrap();
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

/// A folder removed on drop if it was not there at first and is empty then.
struct RemoveIfMade(Option<&'static str>);

impl RemoveIfMade {
    fn new(dir: &'static str) -> RemoveIfMade {
        RemoveIfMade((!Path::new(dir).exists()).then_some(dir))
    }
}

impl Drop for RemoveIfMade {
    fn drop(&mut self) {
        if let Some(dir) = self.0 {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A chat request on a connection of its own; its status, 0 when none came.
fn chat_status(port: u16) -> u16 {
    chat_on_fresh_connection(([127, 0, 0, 1], port).into()).unwrap_or(0)
}

#[test]
fn the_units_under_a_real_systemd() {
    // The service's ConfigurationDirectory= makes /etc/dsv4 on this machine's file system:
    // not while a test installs or purges the package, and not left behind.
    let _one_at_a_time = package_lock();
    let _etc = RemoveIfMade::new("/etc/dsv4");
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
    let ns = Ns::boot(&units, "test.target", &w.path().join("console.log"), false);

    // Listening, with nothing running.
    ns.wait_active("dsv4.socket", "active");
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
    ns.wait_active("dsv4.service", "inactive");
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
        ns.wait_active("dsv4.service", "inactive");
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
    ns.wait_active("dsv4.service", "inactive");
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
