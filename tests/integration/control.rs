//! The control plane end to end: `dsv4d` serving `io.github.dsv4.Supervisor1` on a private
//! bus started by the test, driven by the real `dsv4ctl` (and, for signals, a zbus client).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::{State, Supervisor1Proxy};
use futures_util::StreamExt;
use zbus::proxy::CacheProperties;

const SEC: Duration = Duration::from_secs(1);
const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

/// Runs `dsv4ctl --bus session ARGS` on `bus`, optionally as another user: the copy of
/// dsv4ctl that user may run, through setpriv with these arguments.
pub(crate) fn ctl(bus: &str, args: &[&str], as_user: Option<(&CtlCopy, &[&str])>) -> Output {
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
    cmd.output_within(HANG)
}

/// A copy of dsv4ctl that any user may run (the build folder may not be reachable); removed
/// on drop.
pub(crate) struct CtlCopy {
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

/// A connection to `bus` and two typed proxies of the daemon on it: one that reads each
/// property from the daemon when asked (what a test checks after an action), and one that
/// caches them, as the property change streams need.
async fn client(
    bus: &PrivateBus,
) -> (
    zbus::Connection,
    Supervisor1Proxy<'static>,
    Supervisor1Proxy<'static>,
) {
    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    let live = Supervisor1Proxy::builder(&conn)
        .cache_properties(zbus::proxy::CacheProperties::No)
        .build()
        .await
        .unwrap();
    let cached = Supervisor1Proxy::new(&conn).await.unwrap();
    (conn, live, cached)
}

pub(crate) async fn wait_bus_name(d: &Daemon, bus: &PrivateBus) {
    let t = Instant::now();
    loop {
        if ctl(&bus.address, &["status", "--json"], None).status.code() == Some(0) {
            return;
        }
        assert!(
            t.elapsed() < PATIENCE,
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
    assert_eq!(s.engine.state, State::Stopped);
    assert_eq!(s.engine.profile, "320k");

    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(proxy.state().await.unwrap(), State::Ready.as_str());
    let first_pid = proxy.engine_pid().await.unwrap();
    assert!(first_pid > 0);
    assert!(d.fake_log().contains("-c 327680"));

    // A request in flight during the switch completes on the old engine (a stream of
    // seconds: it still runs once dsv4ctl has switched, however slow the machine).
    let resp = d.post("/v1/chat/completions", chat(150, true)).await;
    let mut stream = Stream::new(resp.into_body());
    stream.next_event().await.unwrap();
    let out = ctl(&bus.address, &["profile", "64k"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(proxy.profile().await.unwrap(), "64k");
    assert_eq!(proxy.state().await.unwrap(), State::Draining.as_str());
    let (rest, done, _) = stream.collect_chat().await;
    assert_eq!(rest.len(), 149);
    assert!(done);
    let t = Instant::now();
    while proxy.state().await.unwrap() != State::Ready.as_str()
        || proxy.engine_pid().await.unwrap() == first_pid
    {
        assert!(t.elapsed() < PATIENCE, "no restart with the new profile");
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
    d.wait_state(State::Stopped, PATIENCE).await;
    assert_eq!(proxy.engine_pid().await.unwrap(), 0);

    // The states went by in order, each announced.
    use State::*;
    let want = [
        Starting, Ready, Draining, Stopping, Starting, Ready, Stopping, Stopped,
    ]
    .map(State::as_str);
    let t = Instant::now();
    let last = |v: &Arc<Mutex<Vec<String>>>| v.lock().unwrap().last().cloned();
    while last(&seen).as_deref() != Some(Stopped.as_str())
        || last(&announced).as_deref() != Some(Stopped.as_str())
    {
        if t.elapsed() > PATIENCE {
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
    for w in [Stopped, Ready, Stopped].map(State::as_str) {
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
    d.log_with(&["refused"]).await;

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
    // At once: a client that waited for the name would hang for the bus's 25 s call timeout.
    assert!(t.elapsed() < 3 * LOAD_MARGIN, "{:?}", t.elapsed());
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
    assert_eq!(st.engine.profile, "64k");
    // and the next start uses it
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    assert!(d
        .fake_log()
        .lines()
        .any(|l| l.starts_with("start pid=") && l.contains(" -c 65536 ")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_choice_that_cannot_be_saved_fails_and_changes_nothing() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    // state_dir becomes a file: nothing can be saved in it (even by root).
    let state = d.dir().join("state");
    let _ = std::fs::remove_dir_all(&state);
    std::fs::write(&state, "not a folder").unwrap();
    let out = ctl(&bus.address, &["profile", "64k"], None);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot remember profile 64k in"), "{err}");
    assert!(err.contains("nothing changed"), "{err}");
    let out = ctl(&bus.address, &["--json", "profile"], None);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["profile"], "320k");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_show_the_engine_output() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // The engine's lines are read from its pipes beside the readiness poll, so they may
    // reach the daemon just after `start --wait` returns: asked again until they are there.
    let t = std::time::Instant::now();
    loop {
        let out = ctl(&bus.address, &["logs"], None);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let logs = text(&out.stdout);
        let loading =
            logs.contains("fake-engine: loading model ") && logs.contains("/models/320k.gguf");
        if loading && logs.contains("main: model loaded") {
            break;
        }
        assert!(t.elapsed() < PATIENCE, "{logs}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_wait_fails_with_the_engine_error() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus).knob("fail_start", "exit:7"));
    wait_bus_name(&d, &bus).await;
    // Twice: the second start comes while the daemon backs off after the first failure, and
    // must be a real try answered by its own failure, not an old state read as the answer.
    for attempt in 1..=2 {
        let t = Instant::now();
        let out = ctl(&bus.address, &["start", "--wait"], None);
        let took = t.elapsed();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.starts_with("dsv4ctl: engine failed to start"), "{err}");
        assert!(err.contains("exit code 7"), "{err}");
        // The engine's last lines, as the daemon quotes them.
        assert!(err.contains("failed to load model"), "{err}");
        // The engine fails at once; the answer follows it, with no grace period.
        assert!(
            took < SEC + LOAD_MARGIN,
            "attempt {attempt}: dsv4ctl took {took:?}"
        );
        assert_eq!(d.starts().len(), attempt, "{}", d.log());
    }
    // the daemon is fine
    let out = ctl(&bus.address, &["status"], None);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text(&out.stdout).contains(State::Backoff.as_str()),
        "{}",
        text(&out.stdout)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_wait_shows_the_states_the_daemon_announces() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus).knob("load_ms", "600"));
    wait_bus_name(&d, &bus).await;
    let t = Instant::now();
    let out = ctl(&bus.address, &["start", "--wait"], None);
    let took = t.elapsed();
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.first(), Some(&State::Starting.as_str()), "{stdout}");
    assert!(
        lines.last().is_some_and(|l| l.starts_with("ready after ")),
        "{stdout}"
    );
    // It waited for the load, and not much longer.
    assert!(took >= Duration::from_millis(600), "{took:?}");
    assert!(
        took < Duration::from_millis(600) + SEC + LOAD_MARGIN,
        "{took:?}"
    );
    assert_eq!(d.status().await["state"], State::Ready.as_str());
    // Already ready: answered at once.
    let out = ctl(&bus.address, &["--json", "start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s: dsv4_client::Status = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s.engine.state, State::Ready);
    assert_eq!(d.starts().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_prints_new_lines_as_the_engine_writes_them() {
    use std::io::{BufRead, BufReader};
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mut follow = Command::new(DSV4CTL)
        .args(["--bus", "session", "logs", "-f", "-n", "1"])
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = follow.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // The last line so far comes first.
    rx.recv_timeout(PATIENCE).expect("logs -f printed nothing");
    // A request makes the engine log; the line shows up while logs -f keeps running.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = d.post("/v1/chat/completions", chat(2, false)).await;
    assert_eq!(resp.status(), 200);
    let deadline = Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains("/v1/chat/completions") => break,
            Ok(line) => seen.push(line),
            Err(_) => panic!(
                "the request's log line never came; saw {seen:?}\n{}",
                d.log()
            ),
        }
    }
    assert!(follow.try_wait().unwrap().is_none(), "logs -f ended");
    // Ctrl-C ends it cleanly.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(follow.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = follow.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_while_serving_raises_an_alert() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus).knob("die_after_tokens", "3"));
    wait_bus_name(&d, &bus).await;
    let (_conn, proxy, _) = client(&bus).await;
    let mut alerts = proxy.receive_alert().await.unwrap();
    // A clean start and stop raise nothing.
    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let out = ctl(&bus.address, &["stop"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    d.wait_state(State::Stopped, PATIENCE).await;
    // A request that makes it die mid-answer does.
    let resp = d.post("/v1/chat/completions", chat(10, false)).await;
    assert_eq!(resp.status(), 502);
    let args = next_alert(&mut alerts, &d).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Engine);
    assert!(args.message.contains("profile 320k"), "{}", args.message);
    assert!(args.message.contains("exit code 3"), "{}", args.message);
    assert!(
        args.message.contains("dying on purpose"),
        "{}",
        args.message
    );
    // Only the crash: nothing else is queued.
    let more = tokio::time::timeout(Duration::from_millis(300), alerts.next()).await;
    assert!(more.is_err(), "unexpected second alert");
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

#[test]
fn a_configuration_check_never_shows_a_secret_read_as_configuration() {
    let dir = temp_dir("check-secret");
    let fake_log = dir.path().join("fake.log");
    let config = Setup::default().write(dir.path(), &fake_log);
    let secret = "3f9a0c6e1b2d4f5a6c7e8d9b0a1c2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d";
    let keys = dir.path().join("admin-keys");
    std::fs::write(&keys, format!("{secret}\n")).unwrap();
    // A profile linked to the key file, and one with the secret where a number goes.
    std::os::unix::fs::symlink(&keys, dir.path().join("profiles/keys.yaml")).unwrap();
    let profile = format!("engine: llama-server\ncommand: x\ncontext: {secret}\n");
    std::fs::write(dir.path().join("profiles/pasted.yaml"), profile).unwrap();
    let out = run_dsv4d(["--check-config", "--config", config.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains(
            "profiles/keys.yaml: is a symbolic link to admin-keys, outside the profiles folder \
             profiles"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "profiles/pasted.yaml:3:10: context: invalid type: string (64 characters, not \
             shown), expected"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains(&secret[..13]), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_figures_are_announced_at_a_bounded_rate_and_end_true() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&setup(&bus));
    wait_bus_name(&d, &bus).await;
    let (_conn, _, cached) = client(&bus).await;
    let out = ctl(&bus.address, &["start", "--wait"], None);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let mut in_flight = cached.receive_in_flight_changed().await;
    // The stream first yields the current value.
    tokio::time::timeout(PATIENCE, in_flight.next())
        .await
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let sink = seen.clone();
    tokio::spawn(async move {
        while let Some(c) = in_flight.next().await {
            if let Ok(v) = c.get().await {
                sink.lock().unwrap().push(v);
            }
        }
    });
    // 40 requests one after another: InFlight goes 0 -> 1 -> 0 each time.
    let t = Instant::now();
    for _ in 0..40 {
        let resp = d.post("/v1/chat/completions", chat(1, false)).await;
        assert_eq!(resp.status(), 200);
        let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
    }
    let took = t.elapsed();
    // The last value always goes out, a gap later.
    let t = Instant::now();
    while seen.lock().unwrap().last() != Some(&0) {
        assert!(
            t.elapsed() < PATIENCE,
            "the last InFlight (0) never went out: {:?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seen = seen.lock().unwrap().clone();
    // Held back to one announcement per 250 ms (plus the first and the last).
    let bound = (took.as_millis() / 250 + 3) as usize;
    assert!(
        seen.len() <= bound,
        "{} InFlight announcements for 40 requests in {took:?}: {seen:?}",
        seen.len()
    );
}
