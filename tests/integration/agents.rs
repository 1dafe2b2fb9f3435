//! The coding agents the user runs, for real, through dsv4d in front of the real llama-server:
//! Claude Code (`claude -p`, Anthropic Messages) and Codex (`codex exec`, OpenAI Responses),
//! pinned and installed from npm by `tests/agents/prepare`.
//!
//! Both time a stream by its events, not its bytes: Claude Code 2.1.332 drops a stream whose
//! last event is about 600 s old (its 300 s watchdog, lengthened by a heartbeat that counts
//! bytes for 30 ticks of 10 s) and resends the whole request; Codex drops one after its
//! `stream_idle_timeout_ms` and resends. llama-server sends a streamed answer's head at once
//! and its first event only when the prefill is done; dsv4d's own head goes out during a cold
//! start. The model is the tiny one with a context of 128K tokens (Codex's prompt is about 20K)
//! and a chat template whose answer stops: it ends the prompt with `5`, so the model counts
//! `6789` and ends the generation.
//!
//! Slow waits: the Claude Code test waits through a load of 640 s. `.ci/run` runs it beside
//! the rest of the suite, not after it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::real::{cache_dir_of, engine, tiny_with_context};
use crate::support::*;
use dsv4_client::State;
use serde_json::Value;

/// The agents' binaries: `DSV4_CLAUDE` and `DSV4_CODEX`, else the cache `tests/agents/prepare`
/// fills. A test that needs them fails with that hint when neither has them.
fn agents() -> (PathBuf, PathBuf) {
    let dir = cache_dir_of("agents");
    let claude = std::env::var_os("DSV4_CLAUDE")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("claude-code-2.1.332/node_modules/.bin/claude"));
    let codex = std::env::var_os("DSV4_CODEX")
        .map(PathBuf::from)
        .unwrap_or_else(|| dir.join("codex-0.171.0/node_modules/.bin/codex"));
    assert!(
        claude.exists() && codex.exists(),
        "no Claude Code at {} or no Codex at {}: run tests/agents/prepare first (or set \
         DSV4_CLAUDE and DSV4_CODEX)",
        claude.display(),
        codex.display()
    );
    (claude, codex)
}

/// ChatML, every text part of every message, and a generation prompt that ends with `5`: the
/// tiny model answers `6789` and ends (digits count up to 9, then the end of generation).
const STOPPING_TEMPLATE: &str = "{%- for m in messages -%}<|im_start|>{{ m.role }}\n\
{% if m.content is string %}{{ m.content }}{% elif m.content %}{% for p in m.content %}\
{% if p.text is defined %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n\
{% endfor -%}{%- if add_generation_prompt -%}<|im_start|>assistant\n5{%- endif -%}";

/// The answer of the tiny model under [`STOPPING_TEMPLATE`].
const ANSWER: &str = "6789";

/// `loading.py PORT SECONDS`: holds 127.0.0.1:PORT for SECONDS, answering every request 503
/// "Loading model" in llama-server's words, then lets the port go.
const LOADING_STAND_IN: &str = r#"import socket, sys, time
port, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
body = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(16)
s.settimeout(0.5)
while time.monotonic() < until:
    try:
        c, _ = s.accept()
    except socket.timeout:
        continue
    c.settimeout(1)
    try:
        c.recv(65536)
        c.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    except OSError:
        pass
    c.close()
s.close()
"#;

