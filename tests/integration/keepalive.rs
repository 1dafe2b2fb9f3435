//! Streamed answers that never go silent (`api.stream_keepalive`): the official `openai`
//! package, with a 5 s timeout, through a 30 s cold start, a prefill longer than its timeout on
//! the real llama-server (which sends its head, then nothing until the first token) and on the
//! real ds4-server (which sends nothing at all until its prefill ends); the comments curl
//! sees, with the load's estimate on the second cold start; the relayed stream, less the
//! comments, the engine's own; and an engine's error after dsv4d's own head, an error event the
//! package raises with the engine's message. With `api.loading_reasoning`, the waiting's words
//! as `reasoning_content` chunks, on chat streams alone: read by the `openai` package
//! before the engine's answer, unchanged, through the fake engine's and the real
//! llama-server's cold starts, and by curl, next to the comments.

use std::time::{Duration, Instant};

use crate::soak::{need_curl, python, run_client};
use crate::support::real::{ds4_engine, ds4_setup, LlamaServer};
use crate::support::*;
use dsv4_client::State;
use serde_json::{json, Value};

const OPENAI_STREAM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/openai_stream.py");

/// The `openai` package's timeout in these tests: the longest it waits for a byte.
const CLIENT_TIMEOUT: f64 = 5.0;

/// A prompt of the tiny llama model whose prefill, on one thread, takes longer than
/// `CLIENT_TIMEOUT` (one character is one token): about 10 s, and 4.8 s at 14,000 tokens on
/// an idle machine, so twice that.
pub(crate) const LONG_PROMPT_TOKENS: usize = 28_000;

/// A prompt of the tiny ds4 model whose prefill, on its CPU path, takes longer than
/// `CLIENT_TIMEOUT`.
pub(crate) const DS4_PROMPT_TOKENS: usize = 300;

/// One streamed chat of `request` (without `stream`) by the `openai` package at `base`
/// (`http://HOST:PORT`) with `CLIENT_TIMEOUT`: its line of JSON (`content`, or `error` and
/// `message`; see `tests/clients/openai_stream.py`).
async fn openai_stream(base: &str, request: &Value) -> Value {
    let dir = temp_dir("openai-stream");
    let file = dir.path().join("request.json");
    std::fs::write(&file, request.to_string()).unwrap();
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg("-B")
        .arg(OPENAI_STREAM)
        .arg(format!("{}/v1", base.trim_end_matches('/')))
        .arg(&file)
        .arg(CLIENT_TIMEOUT.to_string());
    let run = run_client(cmd, Duration::from_secs(300))
        .await
        .unwrap_or_else(|e| panic!("openai_stream.py: {e}"));
    let line = run.stdout.lines().last().unwrap_or_default();
    match (run.status.code(), serde_json::from_str(line)) {
        (Some(0 | 1), Ok(v)) => v,
        _ => panic!("openai_stream.py: {}", run.explain()),
    }
}

/// One streamed chat of `body` by curl (`-N`: as it comes); what curl printed.
async fn curl_stream(d: &Daemon, body: &Value) -> String {
    curl_stream_at(d, "/v1/chat/completions", body).await
}

/// One streamed request of `body` to `path` by curl; what curl printed.
async fn curl_stream_at(d: &Daemon, path: &str, body: &Value) -> String {
    let run = curl_run(d, path, body).await;
    assert!(run.status.success(), "curl: {}", run.explain());
    run.stdout
}

/// curl's run of a streamed request of `body` to `path` (`-N`: as it comes), however it
/// ended.
pub(crate) async fn curl_run(d: &Daemon, path: &str, body: &Value) -> crate::soak::ClientRun {
    need_curl();
    let mut cmd = tokio::process::Command::new("curl");
    cmd.args([
        "-sSN",
        "--max-time",
        "60",
        "-H",
        "content-type: application/json",
    ])
    .arg("--data-binary")
    .arg(body.to_string())
    .arg(d.url(path));
    run_client(cmd, Duration::from_secs(90)).await.unwrap()
}

/// The comment lines of an event stream.
fn comments(stream: &str) -> Vec<&str> {
    stream.lines().filter(|l| l.starts_with(':')).collect()
}

