//! Connections to the engine: every way an engine closes them, with requests back to back.
//!
//! Engines close connections whenever they like: llama-server right after each streamed
//! answer and after 5 s idle, any server after `max` requests or under load. The fake engine
//! does each on demand (`FAKE_ENGINE_CONNECTIONS`), and here clients send requests back to
//! back through dsv4d, on one kept-alive client connection and on fresh ones, with streamed
//! and plain answers interleaved: every request must be answered whole, none may hang, and
//! none may get a 502 for a connection the engine closed between two exchanges. Where the
//! engine really breaks an exchange, the client must be told so, with the engine's last words.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use bytes::Bytes;
use dsv4_client::State;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;

/// Longer than any answer here takes; a request past it is a hang.
const HANG: Duration = Duration::from_secs(5);

/// The `i`-th request of a run: chat streamed, chat plain, text completion and native
/// completion in turn, each with the answer the fake engine gives to it.
fn nth(i: usize) -> (&'static str, serde_json::Value, bool, &'static str) {
    let n = 1 + (i % 8) as u32;
    let letters = &"abcdefgh"[..n as usize];
    match i % 4 {
        0 => ("/v1/chat/completions", chat(n, true), true, letters),
        1 => ("/v1/chat/completions", chat(n, false), false, letters),
        2 => (
            "/v1/completions",
            serde_json::json!({"prompt": "count 5", "max_tokens": 8}),
            false,
            "6789",
        ),
        _ => (
            "/completion",
            serde_json::json!({"prompt": "count 5", "n_predict": 8, "stream": true}),
            true,
            "6789",
        ),
    }
}

/// Sends the `i`-th request on `s` and checks the whole answer; `Err` says what went wrong.
async fn exchange(
    s: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    i: usize,
) -> Result<(), String> {
    let (path, body, stream, want) = nth(i);
    let req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let work = async {
        s.ready()
            .await
            .map_err(|e| format!("client connection: {e}"))?;
        let resp = s
            .send_request(req)
            .await
            .map_err(|e| format!("no answer: {e}"))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body broke: {e}"))?
            .to_bytes();
        let text = String::from_utf8_lossy(&body).into_owned();
        if status != 200 {
            return Err(format!("status {status}: {text}"));
        }
        let got = if stream {
            streamed_content(&text)?
        } else {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("bad JSON {e}: {text}"))?;
            let c = &v["choices"][0];
            c["message"]["content"]
                .as_str()
                .or(c["text"].as_str())
                .or(v["content"].as_str())
                .unwrap_or_default()
                .to_string()
        };
        if got != want {
            return Err(format!("content {got:?}, expected {want:?}: {text}"));
        }
        Ok(())
    };
    match tokio::time::timeout(HANG, work).await {
        Ok(r) => r.map_err(|e| format!("request {i} ({path}, stream {stream}): {e}")),
        Err(_) => Err(format!(
            "request {i} ({path}, stream {stream}): no answer in {HANG:?}"
        )),
    }
}

/// The content of an SSE answer: chat deltas, completion text or native content; checks
/// that the stream ended properly.
fn streamed_content(text: &str) -> Result<String, String> {
    let mut content = String::new();
    let mut ended = false;
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let Some(data) = event.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            ended = true;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("bad event {e}: {data}"))?;
        if v.get("error").is_some() {
            return Err(format!("error event: {data}"));
        }
        let c = &v["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str().or(v["content"].as_str()) {
            content.push_str(t);
        }
        if v["stop"] == true || c["finish_reason"].is_string() {
            ended = true;
        }
    }
    if !ended {
        return Err(format!("stream ended without its last event: {text}"));
    }
    Ok(content)
}

/// `n` requests back to back on one kept-alive client connection, then `n` more each on a
/// fresh one, optionally `gap` apart; panics listing every failure.
async fn back_to_back(d: &Daemon, n: usize, gap: impl Fn(usize) -> Duration) {
    let mut failures = Vec::new();
    let mut s = one_connection(d.addr).await;
    for i in 0..n {
        if let Err(e) = exchange(&mut s, d.addr, i).await {
            failures.push(format!("one connection: {e}"));
            // The client connection may be gone with it; go on with a new one.
            s = one_connection(d.addr).await;
        }
        tokio::time::sleep(gap(i)).await;
    }
    for i in 0..n {
        let mut s = one_connection(d.addr).await;
        if let Err(e) = exchange(&mut s, d.addr, i).await {
            failures.push(format!("fresh connections: {e}"));
        }
        tokio::time::sleep(gap(i)).await;
    }
    assert!(
        failures.is_empty(),
        "{} of {} requests failed:\n{}\n--- dsv4d log ---\n{}",
        failures.len(),
        2 * n,
        failures.join("\n"),
        d.log()
    );
    // The engine refuses any other credential than its generation's secret: every request
    // carried it, those sent again on a fresh connection too.
    let want = format!(
        " authorization={:?} x-api-key=-",
        EngineSeen::of(d).await.bearer()
    );
    let log = d.fake_log();
    let without: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("request ") && !l.starts_with("request GET /health "))
        .filter(|l| !l.ends_with(&want))
        .collect();
    assert!(
        without.is_empty(),
        "without the secret:\n{}",
        without.join("\n")
    );
}