/// A daemon whose profile `agents` runs the real llama-server on [`model_128k`] with the
/// stopping template, started by a wrapper that first waits `load` (a slow load), with
/// `api.stream_keepalive` of `keepalive`.
fn agent_daemon(load: Duration, keepalive: &str) -> Daemon {
    let (server, _) = engine();
    let dir = temp_dir("agents");
    let template = dir.path().join("stopping.jinja");
    std::fs::write(&template, STOPPING_TEMPLATE).unwrap();
    // A slow load: for `load`, the engine's port is held by a stand-in of the engine's own
    // (it carries the engine's mark, as any child of it does) that answers 503 "Loading
    // model", as llama-server does while it loads; then llama-server takes the port. Held,
    // the port cannot be taken by another test's server meanwhile (dsv4d would rightly
    // start the engine again elsewhere).
    let loading = dir.path().join("loading.py");
    std::fs::write(&loading, LOADING_STAND_IN).unwrap();
    let wrapper = dir.path().join("slow-llama-server");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n\
             port=; prev=\n\
             for a in \"$@\"; do [ \"$prev\" = --port ] && port=$a; prev=$a; done\n\
             if [ {secs} -gt 0 ]; then /usr/bin/python3 {} \"$port\" {secs}; fi\n\
             exec {} \"$@\"\n",
            loading.display(),
            server.display(),
            secs = load.as_secs(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mut s = Setup::default()
        .log_level("info,dsv4::http=debug")
        .engine("idle_timeout", "30m")
        .engine("start_timeout", "30m")
        .engine("stop_timeout", "5s")
        .api("stream_keepalive", keepalive);
    s.custom_profiles.insert(
        "agents".into(),
        format!(
            "description: the tiny model for the agents\nengine: llama-server\ncommand: {}\n\
             model: {}\ncontext: 131072\nparallel: 1\nextra_args: [\"--no-webui\", \
             \"--threads\", \"1\", \"--threads-batch\", \"1\", \"--jinja\", \
             \"--chat-template-file\", \"{}\"]\n",
            wrapper.display(),
            tiny_with_context(131_072).display(),
            template.display()
        ),
    );
    s.default_profile = "agents".into();
    Daemon::start_in(&s, dir)
}

/// `claude -p PROMPT` against `d`, in a fresh home, as a user runs it with a local endpoint.
fn claude(d: &Daemon, prompt: Option<&str>, env: &[(&str, &str)], limit: Duration) -> Output {
    let (claude, _) = agents();
    let home = temp_dir("claude-home");
    let mut cmd = Command::new(claude);
    cmd.env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", home.path())
        .env("ANTHROPIC_BASE_URL", d.url(""))
        .env("ANTHROPIC_API_KEY", "sk-dsv4-test")
        .env("ANTHROPIC_MODEL", "agents")
        .env("DISABLE_AUTOUPDATER", "1")
        .current_dir(home.path())
        .arg("-p");
    if let Some(prompt) = prompt {
        // Its own short system prompt and no tools: the tiny model's prefill stays short.
        cmd.arg(prompt)
            .args(["--system-prompt", "Answer briefly.", "--tools", ""]);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output_within(limit)
}

/// `codex exec PROMPT` against `d`, with the provider set as a user sets a local one, its
/// stream timed out after `idle_ms` of no event and retried up to 5 times.
fn codex(d: &Daemon, prompt: &str, idle_ms: u64) -> Output {
    let (_, codex) = agents();
    let home = temp_dir("codex-home");
    std::fs::write(
        home.path().join("config.toml"),
        format!(
            "model = \"agents\"\nmodel_provider = \"dsv4\"\n[model_providers.dsv4]\n\
             name = \"dsv4\"\nbase_url = \"{}\"\nenv_key = \"DSV4_API_KEY\"\n\
             wire_api = \"responses\"\nstream_idle_timeout_ms = {idle_ms}\n\
             stream_max_retries = 5\nrequest_max_retries = 0\n",
            d.url("/v1")
        ),
    )
    .unwrap();
    Command::new(codex)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", home.path())
        .env("CODEX_HOME", home.path())
        .env("DSV4_API_KEY", "sk-dsv4-test")
        .current_dir(home.path())
        .args([
            "exec",
            "--skip-git-repo-check",
            "--ephemeral",
            "-s",
            "read-only",
        ])
        .args(["--disable", "plugins", "--disable", "apps", prompt])
        .output_within(HANG)
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// How many requests of `api` (`anthropic`, `responses`) the status counted, and their
/// generated tokens.
async fn counted(d: &Daemon, api: &str) -> (u64, u64) {
    let s = d.status().await;
    let t = &s["requests"]["by_protocol"][api];
    (
        t["requests"].as_u64().unwrap_or(0),
        t["generated_tokens"].as_u64().unwrap_or(0),
    )
}

/// How many requests `METHOD PATH` reached dsv4d, by its log of each request.
fn arrived(d: &Daemon, request: &str) -> usize {
    let line = format!("request: {request}");
    d.log().lines().filter(|l| l.ends_with(&line)).count()
}

/// How many engines dsv4d started, by its log.
fn starts(d: &Daemon) -> usize {
    d.log().matches("starting engine: ").count()
}

/// A prompt of about `tokens` tokens of the tiny model (a character each).
fn long_prompt(tokens: usize) -> String {
    "word ".repeat(tokens / 5)
}

/// Claude Code through a load of 640 s, longer than its watchdog lets a stream go without an
/// event (600 s with its byte heartbeat): dsv4d's keep-alives are events of the API
/// (`message_start`, then empty `message_delta`s), so exactly one `/v1/messages` request
/// reaches dsv4d, the answer is printed and Claude Code exits 0. With SSE comments alone it
/// dropped the stream at 603 s and resent the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_gets_its_answer_through_a_load_longer_than_its_watchdog() {
    let d = agent_daemon(Duration::from_secs(640), "10s");
    let env = [
        ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"),
        ("CLAUDE_CODE_MAX_RETRIES", "0"),
    ];
    let o = claude(&d, Some("hi"), &env, Duration::from_secs(1200));
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}\n{}", d.log());
    assert_eq!(out.trim(), ANSWER, "{err}");
    assert_eq!(arrived(&d, "POST /v1/messages"), 1, "{}", d.log());
    assert_eq!(counted(&d, "anthropic").await.0, 1);
}

/// Codex, its stream timed out after 5 s without an event, through a 20 s load and then a
/// prefill of its own prompt and a long one (well over 5 s on one thread): no reconnect, one
/// request each, counted under `responses` with its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_keeps_one_request_through_a_load_and_a_long_prefill() {
    let d = agent_daemon(Duration::from_secs(20), "1s");
    let o = codex(&d, "hi", 5000);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}\n{}", d.log());
    assert!(!err.contains("Reconnecting"), "{err}");
    assert!(out.contains(ANSWER), "{out}");
    assert_eq!(counted(&d, "responses").await.0, 1, "{}", d.log());

    let o = codex(&d, &long_prompt(30_000), 5000);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}");
    assert!(!err.contains("Reconnecting"), "{err}");
    assert!(out.contains(ANSWER), "{out}");
    let (requests, tokens) = counted(&d, "responses").await;
    assert_eq!(requests, 2, "{}", d.log());
    assert!(tokens >= 8, "{tokens}");
    assert_eq!(arrived(&d, "POST /v1/responses"), 2, "{}", d.log());
}

