//! Tests of the lifecycle actor on its own (no HTTP front end): `dsv4::lifecycle::actor`
//! driving the fake engine over real loopback sockets, through its `Handle`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use dsv4::config::Config;
use dsv4::lifecycle::actor::{self, ControlError, Handle, Lease, Status};
use dsv4::lifecycle::state::{Refusal, State};
use dsv4::lifecycle::EngineRef;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

const SEC: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// One actor under test, with its config folder and the fake engine's event log.
struct Rig {
    handle: Handle,
    task: tokio::task::JoinHandle<()>,
    fake_log: PathBuf,
    _dir: TempDir,
}

impl Rig {
    fn new(setup: &Setup) -> Rig {
        Rig::with(setup, "320k", |_, _| {})
    }

    /// Writes `setup`, lets `extra` add to the config folder, and starts the actor on
    /// `profile`.
    fn with(setup: &Setup, profile: &str, extra: impl FnOnce(&Path, &Path)) -> Rig {
        let dir = temp_dir("actor");
        let fake_log = dir.path().join("fake-engine.log");
        let path = setup.write(dir.path(), &fake_log);
        extra(dir.path(), &fake_log);
        let config = Config::load(&path).unwrap_or_else(|e| panic!("config: {e}"));
        // The configuration as dsv4d publishes it; never reloaded here.
        let (_, config) = tokio::sync::watch::channel(Arc::new(config));
        let (handle, task) = actor::spawn(config, profile.to_string(), Default::default());
        Rig {
            handle,
            task,
            fake_log,
            _dir: dir,
        }
    }

    fn fake_log(&self) -> String {
        std::fs::read_to_string(&self.fake_log).unwrap_or_default()
    }

    /// The fake engine's `start` lines, one per engine process.
    fn starts(&self) -> Vec<String> {
        self.fake_log()
            .lines()
            .filter(|l| l.starts_with("start pid="))
            .map(String::from)
            .collect()
    }

    async fn wait_fake_log(&self, needle: &str, within: Duration) {
        let t = Instant::now();
        while !self.fake_log().contains(needle) {
            assert!(
                t.elapsed() < within,
                "fake engine never logged {needle:?} in {within:?}:\n{}",
                self.fake_log()
            );
            tokio::time::sleep(10 * MS).await;
        }
    }

    /// Waits until the published status satisfies `pred`; returns it. Polls rather than waits
    /// on the status watch, so that no test here leans on the watch's wake-ups, which
    /// `the_status_watch_wakes_on_every_change` checks on their own.
    async fn wait_status(
        &self,
        what: &str,
        within: Duration,
        mut pred: impl FnMut(&Status) -> bool,
    ) -> Status {
        let t = Instant::now();
        loop {
            let s = self.handle.status();
            if pred(&s) {
                return s;
            }
            assert!(
                t.elapsed() < within,
                "{what} not reached in {within:?}; status {s:?}\nfake log:\n{}",
                self.fake_log()
            );
            tokio::time::sleep(5 * MS).await;
        }
    }

    async fn wait_state(&self, state: State, within: Duration) -> Status {
        self.wait_status(&format!("state {state}"), within, |s| s.state == state)
            .await
    }

    async fn acquire(&self) -> Lease {
        match tokio::time::timeout(PATIENCE, self.handle.acquire()).await {
            Ok(Ok(lease)) => lease,
            Ok(Err(why)) => panic!("acquire refused: {why:?}\n{}", self.fake_log()),
            Err(_) => panic!("acquire did not resolve\n{}", self.fake_log()),
        }
    }
}

/// Posts a chat completion straight to the engine a lease is for, on a connection of its own.
async fn post_chat(engine: &EngineRef, max_tokens: u32, stream: bool) -> hyper::Response<Incoming> {
    let tcp = tokio::net::TcpStream::connect(engine.upstream)
        .await
        .expect("connect to the engine");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("handshake with the engine");
    tokio::spawn(conn);
    let mut req = hyper::Request::post("/v1/chat/completions")
        .header(hyper::header::HOST, engine.upstream.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(chat(max_tokens, stream).to_string())))
        .unwrap();
    // The engine takes only its generation's key, as it would from dsv4d.
    if let Some(key) = engine.connections.key() {
        req.headers_mut()
            .insert(hyper::header::AUTHORIZATION, key.clone());
    }
    let resp = sender.send_request(req).await.expect("engine response");
    assert_eq!(resp.status(), 200);
    resp
}

