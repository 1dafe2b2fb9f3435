//! The APIs beside OpenAI chat, with the official clients: the `anthropic` package's Messages
//! (plain, streamed, count_tokens) and the `openai` package's Responses (plain, streamed),
//! through dsv4d in front of the real llama-server and the real ds4-server
//! (`tests/clients/protocols_soak.py`), every answer checked, then the statistics of each API
//! in `/status` with the token counts the clients read; and each SDK's key header under
//! `api.api_keys_file`, with Anthropic's own headers reaching the engine unchanged.
//!
//! Needs the real engines and the venv of `tests/clients/prepare` (see `soak`); the ds4 test
//! is skipped, saying so, without the ds4 rig (see `ds4_real`).

use std::time::Duration;

use crate::soak::{python, run_client};
use crate::support::real::{self, ds4_engine, ds4_setup};
use crate::support::*;
use serde_json::Value;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/protocols_soak.py");
/// Requests of each kind, in a row.
const ITERATIONS: usize = 50;
const KEY: &str = "sk-dsv4-test-0123456789abcdef";

/// protocols_soak.py with `args`, killed after `within`: its stdout, or why it failed.
async fn script(args: &[&str], within: Duration) -> String {
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg("-B").arg(SCRIPT).args(args);
    let run = run_client(cmd, within).await.expect("protocols_soak.py");
    assert!(
        run.status.success(),
        "protocols_soak.py {args:?}: {}",
        run.explain()
    );
    run.stdout
}

