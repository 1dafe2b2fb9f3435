//! `dsv4d` driving a ds4-server (the fake engine in ds4 mode): no `/health`, the port opens
//! only once the model is loaded, `: prefill` comments while a long prompt is read, and a
//! slow, KV-saving exit on SIGTERM.

use std::time::{Duration, Instant};

use crate::support::*;
use nix::sys::signal::Signal;

const SEC: Duration = Duration::from_secs(1);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_the_port_opening_then_models_answering() {
    let d = Daemon::start(&Setup::default().ds4().knob("load_ms", "800"));
    let t0 = Instant::now();
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert!(t0.elapsed() >= Duration::from_millis(800));
    let log = d.fake_log();
    assert_eq!(d.spawns(), 1);
    assert!(log.contains("request GET /v1/models"), "{log}");
    assert!(
        !log.contains("request GET /health"),
        "ds4 has no /health: {log}"
    );
    let argv = log.lines().find(|l| l.starts_with("start pid=")).unwrap();
    assert!(argv.contains(" --ctx 327680 "), "{argv}");
    assert!(argv.contains(" --host 127.0.0.1 --port "), "{argv}");
    assert!(!argv.contains(" -c "), "{argv}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_comments_reach_the_client_as_they_come() {
    let setup = Setup::default()
        .ds4()
        .knob("prefill_ms", "1300")
        .knob("prefill_comment_ms", "300");
    let d = Daemon::start(&setup);
    let t0 = Instant::now();
    let resp = d.post("/v1/chat/completions", chat(2, true)).await;
    assert_eq!(resp.status(), 200);
    let mut s = Stream::new(resp.into_body());
    let mut comments = Vec::new();
    let first_data = loop {
        let ev = s.next_event().await.expect("stream ended during prefill");
        if ev.starts_with(':') {
            comments.push((ev, t0.elapsed()));
        } else {
            break t0.elapsed();
        }
    };
    assert!(comments.len() >= 3, "{comments:?}");
    assert!(
        comments.iter().all(|(c, _)| c == ": prefill"),
        "{comments:?}"
    );
    // Unchanged and unbuffered: the first comment came well before the first token.
    assert!(
        first_data - comments[0].1 >= Duration::from_millis(600),
        "{comments:?} then data at {first_data:?}"
    );
    let (rest, done, _) = s.collect_chat().await;
    assert_eq!(rest, "b");
    assert!(done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_gives_ds4_its_grace_to_save_the_kv_cache() {
    // It takes 3 s after SIGTERM, well inside stop_timeout (10 s), and long enough that a
    // late look at it on a loaded machine still finds it alive at the first second.
    let setup = Setup::default()
        .ds4()
        .engine("stop_timeout", "10s")
        .knob("sigterm_ms", "3000");
    let mut d = Daemon::start(&setup);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    let t0 = Instant::now();
    d.signal(Signal::SIGTERM);
    // Still there a second later: nothing cut the KV save short.
    tokio::time::sleep(SEC).await;
    assert!(alive(pid), "engine killed before its stop grace");
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0));
    assert!(t0.elapsed() >= Duration::from_millis(2900));
    assert!(!alive(pid));
    let log = d.log_with(&["the engine stopped (exit code 0)"]).await;
    assert!(!log.contains("SIGKILL") && !log.contains("SIGINT"), "{log}");
}

/// ds4-server ends a stream by closing its connection (no chunked framing), so a stop in the
/// middle of an answer looks to a proxy like its end, minus the `[DONE]`. The client must not
/// take the cut answer for a whole one: it gets the error event that llama-server's breaks
/// get.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ds4_stream_cut_by_a_stop_ends_with_an_error_event() {
    let d = Daemon::start(&Setup::default().ds4().knob("token_ms", "200"));
    let resp = d.post("/v1/chat/completions", chat(20, true)).await;
    assert_eq!(resp.status(), 200);
    let mut s = Stream::new(resp.into_body());
    let first = s.next_event().await.expect("a first event");
    assert!(first.starts_with("data: {"), "{first}");
    // The engine is stopped (a `stop --now`, a systemd stop, a crash): it writes no more.
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGTERM).unwrap();
    let mut rest = Vec::new();
    while let Some(ev) = s.next_event().await {
        rest.push(ev);
    }
    assert!(!rest.iter().any(|e| e == "data: [DONE]"), "{rest:?}");
    let last = rest.last().expect("an event after the cut");
    let v: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "engine_failed", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("before its end ([DONE])"),
        "{v}"
    );
}

/// A cold prefill on ds4-server's CPU path sends nothing, not even the head, until it ends
/// (on the real box a 256K prompt reads for two hours). dsv4d has no timer on an engine's
/// answer: the request is still served after a silence longer than every timer dsv4d has
/// (the longest, a client's 30 s to send a request head). With `api.stream_keepalive` off,
/// so that the silence reaches the client as the engine leaves it (with it on, the client
/// gets dsv4d's own head and comments meanwhile: see `keepalive.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_prefill_longer_than_every_dsv4d_timer_is_still_answered() {
    let setup = Setup::default()
        .api("stream_keepalive", "null")
        .ds4()
        .knob("prefill_ms", "35000")
        .knob("prefill_comment_ms", "0");
    let d = Daemon::start(&setup);
    let t0 = Instant::now();
    let resp = d.post("/v1/chat/completions", chat(3, true)).await;
    assert!(
        t0.elapsed() >= Duration::from_secs(35),
        "the head came early"
    );
    assert_eq!(resp.status(), 200);
    let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
    assert_eq!((content.as_str(), done), ("abc", true));
}
