//! The APIs besides OpenAI chat, end to end with their official SDKs: an Anthropic Messages
//! stream and an OpenAI Responses stream cut mid-way (the engine dies: chunked, as
//! llama-server frames its streams, and unframed, as ds4-server ends them by closing) raised by
//! the `anthropic` and `openai` packages as their own errors with dsv4d's message; dsv4d's own
//! refusals on Anthropic's paths (503 with `engine.max_waiting` full during a start, 401 for a
//! wrong `x-api-key`, 502 when the real llama-server is stopped under a request) in Anthropic's
//! shape, raised as the `anthropic` package's own error classes; and ds4-server's own 404 for
//! the count_tokens route it lacks.

use std::time::{Duration, Instant};

use crate::control::{ctl, wait_bus_name};
use crate::keepalive::{curl_run, long_context_setup, long_prompt, started};
use crate::soak::{python, run_client};
use crate::support::real::{ds4_engine, ds4_setup};
use crate::support::*;
use serde_json::{json, Value};

const ANTHROPIC_CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/anthropic_client.py");
const RESPONSES_CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/responses_client.py");

/// The SDKs' timeout: the longest they wait for a byte.
const CLIENT_TIMEOUT: &str = "20";

/// anthropic_client.py at `base` (`http://HOST:PORT`) in `mode`, with `key` in x-api-key:
/// its line of JSON (see `tests/clients/anthropic_client.py`).
async fn anthropic(base: &str, mode: &str, key: Option<&str>) -> Value {
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg("-B")
        .arg(ANTHROPIC_CLIENT)
        .arg(base.trim_end_matches('/'))
        .arg(mode)
        .arg(CLIENT_TIMEOUT);
    if let Some(key) = key {
        cmd.arg(key);
    }
    client_line(cmd, "anthropic_client.py").await
}

/// responses_client.py at `base` (`http://HOST:PORT`) in `mode`.
async fn responses(base: &str, mode: &str) -> Value {
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg("-B")
        .arg(RESPONSES_CLIENT)
        .arg(format!("{}/v1", base.trim_end_matches('/')))
        .arg(mode)
        .arg(CLIENT_TIMEOUT);
    client_line(cmd, "responses_client.py").await
}

async fn client_line(cmd: tokio::process::Command, name: &str) -> Value {
    let run = run_client(cmd, Duration::from_secs(300))
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let line = run.stdout.lines().last().unwrap_or_default();
    match (run.status.code(), serde_json::from_str(line)) {
        (Some(0 | 1), Ok(v)) => v,
        _ => panic!("{name}: {}", run.explain()),
    }
}

/// The fake engine, llama-server's way (chunked streams) or ds4-server's (closed), dying on
/// purpose after its third token.
fn dying(ds4: bool) -> Setup {
    Setup::default()
        .knob("die_after_tokens", "3")
        .knob("token_ms", "20")
        .pipe(ds4)
}

/// What curl prints of a streamed request of `body` at `path`, however the stream ends.
async fn raw(d: &Daemon, path: &str, body: &Value) -> String {
    curl_run(d, path, body).await.stdout
}