/// Twenty `codex exec` runs in a row: every one is counted, with its tokens, though Codex
/// closes the connection as soon as `response.completed` has come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_codex_runs_in_a_row_are_all_counted() {
    let d = agent_daemon(Duration::ZERO, "2s");
    for run in 1..=20u64 {
        let o = codex(&d, &format!("run {run}"), 300_000);
        let (out, err) = text(&o);
        assert_eq!(o.status.code(), Some(0), "run {run}: {out}\n{err}");
        assert!(out.contains(ANSWER), "run {run}: {out}");
        let (requests, tokens) = counted(&d, "responses").await;
        assert_eq!(requests, run, "run {run}\n{}", d.log());
        assert!(tokens >= 4 * run, "run {run}: {tokens}");
    }
}

/// Claude Code's look before it asks anything (`HEAD` of the base URL) starts nothing; its
/// question then does, and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_p_with_nothing_to_ask_does_not_start_the_engine() {
    let d = agent_daemon(Duration::ZERO, "10s");
    d.wait_state(State::Stopped, PATIENCE).await;
    let o = claude(&d, None, &[], HANG);
    let (out, err) = text(&o);
    assert_ne!(o.status.code(), Some(0), "{out}\n{err}");
    d.log_with(&["request: HEAD /api/hello"]).await;
    assert_eq!(starts(&d), 0, "{}", d.log());
    assert_eq!(d.status().await["state"], State::Stopped.as_str());

    let o = claude(&d, Some("hi"), &[], HANG);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}\n{}", d.log());
    assert_eq!(out.trim(), ANSWER);
    assert_eq!(starts(&d), 1);
    assert_eq!(counted(&d, "anthropic").await.0, 1);
}

/// One stream through an official package's client (`tests/clients/CLIENT`) at `base`, in
/// `mode`, asking the text of the file `prompt`: its line of JSON and its events by type.
fn package_stream(client: &str, base: &str, mode: &str, prompt: &Path) -> (Value, Vec<String>) {
    let clients = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients");
    let o = Command::new(crate::soak::python())
        .arg(clients.join(client))
        .arg(base)
        .arg(format!("{mode}:{}", prompt.display()))
        .arg("120")
        .output_within(HANG);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{client} {mode}: {out}\n{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    let events = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e.as_str().map(String::from))
        .collect();
    (v, events)
}

/// The opening event and the keep-alive event of the API `client` speaks.
fn api_events(client: &str) -> (&'static str, &'static str) {
    match client {
        "anthropic_client.py" => ("message_start", "message_delta"),
        _ => ("response.created", "response.in_progress"),
    }
}

