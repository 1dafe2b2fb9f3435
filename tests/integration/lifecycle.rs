//! End-to-end tests of `dsv4d` against the fake engine, over real loopback sockets, with the
//! API socket handed over the way systemd socket activation does.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::State;
use nix::sys::signal::Signal;

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_streams_during_a_cold_start_spawn_one_engine() {
    let d = Daemon::start(
        &Setup::default()
            .knob("load_ms", "700")
            .knob("token_ms", "2"),
    );
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let client_d = &d;
        tasks.push(async move {
            let resp = client_d.post("/v1/chat/completions", chat(8, true)).await;
            let status = resp.status().as_u16();
            let ctype = resp
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_string());
            let mut s = Stream::new(resp.into_body());
            let (content, done, events) = s.collect_chat().await;
            (status, ctype, content, done, events)
        });
    }
    let results = futures_util::future::join_all(tasks).await;
    for (status, ctype, content, done, events) in &results {
        assert_eq!(*status, 200);
        assert_eq!(ctype.as_deref(), Some("text/event-stream"));
        assert_eq!(content, "abcdefgh");
        assert!(*done, "no [DONE]");
        assert_eq!(*events, 10, "8 tokens + final chunk + [DONE]");
    }
    assert_eq!(
        d.spawns(),
        1,
        "engine spawned more than once:\n{}",
        d.fake_log()
    );
    let s = d.status().await;
    assert_eq!(s["state"], State::Ready.as_str());
    assert_eq!(s["in_flight"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_pauses_past_idle_timeout_completes_and_is_not_buffered() {
    let setup = Setup::default()
        .engine("idle_timeout", "1s")
        .knob("pause_after", "1")
        .knob("pause_ms", "2500");
    let d = Daemon::start(&setup);
    let t0 = Instant::now();
    let resp = d.post("/v1/chat/completions", chat(4, true)).await;
    assert_eq!(resp.status(), 200);
    let mut s = Stream::new(resp.into_body());
    let first = s.next_event().await.expect("first event");
    let first_at = Instant::now();
    assert!(first.contains(r#""content":"a""#), "{first}");
    let (rest, done, _) = s.collect_chat().await;
    // The first token reached the client before the engine's 2.5 s pause, not with the rest
    // after it: nothing buffers it. (Load can only delay the first, and so shorten the gap.)
    let gap = first_at.elapsed();
    assert!(
        gap >= Duration::from_millis(1500),
        "the rest came {gap:?} after the first chunk"
    );
    assert!(t0.elapsed() >= Duration::from_millis(2500));
    assert_eq!(rest, "bcd");
    assert!(done);
    // The pause was longer than idle_timeout, but the lease held the engine up.
    assert_eq!(d.spawns(), 1);
    assert!(
        !d.fake_log().contains("sigterm"),
        "engine stopped mid-stream:\n{}",
        d.fake_log()
    );
    // Idle time counts from the end of the stream: it stops about a second later.
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(d.fake_log().contains("sigterm"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_engine_stops_and_the_next_request_starts_it_again() {
    let d = Daemon::start(&Setup::default().engine("idle_timeout", "1s"));
    // The supervisor's own endpoints never start the engine.
    for path in ["/health", "/status", "/v1/models", "/metrics"] {
        let (status, v) = d.get(path).await;
        assert_eq!(status, 200, "{path}: {v}");
    }
    let (_, models) = d.get("/v1/models").await;
    let ids: Vec<_> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["320k", "64k"]);
    assert_eq!(models["data"][0]["context"], 327680);
    assert_eq!(models["data"][0]["active"], true);
    let (_, health) = d.get("/health").await;
    assert_eq!(health["engine"], State::Stopped.as_str());
    assert_eq!(d.spawns(), 0);

    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert_eq!(d.spawns(), 1);
    let s = d.status().await;
    assert_eq!(s["state"], State::Ready.as_str());
    assert!(s["engine_pid"].as_i64().is_some());
    assert!(s["idle_deadline"].as_f64().is_some());

    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(d.fake_log().contains("sigterm"));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(d.spawns(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_exits_at_start_gives_its_stderr_and_the_daemon_stays_up() {
    let d = Daemon::start(&Setup::default().knob("fail_start", "exit:7"));
    let (status, headers, v) =
        body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 503, "{v}");
    assert!(headers.contains_key("retry-after"));
    assert_eq!(v["error"]["type"], "unavailable_error");
    assert_eq!(v["error"]["code"], "engine_start_failed");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("exited before it was ready (exit code 7)"),
        "{msg}"
    );
    assert!(
        msg.contains("fake-engine: error: failing on purpose (exit 7)"),
        "{msg}"
    );
    let (status, health) = d.get("/health").await;
    assert_eq!(status, 200);
    assert_eq!(health["engine"], State::Backoff.as_str());
    let s = d.status().await;
    assert!(
        s["last_error"].as_str().unwrap().contains("exit code 7"),
        "{s}"
    );
    // During the backoff: refused at once, without a spawn.
    let (status, headers, v) =
        body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 503);
    assert_eq!(v["error"]["code"], "engine_backoff");
    assert!(headers.contains_key("retry-after"));
    assert_eq!(d.spawns(), 1);
    // After it, a later request tries again.
    d.wait_state(State::Stopped, PATIENCE).await;
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 503);
    assert_eq!(d.spawns(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_never_gets_ready_times_out_with_504_and_is_stopped() {
    let setup = Setup::default()
        .engine("start_timeout", "1s")
        .knob("fail_start", "hang");
    let d = Daemon::start(&setup);
    let t0 = Instant::now();
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    let took = t0.elapsed();
    assert_eq!(status, 504, "{v}");
    assert!(took >= SEC && took < SEC + LOAD_MARGIN, "{took:?}");
    assert_eq!(v["error"]["code"], "engine_start_timeout");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("engine.start_timeout (1s)"), "{msg}");
    assert!(
        msg.contains("fake-engine: loading model"),
        "no output tail: {msg}"
    );
    d.wait_fake_log("sigterm", PATIENCE).await;
    d.wait_state(State::Backoff, PATIENCE).await;
    let (status, _) = d.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_closes_the_engine_connection() {
    let d = Daemon::start(&Setup::default().knob("token_ms", "50"));
    let resp = d.post("/v1/chat/completions", chat(400, true)).await;
    let mut s = Stream::new(resp.into_body());
    s.next_event().await.unwrap();
    s.next_event().await.unwrap();
    assert_eq!(d.status().await["in_flight"], 1);
    drop(s);
    let dropped = Instant::now();
    d.wait_fake_log("client-closed /v1/chat/completions", PATIENCE)
        .await;
    assert!(!d.fake_log().contains("done /v1/chat/completions"));
    // and the lease is gone with it (the stream would hold it for 20 s)
    while d.status().await["in_flight"] != 0 {
        assert!(dropped.elapsed() < SEC + LOAD_MARGIN, "lease still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_mid_request_gives_502_with_its_output() {
    let d = Daemon::start(&Setup::default().knob("die_after_tokens", "3"));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(10, false)).await).await;
    assert_eq!(status, 502, "{v}");
    assert_eq!(v["error"]["code"], "engine_failed");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("exited while handling the request (exit code 3)"),
        "{msg}"
    );
    assert!(msg.contains("dying on purpose"), "{msg}");
    d.wait_state(State::Stopped, PATIENCE).await;
    let s = d.status().await;
    assert!(
        s["last_error"]
            .as_str()
            .unwrap()
            .contains("exited unexpectedly"),
        "{s}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_max_waiting_get_503_with_retry_after() {
    let setup = Setup::default()
        .engine("max_waiting", "2")
        .knob("load_ms", "800");
    let d = Daemon::start(&setup);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let d = &d;
        tasks.push(
            async move { body_json(d.post("/v1/chat/completions", chat(2, false)).await).await },
        );
    }
    let results = futures_util::future::join_all(tasks).await;
    let ok = results.iter().filter(|r| r.0 == 200).count();
    let full: Vec<_> = results.iter().filter(|r| r.0 == 503).collect();
    assert_eq!(ok, 2, "{results:?}");
    assert_eq!(full.len(), 2, "{results:?}");
    for (_, h, v) in full {
        assert_eq!(v["error"]["code"], "queue_full");
        assert!(h.contains_key("retry-after"));
    }
    assert_eq!(d.spawns(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_the_stream_finish_then_exits_zero_with_no_engine_left() {
    let d = Daemon::start(&Setup::default().knob("token_ms", "100"));
    let resp = d.post("/v1/chat/completions", chat(10, true)).await;
    let mut s = Stream::new(resp.into_body());
    s.next_event().await.unwrap();
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    assert!(alive(pid));
    d.signal(Signal::SIGTERM);
    // The in-flight stream still completes.
    let (rest, done, _) = s.collect_chat().await;
    assert_eq!(rest, "bcdefghij");
    assert!(done);
    let mut d = d;
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(!alive(pid), "engine {pid} outlived the daemon");
    assert!(d.fake_log().contains("sigterm"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_stopped_exits_zero_at_once() {
    let mut d = Daemon::start(&Setup::default());
    d.wait_state(State::Stopped, PATIENCE).await;
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_daemon_leaves_no_engine_behind() {
    let mut d = Daemon::start(&Setup::default());
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    d.signal(Signal::SIGKILL);
    d.wait_exit(PATIENCE).await;
    let t = Instant::now();
    while alive(pid) {
        assert!(
            t.elapsed() < PATIENCE,
            "engine {pid} survived a SIGKILLed daemon"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_a_killed_daemon_left_running_is_ended_at_the_next_start() {
    // A `command` that is a wrapper script without `exec`: the death signal reaches the
    // script, which is the daemon's child, and not the engine it runs.
    let dir = temp_dir("leftover");
    let wrapper = dir.path().join("engine-wrapper");
    std::fs::write(&wrapper, format!("#!/bin/sh\n{FAKE_ENGINE} \"$@\"\n")).unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let command = wrapper.display().to_string();
    let setup = Setup::default()
        .profile_key("320k", "command", &command)
        .profile_key("64k", "command", &command);
    let d = Daemon::start_in(&setup, dir);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let script = d.status().await["engine_pid"].as_i64().unwrap();
    let engine: i64 = d.starts()[0]
        .strip_prefix("start pid=")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap();
    assert_ne!(script, engine, "the engine is the script's child");
    let record = std::fs::read_to_string(d.dir().join("state/engine-group")).unwrap();
    assert!(record.contains(&format!("pgid={script}\n")), "{record}");

    let dir = d.kill_and_keep_dir().await;
    let t = Instant::now();
    while alive(script) {
        assert!(t.elapsed() < PATIENCE, "the script survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // What the fix is for: the engine itself is still there, with nobody to stop it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        alive(engine),
        "the engine went with its script; nothing left to test"
    );

    let d = Daemon::start_in(&setup, dir);
    let t = Instant::now();
    while alive(engine) {
        assert!(
            t.elapsed() < PATIENCE,
            "the leftover engine {engine} was not ended:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.log_with(&["ending an engine process a previous dsv4d left running"])
        .await;
    // The new daemon serves with an engine of its own, and its record replaced the old one.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let new_script = d.status().await["engine_pid"].as_i64().unwrap();
    let record = std::fs::read_to_string(d.dir().join("state/engine-group")).unwrap();
    assert!(record.contains(&format!("pgid={new_script}\n")), "{record}");
    // A clean stop removes the record.
    let dir = d.stop().await;
    assert!(!dir.path().join("state/engine-group").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_reach_the_engine_whole_and_hop_by_hop_headers_are_dropped() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::body::Frame;
    let d = Daemon::start(&Setup::default());
    // A raw HTTP/1.1 client so the request body can be sent piece by piece.
    let stream = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(4);
    let mut rx = rx;
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let req = hyper::Request::post("/echo")
        // A name of this machine that is not the engine's address.
        .header("host", "localhost:9")
        .header("connection", "x-custom")
        .header("x-custom", "hop")
        .header("content-type", "text/plain")
        .body(body)
        .unwrap();
    let mut resp_fut = tokio::spawn(async move { sender.send_request(req).await });
    tx.send(Ok(Frame::data(Bytes::from_static(b"first "))))
        .await
        .unwrap();
    // Half a body reaches neither the engine nor the lifecycle: it is read whole first.
    let early = tokio::time::timeout(Duration::from_millis(500), &mut resp_fut).await;
    assert!(early.is_err(), "answered before the body ended");
    assert_eq!(d.spawns(), 0, "half a body started the engine");
    tx.send(Ok(Frame::data(Bytes::from_static(b"second"))))
        .await
        .unwrap();
    drop(tx);
    let resp = tokio::time::timeout(PATIENCE, resp_fut)
        .await
        .expect("an answer once the body ended")
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let h = resp.headers().clone();
    assert_eq!(h.get("x-echo-content-type").unwrap(), "text/plain");
    assert!(
        h.get("x-echo-x-custom").is_none(),
        "a header named in Connection was forwarded"
    );
    assert!(h
        .get("x-echo-connection")
        .map(|v| v != "x-custom")
        .unwrap_or(true));
    assert_ne!(h.get("x-echo-host").unwrap(), "localhost:9");
    let echoed = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(echoed, "first second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_stream_arrives_whole_and_in_order() {
    // The proxy may carry several events in one frame when they are already there; none may
    // be lost, split wrongly or reordered.
    let d = Daemon::start(&Setup::default());
    for _ in 0..2 {
        let resp = d.post("/v1/chat/completions", chat(5000, true)).await;
        let mut s = Stream::new(resp.into_body());
        let (content, done, events) = s.collect_chat().await;
        let want: String = (0..5000u32)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        assert_eq!(content, want);
        assert!(done);
        assert_eq!(events, 5002);
    }
    // both streams went over the engine's kept-alive connection pool of one engine
    assert_eq!(d.spawns(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_socket_activation_it_binds_listen() {
    let setup = Setup::default()
        .listen_flag()
        .log_level("info")
        .leave_log_once_listening();
    let mut d = Daemon::start(&setup);
    // The reader of its log is gone now (stderr is a closed pipe): the daemon must not care.
    let (status, body) = {
        let mut s = std::net::TcpStream::connect(d.addr).unwrap();
        use std::io::{Read, Write};
        s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        (out.lines().next().unwrap_or_default().to_string(), out)
    };
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    assert!(
        body.contains(&format!(r#""engine":"{}""#, State::Stopped)),
        "{body}"
    );
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_config_is_fatal_with_the_file_line_and_field() {
    let dir = temp_dir("badcfg");
    // `idle_timeout` belongs under `engine:`.
    let config = Setup::default()
        .top_level("idle_timeout", "5m")
        .write(dir.path(), &dir.path().join("fake.log"));
    let text = std::fs::read_to_string(&config).unwrap();
    let out = run_dsv4d(["--config", config.to_str().unwrap(), "--bus", "none"]);
    // EX_CONFIG, which the unit's RestartPreventExitStatus=78 does not restart.
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    let line = text
        .lines()
        .position(|l| l.starts_with("idle_timeout:"))
        .unwrap()
        + 1;
    assert!(
        err.contains(&format!(
            "supervisor.yaml:{line}:1: idle_timeout: unknown key `idle_timeout`"
        )),
        "{err}"
    );
    assert!(err.starts_with("dsv4d: "), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_connections_are_kept_alive_and_reused() {
    let d = Daemon::start(&Setup::default().knob("connections", "keep"));
    for n in [1, 5, 7] {
        let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(n, false)).await).await;
        assert_eq!(status, 200);
        let resp = d.post("/v1/chat/completions", chat(n, true)).await;
        let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
        assert_eq!(content.len(), n as usize);
        assert!(done);
    }
    let (_, _, v) = body_json(
        d.post(
            "/completion",
            serde_json::json!({"prompt": "7", "n_predict": 4}),
        )
        .await,
    )
    .await;
    assert_eq!(v["content"], "89");
    // One connection for the readiness probe, one for all seven requests.
    let conns = d
        .fake_log()
        .lines()
        .filter(|l| l.starts_with("connection from"))
        .count();
    assert_eq!(conns, 2, "{}", d.fake_log());
}

/// `--sysroot` is where the daemon reads the host: a fixture tree shaped like a 128 GB
/// Strix Halo's `/proc` stands in for this machine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_is_read_below_the_sysroot() {
    // A copy: the power policy writes the tree's cpufreq files while the engine runs.
    let tree = fixture_copy("strix-halo");
    let fixture = tree.path().to_str().unwrap();
    let setup = Setup {
        daemon_args: vec!["--sysroot".into(), fixture.into()],
        ..Setup::default()
    };
    let d = Daemon::start(&setup);
    let resp = d.post("/v1/chat/completions", chat(2, false)).await;
    assert_eq!(resp.status(), 200);
    // MemAvailable: 118012544 kB in the fixture.
    let log = d
        .log_with(&["memory available before the start: 112.5 GiB"])
        .await;
    assert!(
        log.contains(&format!("reading /proc and /sys below {fixture}")),
        "{log}"
    );
}

/// The peak resident memory of process `pid` (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM:\n{status}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_bar_without_newlines_does_not_grow_the_daemon() {
    // 100 MiB of `loading NN%\r` and not one newline: read to the newline, it would be held
    // whole.
    let d = Daemon::start(&Setup::default().knob("spew_cr_mib", "100"));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}");
    d.wait_fake_log("spewed 100 MiB of progress", PATIENCE)
        .await;
    // dsv4d has read all of it once the line after it is in its log.
    let t = Instant::now();
    while !d.log().contains("fake-engine: progress done") {
        assert!(
            t.elapsed() < PATIENCE,
            "the line after the progress never came"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Not one redraw of the bar was logged as a line of its own.
    assert!(d.log().matches("loading ").count() <= 2, "redraws logged");
    let peak = peak_rss_kib(d.child.id());
    assert!(peak < 64 * 1024, "dsv4d's peak RSS reached {peak} KiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_on_every_request_backs_off_instead_of_reloading() {
    // Each engine dies on its third token (exit code 3): a request that kills it, retried at
    // once by its client, five times.
    let d = Daemon::start(&Setup::default().knob("die_after_tokens", "3"));
    let t = Instant::now();
    let mut answers = Vec::new();
    for _ in 0..6 {
        let (status, headers, v) =
            body_json(d.post("/v1/chat/completions", chat(10, false)).await).await;
        answers.push((status, v["error"]["code"].clone(), v, headers));
    }
    let spawns = d.spawns();
    assert!(
        spawns <= 2,
        "{spawns} spawns: {:?}",
        answers.iter().map(|a| a.0).collect::<Vec<_>>()
    );
    assert!(t.elapsed() < 15 * SEC);
    assert_eq!(answers[0].0, 502, "{}", answers[0].2);
    let (status, code, v, headers) = answers.last().unwrap();
    assert_eq!(*status, 503, "{v}");
    assert_eq!(code, "engine_backoff", "{v}");
    assert!(headers.contains_key("retry-after"));
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("exited unexpectedly (exit code 3)")
            && message.contains("it died twice within 10m with no response delivered"),
        "{message}"
    );
    let s = d.status().await;
    assert_eq!(s["state"], State::Backoff.as_str(), "{s}");
    assert_eq!(s["failures"], 1, "{s}");
    assert!(
        s["last_error"].as_str().unwrap().contains("died twice"),
        "{s}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_the_oom_killer_ends_is_said_to_be_out_of_memory() {
    // dsv4d's cgroup, as the sysroot shows it: the OOM killer's count goes up as the engine
    // is killed.
    let tree = fixture_copy("strix-halo");
    let cg = tree.path().join("sys/fs/cgroup/system.slice/dsv4.service");
    std::fs::create_dir_all(&cg).unwrap();
    std::fs::create_dir_all(tree.path().join("proc/self")).unwrap();
    std::fs::write(
        tree.path().join("proc/self/cgroup"),
        "0::/system.slice/dsv4.service\n",
    )
    .unwrap();
    let events = |n: u32| format!("low 0\nhigh 0\nmax 0\noom {n}\noom_kill {n}\n");
    std::fs::write(cg.join("memory.events"), events(0)).unwrap();
    let d = Daemon::start(
        &Setup::default()
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("memory", "{ reserve: 0GiB }"),
    );
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    std::fs::write(cg.join("memory.events"), events(1)).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    d.wait_state(State::Stopped, PATIENCE).await;
    let s = d.status().await;
    let error = s["last_error"].as_str().unwrap();
    assert!(
        error.contains("killed by SIGKILL; out of memory: the kernel's OOM killer ended it"),
        "{error}"
    );
    assert!(
        error.contains(
            "oom_kill in /sys/fs/cgroup/system.slice/dsv4.service/memory.events went from 0 to 1"
        ),
        "{error}"
    );
}

/// On a terminal (a pseudo-terminal from script(1)) the log is coloured, unless `NO_COLOR`
/// is set to anything but the empty string (no-color.org).
#[test]
fn the_log_is_coloured_on_a_terminal_unless_no_color_is_set() {
    let dir = temp_dir("no-color");
    let missing = dir.path().join("missing.yaml");
    let run = |no_color: &str| {
        let out = std::process::Command::new("script")
            .args(["-qec"])
            .arg(format!(
                "NO_COLOR='{no_color}' {DSV4D} --config {} --bus none",
                missing.display()
            ))
            .arg("/dev/null")
            .stdin(std::process::Stdio::null())
            .output_within(HANG);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let coloured = run("");
    assert!(coloured.contains("\x1b[31mERROR"), "{coloured:?}");
    let plain = run("1");
    assert!(plain.contains("ERROR"), "{plain:?}");
    assert!(!plain.contains('\x1b'), "{plain:?}");
}

/// Socket-activated with a configuration it cannot use, dsv4d answers every request, the one
/// that activated it first, with 503 `config_invalid` naming each problem and its place (in
/// the shape of the request's protocol), `/health` too; and once the file is fixed it starts
/// afresh on the same socket, same pid, and serves.
#[test]
fn socket_activated_with_a_bad_config_every_request_is_told_why_until_it_is_fixed() {
    use std::os::fd::AsRawFd;
    let dir = temp_dir("unusable");
    let config = Setup::default()
        .top_level("idle_timeout", "5m")
        .write(dir.path(), &dir.path().join("fake.log"));
    let good = std::fs::read_to_string(&config).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // A client already waits, as the one whose connection made systemd start the service.
    let first = std::thread::spawn(move || curl_json(addr, "/v1/chat/completions"));
    let bus = PrivateBus::start();
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=api exec \"$0\" \"$@\"")
        .arg(DSV4D)
        .args(["--bus", "session", "--config"])
        .arg(&config)
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .env("DSV4_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    hand_over_listener(&mut cmd, listener.as_raw_fd());
    let mut child = cmd.spawn().unwrap();
    drop(listener);
    let pid = child.id();
    let (code, v) = first.join().unwrap();
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["code"], "config_invalid", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("supervisor.yaml:") && message.contains("unknown key `idle_timeout`"),
        "{message}"
    );
    // Many in a row, each answered; Anthropic's path in Anthropic's shape; /health alike.
    for _ in 0..20 {
        assert_eq!(curl_json(addr, "/v1/chat/completions").0, 503);
    }
    let (code, v) = curl_json(addr, "/v1/messages");
    assert_eq!(code, 503);
    assert_eq!(v["type"], "error", "{v}");
    let (code, v) = curl_json(addr, "/health");
    assert_eq!(code, 503);
    assert_eq!(v["error"]["code"], "config_invalid", "{v}");
    // dsv4ctl status says the same.
    let status = |bus: &PrivateBus| {
        Command::new(env!("CARGO_BIN_EXE_dsv4ctl-under-test"))
            .args(["--bus", "session", "status"])
            .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
            .stdin(Stdio::null())
            .output_within(HANG)
    };
    let t = Instant::now();
    let out = loop {
        let out = status(&bus);
        // The name is taken once the first answers are out; wait for it, not for time.
        if out.status.code() != Some(2) || t.elapsed() > PATIENCE {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("config_invalid") && err.contains("idle_timeout"),
        "{err}"
    );

    // Fixed: the same process, started afresh on its socket, serves.
    let fixed: String = good
        .lines()
        .filter(|l| !l.starts_with("idle_timeout:"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&config, fixed).unwrap();
    let t = Instant::now();
    loop {
        let (code, v) = curl_json(addr, "/v1/chat/completions");
        if code == 200 {
            break;
        }
        assert_eq!(code, 503, "{v}");
        assert!(t.elapsed() < PATIENCE, "never served after the fix: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(child.try_wait().unwrap().is_none(), "dsv4d exited");
    assert!(alive(i64::from(pid)));
    let t = Instant::now();
    while !status(&bus).status.success() {
        assert!(
            t.elapsed() < PATIENCE,
            "dsv4ctl status never reached the started daemon"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(0));
}

/// POST a chat to `path` with curl: the status and the JSON body.
fn curl_json(addr: std::net::SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "-w", "\n%{http_code}", "-H"])
        .arg("content-type: application/json")
        .arg("-d")
        .arg(chat(2, false).to_string())
        .arg(format!("http://{addr}{path}"))
        .output_within(HANG);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    let code = code.trim().parse().unwrap_or(0);
    (
        code,
        serde_json::from_str(body).unwrap_or(serde_json::Value::Null),
    )
}

/// `DSV4_LOG` is read as a level and `target=level` directives: `off` silences the log (the
/// one-line `dsv4d:` error stays), `debug` lets debug lines through, and a filter that cannot
/// be read is said, with info used.
#[test]
fn dsv4_log_is_a_level_and_target_directives() {
    let run = |filter: &str| {
        let out = Command::new(DSV4D)
            .args(["--config", "/nonexistent/dsv4.yaml", "--bus", "none"])
            .env("DSV4_LOG", filter)
            .stdin(Stdio::null())
            .output_within(HANG);
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let off = run("off");
    assert!(!off.contains(" ERROR "), "{off}");
    assert!(off.contains("dsv4d: "), "{off}");
    let targeted = run("warn,dsv4::http=info");
    assert!(targeted.contains(" INFO open-file limit"), "{targeted}");
    let warn = run("warn");
    assert!(!warn.contains(" INFO "), "{warn}");
    assert!(warn.contains(" ERROR "), "{warn}");
    let bad = run("bad===");
    assert!(
        bad.contains("DSV4_LOG=\"bad===\" is not a log filter"),
        "{bad}"
    );
    assert!(bad.contains(" INFO "), "{bad}");
}