/// `stream` without dsv4d's comments (each `: dsv4 ...` and the blank line after it).
fn less_comments(stream: &str) -> String {
    let mut out = String::new();
    let mut rest = stream;
    while let Some(i) = rest.find(": dsv4 ") {
        let at_boundary = i == 0 || rest[..i].ends_with("\n\n");
        let end = rest[i..].find("\n\n").map(|e| i + e + 2);
        match (at_boundary, end) {
            (true, Some(end)) => {
                out.push_str(&rest[..i]);
                rest = &rest[end..];
            }
            _ => panic!("a comment inside an event, or unended: {stream:?}"),
        }
    }
    out.push_str(rest);
    out
}

pub(crate) fn chat_request(prompt: &str, max_tokens: u32) -> Value {
    json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_package_gets_a_whole_stream_through_a_30_s_cold_start() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "2s")
            .knob("load_ms", "30000"),
    );
    let t = Instant::now();
    let out = openai_stream(&d.url(""), &chat_request("hello", 8)).await;
    assert_eq!(out["content"], "abcdefgh", "{out}\n{}", d.log());
    assert_eq!(out["finish_reason"], "length", "{out}");
    assert!(t.elapsed() >= Duration::from_secs(30), "{:?}", t.elapsed());
    assert_eq!(d.spawns(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_sees_what_a_stream_waits_for_and_the_estimate_on_the_next_cold_start() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .engine("idle_timeout", "1s")
            .knob("load_ms", "3000"),
    );
    let body = chat(4, true);
    let first = curl_stream(&d, &body).await;
    assert!(first.starts_with(": dsv4 loading 320k: "), "{first:?}");
    let loading: Vec<&str> = comments(&first)
        .into_iter()
        .filter(|c| c.starts_with(": dsv4 loading 320k: "))
        .collect();
    assert!(loading.len() >= 2, "{first:?}");
    // The first load of the profile: no estimate yet.
    assert!(loading.iter().all(|c| !c.contains("about")), "{first:?}");
    assert!(first.ends_with("data: [DONE]\n\n"), "{first:?}");
    // The load's time is kept (written off the runtime's threads, so waited for).
    let file = d.dir().join("state/load-times.json");
    let t = Instant::now();
    while !std::fs::read_to_string(&file).is_ok_and(|t| t.contains("\"320k\"")) {
        assert!(t.elapsed() < PATIENCE, "no load time in {}", file.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    d.wait_state(State::Stopped, PATIENCE).await;
    let second = curl_stream(&d, &body).await;
    let about: Vec<u64> = comments(&second)
        .into_iter()
        .filter_map(|c| c.strip_prefix(": dsv4 loading 320k: "))
        .filter_map(|c| c.split(" of about ").nth(1))
        .filter_map(seconds)
        .collect();
    // The fake engine loads in 3 s.
    assert!(
        !about.is_empty() && about.iter().all(|s| (3..=5).contains(s)),
        "{second:?}"
    );
    assert!(second.ends_with("data: [DONE]\n\n"), "{second:?}");
    assert_eq!(d.spawns(), 2);
}

/// The words are written only after a full period of silence: once the engine's answer has
/// come under dsv4d's own head, its prefill is told as `waiting for the engine's answer: N s`
/// from the first full period on (never `0 s` at the next tick), the docs' words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_words_come_after_a_full_period_of_silence_and_are_the_docs_words() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .knob("load_ms", "1500")
            .knob("prefill_ms", "3500"),
    );
    let stream = curl_stream(&d, &chat(4, true)).await;
    assert!(stream.starts_with(": dsv4 loading 320k: "), "{stream:?}");
    let waiting: Vec<u64> = comments(&stream)
        .into_iter()
        .filter_map(|c| c.strip_prefix(": dsv4 waiting for the engine's answer: "))
        .filter_map(seconds)
        .collect();
    assert!(waiting.len() >= 2, "{stream:?}");
    assert!(waiting.iter().all(|s| *s >= 1), "{stream:?}\n{}", d.log());
    assert!(rising(&waiting), "{stream:?}");
    // Only the docs' words: loading, or waiting for the engine's answer.
    for c in comments(&stream) {
        assert!(
            c.starts_with(": dsv4 loading 320k: ")
                || c.starts_with(": dsv4 waiting for the engine's answer: "),
            "{c:?}"
        );
    }
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_error_after_dsv4ds_own_head_is_an_error_event_the_openai_package_raises() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .knob("load_ms", "3000"),
    );
    // A grammar the engine cannot parse: it answers 400 once loaded, long after dsv4d sent
    // the stream's head.
    let mut request = chat_request("hello", 8);
    request["extra_body"] = json!({"grammar": "root ::= ("});
    let out = openai_stream(&d.url(""), &request).await;
    assert_eq!(out["error"], "APIError", "{out}\n{}", d.log());
    assert_eq!(out["message"], "Failed to parse grammar", "{out}");
    assert_eq!(out["body"]["code"], 400, "{out}");
    assert_eq!(out["body"]["status"], 400, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_fails_after_dsv4ds_own_head_ends_the_stream_with_its_error() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .engine("start_timeout", "3s")
            .knob("fail_start", "hang"),
    );
    let out = curl_stream(&d, &chat(4, true)).await;
    assert!(out.starts_with(": dsv4 loading 320k: "), "{out:?}");
    let last = out.trim_end().lines().last().unwrap_or_default();
    let data = last
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("{out:?}"));
    let v: Value = serde_json::from_str(data).unwrap();
    assert_eq!(v["error"]["code"], "engine_start_timeout", "{v}");
    assert_eq!(v["error"]["status"], 504, "{v}");
    assert!(out.ends_with("\n\n"), "{out:?}");
}