/// The `anthropic` package through its plain stream and its stream helper (which builds the
/// message from the events, and refuses a stream that does not open with `message_start`), and
/// the `openai` package through its Responses stream, on prefills long enough for several
/// keep-alive events before the engine's first: every stream parses, the answer is whole, the
/// prompt's tokens come through (Anthropic), and the stream names one response (Responses).
/// (The `openai` package's `responses.stream()` helper needs `output_index` in the events,
/// which llama-server's own stream lacks: it fails on llama-server alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_packages_parse_every_kept_alive_stream() {
    let d = agent_daemon(Duration::from_secs(6), "1s");
    let dir = temp_dir("sdk-prompts");
    for (n, (client, base, mode)) in [
        ("anthropic_client.py", d.url(""), "stream"),
        ("anthropic_client.py", d.url(""), "helper"),
        ("responses_client.py", d.url("/v1"), "stream"),
    ]
    .into_iter()
    .enumerate()
    {
        // Its own prompt (nothing cached), long enough for a prefill of several seconds.
        let prompt = dir.path().join(format!("prompt-{n}"));
        std::fs::write(&prompt, format!("{n} {}", long_prompt(20_000))).unwrap();
        let (v, events) = package_stream(client, &base, mode, &prompt);
        let what = format!("{client} {mode}: {v}");
        assert_eq!(v["text"], ANSWER, "{what}");
        let (opening, keepalive) = api_events(client);
        let first_content = match client {
            "anthropic_client.py" => "content_block_start",
            _ => "response.output_item.added",
        };
        assert_eq!(events.first().map(String::as_str), Some(opening), "{what}");
        assert_eq!(events.iter().filter(|e| *e == opening).count(), 1, "{what}");
        let before = events.iter().position(|e| e == first_content).unwrap();
        assert!(events[..before].iter().any(|e| e == keepalive), "{what}");
        match client {
            "anthropic_client.py" => {
                assert_eq!(v["stop_reason"], "end_turn", "{what}");
                if mode == "helper" {
                    assert!(v["input_tokens"].as_u64().unwrap() > 20_000, "{what}");
                }
            }
            _ => {
                assert_eq!(v["status"], "completed", "{what}");
                let ids = v["ids"].as_array().unwrap();
                assert_eq!(ids.len(), 1, "{what}");
                assert!(ids[0].as_str().unwrap().starts_with("resp_dsv4_"), "{what}");
            }
        }
    }
}

/// The same on the real ds4-server, which sends nothing, not even a head, until its prefill
/// ends: through a silent prefill of several seconds, the `anthropic` package's stream and
/// stream helper and the `openai` package's Responses stream get dsv4d's opening and
/// keep-alive events first, then ds4-server's answer, whole, in one message or response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_packages_parse_every_kept_alive_stream_of_the_real_ds4() {
    let test = "the_python_packages_parse_every_kept_alive_stream_of_the_real_ds4";
    let Some((server, model)) = crate::support::real::ds4_engine(test) else {
        return;
    };
    let dir = temp_dir("ds4-agents");
    let s = crate::support::real::ds4_setup(&server, &model, dir.path(), "10m")
        .api("stream_keepalive", "1s");
    let d = Daemon::start_in(&s, dir);
    let prompts = temp_dir("ds4-prompts");
    for (n, (client, base, mode)) in [
        ("anthropic_client.py", d.url(""), "stream"),
        ("anthropic_client.py", d.url(""), "helper"),
        ("responses_client.py", d.url("/v1"), "stream"),
    ]
    .into_iter()
    .enumerate()
    {
        let prompt = prompts.path().join(format!("prompt-{n}"));
        let words = "word ".repeat(crate::keepalive::DS4_PROMPT_TOKENS / 5);
        std::fs::write(&prompt, format!("{n} {words}")).unwrap();
        let (v, events) = package_stream(client, &base, mode, &prompt);
        let what = format!("{client} {mode}: {v}\n{}", d.log());
        assert_eq!(v["text"], "Hi!", "{what}");
        let (opening, keepalive) = api_events(client);
        assert_eq!(events.first().map(String::as_str), Some(opening), "{what}");
        assert_eq!(events.iter().filter(|e| *e == opening).count(), 1, "{what}");
        assert_eq!(events.get(1).map(String::as_str), Some(keepalive), "{what}");
        if client == "responses_client.py" {
            assert_eq!(v["status"], "completed", "{what}");
            assert_eq!(v["ids"].as_array().map(Vec::len), Some(1), "{what}");
        }
    }
}

/// Claude Code on the real ds4-server, which sends nothing, not even a head, until its
/// prefill ends: dsv4d's own head and events carry it through the prefill, ds4-server's own
/// `message_start` follows as a delta, and Claude Code prints ds4's answer, from one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_gets_the_real_ds4s_answer_through_its_silent_prefill() {
    let test = "claude_code_gets_the_real_ds4s_answer_through_its_silent_prefill";
    let Some((server, model)) = crate::support::real::ds4_engine(test) else {
        return;
    };
    let dir = temp_dir("ds4-claude");
    let s = crate::support::real::ds4_setup(&server, &model, dir.path(), "10m")
        .api("stream_keepalive", "1s")
        .log_level("info,dsv4::http=debug");
    let d = Daemon::start_in(&s, dir);
    let env = [("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")];
    let o = claude(&d, Some("hi"), &env, HANG);
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}\n{err}\n{}", d.log());
    assert_eq!(out.trim(), "Hi!", "{err}");
    assert_eq!(arrived(&d, "POST /v1/messages"), 1, "{}", d.log());
    assert_eq!(counted(&d, "anthropic").await.0, 1, "{}", d.log());
}