/// Waits until process `pid` is gone (or a zombie).
async fn wait_gone(pid: u32, within: Duration) {
    let t = Instant::now();
    while alive(pid.into()) {
        assert!(
            t.elapsed() < within,
            "process {pid} still alive after {within:?}"
        );
        tokio::time::sleep(10 * MS).await;
    }
}

/// Adds a `ds4` profile (engine kind ds4, the fake in ds4 mode) with the given knobs.
fn write_ds4_profile(dir: &Path, fake_log: &Path, knobs: &[(&str, &str)]) {
    let mut env = format!(
        "  FAKE_ENGINE_LOG_FILE: \"{}\"\n  FAKE_ENGINE_MODE: \"ds4\"\n",
        fake_log.display()
    );
    for (k, v) in knobs {
        env.push_str(&format!("  FAKE_ENGINE_{}: \"{v}\"\n", k.to_uppercase()));
    }
    let p = format!(
        "description: test profile ds4\nengine: ds4\ncommand: {FAKE_ENGINE}\n\
         model: models/320k.gguf\ncontext: 65536\nenv:\n{env}"
    );
    std::fs::write(dir.join("profiles").join("ds4.yaml"), p).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_switch_drains_the_stream_then_restarts_with_the_new_profile() {
    let rig = Rig::new(&Setup::default().knob("token_ms", "50"));
    let lease = rig.acquire().await;
    let old = lease.engine.clone();
    assert_eq!(old.gen, 1);
    assert!(rig.starts()[0].contains("-c 327680"), "{:?}", rig.starts());
    let resp = post_chat(&old, 20, true).await;
    let mut stream = Stream::new(resp.into_body());
    let first = stream.next_event().await.expect("first event");
    assert!(first.contains(r#""content":"a""#), "{first}");

    rig.handle.set_profile("64k").await.unwrap();
    let s = rig.wait_state(State::Draining, PATIENCE).await;
    assert_eq!(s.profile, "64k");
    assert_eq!(s.engine_profile.as_deref(), Some("320k"));
    assert_eq!(s.engine_pid, Some(old.pid));
    assert_eq!(s.in_flight, 1);

    let h = rig.handle.clone();
    let mut waiter = tokio::spawn(async move { h.acquire().await });
    rig.wait_status("one waiter", PATIENCE, |s| s.waiting == 1)
        .await;

    // The stream runs to its end on the old engine while the new request waits.
    let mut content = String::from("a");
    let mut done = false;
    while let Some(ev) = stream.next_event().await {
        assert!(!waiter.is_finished(), "acquire resolved during the drain");
        let data = ev.strip_prefix("data: ").unwrap_or_default();
        if data == "[DONE]" {
            done = true;
        } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(data) {
            content.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(content, "abcdefghijklmnopqrst");
    assert!(done, "no [DONE]");
    // The engine logs the end of its answer as it finishes it, just after the client has it.
    rig.wait_fake_log("done /v1/chat/completions", PATIENCE)
        .await;
    let log = rig.fake_log();
    assert!(
        !log.contains("sigterm"),
        "old engine signalled mid-stream:\n{log}"
    );
    assert!(
        tokio::time::timeout(200 * MS, &mut waiter).await.is_err(),
        "acquire resolved while the old lease was still held"
    );
    assert_eq!(rig.handle.status().state, State::Draining);
    assert!(alive(old.pid.into()));

    drop(stream);
    drop(lease);
    let new = tokio::time::timeout(PATIENCE, waiter)
        .await
        .expect("the waiting acquire never resolved")
        .unwrap()
        .expect("the waiting acquire was refused");
    assert_eq!(new.engine.gen, 2);
    assert_ne!(new.engine.pid, old.pid);
    wait_gone(old.pid, PATIENCE).await;

    let log = rig.fake_log();
    let at = |needle: &str| {
        log.find(needle)
            .unwrap_or_else(|| panic!("no {needle:?} in the fake log:\n{log}"))
    };
    let second_start = format!("start pid={}", new.engine.pid);
    assert!(at("done /v1/chat/completions") < at("sigterm"), "{log}");
    assert!(at("sigterm") < at(&second_start), "{log}");
    let starts = rig.starts();
    assert_eq!(starts.len(), 2, "{log}");
    assert!(starts[1].contains("-c 65536"), "{}", starts[1]);

    let s = rig.handle.status();
    assert_eq!(s.state, State::Ready);
    assert_eq!(s.profile, "64k");
    assert_eq!(s.engine_profile.as_deref(), Some("64k"));
    assert_eq!(s.generation, Some(2));
    assert_eq!(s.engine_pid, Some(new.engine.pid));
    assert_eq!(s.in_flight, 1);
    assert_eq!(s.waiting, 0);

    // The new engine serves.
    let resp = post_chat(&new.engine, 3, false).await;
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_profile_is_refused_and_changes_nothing() {
    let rig = Rig::new(&Setup::default());
    // While stopped.
    let err = rig.handle.set_profile("128k").await.unwrap_err();
    assert_eq!(
        err,
        ControlError::UnknownProfile {
            name: "128k".into(),
            known: vec!["320k".into(), "64k".into()],
        }
    );
    let msg = err.to_string();
    assert!(msg.contains("`128k`"), "{msg}");
    assert!(msg.contains("320k, 64k"), "{msg}");
    assert_eq!(rig.handle.status().profile, "320k");

    // While ready.
    rig.handle.start().await.unwrap();
    let before = rig.wait_state(State::Ready, PATIENCE).await;
    let err = rig.handle.set_profile("128k").await.unwrap_err();
    assert!(err.to_string().contains("320k, 64k"), "{err}");
    tokio::time::sleep(100 * MS).await;
    let after = rig.handle.status();
    assert_eq!(after.state, State::Ready);
    assert_eq!(after.profile, "320k");
    assert_eq!(after.engine_profile.as_deref(), Some("320k"));
    assert_eq!(after.generation, before.generation);
    assert_eq!(after.engine_pid, before.engine_pid);
    assert!(!rig.fake_log().contains("sigterm"), "{}", rig.fake_log());
    let lease = rig.acquire().await;
    assert_eq!(lease.engine.gen, 1);
    assert_eq!(rig.starts().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_waits_for_the_lease_and_an_immediate_one_does_not() {
    // sigterm_ms keeps the engine in `stopping` long enough to be seen.
    let rig = Rig::new(&Setup::default().knob("sigterm_ms", "300"));
    let lease = rig.acquire().await;
    let pid = lease.engine.pid;
    rig.handle.stop(false).await.unwrap();
    let s = rig.wait_state(State::Draining, PATIENCE).await;
    assert_eq!(s.in_flight, 1);
    tokio::time::sleep(300 * MS).await;
    assert_eq!(rig.handle.status().state, State::Draining);
    assert!(
        !rig.fake_log().contains("sigterm"),
        "engine signalled while a lease was held:\n{}",
        rig.fake_log()
    );
    assert!(alive(pid.into()));

    drop(lease);
    rig.wait_state(State::Stopping, PATIENCE).await;
    rig.wait_fake_log("sigterm", PATIENCE).await;
    let s = rig.wait_state(State::Stopped, PATIENCE).await;
    assert_eq!(s.engine_pid, None);
    assert_eq!(s.generation, None);
    assert_eq!(s.in_flight, 0);
    assert_eq!(s.last_error, None);
    wait_gone(pid, PATIENCE).await;

    // stop(true) does not wait for the lease.
    let lease = rig.acquire().await;
    assert_eq!(lease.engine.gen, 2);
    let pid = lease.engine.pid;
    rig.handle.stop(true).await.unwrap();
    let t = Instant::now();
    let s = rig
        .wait_status("stopping or stopped", PATIENCE, |s| {
            s.state == State::Stopping || s.state == State::Stopped
        })
        .await;
    assert_ne!(s.state, State::Draining);
    while rig.fake_log().matches("sigterm").count() < 2 {
        assert!(
            t.elapsed() < PATIENCE,
            "no SIGTERM with the lease held:\n{}",
            rig.fake_log()
        );
        tokio::time::sleep(10 * MS).await;
    }
    rig.wait_state(State::Stopped, PATIENCE).await;
    wait_gone(pid, PATIENCE).await;
    // A lease on the stopped engine is released harmlessly; a new one starts generation 3.
    drop(lease);
    tokio::time::sleep(50 * MS).await;
    let s = rig.handle.status();
    assert_eq!((s.state, s.in_flight), (State::Stopped, 0));
    let lease = rig.acquire().await;
    assert_eq!(lease.engine.gen, 3);
    rig.wait_status("one lease", PATIENCE, |s| {
        s.state == State::Ready && s.in_flight == 1
    })
    .await;
    drop(lease);
    rig.wait_status("no lease", PATIENCE, |s| s.in_flight == 0)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_ds4_stop_gets_its_time_and_an_engine_ignoring_sigterm_is_killed() {
    // ds4 writes its KV checkpoint after SIGTERM: it must not be interrupted or killed early.
    // It takes 3 s after SIGTERM, well inside stop_timeout (10 s), and long enough that a
    // slow look at it on a loaded machine still finds it alive at the first second.
    let setup = Setup::default().engine("stop_timeout", "10s");
    let rig = Rig::with(&setup, "ds4", |dir, log| {
        write_ds4_profile(dir, log, &[("sigterm_ms", "3000")])
    });
    let lease = rig.acquire().await;
    let pid = lease.engine.pid;
    let mut exit = lease.engine.exit.clone();
    assert!(
        rig.starts()[0].contains("--ctx 65536"),
        "{:?}",
        rig.starts()
    );
    drop(lease);
    rig.wait_status("idle", PATIENCE, |s| {
        s.state == State::Ready && s.in_flight == 0
    })
    .await;

    let t0 = Instant::now();
    rig.handle.stop(false).await.unwrap();
    rig.wait_fake_log("sigterm", PATIENCE).await;
    tokio::time::sleep(SEC.saturating_sub(t0.elapsed())).await;
    assert!(alive(pid.into()), "engine ended early");
    assert!(exit.borrow().is_none());
    assert_eq!(rig.handle.status().state, State::Stopping);

    let report = tokio::time::timeout(PATIENCE, exit.wait_for(Option::is_some))
        .await
        .expect("engine did not exit")
        .unwrap()
        .clone()
        .unwrap();
    let took = t0.elapsed();
    // Exit code 0: it ran its SIGTERM course (a SIGINT would make it exit 1, SIGKILL gives a signal).
    assert_eq!((report.code, report.signal), (Some(0), None), "{report}");
    assert!(took >= 2900 * MS, "exited after {took:?}");
    let s = rig.wait_state(State::Stopped, PATIENCE).await;
    assert_eq!(s.last_error, None);
    assert_eq!(s.engine_pid, None);

    // An engine that ignores SIGTERM is SIGKILLed once stop_timeout has passed.
    let setup = Setup::default()
        .engine("stop_timeout", "1s")
        .knob("ignore_sigterm", "1");
    let rig = Rig::new(&setup);
    rig.handle.start().await.unwrap();
    let s = rig.wait_state(State::Ready, PATIENCE).await;
    let pid = s.engine_pid.unwrap();
    let lease = rig.acquire().await;
    let mut exit = lease.engine.exit.clone();
    drop(lease);
    rig.wait_status("idle", PATIENCE, |s| s.in_flight == 0)
        .await;
    let t0 = Instant::now();
    rig.handle.stop(false).await.unwrap();
    rig.wait_fake_log("sigterm", PATIENCE).await;
    wait_gone(pid, PATIENCE).await;
    let took = t0.elapsed();
    let report = tokio::time::timeout(PATIENCE, exit.wait_for(Option::is_some))
        .await
        .expect("no exit report")
        .unwrap()
        .clone()
        .unwrap();
    assert_eq!(report.signal, Some(libc::SIGKILL), "{report}");
    assert!(
        took >= 900 * MS,
        "killed after {took:?}, before stop_timeout"
    );
    let s = rig.wait_state(State::Stopped, PATIENCE).await;
    assert_eq!(s.last_error, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_brings_the_engine_up_without_a_request() {
    let rig = Rig::new(&Setup::default());
    assert_eq!(rig.handle.status().state, State::Stopped);
    rig.handle.start().await.unwrap();
    let s = rig.wait_state(State::Ready, PATIENCE).await;
    let pid = s.engine_pid.expect("engine_pid");
    assert!(alive(pid.into()));
    assert_eq!(s.generation, Some(1));
    assert_eq!(s.engine_profile.as_deref(), Some("320k"));
    assert_eq!(s.in_flight, 0);
    assert!(s.ready_since.is_some());
    assert!(s.idle_deadline.is_some());
    assert_eq!(s.last_error, None);
    // Starting a ready engine again does nothing.
    rig.handle.start().await.unwrap();
    tokio::time::sleep(100 * MS).await;
    assert_eq!(rig.handle.status().engine_pid, Some(pid));
    assert_eq!(rig.starts().len(), 1);
    assert!(
        !rig.fake_log().contains("request POST"),
        "{}",
        rig.fake_log()
    );
    assert!(rig.starts()[0].contains(&format!("start pid={pid} ")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_the_stream_then_stops_the_engine_and_ends_the_actor() {
    // stop_timeout is far off: the shutdown must follow the lease, not the timer.
    let setup = Setup::default()
        .engine("stop_timeout", "30s")
        .knob("token_ms", "50");
    let rig = Rig::new(&setup);
    let lease = rig.acquire().await;
    let pid = lease.engine.pid;
    let resp = post_chat(&lease.engine, 20, true).await;
    let mut stream = Stream::new(resp.into_body());
    stream.next_event().await.expect("first event");

    let h = rig.handle.clone();
    let mut shutdown = tokio::spawn(async move { h.shutdown().await });
    rig.wait_state(State::Draining, PATIENCE).await;
    // No new leases once shutting down.
    let refused = tokio::time::timeout(PATIENCE, rig.handle.acquire())
        .await
        .expect("acquire during shutdown did not resolve");
    assert!(
        matches!(refused, Err(Refusal::ShuttingDown)),
        "{:?}",
        refused.map(|l| l.engine.gen)
    );

    let (rest, done, _) = stream.collect_chat().await;
    assert_eq!(rest, "bcdefghijklmnopqrst");
    assert!(done);
    assert!(
        !shutdown.is_finished(),
        "shutdown did not wait for the lease"
    );
    assert!(!rig.fake_log().contains("sigterm"), "{}", rig.fake_log());
    drop(stream);
    drop(lease);
    let released = Instant::now();

    tokio::time::timeout(PATIENCE, &mut shutdown)
        .await
        .expect("shutdown did not resolve")
        .unwrap();
    // The engine stops at once when the lease goes (an idle SIGTERM ends it in milliseconds).
    assert!(
        released.elapsed() < SEC + LOAD_MARGIN,
        "the shutdown took {:?} after the lease went",
        released.elapsed()
    );
    assert!(rig.fake_log().contains("sigterm"));
    wait_gone(pid, PATIENCE).await;
    let Rig { handle, task, .. } = rig;
    tokio::time::timeout(PATIENCE, task)
        .await
        .expect("the actor task did not end")
        .unwrap();
    assert!(matches!(handle.acquire().await, Err(Refusal::ShuttingDown)));
    assert_eq!(handle.start().await, Err(ControlError::Gone));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_no_longer_than_stop_timeout() {
    let setup = Setup::default()
        .engine("stop_timeout", "1s")
        .knob("token_ms", "50");
    let rig = Rig::new(&setup);
    let lease = rig.acquire().await;
    let pid = lease.engine.pid;
    // 400 tokens: 20 s, far beyond stop_timeout.
    let resp = post_chat(&lease.engine, 400, true).await;
    let mut body = resp.into_body();
    body.frame().await.expect("first frame").unwrap();

    let t0 = Instant::now();
    // The drain is cut at stop_timeout (1 s), and the engine has at most as long again to
    // exit; the stream alone would take 20 s.
    tokio::time::timeout(2 * SEC + LOAD_MARGIN, rig.handle.shutdown())
        .await
        .expect("shutdown was not bounded by stop_timeout");
    let took = t0.elapsed();
    assert!(took >= 900 * MS, "the drain was cut short: {took:?}");
    assert!(rig.fake_log().contains("sigterm"));
    assert!(!rig.fake_log().contains("done /v1/chat/completions"));
    wait_gone(pid, PATIENCE).await;
    tokio::time::timeout(PATIENCE, rig.task)
        .await
        .expect("the actor task did not end")
        .unwrap();
    drop(lease);
}

/// Regression: dropping every `Handle` is a shutdown. A closed command channel is ready at
/// once, forever; the actor used to spin on it (a core at 100 %) and never reach its timers,
/// so an engine that ignored SIGTERM was never killed and the actor never ended.
///
/// The test runs on a runtime of its own, whose threads have a name: the CPU it measures is
/// theirs, not that of other tests running in the same process.
#[test]
fn dropping_every_handle_stops_the_engine_within_stop_timeout() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(SPIN_TEST_THREADS)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        rt.spawn(dropping_every_handle_stops_the_engine())
            .await
            .unwrap()
    });
}

const SPIN_TEST_THREADS: &str = "dsv4-spin-test";

async fn dropping_every_handle_stops_the_engine() {
    let setup = Setup::default()
        .engine("stop_timeout", "1s")
        .knob("ignore_sigterm", "1");
    let rig = Rig::new(&setup);
    rig.handle.start().await.unwrap();
    let pid = rig
        .wait_state(State::Ready, PATIENCE)
        .await
        .engine_pid
        .unwrap();
    let Rig {
        handle,
        task,
        fake_log,
        _dir,
    } = rig;
    drop(handle);
    let log = || std::fs::read_to_string(&fake_log).unwrap_or_default();
    let t = Instant::now();
    while !log().contains("sigterm") {
        assert!(t.elapsed() < PATIENCE, "no SIGTERM after the handles went");
        tokio::time::sleep(10 * MS).await;
    }
    let cpu0 = threads_cpu_time(SPIN_TEST_THREADS);
    let wall0 = Instant::now();
    wait_gone(pid, PATIENCE).await;
    let cpu = threads_cpu_time(SPIN_TEST_THREADS).saturating_sub(cpu0);
    let wall = wall0.elapsed();
    assert!(
        cpu < wall / 2,
        "the runtime burnt {cpu:?} of CPU in {wall:?} while the engine stopped"
    );
    tokio::time::timeout(PATIENCE, task)
        .await
        .expect("the actor task did not end")
        .unwrap();
}

/// Regression: `watch_status()` receivers used to be woken only when `state` changed, so a
/// profile switch while stopped, or a lease taken or released, went unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_watch_wakes_on_every_change() {
    let rig = Rig::new(&Setup::default());
    let mut rx = rig.handle.watch_status();
    rx.mark_unchanged();
    rig.handle.set_profile("64k").await.unwrap();
    // The answer comes after the status that reflects it is published.
    assert_eq!(rig.handle.status().profile, "64k");
    tokio::time::timeout(PATIENCE, rx.changed())
        .await
        .expect("no change notified for the new profile")
        .unwrap();
    assert_eq!(rx.borrow_and_update().profile, "64k");
}

/// User + system CPU time of this process's threads named `name`.
fn threads_cpu_time(name: &str) -> Duration {
    let mut ticks = 0;
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        // A thread that ended meanwhile has no stat any more.
        let Ok(stat) = std::fs::read_to_string(task.unwrap().path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ...`; comm may hold spaces and parentheses, the last `)` ends it.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != name {
            continue;
        }
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After comm: state is field 3, utime 14, stime 15 (1-based in proc(5)).
        ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    }
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// Waits (in whatever time the runtime keeps) until the published state is `state`.
async fn until_state(rig: &Rig, state: State) -> Status {
    let mut w = rig.handle.watch_status();
    loop {
        let s = w.borrow_and_update().clone();
        if s.state == state {
            return s;
        }
        w.changed().await.expect("the actor ended");
    }
}

// The actor keeps its time on tokio's clock, so an hour of idle timeout passes in paused time.
// The engine starts in real time (a real process has to load); the clock is paused once it is
// ready, and resumed as soon as the stop begins, so the engine's own exit is not hurried.
#[tokio::test(flavor = "current_thread")]
async fn an_idle_engine_is_stopped_after_its_idle_timeout_in_paused_time() {
    let rig = Rig::new(&Setup::default().engine("idle_timeout", "1h"));
    let asked = Instant::now();
    rig.handle.start().await.unwrap();
    rig.wait_state(State::Ready, PATIENCE).await;
    let wall = Instant::now();
    tokio::time::pause();
    // Idle time counts from the ready, which came some real time before the pause: at most
    // the time since the start was asked for (more on a loaded machine).
    let before_pause = asked.elapsed();
    let t0 = tokio::time::Instant::now();
    until_state(&rig, State::Stopping).await;
    let idle = t0.elapsed();
    tokio::time::resume();
    rig.wait_state(State::Stopped, PATIENCE).await;
    let hour = Duration::from_secs(3600);
    assert!(
        idle >= hour.saturating_sub(before_pause) && idle <= hour + 10 * MS,
        "stopped after {idle:?} of paused time ({before_pause:?} of real time before it)"
    );
    // An hour of idle timeout in far less than an hour: the actor's clock is tokio's.
    assert!(
        wall.elapsed() < PATIENCE,
        "took {:?} of wall time",
        wall.elapsed()
    );
    // A graceful stop: SIGTERM, not the escalation.
    assert!(rig.fake_log().contains("sigterm"), "{}", rig.fake_log());
    assert_eq!(rig.starts().len(), 1);
}

// Backoff after failed starts: 1 s, then 2 s (doubling), in paused time. Each start runs in
// real time (the engine is a real process that fails), each backoff paused.
#[tokio::test(flavor = "current_thread")]
async fn failed_starts_back_off_doubling_in_paused_time() {
    let rig = Rig::new(&Setup::default().knob("fail_start", "exit:7"));
    let wall = Instant::now();
    for (failures, backoff) in [(1, 1), (2, 2)] {
        let asked = Instant::now();
        rig.handle.start().await.unwrap();
        let s = until_state(&rig, State::Backoff).await;
        assert_eq!(s.failures, failures);
        assert!(
            s.last_error
                .as_deref()
                .unwrap_or("")
                .contains("exit code 7"),
            "{s:?}"
        );
        tokio::time::pause();
        // The backoff began some real time before the pause: at most this much.
        let before_pause = asked.elapsed();
        let t0 = tokio::time::Instant::now();
        // A request during the backoff is refused at once, with the time left.
        match rig.handle.acquire().await {
            Err(Refusal::Backoff { retry_after, .. }) => {
                assert!(
                    retry_after <= Duration::from_secs(backoff),
                    "{retry_after:?}"
                )
            }
            other => panic!("expected a backoff refusal, got {other:?}"),
        }
        let s = until_state(&rig, State::Stopped).await;
        let waited = t0.elapsed();
        tokio::time::resume();
        let want = Duration::from_secs(backoff);
        assert!(
            // Timers round up to the millisecond.
            waited <= want + 10 * MS && waited >= want.saturating_sub(before_pause),
            "backoff {failures}: {waited:?} of paused time, want about {want:?} \
             ({before_pause:?} of real time before the pause)"
        );
        assert_eq!(s.failures, failures, "the count survives the backoff");
    }
    assert_eq!(rig.starts().len(), 2);
    assert!(
        wall.elapsed() < PATIENCE,
        "took {:?} of wall time",
        wall.elapsed()
    );
}
