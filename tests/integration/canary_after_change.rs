//! The canary after a change (issue 58.3): a start that finds the engine changed since its
//! profile's canary last ran runs the canary once the engine is idle, users first; a drift is
//! said in the journal, the status, `dsv4ctl status`, the dashboard and a desktop
//! notification, and with `canary.hold` the profile refuses requests until `dsv4ctl canary
//! accept`.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::identity::wrapper;
use crate::notify::{Agent, Desktop};
use crate::support::real::{engine, profile, tiny_with_seed};
use crate::support::*;
use crate::validate::{ctl, text};
use dsv4_client::State;
use serde_json::{json, Value};

const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

/// `dsv4ctl --bus system ARGS` against the daemon on `bus`, as the system service is reached.
fn sys_ctl(bus: &PrivateBus, args: &[&str]) -> Output {
    Command::new(DSV4CTL)
        .args(["--bus", "system"])
        .args(args)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::null())
        .output_within(HANG)
}

/// The status' canary check of `profile` once `done` holds of it.
async fn canary_once(d: &Daemon, profile: &str, done: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let s = d.status().await;
        let checks = s["canary"].as_array().cloned().unwrap_or_default();
        if let Some(c) = checks.iter().find(|c| c["profile"] == profile) {
            if done(c) {
                return c.clone();
            }
        }
        assert!(t.elapsed() < PATIENCE, "{}\n{}", s["canary"], d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Records the canary's reference of the active profile (`dsv4ctl validate --canary`
/// through `ctl`), then stops the engine and waits until it has.
async fn reference_then_stop(d: &Daemon, ctl: impl Fn(&[&str]) -> Output) {
    let out = ctl(&["validate", "--canary"]);
    assert!(out.status.success(), "{}{}", text(&out.stderr), d.log());
    let out = ctl(&["stop"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    d.wait_state(State::Stopped, PATIENCE).await;
}

fn chat() -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_weights_are_canaried_once_idle_said_everywhere_and_held_until_accepted() {
    let desktop = Desktop::start();
    let system = PrivateBus::start();
    let dir = temp_dir("canary-hold");
    let model = dir.path().join("64k.gguf");
    tiny_with_seed(&model, 0);
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .system_bus(&system)
        .top_level("canary", "{ hold: true }");
    s.custom_profiles
        .insert("64k".into(), profile(&model, 1024, ""));
    s.default_profile = "64k".into();
    let d = Daemon::start(&s);
    live_proxy(&system, &d).await;
    let _agent = Agent::start(&system, &desktop.bus.address);

    // The reference, then the engine stopped and its model written with other weights.
    reference_then_stop(&d, |args| sys_ctl(&system, args)).await;
    tiny_with_seed(&model, 1);

    // The request that starts the changed engine is served; the canary runs after it.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let check = canary_once(&d, "64k", |c| c["state"] == "drifted").await;
    let drift = &check["result"]["drift"];
    assert_eq!(
        (drift["prompt"].as_u64(), drift["position"].as_u64()),
        (Some(1), Some(0)),
        "{check}"
    );
    assert_eq!(check["held"], true, "{check}");
    assert!(
        check["changed"][0]
            .as_str()
            .unwrap()
            .contains("written since"),
        "{check}"
    );

    // The journal: the change at notice, then the drift.
    let log = d
        .log_with(&[
            "engine changed: model",
            "64k: answers changed since llama-server",
        ])
        .await;
    assert!(log.contains("canary drift at prompt 1"), "{log}");
    // The desktop.
    let note = desktop.wait(0, PATIENCE);
    assert_eq!(
        note.summary, "dsv4: the engine's answers changed",
        "{note:?}"
    );
    assert!(
        note.body
            .contains("64k: answers changed since llama-server"),
        "{note:?}"
    );
    assert!(note.body.contains("canary drift at prompt 1"), "{note:?}");
    // dsv4ctl status, and the dashboard in a real browser.
    let out = sys_ctl(&system, &["status"]);
    let said = text(&out.stdout);
    assert!(said.contains("64k  drifted on llama-server"), "{said}");
    assert!(said.contains("requests refused until accepted"), "{said}");
    let dom = crate::dashboard::page_once(
        &format!("http://{}/ui", d.addr),
        "document.getElementById('canary').textContent.includes('drifted')",
    );
    assert!(dom.contains("canary 64k: drifted on llama-server"), "{dom}");
    assert!(
        dom.contains("requests refused until dsv4ctl canary accept 64k"),
        "{dom}"
    );

    // Held: a request is refused with where it drifted, an Anthropic one in its own shape.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "canary_drift", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("canary drift at prompt 1"), "{message}");
    assert!(message.contains("dsv4ctl canary accept 64k"), "{message}");
    let anthropic = json!({"model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, v) = body_json(d.post("/v1/messages", anthropic).await).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["type"], "error", "{v}");
    // The doctor says so, with the fix.
    let c = doctor_check(&d, "canary", "64k");
    assert_eq!(c["verdict"], "fail", "{c}");
    assert!(
        c["fix"]
            .as_str()
            .unwrap()
            .contains("dsv4ctl canary accept 64k"),
        "{c}"
    );

    // Accepted: the drifted run is the reference, and the profile serves again.
    let out = sys_ctl(&system, &["canary", "accept", "64k"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("is its reference now"),
        "{}",
        text(&out.stdout)
    );
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 200, "{v}");
    let out = sys_ctl(&system, &["canary", "accept", "64k"]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("is its reference already"),
        "{}",
        text(&out.stderr)
    );
    // These weights now match their reference.
    let out = sys_ctl(&system, &["validate", "--canary"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let check = canary_once(&d, "64k", |c| c["state"] == "passed").await;
    assert_eq!(check["held"], false, "{check}");
}

/// Another build of the engine (a wrapper that says another version and changes the
/// numbers), started by two clients' runs of requests: each is served, the canary waits for
/// the engine to be idle, then drifts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_build_is_canaried_once_the_requests_that_came_first_are_served() {
    let (server, tiny) = engine();
    let dir = temp_dir("canary-build");
    let program = dir.path().join("llama-server");
    wrapper(&program, &server, None, "");
    let bus = PrivateBus::start();
    // Two slots: a canary that did not wait would run beside the users' requests.
    let yaml = profile(&tiny, 1024, "")
        .replace(
            &format!("command: {}", server.display()),
            &format!("command: {}", program.display()),
        )
        .replace("parallel: 1", "parallel: 2");
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .session_bus(&bus);
    s.custom_profiles.insert("64k".into(), yaml);
    s.default_profile = "64k".into();
    let d = Daemon::start(&s);
    crate::control::wait_bus_name(&d, &bus).await;
    reference_then_stop(&d, |args| ctl(&bus, args)).await;

    // Another build: another version, and an RMS-norm epsilon that moves every logit.
    let flag = "--override-kv llama.attention.layer_norm_rms_epsilon=float:0.5";
    wrapper(&program, &server, Some("9999 (another build)"), flag);
    // Two clients, each sending requests one after another for 8 s (the first starts the
    // engine): some request is in flight all along, a loaded machine's stall of one client
    // notwithstanding. Meanwhile the status says the canary waits, once the change is known.
    let deadline = Instant::now() + Duration::from_secs(8);
    let client = || async {
        let mut served = 0;
        while Instant::now() < deadline {
            let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
            assert_eq!(status, 200, "{v}\n{}", d.log());
            served += 1;
        }
        served
    };
    let watch = async {
        let mut seen_waiting = false;
        while Instant::now() < deadline {
            let s = d.status().await;
            let state = s["canary"][0]["state"].clone();
            // The validation's check, until the changed engine is known.
            assert!(
                state == "recorded" || state == "waiting",
                "the canary ran between requests: {s}"
            );
            seen_waiting |= state == "waiting";
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        seen_waiting
    };
    let (a, b, seen_waiting) = tokio::join!(client(), client(), watch);
    let last_answer = dsv4_client::clock::unix_now();
    assert!(
        seen_waiting,
        "the change was not seen while requests came ({a} and {b} served)"
    );
    let check = canary_once(&d, "64k", |c| c["state"] == "drifted").await;
    let began = check["result"]["run"]["at"].as_f64().unwrap();
    assert!(
        began >= last_answer,
        "the canary began at {began}, the last answer came at {last_answer}"
    );
    assert!(
        check["changed"][0]
            .as_str()
            .unwrap()
            .contains("-> llama-server 9999 (another build)"),
        "{check}"
    );
    assert!(
        check["result"]["run"]["engine"]
            .as_str()
            .unwrap()
            .contains("9999"),
        "{check}"
    );
    d.log_with(&[
        "engine changed: llama-server",
        "64k: answers changed since llama-server 9999",
    ])
    .await;
    // Not held (canary.hold is off): served.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 200, "{v}");
}

/// A request that comes while a canary prompt runs ends that prompt: the canary goes back to
/// waiting for a quiet engine, and ends later (the fake engine: 100 ms a token, so a canary
/// prompt takes 1.6 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_comes_while_the_canary_runs_goes_first() {
    let bus = PrivateBus::start();
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .knob("token_ms", "100")
        .session_bus(&bus);
    s.default_profile = "64k".into();
    let d = Daemon::start(&s);
    crate::control::wait_bus_name(&d, &bus).await;
    reference_then_stop(&d, |args| ctl(&bus, args)).await;
    // The model written since: a change.
    let model = d.dir().join("profiles/models/64k.gguf");
    let when = std::time::SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&model)
        .unwrap()
        .set_modified(when)
        .unwrap();

    let out = ctl(&bus, &["start"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    canary_once(&d, "64k", |c| c["state"] == "running").await;
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 200, "{v}");
    // The prompt it ran was left: the canary waits for the next quiet (3 s), then ends.
    canary_once(&d, "64k", |c| c["state"] == "waiting").await;
    d.log_with(&["a request came: the canary waits"]).await;
    let check = canary_once(&d, "64k", |c| c["state"] == "passed").await;
    assert_eq!(check["result"]["drift"], Value::Null, "{check}");
}

/// ds4-server gives no log-probabilities: its canary after a change is its greedy text. A
/// rebuilt program that computes the same (here a wrapper written again) is due, runs once
/// idle, and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_ds4_servers_canary_runs_after_a_change_and_passes_when_its_text_is_the_same() {
    let Some((server, model)) = crate::support::real::ds4_engine("ds4_canary_after_change") else {
        return;
    };
    let dir = temp_dir("ds4-canary-change");
    let program = dir.path().join("ds4-server");
    let rebuilt = |build: &str| {
        let tmp = program.with_extension("tmp");
        let text = format!(
            "#!/bin/sh\n# build {build}\nexec {} \"$@\"\n",
            server.display()
        );
        std::fs::write(&tmp, text).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, &program).unwrap();
    };
    rebuilt("1");
    let bus = PrivateBus::start();
    let mut s =
        crate::support::real::ds4_setup(&program, &model, dir.path(), "10m").session_bus(&bus);
    let ds4 = s.custom_profiles.remove("ds4").unwrap();
    s.custom_profiles.insert("64k".into(), ds4);
    s.default_profile = "64k".into();
    let d = Daemon::start_in(&s, dir);
    crate::control::wait_bus_name(&d, &bus).await;
    reference_then_stop(&d, |args| ctl(&bus, args)).await;

    rebuilt("2");
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat()).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let check = canary_once(&d, "64k", |c| c["state"] == "passed").await;
    assert!(
        check["changed"][0]
            .as_str()
            .unwrap()
            .contains("ds4-server program"),
        "{check}"
    );
    assert_eq!(check["result"]["drift"], Value::Null, "{check}");
}
