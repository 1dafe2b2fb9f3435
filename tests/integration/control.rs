//! The control plane end to end: `dsv4d` serving `io.github.dsv4.Supervisor1` on a private
//! bus started by the test, driven by the real `dsv4ctl` (and, for signals, a zbus client).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::Supervisor1Proxy;
use futures_util::StreamExt;
use zbus::proxy::CacheProperties;

const SEC: Duration = Duration::from_secs(1);
const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

/// Runs `dsv4ctl --bus session ARGS` on `bus`, optionally as another user: the copy of
/// dsv4ctl that user may run, through setpriv with these arguments.
fn ctl(bus: &str, args: &[&str], as_user: Option<(&CtlCopy, &[&str])>) -> Output {
    let mut cmd = match as_user {
        Some((copy, setpriv_args)) => {
            let mut c = Command::new("setpriv");
            c.args(setpriv_args).arg(&copy.path);
            c
        }
        None => Command::new(DSV4CTL),
    };
    cmd.arg("--bus")
        .arg("session")
        .args(args)
        .env("DBUS_SESSION_BUS_ADDRESS", bus);
    let t = Instant::now();
    let out = cmd.output().expect("run dsv4ctl");
    assert!(
        t.elapsed() < 20 * SEC,
        "dsv4ctl {args:?} took {:?}",
        t.elapsed()
    );
    out
}

/// A copy of dsv4ctl that any user may run (the build folder may not be reachable); removed
/// on drop.
struct CtlCopy {
    path: PathBuf,
    _dir: TempDir,
}

