//! `engine: openai`, the kind whose command line, readiness, key and stop the profile gives:
//! the real llama-server (`tests/engine/prepare`) started through it, driven by the official
//! `openai` Python package (`tests/clients/prepare`), and the fake engine for what the real
//! one cannot show on demand (never ready, deaf to SIGTERM). Like the other real-engine
//! tests, these fail with the command that installs what they need: they never pass by
//! skipping.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use crate::soak::{openai_soak_with, python};
use crate::support::real::engine;
use crate::support::*;
use dsv4_client::State;

/// openai_soak.py iterations: 4 requests each, 100 in all.
const ITERATIONS: usize = 25;

/// Arguments of the real engine as the generic kind starts it: the model, one slot of 1024
/// tokens, and one thread (see `support::real`); `{host}` and `{port}` are dsv4d's to fill.
fn llama_args(model: &Path) -> String {
    let args = [
        "-m",
        &model.display().to_string(),
        "--host",
        "{host}",
        "--port",
        "{port}",
        "-c",
        "1024",
        "-np",
        "1",
        "--no-webui",
        "--threads",
        "1",
        "--threads-batch",
        "1",
    ];
    let quoted: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    format!("[{}]", quoted.join(", "))
}

/// A daemon whose only profile, `generic`, runs the real llama-server through `engine:
/// openai`, found as `command: llama-server` in the profile's PATH, with the YAML lines
/// `more`; its idle engine stops after `idle`.
fn generic_setup(idle: &str, more: &str) -> Setup {
    let (server, model) = engine();
    let bin = server.parent().unwrap().display().to_string();
    let mut s = Setup::default()
        .engine("idle_timeout", idle)
        .engine("stop_timeout", "5s");
    s.custom_profiles.insert(
        "generic".into(),
        format!(
            "description: llama-server through the generic kind\nengine: openai\n\
             command: llama-server\nargs: {}\nhealth: /health\n{more}env:\n  PATH: \
             \"{bin}:/usr/bin:/bin\"\n",
            llama_args(&model)
        ),
    );
    s.default_profile = "generic".into();
    s
}

/// The running engine's pid, from `/status`.
async fn engine_pid(d: &Daemon) -> i64 {
    let s = d.status().await;
    s["engine_pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("no engine runs: {s}"))
}

/// The port in an engine's argv (`--port N`, as its profile's `args` gave it).
fn port_of(argv: &[String]) -> u16 {
    flag_value(argv, "--port")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no --port N in {argv:?}"))
}

/// 100 requests in a row from the `openai` package, each answered exactly; then the idle
/// engine stops (its process gone), and the next request starts another that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_llama_server_serves_through_the_generic_kind_stops_idle_and_restarts() {
    let python = python();
    // Idle long enough that the engine outlives the gap between the client's end and the
    // look at its pid below, short enough that its stop comes soon after.
    let d = Daemon::start(&generic_setup("4s", ""));
    assert_eq!(d.status().await["state"], State::Stopped.as_str());
    let summary = openai_soak_with(
        &python,
        &d.url(""),
        ITERATIONS,
        &[],
        Duration::from_secs(300),
    )
    .await
    .unwrap_or_else(|e| panic!("the openai client failed: {e}\n{}", d.log()));
    assert!(
        summary.contains(&format!("OK: {} requests", 4 * ITERATIONS)),
        "{summary}"
    );
    eprintln!("{summary}");
    let s = d.status().await;
    assert_eq!(s["state"], State::Ready.as_str(), "{s}");
    assert_eq!(s["generation"], 1, "one engine served them all: {s}");
    let pid = engine_pid(&d).await;
    // The engine is llama-server, found in the profile's PATH, on the port dsv4d filled in.
    let argv = argv_of(pid);
    assert!(argv[0].ends_with("llama-server"), "{argv:?}");
    assert!(!argv.iter().any(|a| a.contains('{')), "{argv:?}");
    assert_eq!(flag_value(&argv, "--host"), Some("127.0.0.1"), "{argv:?}");
    port_of(&argv);
    assert_eq!(
        s["engine_key"], "none (the profile gives the engine no key: key_env or key_arg)",
        "{s}"
    );

    d.wait_state(State::Stopped, PATIENCE).await;
    let t = std::time::Instant::now();
    while alive(pid) {
        assert!(t.elapsed() < PATIENCE, "idle engine {pid} still runs");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(d.status().await["engine_pid"], serde_json::Value::Null);

    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    let s = d.status().await;
    assert_eq!(s["generation"], 2, "{s}");
    let again = engine_pid(&d).await;
    assert_ne!(again, pid);
    assert!(alive(again));
}

/// `key_env: LLAMA_API_KEY`: the engine gets a fresh key in its environment, which
/// llama-server reads, so its port refuses a request without it while requests through dsv4d
/// (which sends it) are answered; the key is nowhere on its command line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_the_environment_closes_the_engines_port_and_stays_off_its_command_line() {
    let d = Daemon::start(&generic_setup("1h", "key_env: LLAMA_API_KEY\n"));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abcd");
    let s = d.status().await;
    assert_eq!(
        s["engine_key"], "per-generation secret, in the engine's environment",
        "{s}"
    );
    let pid = engine_pid(&d).await;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("the engine's environ");
    let secret = environ
        .split(|b| *b == 0)
        .find_map(|v| v.strip_prefix(b"LLAMA_API_KEY="))
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .expect("LLAMA_API_KEY in the engine's environment");
    assert_eq!(secret.len(), 64, "a 256-bit secret in hex");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(&secret),
        "the key is on the engine's command line"
    );
    assert!(!d.log().contains(&secret), "the key is in dsv4d's log");

    let seen = EngineSeen {
        pid,
        argv: argv_of(pid),
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port_of(&argv_of(pid)))),
        key_file: None,
        secret: Some(secret),
    };
    the_engines_port_wants_its_key(&seen).await;
    // Through dsv4d, again, with no key of the client's.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
}