/// A daemon in front of the real llama-server on the tiny model with a 16K context, one
/// thread; the engine started. The model file is kept in the daemon's folder. With
/// `api.loading_reasoning`, which must add nothing to a stream the engine has begun.
pub(crate) async fn long_context_daemon() -> Daemon {
    started(Daemon::start(&long_context_setup())).await
}

/// The setup of [`long_context_daemon`]: a profile `32k` of the tiny model with a context of
/// 32K tokens.
pub(crate) fn long_context_setup() -> Setup {
    let model = crate::support::real::tiny_with_context(32_768);
    let mut s = Setup::default()
        .api("stream_keepalive", "2s")
        .api("loading_reasoning", "true")
        .engine("idle_timeout", "10m");
    s.custom_profiles.insert(
        "32k".into(),
        crate::support::real::profile(&model, 32_768, ""),
    );
    s.default_profile = "32k".into();
    s
}

/// `d`, its engine started by a short request.
pub(crate) async fn started(d: Daemon) -> Daemon {
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    d
}

pub(crate) fn long_prompt() -> String {
    "word ".repeat(LONG_PROMPT_TOKENS / 5)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_package_gets_a_whole_stream_through_a_long_prefill_on_the_real_engine() {
    let d = long_context_daemon().await;
    let t = Instant::now();
    let out = openai_stream(&d.url(""), &chat_request(&long_prompt(), 8)).await;
    let took = t.elapsed();
    assert_eq!(out["content"], "abcdefgh", "{out}\n{}", d.log());
    // The prefill alone was longer than the client's timeout.
    assert!(took > Duration::from_secs_f64(CLIENT_TIMEOUT), "{took:?}");
}

/// The raw bytes of a streamed chat of `body` at `url` (a full URL).
pub(crate) async fn raw_stream(url: &str, body: &Value) -> String {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status();
    use http_body_util::BodyExt;
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    assert_eq!(status, 200, "{url}: {text}");
    text
}

/// `stream` with what differs from one answer to the next (the completion's id, its time,
/// the timings) set to fixed values, each line otherwise as it was.
fn fixed(stream: &str) -> String {
    stream
        .split('\n')
        .map(|line| match line.strip_prefix("data: {") {
            Some(_) => {
                let mut v: Value = serde_json::from_str(&line["data: ".len()..]).unwrap();
                for key in ["id", "created", "timings", "system_fingerprint"] {
                    if let Some(value) = v.get_mut(key) {
                        *value = Value::Null;
                    }
                }
                format!("data: {v}")
            }
            None => line.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_stream_less_its_comments_is_the_engines_own() {
    let d = long_context_daemon().await;
    // The same model file: its path is in every chunk.
    let direct = LlamaServer::start_on(&crate::support::real::tiny_with_context(32_768), 32_768);
    let mut body = chat_request(&long_prompt(), 12);
    body["stream"] = json!(true);
    let through = raw_stream(&d.url("/v1/chat/completions"), &body).await;
    let own = raw_stream(&format!("{}/v1/chat/completions", direct.url), &body).await;
    assert!(
        !comments(&through).is_empty(),
        "the prefill was too short for a comment: {through:?}"
    );
    // llama-server pings (`:`) a stream silent for 30 s itself (`--sse-ping-interval`),
    // which a loaded machine's prefill may reach: those pass through like any event.
    assert!(comments(&own).iter().all(|c| *c == ":"), "{own:?}");
    let pings = |s: &str| s.replace(":\n\n", "");
    assert_eq!(fixed(&pings(&less_comments(&through))), fixed(&pings(&own)));
    assert!(own.contains("\"content\":\"a\""), "{own}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_package_gets_a_whole_stream_through_a_silent_prefill_on_the_real_ds4() {
    let test = "the_openai_package_gets_a_whole_stream_through_a_silent_prefill_on_the_real_ds4";
    let Some((server, model)) = ds4_engine(test) else {
        return;
    };
    let dir = temp_dir("ds4-real");
    let s = ds4_setup(&server, &model, dir.path(), "10m").api("stream_keepalive", "2s");
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let prompt = "word ".repeat(DS4_PROMPT_TOKENS / 5);
    let t = Instant::now();
    let out = openai_stream(&d.url(""), &chat_request(&prompt, 16)).await;
    let took = t.elapsed();
    assert_eq!(out["content"], "Hi!", "{out}\n{}", d.log());
    assert!(took > Duration::from_secs_f64(CLIENT_TIMEOUT), "{took:?}");
}

/// A client that leaves after dsv4d's own head is noticed as one that leaves before it: its
/// place in the queue goes within a second, not at the next comment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_after_dsv4ds_own_head_stops_waiting_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .knob("load_ms", "60000"),
    );
    let body = chat(3, true).to_string();
    let mut s = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        d.addr,
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // dsv4d's own head and its first comment.
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains(": dsv4 loading") {
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
            .await
            .expect("dsv4d's own head")
            .unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    assert_eq!(d.status().await["waiting"], 1);
    let left = Instant::now();
    drop(s);
    loop {
        if d.status().await["waiting"] == 0 {
            break;
        }
        assert!(
            left.elapsed() < Duration::from_millis(300) + LOAD_MARGIN,
            "the waiter is still there"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The events of an event stream as a client reads them, in order: comments (their text,
/// `: ` left off), dsv4d's `reasoning_content` chunks (their JSON), and the rest.
#[derive(Debug)]
enum Event {
    Comment(String),
    Reasoning(Value),
    Other(String),
}

fn events(stream: &str) -> Vec<Event> {
    assert!(stream.ends_with("\n\n"), "{stream:?}");
    stream
        .trim_end_matches('\n')
        .split("\n\n")
        .map(|event| {
            if let Some(text) = event.strip_prefix(": ") {
                return Event::Comment(text.to_string());
            }
            let data = event.strip_prefix("data: ").and_then(|d| {
                serde_json::from_str::<Value>(d)
                    .ok()
                    .filter(|v| v["choices"][0]["delta"]["reasoning_content"].is_string())
            });
            match data {
                Some(v) => Event::Reasoning(v),
                None => Event::Other(event.to_string()),
            }
        })
        .collect()
}

/// The seconds a loading line (`dsv4 loading 320k: 3s`, with or without an estimate and a
/// line end) says; `None` for another line.
fn loading_seconds(line: &str, profile: &str) -> Option<u64> {
    let rest = line.strip_prefix(&format!("dsv4 loading {profile}: "))?;
    seconds(rest.split([' ', ',', '\n']).next()?)
}

/// The whole seconds of a time the words say (`3s`, `1m4s`: the project's duration grammar).
fn seconds(words: &str) -> Option<u64> {
    let d = dsv4_client::duration::parse(words.trim()).ok()?;
    (d.subsec_nanos() == 0).then_some(d.as_secs())
}

/// That `seconds` (one a tick) never go down and do go up.
fn rising(seconds: &[u64]) -> bool {
    seconds.windows(2).all(|w| w[0] <= w[1]) && seconds.first() < seconds.last()
}

/// A chat stream's reasoning chunks, checked against the comments and the engine's events
/// around them: each comes right after a comment of the same words, all before the engine's
/// first event, all of one id and naming `model`. Returns their words, and the content of
/// the engine's events.
fn reasoning_of(stream: &str, model: &str) -> (Vec<String>, String) {
    let (mut words, mut content, mut ids) = (Vec::new(), String::new(), Vec::new());
    let (mut last_comment, mut engine_began) = (None, false);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for event in events(stream) {
        match event {
            Event::Comment(text) => last_comment = Some(text),
            Event::Reasoning(v) => {
                assert!(
                    !engine_began,
                    "reasoning after the engine's first event: {stream}"
                );
                let text = v["choices"][0]["delta"]["reasoning_content"]
                    .as_str()
                    .unwrap()
                    .to_string();
                let said = last_comment.take().unwrap_or_else(|| panic!("{stream}"));
                assert_eq!(text, format!("{said}\n"), "{stream}");
                assert_eq!(v["object"], "chat.completion.chunk", "{v}");
                assert_eq!(v["model"], model, "{v}");
                assert_eq!(v["choices"][0]["index"], 0, "{v}");
                assert_eq!(v["choices"][0]["finish_reason"], Value::Null, "{v}");
                assert_eq!(v["choices"][0]["delta"]["role"], "assistant", "{v}");
                let created = v["created"].as_u64().unwrap();
                assert!(created.abs_diff(now) < 300, "{v}");
                ids.push(v["id"].as_str().unwrap().to_string());
                words.push(text);
            }
            Event::Other(event) => {
                last_comment = None;
                engine_began = true;
                if let Some(Ok(v)) = event
                    .strip_prefix("data: ")
                    .filter(|d| d.starts_with('{'))
                    .map(serde_json::from_str::<Value>)
                {
                    if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                        content.push_str(c);
                    }
                }
            }
        }
    }
    ids.dedup();
    assert!(
        ids.len() <= 1 && ids.iter().all(|id| id.starts_with("dsv4-loading-")),
        "{ids:?}"
    );
    (words, content)
}

/// With `api.loading_reasoning`, curl sees each comment of the wait followed by a
/// `reasoning_content` chunk of the same words, the seconds rising, naming the request's
/// model or else the profile; the engine's answer after them as it was; and a text
/// completion's stream, waiting through the same load, gets the comments alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_loading_reasoning_curl_sees_the_waits_words_as_reasoning_on_chat_streams_alone() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .api("loading_reasoning", "true")
            .knob("load_ms", "4000"),
    );
    let mut named = chat(4, true);
    named["model"] = json!("qwen-test");
    let unnamed = chat(4, true);
    let text = json!({"prompt": "hello", "max_tokens": 4, "stream": true});
    // All three wait for the same cold start.
    let (named, unnamed, text) = tokio::join!(
        curl_stream_at(&d, "/v1/chat/completions", &named),
        curl_stream_at(&d, "/chat/completions", &unnamed),
        curl_stream_at(&d, "/v1/completions", &text),
    );
    for (stream, model) in [(&named, "qwen-test"), (&unnamed, "320k")] {
        assert!(stream.starts_with(": dsv4 loading 320k: "), "{stream:?}");
        let (words, content) = reasoning_of(stream, model);
        let seconds: Vec<u64> = words
            .iter()
            .filter_map(|w| loading_seconds(w, "320k"))
            .collect();
        assert!(
            seconds.len() >= 2 && rising(&seconds),
            "{seconds:?}: {stream}"
        );
        assert_eq!(content, "abcd", "{stream}");
        assert!(stream.ends_with("data: [DONE]\n\n"), "{stream:?}");
    }
    assert!(comments(&text).len() >= 2, "{text:?}");
    assert!(!text.contains("reasoning_content"), "{text:?}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text:?}");
    assert_eq!(d.spawns(), 1);
}

/// Off by default: a chat stream waiting for a cold start gets comments, no reasoning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_loading_reasoning_a_waiting_chat_stream_gets_comments_alone() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .knob("load_ms", "3000"),
    );
    let out = curl_stream(&d, &chat(4, true)).await;
    assert!(comments(&out).len() >= 2, "{out:?}");
    assert!(!out.contains("reasoning_content"), "{out:?}");
    let (words, content) = reasoning_of(&out, "320k");
    assert!(words.is_empty());
    assert_eq!(content, "abcd", "{out}");
}

/// The `openai` package's reasoning deltas of one streamed chat (see `openai_stream`).
fn reasoning_deltas(out: &Value) -> Vec<String> {
    let deltas = out["reasoning"].as_array();
    let deltas = deltas.unwrap_or_else(|| panic!("{out}"));
    deltas
        .iter()
        .map(|d| d.as_str().unwrap().to_string())
        .collect()
}

/// The official `openai` package reads the loading chunks and then the engine's as one
/// answer: the words as `delta.reasoning_content`, one line each, the seconds rising; the
/// content and finish reason those of the same request with the key off (see
/// `the_openai_package_gets_a_whole_stream_through_a_30_s_cold_start`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_loading_reasoning_the_openai_package_reads_the_loading_words_then_the_answer() {
    let d = Daemon::start(
        &Setup::default()
            .api("stream_keepalive", "1s")
            .api("loading_reasoning", "true")
            .knob("load_ms", "4000"),
    );
    let out = openai_stream(&d.url(""), &chat_request("hello", 8)).await;
    assert_eq!(out["content"], "abcdefgh", "{out}\n{}", d.log());
    assert_eq!(out["finish_reason"], "length", "{out}");
    let reasoning = reasoning_deltas(&out);
    assert!(
        reasoning
            .iter()
            .all(|r| r.starts_with("dsv4 ") && r.ends_with("s\n")),
        "{reasoning:?}"
    );
    let seconds: Vec<u64> = reasoning
        .iter()
        .filter_map(|r| loading_seconds(r, "320k"))
        .collect();
    assert!(seconds.len() >= 2 && rising(&seconds), "{reasoning:?}");
}

/// Through the real llama-server's cold start (its first event a `role` chunk of its own),
/// the `openai` package gets dsv4d's reasoning, then the content the engine gives the same
/// request with no dsv4d in front. The tiny model loads in a tenth of a second: the engine
/// is started 2 s late, as a large model's load would take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_loading_reasoning_the_real_engines_answer_follows_unchanged() {
    use std::os::unix::fs::PermissionsExt;
    let dir = temp_dir("daemon");
    let (server, _) = crate::support::real::engine();
    let late = dir.path().join("late-llama-server");
    let script = format!("#!/bin/sh\nsleep 2\nexec '{}' \"$@\"\n", server.display());
    std::fs::write(&late, script).unwrap();
    std::fs::set_permissions(&late, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut s = crate::support::real::setup()
        .api("stream_keepalive", "500ms")
        .api("loading_reasoning", "true");
    let tiny = s.custom_profiles.get_mut("tiny").unwrap();
    let command = format!("command: {}\n", server.display());
    assert!(tiny.contains(&command), "{tiny}");
    *tiny = tiny.replace(&command, &format!("command: {}\n", late.display()));
    let d = Daemon::start_in(&s, dir);
    let request = chat_request("hello", 8);
    let out = openai_stream(&d.url(""), &request).await;
    let reasoning = reasoning_deltas(&out);
    let seconds: Vec<u64> = reasoning
        .iter()
        .filter_map(|r| loading_seconds(r, "tiny"))
        .collect();
    assert!(rising(&seconds), "{out}\n{}", d.log());
    let direct = LlamaServer::start();
    let own = openai_stream(&direct.url, &request).await;
    assert!(reasoning_deltas(&own).is_empty(), "{own}");
    assert_eq!(out["content"], own["content"], "{out}\n{own}");
    assert_eq!(out["finish_reason"], own["finish_reason"], "{out}\n{own}");
    assert!(!own["content"].as_str().unwrap().is_empty(), "{own}");
}