/// `dsv4ctl stop --now` over `bus`, which must succeed.
async fn stop_now(bus: &PrivateBus) {
    let address = bus.address.clone();
    let out = tokio::task::spawn_blocking(move || ctl(&address, &["stop", "--now"], None))
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fakes_streams_end_with_each_protocols_last_event_and_pass_whole() {
    for ds4 in [false, true] {
        let d = Daemon::start(&Setup::default().knob("token_ms", "5").pipe(ds4));
        let out = anthropic(&d.url(""), "stream", None).await;
        assert_eq!(out["text"], "abcdefgh", "ds4 {ds4}: {out}\n{}", d.log());
        assert_eq!(
            out["events"].as_array().unwrap().last().unwrap(),
            "message_stop"
        );
        let out = responses(&d.url(""), "stream").await;
        assert_eq!(out["text"], "abcdefgh", "ds4 {ds4}: {out}\n{}", d.log());
        assert_eq!(out["status"], "completed", "{out}");
        let out = anthropic(&d.url(""), "plain", None).await;
        assert_eq!(out["text"], "abcdefgh", "{out}");
        let out = responses(&d.url(""), "plain").await;
        assert_eq!(out["text"], "abcdefgh", "{out}");
    }
}

trait Pipe {
    fn pipe(self, ds4: bool) -> Self;
}

impl Pipe for Setup {
    fn pipe(self, ds4: bool) -> Setup {
        match ds4 {
            true => self.ds4(),
            false => self,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_stream_cut_by_the_engines_death_is_raised_by_the_anthropic_package() {
    for ds4 in [false, true] {
        let d = Daemon::start(&dying(ds4));
        let out = anthropic(&d.url(""), "stream", None).await;
        // The package's own class for an error event (an error answer's would name its
        // status), with dsv4d's words, never a whole-looking answer or a bare broken
        // connection.
        assert_eq!(
            out["error"],
            "APIStatusError",
            "ds4 {ds4}: {out}\n{}",
            d.log()
        );
        let message = out["message"].as_str().unwrap();
        let said = match ds4 {
            false => "the engine broke off the answer",
            true => "the engine ended the answer before its end (message_stop)",
        };
        assert!(message.contains(said), "{out}");
        assert_eq!(out["body"]["type"], "error", "{out}");
        assert_eq!(out["body"]["error"]["type"], "api_error", "{out}");
        assert_eq!(
            out["body"]["error"]["details"]["error_code"], "engine_failed",
            "{out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_stream_cut_by_the_engines_death_is_raised_by_the_openai_package() {
    for ds4 in [false, true] {
        let d = Daemon::start(&dying(ds4));
        let out = responses(&d.url(""), "stream").await;
        assert_eq!(out["error"], "APIError", "ds4 {ds4}: {out}\n{}", d.log());
        let said = match ds4 {
            false => "the engine broke off the answer",
            true => "the engine ended the answer before its end (response.completed)",
        };
        assert!(out["message"].as_str().unwrap().contains(said), "{out}");
        assert_eq!(out["body"]["code"], "engine_failed", "{out}");
        // On the wire, Responses' own error event, which a client that reads the events'
        // types (Codex) sees as one.
        let d = Daemon::start(&dying(ds4));
        let body = json!({"model": "m", "input": "hello", "max_output_tokens": 8, "stream": true});
        let text = raw(&d, "/v1/responses", &body).await;
        let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
        let mut lines = last.lines();
        assert_eq!(lines.next(), Some("event: error"), "{text:?}");
        let v: Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            (&v["type"], &v["code"]),
            (&json!("error"), &json!("engine_failed"))
        );
        assert!(v["message"].as_str().unwrap().contains(said), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_during_a_start_is_the_anthropic_packages_own_503() {
    let d = Daemon::start(
        &Setup::default()
            .engine("max_waiting", "1")
            // A start that lasts the whole test.
            .knob("load_ms", "600000"),
    );
    // One request waits for the start and fills the queue.
    let body = json!({"model": "m", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hello"}]});
    let _waiting = {
        let (addr, body) = (d.addr, body.to_string());
        tokio::spawn(async move {
            let mut sender = one_connection(addr).await;
            let req = hyper::Request::post("/v1/messages")
                .header("host", addr.to_string())
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap();
            sender.send_request(req).await
        })
    };
    let t = Instant::now();
    while d.status().await["waiting"].as_u64().unwrap_or(0) < 1 {
        assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for mode in ["stream", "plain", "count_tokens"] {
        let out = anthropic(&d.url(""), mode, None).await;
        assert_eq!(out["error"], "ServiceUnavailableError", "{mode}: {out}");
        assert_eq!(out["status"], 503, "{out}");
        assert_eq!(out["body"]["type"], "error", "{out}");
        assert_eq!(out["body"]["error"]["type"], "overloaded_error", "{out}");
        assert_eq!(
            out["body"]["error"]["details"]["error_code"], "queue_full",
            "{out}"
        );
        assert!(
            out["message"]
                .as_str()
                .unwrap()
                .contains("engine.max_waiting"),
            "{out}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_x_api_key_is_the_anthropic_packages_authentication_error() {
    let d = Daemon::start(&Setup::default().api_keys_file("sk-right\n", 0o600));
    let out = anthropic(&d.url(""), "plain", Some("sk-wrong")).await;
    assert_eq!(out["error"], "AuthenticationError", "{out}");
    assert_eq!(
        out["body"]["error"]["type"], "authentication_error",
        "{out}"
    );
    assert!(
        out["message"].as_str().unwrap().contains("invalid API key"),
        "{out}"
    );
    let out = anthropic(&d.url(""), "stream", Some("sk-right")).await;
    assert_eq!(out["text"], "abcdefgh", "{out}");
    // An OpenAI path keeps OpenAI's shape, byte for byte.
    let (status, _, v) = d
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-api-key", "sk-wrong")],
            Some(chat(2, false)),
        )
        .await;
    assert_eq!(status, 401);
    assert_eq!(
        v,
        json!({"error": {"message": "invalid API key", "type": "invalid_request_error",
                         "code": "invalid_api_key"}})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_now_under_an_anthropic_request_on_the_real_engine_is_the_packages_own_502() {
    let bus = PrivateBus::start();
    let dir = temp_dir("daemon");
    let s = long_context_setup().session_bus(&bus);
    let d = started(Daemon::start_in(&s, dir)).await;
    wait_bus_name(&d, &bus).await;
    // A long prompt: its prefill is under way when the stop comes.
    let prompt = long_prompt();
    let url = d.url("");
    let request = tokio::spawn(async move { anthropic_long(&url, &prompt).await });
    let t = Instant::now();
    while d.status().await["in_flight"] != 1 {
        assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_now(&bus).await;
    let out = request.await.unwrap();
    assert_eq!(out["error"], "InternalServerError", "{out}\n{}", d.log());
    assert_eq!(out["status"], 502, "{out}");
    assert_eq!(out["body"]["type"], "error", "{out}");
    assert_eq!(out["body"]["error"]["type"], "api_error", "{out}");
    assert_eq!(
        out["body"]["error"]["details"]["error_code"],
        "engine_failed"
    );
    assert!(
        out["message"].as_str().unwrap().contains("the engine"),
        "{out}"
    );
}

/// anthropic_client.py's plain request of a long prompt (mode `plain:PROMPT_FILE`).
async fn anthropic_long(base: &str, prompt: &str) -> Value {
    let dir = temp_dir("anthropic-long");
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let mode = format!("plain:{}", file.display());
    anthropic(base, &mode, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_answers_count_tokens_with_its_own_404_through_dsv4d() {
    let Some((server, model)) = ds4_engine("real_ds4_answers_count_tokens_with_its_own_404") else {
        return;
    };
    let dir = temp_dir("ds4-real");
    let s = ds4_setup(&server, &model, dir.path(), "10m");
    let d = Daemon::start_in(&s, dir);
    let out = anthropic(&d.url(""), "count_tokens", None).await;
    assert_eq!(out["error"], "NotFoundError", "{out}\n{}", d.log());
    assert_eq!(out["status"], 404, "{out}");
    // ds4-server's own words, not dsv4d's.
    assert_eq!(out["body"]["error"]["message"], "unknown endpoint", "{out}");
    // Its Messages route answers.
    let out = anthropic(&d.url(""), "plain", None).await;
    assert!(out["text"].is_string(), "{out}\n{}", d.log());
}

/// A stream on each API, its engine (the real llama-server, mid-prefill of a long prompt)
/// stopped by `dsv4ctl stop --now`: each SDK raises the error event dsv4d writes in its
/// protocol, with the engine's failure, never a stream that merely ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_now_under_a_stream_on_the_real_engine_is_an_error_event_each_sdk_raises() {
    let bus = PrivateBus::start();
    let dir = temp_dir("daemon");
    let s = long_context_setup().session_bus(&bus);
    let d = started(Daemon::start_in(&s, dir)).await;
    wait_bus_name(&d, &bus).await;
    let prompts = temp_dir("prompts");
    for api in ["anthropic", "responses"] {
        // A prompt no cache holds: its prefill is long, whatever came before.
        let file = prompts.path().join(format!("{api}.txt"));
        std::fs::write(&file, format!("{api} {}", long_prompt())).unwrap();
        let mode = format!("stream:{}", file.display());
        let url = d.url("");
        let request = tokio::spawn(async move {
            match api {
                "anthropic" => anthropic(&url, &mode, None).await,
                _ => responses(&url, &mode).await,
            }
        });
        // Stopped once its head is out (dsv4d's own after stream_keepalive, or the
        // engine's), in its prefill.
        let t = Instant::now();
        loop {
            let s = d.status().await;
            let flight = &s["in_progress"][0];
            if flight["phase"] == "prefill" && flight["age_s"].as_f64().unwrap_or(0.0) > 3.0 {
                break;
            }
            assert!(t.elapsed() < PATIENCE, "{s}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop_now(&bus).await;
        let out = request.await.unwrap();
        assert!(out["error"].is_string(), "{api}: {out}\n{}", d.log());
        assert!(
            out["message"].as_str().unwrap().contains("the engine"),
            "{api}: {out}"
        );
        match api {
            "anthropic" => {
                assert_eq!(out["error"], "APIStatusError", "{out}");
                assert_eq!(out["body"]["type"], "error", "{out}");
                assert_eq!(out["body"]["error"]["type"], "api_error", "{out}");
            }
            _ => assert_eq!(out["error"], "APIError", "{out}"),
        }
    }
}