/// A profile of the fake engine (playing llama-server) through the generic kind, with the
/// YAML lines `more` and the fake engine's knobs `knobs` (`NAME: value` lines of its env).
pub(crate) fn fake_setup(more: &str, knobs: &[(&str, &str)]) -> Setup {
    let mut env = String::new();
    for (k, v) in knobs {
        env += &format!("  FAKE_ENGINE_{k}: {v:?}\n");
    }
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .engine("stop_timeout", "60s");
    s.custom_profiles.insert(
        "generic".into(),
        format!(
            "engine: openai\ncommand: {FAKE_ENGINE}\n\
             args: [--host, \"{{host}}\", --port, \"{{port}}\"]\n{more}env:\n{env}  \
             FAKE_ENGINE_CONNECTIONS: llama\n"
        ),
    );
    s.default_profile = "generic".into();
    s
}

/// `health: connect`: an engine whose `/health` never answers 200 is ready once its port
/// takes a connection (with `health: /health` it would never be).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_connect_is_ready_once_the_port_takes_a_connection() {
    let d = Daemon::start(&fake_setup("health: connect\n", &[("FAIL_START", "hang")]));
    // Answered by the engine itself (it says it is loading): dsv4d passed the request on.
    let answered = tokio::time::timeout(PATIENCE, d.post("/v1/chat/completions", chat(2, false)));
    let resp = answered
        .await
        .unwrap_or_else(|_| panic!("never ready:\n{}", d.log()));
    let (status, _, v) = body_json(resp).await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v.to_string().contains("Loading model"),
        "not the engine's: {v}"
    );
}

/// `stop_signal: SIGINT`: an engine deaf to SIGTERM stops at once on its own signal, long
/// before `engine.stop_timeout` (60 s) would kill it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profiles_stop_signal_stops_the_engine() {
    let more = "health: /health\nstop_signal: SIGINT\n";
    let d = Daemon::start(&fake_setup(more, &[("IGNORE_SIGTERM", "1")]));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let pid = engine_pid(&d).await;
    d.log_with(&["sending SIGINT to the engine"]).await;
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(!alive(pid));
    assert!(!d.log().contains("sending SIGKILL"), "{}", d.log());
}

/// `stop_grace: 1s`: an engine deaf to its stop signal is killed after the profile's grace,
/// not after `engine.stop_timeout` (60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_profiles_stop_grace_bounds_the_stop() {
    let more = "health: /health\nstop_grace: 1s\n";
    let d = Daemon::start(&fake_setup(more, &[("IGNORE_SIGTERM", "1")]));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let pid = engine_pid(&d).await;
    d.log_with(&[
        "sending SIGTERM to the engine",
        "sending SIGKILL to the engine",
    ])
    .await;
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(!alive(pid));
}