/// The soak against `d`; its report (per step: requests, input, cached, output tokens).
async fn soak(d: &Daemon, ds4: bool, within: Duration) -> Value {
    let base = d.url("");
    let iterations = ITERATIONS.to_string();
    let mut args = vec!["soak", base.trim_end_matches('/'), &iterations];
    if ds4 {
        args.push("ds4");
    }
    let out = script(&args, within).await;
    let last = out.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// The statistics of each API are those of the requests the clients made, with the token
/// counts the clients read from each answer's `usage`; count_tokens is not a generation and
/// is not counted. `others`: the requests of other APIs made besides.
async fn assert_stats(d: &Daemon, report: &Value, others: u64) {
    assert_stats_of(d, report, ITERATIONS as u64, others).await;
}

/// [`assert_stats`] after `iterations` requests of each kind.
async fn assert_stats_of(d: &Daemon, report: &Value, iterations: u64, others: u64) {
    let status = d.status().await;
    let requests = &status["requests"];
    for (protocol, steps) in [
        ("anthropic", ["messages", "messages_stream"]),
        ("responses", ["responses", "responses_stream"]),
    ] {
        let sum = |k: &str| -> u64 { steps.iter().map(|s| report[s][k].as_u64().unwrap()).sum() };
        let t = &requests["by_protocol"][protocol];
        let what = format!("{protocol}: {t}\nclients read: {report}");
        assert_eq!(t["requests"], 2 * iterations, "{what}");
        let prompt = t["prompt_tokens"].as_u64().unwrap() + t["cached_tokens"].as_u64().unwrap();
        assert_eq!(prompt, sum("input"), "{what}");
        assert_eq!(t["cached_tokens"], sum("cached"), "{what}");
        assert_eq!(t["generated_tokens"], sum("output"), "{what}");
        assert!(sum("output") > 0, "{what}");
        // Streamed answers have rates (the engine's timings or dsv4d's clock).
        assert!(
            t["decode_tok_s"].as_f64().is_some_and(|r| r > 0.0),
            "{what}"
        );
    }
    assert_eq!(requests["requests"], 4 * iterations + others, "{requests}");
    let recent = requests["recent"].as_array().unwrap();
    for r in recent {
        let want = match r["path"].as_str().unwrap() {
            "/v1/messages" => "anthropic",
            "/v1/responses" => "responses",
            _ => "openai",
        };
        assert_eq!(r["protocol"], want, "{r}");
    }
    assert!(
        !recent
            .iter()
            .any(|r| r["path"] == "/v1/messages/count_tokens"),
        "{requests}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_and_responses_clients_50_times_each_on_llama_server_and_their_stats() {
    let d = Daemon::start(&real::setup().engine("idle_timeout", "10m"));
    let report = soak(&d, false, Duration::from_secs(240)).await;
    assert_eq!(report["count_tokens"]["requests"], ITERATIONS, "{report}");
    assert_stats(&d, &report, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_anthropic_and_responses_clients_50_times_each_on_ds4_server_and_their_stats() {
    let test = "the_anthropic_and_responses_clients_50_times_each_on_ds4_server";
    let Some((server, model)) = ds4_engine(test) else {
        return;
    };
    let dir = temp_dir("ds4-protocols");
    let d = Daemon::start_in(&ds4_setup(&server, &model, dir.path(), "10m"), dir);
    // ds4-server answers a request in about a second on its CPU path.
    let report = soak(&d, true, Duration::from_secs(600)).await;
    assert!(report.get("count_tokens").is_none(), "{report}");
    assert_stats(&d, &report, 0).await;
}

/// Each API's statistics where one looks, after the anthropic package's messages (plain and
/// streamed) and the openai package's responses (plain and streamed), once each, on the real
/// llama-server: `/metrics` counts them by API, `dsv4ctl status` has totals for each API and
/// names each request's, the clock-timed rates of the Anthropic stream (llama-server sends it
/// no timings) marked, and the dashboard in a real browser names them in both its tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_apis_statistics_are_shown_in_metrics_dsv4ctl_status_and_the_dashboard() {
    use crate::control::{ctl, wait_bus_name};
    use crate::dashboard::Browser;
    let bus = PrivateBus::start();
    let d = Daemon::start(
        &real::setup()
            .session_bus(&bus)
            .engine("idle_timeout", "10m"),
    );
    let base = d.url("");
    let out = script(
        &["soak", base.trim_end_matches('/'), "1"],
        Duration::from_secs(60),
    )
    .await;
    let report: Value = serde_json::from_str(out.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {out}"));
    // A request is counted once its answer has ended, as its client reads the end.
    let t = std::time::Instant::now();
    while d.status().await["requests"]["requests"] != 4 {
        assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_stats_of(&d, &report, 1, 0).await;

    let (status, _, body) = d.send("GET", "/metrics", &[], None).await;
    assert_eq!(status, 200);
    let metrics = body.as_str().unwrap().to_string();
    let lines: Vec<&str> = metrics.lines().collect();
    let generated = |steps: [&str; 2]| -> u64 {
        steps
            .iter()
            .map(|s| report[s]["output"].as_u64().unwrap())
            .sum()
    };
    for line in [
        "dsv4_api_requests_total{protocol=\"openai\"} 0".to_string(),
        "dsv4_api_requests_total{protocol=\"anthropic\"} 2".to_string(),
        "dsv4_api_requests_total{protocol=\"responses\"} 2".to_string(),
        format!(
            "dsv4_api_generated_tokens_total{{protocol=\"anthropic\"}} {}",
            generated(["messages", "messages_stream"])
        ),
        format!(
            "dsv4_api_generated_tokens_total{{protocol=\"responses\"}} {}",
            generated(["responses", "responses_stream"])
        ),
        // The Anthropic stream, timed by dsv4d's clock; llama-server times the Responses one.
        "dsv4_api_clock_timed_requests_total{protocol=\"anthropic\"} 1".to_string(),
        "dsv4_api_clock_timed_requests_total{protocol=\"responses\"} 0".to_string(),
    ] {
        assert!(lines.contains(&line.as_str()), "no {line} in\n{metrics}");
    }
    for protocol in ["anthropic", "responses"] {
        let rate = format!("dsv4_api_decode_tokens_per_second{{protocol=\"{protocol}\"}} ");
        assert!(
            lines.iter().any(|l| l.starts_with(&rate)),
            "no {rate} in\n{metrics}"
        );
    }

    wait_bus_name(&d, &bus).await;
    let out = tokio::task::block_in_place(|| ctl(&bus.address, &["status"], None));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for part in [
        "\nby API         anthropic 2 (prompt tokens ",
        "\n               responses 2 (prompt tokens ",
        "ago tiny responses /v1/responses: ",
        "ago tiny anthropic /v1/messages: ",
        ", decode ~",
        "\n~              a rate timed by dsv4d's clock",
    ] {
        assert!(printed.contains(part), "no {part:?} in\n{printed}");
    }
    assert!(!printed.contains("openai 0"), "{printed}");

    let dom = tokio::task::block_in_place(|| {
        Browser::opened(
            &format!("http://{}/ui", d.addr),
            "document.getElementById('live').textContent === 'live' && \
             document.querySelectorAll('#requests tbody tr').length === 4",
        )
        .eval(
            "JSON.stringify({ \
               apis: [...document.querySelectorAll('#apis tbody tr')].map(r => r.cells[0].textContent), \
               requests: [...document.querySelectorAll('#requests tbody tr')] \
                 .map(r => r.cells[2].textContent + ' ' + r.cells[3].textContent + ' ' + r.cells[8].textContent), \
               note: !document.getElementById('clock-note').hidden })",
        )
    });
    let shown: Value = serde_json::from_str(dom.as_str().unwrap()).unwrap();
    assert_eq!(
        shown["apis"],
        serde_json::json!(["anthropic", "responses"]),
        "{shown}"
    );
    let requests: Vec<&str> = shown["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    // Newest first: the Responses stream (the engine's timings), the plain Responses answer
    // (no times: no rate), the Anthropic stream (the clock's) and the plain Anthropic answer.
    let [stream, plain, messages_stream, messages] = requests[..] else {
        panic!("{shown}")
    };
    assert!(
        stream.starts_with("responses /v1/responses ") && !stream.ends_with(" -"),
        "{shown}"
    );
    assert!(!stream.contains('~'), "{shown}");
    assert_eq!(plain, "responses /v1/responses -", "{shown}");
    assert_eq!(messages, "anthropic /v1/messages -", "{shown}");
    assert!(
        messages_stream.starts_with("anthropic /v1/messages ~"),
        "{shown}"
    );
    assert_eq!(shown["note"], true, "{shown}");
}

/// Under `api.api_keys_file`, the anthropic package (`x-api-key`) and the openai package
/// (`Authorization: Bearer`) are both answered; the anthropic package with two credentials is
/// refused (400) and with a wrong key gets 401, each raised as its own error; the
/// `anthropic-version` and `anthropic-beta` it sends reach the engine unchanged, and its key
/// does not (dsv4d sends the engine its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sdks_key_header_is_let_through_and_anthropics_headers_reach_the_engine() {
    let d = Daemon::start(
        &Setup::default()
            .api_keys_file(&format!("{KEY}\n"), 0o600)
            .listen_flag(),
    );
    let base = d.url("");
    let out = script(
        &["keys", base.trim_end_matches('/'), KEY],
        Duration::from_secs(60),
    )
    .await;
    assert!(out.contains("keys: OK (400: "), "{out}");
    assert!(out.contains("send one credential"), "{out}");
    let log = d.fake_log();
    let sent: Vec<&str> = log
        .lines()
        .filter(|l| l.starts_with("request POST /v1/messages "))
        .collect();
    // The one answered: the refused ones never reached the engine.
    let [line] = sent[..] else { panic!("{log}") };
    assert!(line.contains(" anthropic-version=\"2023-06-01\""), "{line}");
    assert!(
        line.contains(" anthropic-beta=\"dsv4-test-beta\""),
        "{line}"
    );
    assert!(
        !log.contains(KEY),
        "a client's key reached the engine:\n{log}"
    );
    assert!(line.contains("x-api-key=-"), "{line}");
    assert_eq!(
        log.lines()
            .filter(|l| l.starts_with("request POST /v1/chat/completions "))
            .count(),
        1,
        "{log}"
    );
}