fn ctl_copy() -> CtlCopy {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("ctl");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.path().join("dsv4ctl");
    // Copied by a child process, not by this one: a process that other test threads fork
    // from must not hold the copy open for writing, or exec of it fails with ETXTBSY.
    let st = Command::new("cp").arg(DSV4CTL).arg(&path).status().unwrap();
    assert!(st.success(), "cp {DSV4CTL}");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    CtlCopy { path, _dir: dir }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn setup(bus: &PrivateBus) -> Setup {
    Setup::default().knob("load_ms", "300").session_bus(bus)
}

async fn wait_bus_name(d: &Daemon, bus: &PrivateBus) {
    let t = Instant::now();
    loop {
        if ctl(&bus.address, &["status", "--json"], None).status.code() == Some(0) {
            return;
        }
        assert!(
            t.elapsed() < 10 * SEC,
            "dsv4d never appeared on the bus\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_switch_profile_and_stop_with_dsv4ctl() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus).knob("token_ms", "40"));
    wait_bus_name(&d, &bus).await;

    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    // Properties read from the daemon itself: a proxy's cache follows PropertiesChanged,
    // which may come after `/status` has the change.
    let proxy = Supervisor1Proxy::builder(&conn)
        .cache_properties(CacheProperties::No)
        .build()
        .await
        .unwrap();
    // Every state change, as StateChanged carries it (signals queue; a property stream
    // yields only the latest value)...
    let mut signals = proxy.receive_lifecycle_changed().await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = seen.clone();
    tokio::spawn(async move {
        while let Some(s) = signals.next().await {
            if let Ok(args) = s.args() {
                sink.lock().unwrap().push(args.state.to_string());
            }
        }
    });
    // ...and as PropertiesChanged carries it (a property stream yields the current value,
    // then the latest one after each change: a state that lasts is seen).
    let cached = Supervisor1Proxy::new(&conn).await.unwrap();
    let mut changes = cached.receive_state_changed().await;
    let announced = Arc::new(Mutex::new(Vec::<String>::new()));
    let sink = announced.clone();
    tokio::spawn(async move {
        while let Some(c) = changes.next().await {
            if let Ok(v) = c.get().await {
                sink.lock().unwrap().push(v);
            }
        }
    });

    let out = ctl(&bus.address, &["status", "--json"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s: dsv4_client::Status = serde_json::from_slice(&out.stdout).expect("status --json parses");
    assert_eq!(s.state, "stopped");
    assert_eq!(s.profile, "320k");

    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(proxy.state().await.unwrap(), "ready");
    let first_pid = proxy.engine_pid().await.unwrap();
    assert!(first_pid > 0);
    assert!(d.fake_log().contains("-c 327680"));

    // A request in flight during the switch completes on the old engine.
    let resp = d.post("/v1/chat/completions", chat(30, true)).await;
    let mut stream = Stream::new(resp.into_body());
    stream.next_event().await.unwrap();
    let out = ctl(&bus.address, &["profile", "64k"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(proxy.profile().await.unwrap(), "64k");
    assert_eq!(proxy.state().await.unwrap(), "draining");
    let (rest, done, _) = stream.collect_chat().await;
    assert_eq!(rest.len(), 29);
    assert!(done);
    let t = Instant::now();
    while proxy.state().await.unwrap() != "ready" || proxy.engine_pid().await.unwrap() == first_pid
    {
        assert!(t.elapsed() < 10 * SEC, "no restart with the new profile");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let starts = d.starts();
    assert_eq!(starts.len(), 2);
    assert!(starts[1].contains(" -c 65536 "), "{}", starts[1]);
    assert_eq!(proxy.engine_profile().await.unwrap(), "64k");
    let out = ctl(&bus.address, &["status"], None);
    assert!(text(&out.stdout).contains("64k"), "{}", text(&out.stdout));

    let out = ctl(&bus.address, &["stop"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    d.wait_state("stopped", 10 * SEC).await;
    assert_eq!(proxy.engine_pid().await.unwrap(), 0);

    // The states went by in order, each announced.
    let want = [
        "starting", "ready", "draining", "stopping", "starting", "ready", "stopping", "stopped",
    ];
    let t = Instant::now();
    let last = |v: &Arc<Mutex<Vec<String>>>| v.lock().unwrap().last().cloned();
    while last(&seen).as_deref() != Some("stopped")
        || last(&announced).as_deref() != Some("stopped")
    {
        if t.elapsed() > 5 * SEC {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().unwrap().clone();
    let mut it = seen.iter();
    for w in want {
        assert!(it.any(|s| s == w), "missing {w} in order in {seen:?}");
    }
    let announced = announced.lock().unwrap().clone();
    let mut it = announced.iter();
    for w in ["stopped", "ready", "stopped"] {
        assert!(it.any(|s| s == w), "missing {w} in order in {announced:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_outside_the_control_group_can_read_but_not_change() {
    let bus = PrivateBus::start();
    // `users` (gid 100) stands in for the dsv4 group.
    let d = Daemon::start(&setup(&bus).args(&["--control-group", "users"]));
    wait_bus_name(&d, &bus).await;
    let copy = ctl_copy();
    let nobody = (
        &copy,
        &["--reuid=nobody", "--regid=nogroup", "--clear-groups"][..],
    );
    for args in [
        &["start"][..],
        &["stop"],
        &["profile", "64k"],
        &["stop", "--now"],
    ] {
        let out = ctl(&bus.address, args, Some(nobody));
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.starts_with("dsv4ctl: "), "{err}");
        assert!(err.contains("`users` group"), "{args:?}: {err}");
        assert!(err.contains("usermod -aG users"), "{err}");
    }
    let out = ctl(&bus.address, &["status", "--json"], Some(nobody));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = ctl(&bus.address, &["profiles"], Some(nobody));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(d.spawns(), 0);
    assert!(d.log().contains("refused"), "{}", d.log());

    // A member of the group may.
    let member = (
        &copy,
        &["--reuid=nobody", "--regid=nogroup", "--groups=100"][..],
    );
    let out = ctl(&bus.address, &["start", "--wait"], Some(member));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(d.spawns(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_profile_is_refused_with_the_valid_names() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["profile", "128k"], None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("dsv4ctl: ") && err.contains("128k") && err.contains("320k, 64k"),
        "{err}"
    );
    let out = ctl(&bus.address, &["profile"], None);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("320k"), "{}", text(&out.stdout));
    let (status, _) = d.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_daemon_dsv4ctl_says_so_and_exits_2() {
    let bus = PrivateBus::start();
    let t = Instant::now();
    let out = ctl(&bus.address, &["status"], None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("dsv4ctl: ") && err.contains("session bus"),
        "{err}"
    );
    assert!(t.elapsed() < 6 * SEC);
    // and without a bus at all
    let out = ctl("unix:path=/nonexistent/bus", &["start"], None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("session bus"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chosen_profile_survives_a_daemon_restart() {
    let bus = PrivateBus::start();
    let s = setup(&bus);
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["profile", "64k"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let dir = d.stop().await;
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["status", "--json"], None);
    let st: dsv4_client::Status = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st.profile, "64k");
    // and the next start uses it
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    assert!(d
        .fake_log()
        .lines()
        .any(|l| l.starts_with("start pid=") && l.contains(" -c 65536 ")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_show_the_engine_output() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = ctl(&bus.address, &["logs"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let logs = text(&out.stdout);
    assert!(
        logs.contains("fake-engine: loading model ") && logs.contains("/models/320k.gguf"),
        "{logs}"
    );
    assert!(logs.contains("main: model loaded"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_wait_fails_with_the_engine_error() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus).knob("fail_start", "exit:7"));
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["start", "--wait"], None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("dsv4ctl: engine failed to start"), "{err}");
    assert!(err.contains("exit code 7"), "{err}");
    // the daemon is fine
    let out = ctl(&bus.address, &["status"], None);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text(&out.stdout).contains("backoff"),
        "{}",
        text(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_reports_every_problem_or_a_summary() {
    let dir = temp_dir("check");
    let fake_log = dir.path().join("fake.log");
    let config = Setup::default().write(dir.path(), &fake_log);
    let check = |path: &std::path::Path| {
        Command::new(DSV4CTL)
            .args(["config", "check"])
            .arg(path)
            .env("DSV4D", DSV4D)
            .output()
            .unwrap()
    };
    let out = check(&config);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert!(
        text(&out.stdout).contains("320k") && text(&out.stdout).contains("64k"),
        "{}",
        text(&out.stdout)
    );
    // Two mistakes, both reported, with file:line:column and field.
    let config = Setup::default()
        .top_level("idle_timout", "5m")
        .profile_key("64k", "context", "100")
        .write(dir.path(), &fake_log);
    let out = check(&config);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("supervisor.yaml:") && stdout.contains("idle_timout"),
        "{stdout}"
    );
    assert!(
        stdout.contains("profiles/64k.yaml:") && stdout.contains("context: must be at least 512"),
        "{stdout}"
    );
    assert!(
        text(&out.stderr).starts_with("dsv4ctl: "),
        "{}",
        text(&out.stderr)
    );
    // and dsv4d --check-config itself
    let out = run_dsv4d(["--check-config", "--config", config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), stdout);
}