/// How often the fake engine closed a connection for `reason`.
fn closes(d: &Daemon, reason: &str) -> usize {
    let line = format!("close reason={reason}");
    d.fake_log().lines().filter(|l| *l == line).count()
}

fn engine_closing(spec: &str) -> Setup {
    Setup::default()
        .engine("idle_timeout", "1h")
        .knob("connections", spec)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_closes_after_each_stream_loses_no_request() {
    let d = Daemon::start(&engine_closing("close-after-stream"));
    back_to_back(&d, 60, |_| Duration::ZERO).await;
    // Half the requests were streams, and the engine closed each one's connection.
    assert_eq!(closes(&d, "after-stream"), 60, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_behaves_like_llama_server_loses_no_request() {
    let d = Daemon::start(&engine_closing("llama"));
    back_to_back(&d, 60, |_| Duration::ZERO).await;
    assert_eq!(closes(&d, "after-stream"), 60, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_closes_after_every_answer_loses_no_request() {
    let d = Daemon::start(&engine_closing("close-after-response"));
    back_to_back(&d, 40, |_| Duration::ZERO).await;
    // Every answer, the readiness probe's too.
    assert!(closes(&d, "after-response") > 80, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_closes_after_n_requests_loses_no_request() {
    let d = Daemon::start(&engine_closing("max:3"));
    back_to_back(&d, 40, |_| Duration::ZERO).await;
    assert!(closes(&d, "max") >= 20, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_closes_idle_connections_loses_no_request() {
    // Gaps around the engine's idle limit, so requests arrive just before, at and after
    // the moment it closes the connection they would reuse.
    let d = Daemon::start(&engine_closing("idle:40"));
    back_to_back(&d, 24, |i| Duration::from_millis(30 + (i as u64 * 7) % 25)).await;
    assert!(closes(&d, "idle") >= 10, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_closes_as_the_next_request_arrives_loses_no_request() {
    // The engine drops a kept-alive connection with the next request unread: the request
    // never reached it, so it goes again on a fresh connection.
    let d = Daemon::start(&engine_closing("random:40@before-read"));
    back_to_back(&d, 60, |_| Duration::ZERO).await;
    assert!(closes(&d, "before-read") >= 5, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_past_the_expiry_are_not_reused() {
    // An engine that never closes: dsv4d itself retires a connection idle for 2 s, so an
    // engine's own keep-alive timeout (llama-server: 5 s) never races a request.
    let d = Daemon::start(&engine_closing("keep"));
    let mut s = one_connection(d.addr).await;
    exchange(&mut s, d.addr, 1).await.unwrap();
    exchange(&mut s, d.addr, 1).await.unwrap();
    let conns = |d: &Daemon| {
        d.fake_log()
            .lines()
            .filter(|l| l.starts_with("connection from"))
            .count()
    };
    let before = conns(&d);
    tokio::time::sleep(Duration::from_millis(2300)).await;
    exchange(&mut s, d.addr, 1).await.unwrap();
    assert_eq!(conns(&d), before + 1, "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_drops_a_request_it_read_gives_an_honest_502() {
    let d = Daemon::start(&engine_closing("random:100@after-read"));
    for i in 0..3 {
        let t = Instant::now();
        let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
        assert!(t.elapsed() < HANG);
        assert_eq!(status, 502, "request {i}: {v}");
        assert_eq!(v["error"]["code"], "engine_failed");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(
                "closed the connection after the request was sent, before any byte of an answer"
            ),
            "{msg}"
        );
        // The engine's last lines come with it. Which ones depends on how far the reader of
        // its output has got when the connection breaks; the first line is always there.
        assert!(msg.contains("engine output (last"), "{msg}");
        assert!(msg.contains("fake-engine: loading model"), "{msg}");
    }
    // The engine is still up and serving: the exchange broke, not the engine.
    assert_eq!(d.status().await["state"], State::Ready.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_breaks_off_ends_with_an_error_event() {
    let d = Daemon::start(&engine_closing("random:100@mid-response"));
    let resp = d.post("/v1/chat/completions", chat(8, true)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    let broke = loop {
        match tokio::time::timeout(HANG, body.frame()).await {
            Err(_) => panic!("stream hung: {text}"),
            Ok(None) => break false,
            Ok(Some(Err(_))) => break true,
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    text.push_str(&String::from_utf8_lossy(&d));
                }
            }
        }
    };
    // Not a clean end: the connection breaks after the error event.
    assert!(broke, "the stream ended as if complete: {text}");
    let last = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .last()
        .unwrap_or_default();
    let data = last.strip_prefix("data: ").expect(&text);
    let v: serde_json::Value = serde_json::from_str(data).expect(data);
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    assert_eq!(v["error"]["code"], "engine_failed", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with("the engine broke off the answer"), "{msg}");
    assert!(msg.contains("engine output (last"), "{msg}");
    assert!(msg.contains("fake-engine: loading model"), "{msg}");
    // The events before the break came through as they were.
    assert!(text.starts_with("data: {"), "{text}");
}