/// `key_arg: --api-key`: the engine takes its fresh key after the flag (on its command line,
/// as the profile asked), requires it on its port, and dsv4d's log does not show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_on_the_command_line_when_the_profile_asks_for_it() {
    let d = Daemon::start(&fake_setup("health: /health\nkey_arg: --api-key\n", &[]));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let pid = engine_pid(&d).await;
    let argv = argv_of(pid);
    let secret = flag_value(&argv, "--api-key")
        .unwrap_or_else(|| panic!("no --api-key in {argv:?}"))
        .to_string();
    assert_eq!(secret.len(), 64, "{argv:?}");
    let log = d.log_with(&["<engine key>"]).await;
    assert!(!log.contains(&secret), "the key is in dsv4d's log");
    let s = d.status().await;
    assert!(
        s["engine_key"]
            .as_str()
            .is_some_and(|k| k.contains("command line")),
        "{s}"
    );
    let seen = EngineSeen {
        pid,
        addr: std::net::SocketAddr::from(([127, 0, 0, 1], port_of(&argv))),
        argv,
        key_file: None,
        secret: Some(secret),
    };
    the_engines_port_wants_its_key(&seen).await;
}

/// The engine's own port answers 401 without its key and 200 with it.
async fn the_engines_port_wants_its_key(seen: &EngineSeen) {
    let (status, _, v) = seen
        .send("POST", "/v1/chat/completions", &[], Some(chat(2, false)))
        .await;
    assert_eq!(status, 401, "the engine's port without the key: {v}");
    let bearer = seen.bearer();
    let (status, _, v) = seen
        .send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", &bearer)],
            Some(chat(2, false)),
        )
        .await;
    assert_eq!(status, 200, "the engine's port with the key: {v}");
}

/// An engine that prints its key (and a client's API key it was handed) as it starts, then
/// fails: its words reach the client's 503, a stream's error event, `/status`, the log and
/// `dsv4ctl logs` with `<engine key>` and `<api key>` where the secrets were, never the
/// secrets themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_prints_its_key_never_shows_it() {
    const API_KEY: &str = "sk-dsv4-test-0123456789abcdef";
    let bus = PrivateBus::start();
    let dir = temp_dir("prints-key");
    let seen = dir.path().join("seen-keys");
    let program = dir.path().join("chatty-engine");
    std::fs::write(
        &program,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$LLAMA_API_KEY\" >> {}\n\
             echo \"starting with key $LLAMA_API_KEY; a client sent {API_KEY}\"\nexit 3\n",
            seen.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut s = Setup::default()
        .api_keys_file(&format!("{API_KEY}\n"), 0o600)
        .session_bus(&bus);
    s.custom_profiles.insert(
        "generic".into(),
        format!(
            "engine: openai\ncommand: {}\nargs: [--port, \"{{port}}\"]\nhealth: /health\n\
             key_env: LLAMA_API_KEY\n",
            program.display()
        ),
    );
    s.default_profile = "generic".into();
    let d = Daemon::start(&s);
    let key = [("x-api-key", API_KEY)];
    let (status, plain) = post_text(
        &d.url("/v1/chat/completions"),
        &key,
        &chat(2, false).to_string(),
    )
    .await;
    assert_eq!(status, 503, "{plain}");
    let (_, streamed) = post_text(
        &d.url("/v1/chat/completions"),
        &key,
        &chat(2, true).to_string(),
    )
    .await;
    let proxy = live_proxy(&bus, &d).await;
    let (_, lines) = proxy.logs(0, 100).await.unwrap();
    let status_json = d.status().await.to_string();
    let secrets: Vec<String> = std::fs::read_to_string(&seen)
        .unwrap()
        .lines()
        .map(String::from)
        .collect();
    assert!(
        !secrets.is_empty() && secrets.iter().all(|k| k.len() == 64),
        "{secrets:?}"
    );
    let logs = lines.join("\n");
    for (what, text) in [
        ("the 503", &plain),
        ("the stream", &streamed),
        ("dsv4ctl logs", &logs),
        ("/status", &status_json),
        ("the log", &d.log()),
    ] {
        for secret in secrets.iter().map(String::as_str).chain([API_KEY]) {
            assert!(!text.contains(secret), "{what} shows a secret: {text}");
        }
    }
    for (what, text) in [
        ("the 503", &plain),
        ("the stream", &streamed),
        ("dsv4ctl logs", &logs),
    ] {
        assert!(
            text.contains("starting with key <engine key>; a client sent <api key>"),
            "{what}: {text}"
        );
    }
}
