//! KV checkpoints across stops (`kv_checkpoint`): with the real llama-server and the tiny
//! model, a long prompt's cache survives an idle stop, a profile switch away and back, and a
//! daemon restart; each restore is checked by the next request that goes on from it, in any
//! of the APIs; a checkpoint for another engine is never restored; a full folder evicts
//! the oldest. With the fake engine: a save that stalls does not hold the stop, a failed save
//! says what the next start does, and
//! ds4-server's own shutdown save is measured and reported.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::control::{ctl, wait_bus_name};
use crate::support::real::engine;
use crate::support::*;
use dsv4_client::State;
use serde_json::{json, Value};

const SEC: Duration = Duration::from_secs(1);

/// About 2,800 tokens of the tiny model's vocabulary: a long prompt for a 4096 context.
fn long_prompt() -> String {
    "abc ".repeat(700)
}

/// A profile of the real engine with `kv_checkpoint: KV`.
fn real_profile(model: &Path, context: u32, kv: &str) -> String {
    crate::support::real::profile(model, context, &format!("kv_checkpoint: {kv}\n"))
}

/// A daemon setup with the real engine as profile `tiny` (context 4096); an idle engine
/// stops after `idle`.
fn real_setup(idle: &str) -> Setup {
    let (_, model) = engine();
    let mut s = Setup::default()
        .engine("idle_timeout", idle)
        .engine("stop_timeout", "5s");
    s.custom_profiles
        .insert("tiny".into(), real_profile(&model, 4096, "{ dir: kv }"));
    s.default_profile = "tiny".into();
    s
}

/// One native completion with the cache on (or not): content, `cache_n`, `prompt_n`.
async fn complete(d: &Daemon, prompt: &str, cache: bool) -> (String, u64, u64) {
    let body = json!({"prompt": prompt, "n_predict": 8, "cache_prompt": cache});
    let (status, _, v) = body_json(d.post("/completion", body).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let t = &v["timings"];
    (
        v["content"].as_str().unwrap().to_string(),
        t["cache_n"].as_u64().unwrap(),
        t["prompt_n"].as_u64().unwrap(),
    )
}

/// The `kv` part of the status for `profile`.
pub(crate) async fn kv_of(d: &Daemon, profile: &str) -> Value {
    let s = d.status().await;
    s["kv"]["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["profile"] == profile)
        .cloned()
        .unwrap_or_else(|| panic!("no kv status for {profile}: {s}"))
}

/// Waits until the last save of `profile` has a result.
pub(crate) async fn wait_saved(d: &Daemon, profile: &str, within: Duration) -> Value {
    let t = Instant::now();
    loop {
        let kv = kv_of(d, profile).await;
        if !kv["last_save"].is_null() && d.status().await["state"] == State::Stopped.as_str() {
            return kv;
        }
        assert!(
            t.elapsed() < within,
            "no save within {within:?}: {kv}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The second request after a stop: the first prompt's tokens come from the restored cache,
/// only the new ones are prefilled, and the answer is the one a cold engine gives.
async fn assert_prefix_kept(d: &Daemon, first_prompt_n: u64) {
    let prompt = format!("{}xyz", long_prompt());
    let (content, cache_n, prompt_n) = complete(d, &prompt, true).await;
    assert!(
        cache_n >= first_prompt_n,
        "cache_n {cache_n} does not cover the old prompt's {first_prompt_n} tokens\n{}",
        d.log()
    );
    assert!(
        prompt_n <= 5,
        "{prompt_n} tokens prefilled: only the new ones should be"
    );
    let (cold, cold_cache_n, _) = complete(d, &prompt, false).await;
    assert_eq!(cold_cache_n, 0);
    assert_eq!(content, cold, "the restored cache changed the answer");
    let kv = kv_of(d, "tiny").await;
    assert_eq!(kv["last_restore"]["result"], "restored", "{kv}");
    assert!(kv["last_restore"]["tokens"].as_u64().unwrap() >= first_prompt_n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stop_keeps_the_long_prefix() {
    let d = Daemon::start(&real_setup("1s"));
    let (_, cache_n, prompt_n) = complete(&d, &long_prompt(), true).await;
    assert_eq!(cache_n, 0);
    assert!(prompt_n > 2000, "{prompt_n}");
    let kv = wait_saved(&d, "tiny", PATIENCE).await;
    assert_eq!(kv["last_save"]["result"], "saved", "{kv}");
    assert!(kv["last_save"]["tokens"].as_u64().unwrap() >= prompt_n);
    let checkpoint = &kv["checkpoint"];
    assert_eq!(checkpoint["profile"], "tiny");
    assert!(checkpoint["bytes"].as_u64().unwrap() > 0);
    let files = std::fs::read_dir(d.dir().join("profiles/kv"))
        .unwrap()
        .count();
    assert_eq!(files, 2, "one manifest and one slot file");

    assert_prefix_kept(&d, prompt_n).await;
    let s = d.status().await;
    // Counted exactly: the restore's own count, once, whatever the requests after it used.
    let restored = s["kv"]["restored_tokens_total"].as_u64().unwrap();
    let kv = kv_of(&d, "tiny").await;
    assert_eq!(
        restored,
        kv["last_restore"]["tokens"].as_u64().unwrap(),
        "{kv}"
    );
    assert!(restored >= prompt_n, "{}", s["kv"]);
    let (status, _, body) = d.send("GET", "/metrics", &[], None).await;
    assert_eq!(status, 200);
    let metrics = body.as_str().unwrap().to_string();
    for name in [
        "dsv4_kv_checkpoint_bytes{profile=\"tiny\"}",
        "dsv4_kv_save_seconds{profile=\"tiny\"}",
        "dsv4_kv_restore_seconds{profile=\"tiny\"}",
        "dsv4_kv_restored_tokens_total",
    ] {
        assert!(metrics.contains(name), "no {name} in\n{metrics}");
    }
    assert!(
        metrics.contains(&format!("dsv4_kv_restored_tokens_total {restored}")),
        "{metrics}"
    );
}

/// Waits until the last restore of `tiny` has a check newer than `after` (unix s).
async fn wait_check(d: &Daemon, after: f64) -> Value {
    wait_check_of(d, "tiny", after).await["check"].clone()
}

/// Waits until the last restore of `profile` has a check newer than `after` (unix s): that
/// restore.
pub(crate) async fn wait_check_of(d: &Daemon, profile: &str, after: f64) -> Value {
    let t = Instant::now();
    loop {
        let kv = kv_of(d, profile).await;
        let check = &kv["last_restore"]["check"];
        if check["at"].as_f64().is_some_and(|at| at > after) {
            return kv["last_restore"].clone();
        }
        assert!(
            t.elapsed() < PATIENCE,
            "no check of the restore: {kv}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Each restore is checked by the first request that shares its tokens: one that goes on
/// with the cache on reuses them, and the check says so; one with the cache off reuses
/// none, and that miss is told in the status, the metrics, the journal and an Alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_restore_is_checked_by_the_next_request_and_a_miss_is_told() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&real_setup("1s").session_bus(&bus));
    wait_bus_name(&d, &bus).await;
    let proxy = crate::support::live_proxy(&bus, &d).await;
    let mut alerts = proxy.receive_alert().await.unwrap();
    let (_, _, first) = complete(&d, &long_prompt(), true).await;
    wait_saved(&d, "tiny", PATIENCE).await;

    // The conversation goes on, from the restored cache.
    let prompt = format!("{}xyz", long_prompt());
    let (_, cache_n, _) = complete(&d, &prompt, true).await;
    let good = wait_check(&d, 0.0).await;
    assert_eq!(good["reused"], cache_n, "{good}");
    let shared = good["shared"].as_u64().unwrap();
    assert!(
        shared >= first * 9 / 10 && shared <= first + 8,
        "{good}, first prompt {first}"
    );
    assert_eq!(good["missed"], false, "{good}");
    // All of the shared prefix came from the cache (llama-server evaluates again at most the
    // last token of a prompt it holds whole).
    assert!(shared.abs_diff(cache_n) <= 1, "{good}");

    // Stopped again when idle, restored at the next start; this request does not use it.
    wait_saved(&d, "tiny", PATIENCE).await;
    let (_, cache_n, _) = complete(&d, &prompt, false).await;
    assert_eq!(cache_n, 0);
    let miss = wait_check(&d, good["at"].as_f64().unwrap()).await;
    assert_eq!(miss["reused"], 0, "{miss}");
    assert_eq!(miss["missed"], true, "{miss}");
    assert!(miss["shared"].as_u64().unwrap() >= first * 9 / 10, "{miss}");
    assert_eq!(d.status().await["kv"]["restore_misses_total"], 1);
    let (_, _, metrics) = d.send("GET", "/metrics", &[], None).await;
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    for line in [
        "dsv4_kv_restore_misses_total 1",
        "dsv4_kv_restore_reused_tokens{profile=\"tiny\"} 0",
    ] {
        assert!(metrics.contains(line), "no {line} in\n{metrics}");
    }
    d.log_with(&["the KV checkpoint restore did nothing"]).await;
    let args = next_alert(&mut alerts, &d).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Kv);
    assert!(args.message.contains("profile tiny"), "{}", args.message);
    assert!(args.message.contains("#26676"), "{}", args.message);

    // Once more: restores that keep missing are the doctor's warning, read from the checks
    // the daemon kept in its state folder.
    wait_saved(&d, "tiny", PATIENCE).await;
    complete(&d, &prompt, false).await;
    wait_check(&d, miss["at"].as_f64().unwrap()).await;
    let kept = d.dir().join("state/kv-restore-checks.json");
    let t = Instant::now();
    while !std::fs::read_to_string(&kept).is_ok_and(|k| k.matches("\"missed\":true").count() == 2) {
        assert!(t.elapsed() < PATIENCE, "{} not written", kept.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = doctor_check(&d, "kv.restore", "tiny");
    assert_eq!(c["verdict"], "warn", "{c}");
    assert!(
        c["found"]
            .as_str()
            .unwrap()
            .starts_with("the last 2 restores did nothing"),
        "{c}"
    );
}

/// The agents' APIs check a restore too: Claude Code's Anthropic messages and Codex's
/// Responses requests, each going on with the conversation the restored slot holds, are read
/// as the engine reads them (the chat llama-server makes of them, through its template), and
/// the check finds every shared token reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_is_checked_by_an_anthropic_and_by_a_responses_request() {
    let d = Daemon::start(&real_setup("1s"));
    let text = long_prompt();
    let said = |v: &Value| {
        v["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let first = json!({"model": "tiny", "max_tokens": 4, "system": "answer",
        "messages": [{"role": "user", "content": text}]});
    let (status, _, v) = body_json(d.post("/v1/messages", first).await).await;
    assert_eq!(status, 200, "{v}");
    let answer = said(&v);
    wait_saved(&d, "tiny", PATIENCE).await;

    // Claude Code's next turn: the restored conversation, an answer and a new question.
    let turn = json!({"model": "tiny", "max_tokens": 4,
    "system": [{"type": "text", "text": "answer", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": text}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        {"role": "user", "content": "more"},
    ]});
    let (status, _, v) = body_json(d.post("/v1/messages", turn).await).await;
    assert_eq!(status, 200, "{v}");
    let reused = v["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    let good = wait_check(&d, 0.0).await;
    assert_eq!(good["reused"], reused, "{good}");
    assert_eq!(good["missed"], false, "{good}");
    let shared = good["shared"].as_u64().unwrap();
    assert!(shared > 2000 && shared.abs_diff(reused) <= 1, "{good}");

    // Codex's: the same conversation as Responses input items.
    wait_saved(&d, "tiny", PATIENCE).await;
    let turn = json!({"model": "tiny", "max_output_tokens": 4, "instructions": "answer",
    "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]},
        {"role": "user", "content": "more still"},
    ]});
    let (status, _, v) = body_json(d.post("/v1/responses", turn).await).await;
    assert_eq!(status, 200, "{v}");
    let reused = v["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let next = wait_check(&d, good["at"].as_f64().unwrap()).await;
    assert_eq!(next["reused"], reused, "{next}");
    assert_eq!(next["missed"], false, "{next}");
    assert!(next["shared"].as_u64().unwrap() >= shared, "{next}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_restart_keeps_the_long_prefix() {
    // No idle stop: the daemon's own shutdown saves.
    let s = real_setup("10m");
    let d = Daemon::start(&s);
    let (_, _, prompt_n) = complete(&d, &long_prompt(), true).await;
    let dir = d.stop().await;
    let d = Daemon::start_in(&s, dir);
    assert_prefix_kept(&d, prompt_n).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_switch_away_and_back_keeps_the_long_prefix() {
    let bus = PrivateBus::start();
    let (_, model) = engine();
    let mut s = real_setup("10m").session_bus(&bus);
    // Another profile for another engine (half the context), sharing the folder.
    s.custom_profiles
        .insert("half".into(), real_profile(&model, 2048, "{ dir: kv }"));
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let (_, _, prompt_n) = complete(&d, &long_prompt(), true).await;
    let out = ctl(&bus.address, &["profile", "half"], None);
    assert_eq!(out.status.code(), Some(0));
    // The half profile serves a prompt of its own, cold.
    let (_, cache_n, _) = complete(&d, &"xy ".repeat(300), true).await;
    assert_eq!(cache_n, 0);
    assert_eq!(d.status().await["engine_profile"], "half");
    assert_eq!(kv_of(&d, "tiny").await["last_save"]["result"], "saved");
    let out = ctl(&bus.address, &["profile", "tiny"], None);
    assert_eq!(out.status.code(), Some(0));
    assert_prefix_kept(&d, prompt_n).await;
    // Both checkpoints are there, side by side.
    let out = ctl(&bus.address, &["--json", "kv", "list"], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    let profiles: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["profile"].as_str().unwrap())
        .collect();
    assert!(
        profiles.contains(&"tiny") && profiles.contains(&"half"),
        "{list}"
    );
    // `kv drop` takes one profile's away, and the next start of it is cold.
    let out = ctl(&bus.address, &["kv", "drop", "tiny"], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(&bus.address, &["--json", "kv", "list"], None);
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["profile"], "half");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_for_another_context_or_model_is_not_restored() {
    let (_, model) = engine();
    let prompt = "abc ".repeat(300);
    let mut s = real_setup("1s");
    let d = Daemon::start(&s);
    let (first, _, _) = complete(&d, &prompt, true).await;
    wait_saved(&d, "tiny", PATIENCE).await;
    let dir = d.stop().await;

    // The same profile with half the context: its checkpoint is set aside, with the reason.
    s.custom_profiles
        .insert("tiny".into(), real_profile(&model, 2048, "{ dir: kv }"));
    let d = Daemon::start_in(&s, dir);
    let (again, cache_n, _) = complete(&d, &prompt, true).await;
    assert_eq!(cache_n, 0, "a checkpoint of another context was restored");
    assert_eq!(again, first);
    let log = d
        .log_with(&[
            "set aside, not restored",
            "context per slot 4096 (now 2048)",
        ])
        .await;
    assert!(log.contains("set aside, not restored"), "{log}");
    assert!(log.contains("context per slot 4096 (now 2048)"), "{log}");
    assert_eq!(
        kv_of(&d, "tiny").await["last_restore"]["result"],
        "nothing to restore"
    );
    wait_saved(&d, "tiny", PATIENCE).await;
    let dir = d.stop().await;

    // Another model file (the generator's other seed): not restored either.
    let other = dir.path().join("other.gguf");
    make_tiny_model(&other, 2);
    s.custom_profiles
        .insert("tiny".into(), real_profile(&other, 2048, "{ dir: kv }"));
    let d = Daemon::start_in(&s, dir);
    let (again, cache_n, _) = complete(&d, &prompt, true).await;
    assert_eq!(cache_n, 0, "a checkpoint of another model was restored");
    assert_eq!(again, first);
    d.log_with(&["another model file"]).await;
    let aside = set_aside(&d.dir().join("profiles/kv"));
    assert_eq!(aside, 2, "both set aside");
}

/// Writes the tiny model with another seed (same behaviour, other weights).
fn make_tiny_model(out: &Path, seed: u32) {
    let python = crate::support::real::cache_dir().join("venv/bin/python");
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/make_tiny_gguf.py");
    let st = std::process::Command::new(&python)
        .arg(&generator)
        .arg(out)
        .args(["--seed", &seed.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(st.success(), "the model generator failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_size_evicts_the_oldest_and_keeps_serving() {
    let bus = PrivateBus::start();
    let (_, model) = engine();
    // Room for one checkpoint of the long prompt (~1.5 MB) and not for two.
    let kv = "{ dir: kv, max_size: 2MiB }";
    let mut s = real_setup("10m").session_bus(&bus);
    s.custom_profiles
        .insert("tiny".into(), real_profile(&model, 4096, kv));
    s.custom_profiles
        .insert("half".into(), real_profile(&model, 2048, kv));
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    complete(&d, &long_prompt(), true).await;
    assert_eq!(
        ctl(&bus.address, &["profile", "half"], None).status.code(),
        Some(0)
    );
    complete(&d, &"abc ".repeat(400), true).await;
    let tiny = kv_of(&d, "tiny").await;
    assert_eq!(tiny["last_save"]["result"], "saved", "{tiny}");
    assert_eq!(
        ctl(&bus.address, &["profile", "tiny"], None).status.code(),
        Some(0)
    );
    // half's save pushed the folder over 2 MiB: tiny's, the oldest, went.
    let (_, cache_n, _) = complete(&d, &long_prompt(), true).await;
    assert_eq!(
        cache_n,
        0,
        "the evicted checkpoint was restored\n{}",
        d.log()
    );
    d.log_with(&["removed: kv_checkpoint.max_size reached"])
        .await;
    let kv = kv_of(&d, "tiny").await;
    assert!(kv["dir_bytes"].as_u64().unwrap() <= 2 << 20, "{kv}");
    assert_eq!(kv_of(&d, "half").await["checkpoint"]["profile"], "half");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_save_does_not_hold_the_stop_beyond_save_timeout() {
    // The engine takes a minute to save and ignores SIGTERM: the save is cut at 1 s, and the
    // stop goes on, SIGTERM then SIGKILL at stop_timeout (2 s), as any stop does.
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .engine("stop_timeout", "2s")
        .knob("save_ms", "60000")
        .knob("ignore_sigterm", "1")
        .profile_key("320k", "kv_checkpoint", "{ dir: kv, save_timeout: 1s }");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    d.wait_fake_log("slot 0 save", PATIENCE).await;
    let t = Instant::now();
    let st = d.status().await;
    assert_eq!(st["state"], State::Stopping.as_str(), "{st}");
    assert_eq!(st["kv_step"], "saving", "{st}");
    d.wait_state(State::Stopped, PATIENCE).await;
    let took = t.elapsed();
    assert!(
        took < 3 * SEC + LOAD_MARGIN,
        "the stop took {took:?}\n{}",
        d.log()
    );
    assert!(
        took >= 2 * SEC,
        "the stop did not wait for the save at all: {took:?}"
    );
    d.log_with(&["sending SIGTERM", "sending SIGKILL"]).await;
    let kv = kv_of(&d, "320k").await;
    assert!(
        kv["last_save"]["result"]
            .as_str()
            .unwrap()
            .contains("cut off by kv_checkpoint.save_timeout (1s)"),
        "{kv}"
    );
    // Nothing half-written is taken for a checkpoint.
    assert!(kv["checkpoint"].is_null(), "{kv}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ds4_gets_the_time_its_shutdown_save_needs_and_its_words_are_reported() {
    let mut s = Setup::default()
        .ds4()
        .engine("idle_timeout", "1s")
        .engine("stop_timeout", "10s")
        .knob("sigterm_ms", "1500")
        .profile_key("320k", "kv_disk_dir", "ds4-kv");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    // ds4-server saves from 512 tokens on.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(600, false)).await).await;
    assert_eq!(status, 200);
    let kv = wait_saved(&d, "320k", PATIENCE).await;
    let save = &kv["last_save"];
    assert_eq!(kv["engine"], "ds4");
    assert!(save["seconds"].as_f64().unwrap() >= 1.5, "{save}");
    assert_eq!(save["tokens"], 600, "{save}");
    assert_eq!(save["reason"], "shutdown", "{save}");
    assert!(
        save["engine_said"]
            .as_str()
            .unwrap()
            .contains("kv cache stored tokens=600"),
        "{save}"
    );
    assert!(kv["dir_bytes"].as_u64().unwrap() > 0, "{kv}");
    assert!(
        !d.log().contains("sending SIGINT"),
        "ds4 must not be interrupted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_evicts_the_oldest_and_keeps_serving() {
    // The checkpoint folder is a 2200 KiB tmpfs in the daemon's own mount namespace: one
    // checkpoint of the long prompt (~1.5 MB) fits, a second does not. Mounting needs root,
    // as CI has it.
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test mounts a small tmpfs: run it as root"
    );
    let bus = PrivateBus::start();
    let (_, model) = engine();
    let dir = temp_dir("daemon");
    let kv = dir.path().join("profiles/kv");
    std::fs::create_dir_all(&kv).unwrap();
    let mount = format!(
        "mount -t tmpfs -o size=2200k dsv4-test-kv '{}' && exec \"$@\"",
        kv.display()
    );
    let mut s = real_setup("10m").session_bus(&bus).wrapper(&[
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        &mount,
        "sh",
    ]);
    s.custom_profiles
        .insert("half".into(), real_profile(&model, 2048, "{ dir: kv }"));
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    complete(&d, &long_prompt(), true).await;
    assert_eq!(
        ctl(&bus.address, &["profile", "half"], None).status.code(),
        Some(0)
    );
    complete(&d, &"abc ".repeat(450), true).await;
    assert_eq!(kv_of(&d, "tiny").await["last_save"]["result"], "saved");
    assert_eq!(
        ctl(&bus.address, &["profile", "tiny"], None).status.code(),
        Some(0)
    );
    // half's save found the disk full: the oldest (tiny's) went, half's was kept, and tiny
    // starts cold and serves.
    let (_, cache_n, _) = complete(&d, &long_prompt(), true).await;
    assert_eq!(cache_n, 0, "the evicted checkpoint was restored");
    d.log_with(&["No space left on device", "to make room, and trying again"])
        .await;
    let half = kv_of(&d, "half").await;
    assert_eq!(half["last_save"]["result"], "saved", "{half}");
    assert_eq!(half["checkpoint"]["profile"], "half", "{half}");
}

/// How many checkpoints in `dir` were set aside.
fn set_aside(dir: &Path) -> usize {
    files_with_extension(&dir.join("aside"), "json").len()
}

/// The slot files of the checkpoints in `dir` (not those set aside).
fn slot_files(dir: &Path) -> Vec<std::path::PathBuf> {
    files_with_extension(dir, "bin")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_checkpoint_is_set_aside_and_the_engine_serves_cold() {
    let s = real_setup("10m");
    let d = Daemon::start(&s);
    let (first, _, _) = complete(&d, &long_prompt(), true).await;
    let dir = d.stop().await;
    let kv = dir.path().join("profiles/kv");
    let files = slot_files(&kv);
    assert_eq!(files.len(), 1);

    // Truncated (llama-server aborts on such a file): never offered to the engine.
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(&files[0], &bytes[..bytes.len() / 2]).unwrap();
    let d = Daemon::start_in(&s, dir);
    let (again, cache_n, _) = complete(&d, &long_prompt(), true).await;
    assert_eq!(cache_n, 0);
    assert_eq!(again, first);
    let log = d.log_with(&["truncated:"]).await;
    assert!(
        !log.contains("exited unexpectedly"),
        "the engine was given the file\n{log}"
    );
    let dir = d.stop().await;

    // Same size, garbage inside: whatever the engine makes of it (a refusal, or dying on
    // it), the request is served, cold, and the checkpoint is set aside.
    let files = slot_files(&kv);
    assert_eq!(files.len(), 1, "the shutdown saved a new one");
    let len = std::fs::metadata(&files[0]).unwrap().len() as usize;
    let garbage: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
    std::fs::write(&files[0], garbage).unwrap();
    let d = Daemon::start_in(&s, dir);
    let (again, cache_n, _) = complete(&d, &long_prompt(), true).await;
    assert_eq!(cache_n, 0);
    assert_eq!(again, first);
    let aside = set_aside(&kv);
    assert_eq!(aside, 2, "{}", d.log());
    assert_eq!(d.status().await["state"], State::Ready.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_on_a_restore_is_started_again_without_that_checkpoint() {
    let mut s = Setup::default().engine("idle_timeout", "10m").profile_key(
        "320k",
        "kv_checkpoint",
        "{ dir: kv }",
    );
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let dir = d.stop().await;
    // The next engine aborts on the restore, as llama-server does on a bad slot file.
    let s = s.knob("restore_abort", "1");
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(
        status,
        200,
        "the waiting request was lost: {v}\n{}",
        d.log()
    );
    // Set aside by the restore that saw the engine die, or else by the next start, which
    // finds the mark of a restore that never ended.
    let t = Instant::now();
    let log = loop {
        let log = d.log();
        if log.contains("the engine died restoring it")
            || log.contains("an earlier restore of it never ended")
        {
            break log;
        }
        assert!(
            t.elapsed() < PATIENCE,
            "the checkpoint was not set aside:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(log.matches("starting engine:").count(), 2, "{log}");
    let kv = kv_of(&d, "320k").await;
    assert_eq!(kv["last_restore"]["result"], "nothing to restore", "{kv}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_cannot_drive_the_slots_dsv4d_keeps() {
    let mut s = Setup::default().profile_key("320k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    for action in ["save", "restore", "erase"] {
        let path = format!("/slots/0?action={action}");
        let (status, _, v) = body_json(d.post(&path, json!({"filename": "mine.bin"})).await).await;
        assert_eq!(status, 403, "{v}");
        assert_eq!(v["error"]["code"], "slots_managed", "{v}");
    }
    // Written as the engine decodes it (the fake decodes as llama-server's library does).
    for (path, want) in crate::real_engine::ENCODED_SLOT_ACTIONS {
        let target = format!("{path}?action=save");
        let (status, _, v) =
            body_json(d.post(&target, json!({"filename": "mine.bin"})).await).await;
        assert_eq!(status, want, "{target}: {v}");
    }
    // dsv4d's own endpoints are judged on the decoded path too.
    let (status, v) = d.get("/%73tatus").await;
    assert_eq!(status, 200);
    assert!(v["kv"].is_object() && v["requests"].is_object(), "{v}");
    assert!(!d.fake_log().contains("slot 0 save mine.bin"));
    // Reading the slots still goes to the engine.
    let (status, v) = d.get("/slots").await;
    assert_eq!(status, 200, "{v}");
    assert!(v.is_array(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dying_in_its_save_removes_no_other_checkpoint() {
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .profile_key("320k", "kv_checkpoint", "{ dir: kv }")
        .profile_key("64k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let dir = d.stop().await;
    let manifests = |dir: &Path| files_with_extension(&dir.join("profiles/kv"), "json").len();
    assert_eq!(manifests(dir.path()), 1, "320k's checkpoint");
    // 64k's engine dies while it saves: that is no full disk, and nothing is evicted.
    s.default_profile = "64k".into();
    s.profiles
        .get_mut("64k")
        .unwrap()
        .insert("save_abort", "1".to_string());
    let d = Daemon::start_in(&s, dir);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let dir = d.stop().await;
    assert_eq!(manifests(dir.path()), 1, "320k's checkpoint was removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_save_says_what_the_next_start_does() {
    let mut s = Setup::default().profile_key("320k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    let full = |s: &mut Setup, on: bool| {
        let knobs = s.profiles.get_mut("320k").unwrap();
        match on {
            true => knobs.insert("save_full", "1".to_string()),
            false => knobs.remove("save_full"),
        };
    };
    // The disk is full, and there is no other checkpoint to make room with.
    let not_saved = "KV checkpoint not saved: the engine could not save slot 0";
    // No checkpoint yet: the next start is cold.
    full(&mut s, true);
    let d = Daemon::start(&s);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let log = d.log_with(&[not_saved]).await;
    assert!(
        log.contains("there is no earlier checkpoint of this engine, so the next start is cold"),
        "{log}"
    );
    let dir = d.stop().await;
    // With one saved, a failed save leaves it, and the next start restores it.
    full(&mut s, false);
    let d = Daemon::start_in(&s, dir);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let dir = d.stop().await;
    full(&mut s, true);
    let d = Daemon::start_in(&s, dir);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let log = d.log_with(&[not_saved]).await;
    assert!(
        log.contains("; the next start restores the previous checkpoint, "),
        "{log}"
    );
    let dir = d.stop().await;
    full(&mut s, false);
    let d = Daemon::start_in(&s, dir);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let kv = kv_of(&d, "320k").await;
    assert_eq!(kv["last_restore"]["ok"], true, "{kv}");
}

/// 320k keeps no checkpoints, 64k does; the daemon serves 320k first.
fn switching_toward_checkpoints(bus: &PrivateBus) -> Setup {
    let mut s =
        Setup::default()
            .session_bus(bus)
            .profile_key("64k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    s
}

/// A slot action sent while a switch drains toward a profile with checkpoints is judged
/// against that profile, not the draining engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_action_during_a_switch_is_judged_by_the_profile_switched_to() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&switching_toward_checkpoints(&bus).knob("token_ms", "50"));
    let proxy = live_proxy(&bus, &d).await;
    // A 5 s stream holds the 320k engine: the switch drains behind it.
    let stream = d.post("/v1/chat/completions", chat(100, true)).await;
    assert_eq!(stream.status(), 200);
    proxy.set_profile("64k").await.unwrap();
    d.wait_state(State::Draining, PATIENCE).await;
    let (status, _, v) = body_json(
        d.post("/slots/0?action=save", json!({"filename": "mine.bin"}))
            .await,
    )
    .await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "slots_managed", "{v}");
    drop(stream);
    d.wait_state(State::Ready, PATIENCE).await;
    assert_eq!(d.status().await["engine_profile"], "64k");
    assert!(
        !d.fake_log().contains("slot 0 save mine.bin"),
        "{}",
        d.fake_log()
    );
}

/// One that waits for an engine while the switch happens is judged against the engine that
/// serves it once it has its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_action_is_judged_by_the_engine_that_serves_it() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&switching_toward_checkpoints(&bus).knob("load_ms", "1500"));
    let proxy = live_proxy(&bus, &d).await;
    let request = async {
        body_json(
            d.post("/slots/0?action=save", json!({"filename": "mine.bin"}))
                .await,
        )
        .await
    };
    let switch = async {
        // It waits for the 320k engine it started to load (the state says so once it is a
        // waiter), and the switch gives it a 64k engine, which keeps checkpoints.
        d.wait_state(State::Starting, PATIENCE).await;
        proxy.set_profile("64k").await.unwrap();
    };
    let ((status, _, v), ()) = tokio::join!(request, switch);
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "slots_managed", "{v}");
    assert!(
        !d.fake_log().contains("slot 0 save mine.bin"),
        "{}",
        d.fake_log()
    );
    assert_eq!(d.status().await["engine_profile"], "64k");
}

/// The checkpoint folder and every file in it are private, whatever umask dsv4d is started
/// with: a folder that exists open to others is made private when it is dsv4d's user's, and
/// one of another user's is not used at all (a planted checkpoint would be restored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_folder_and_its_files_are_private() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
    let dir = temp_dir("daemon");
    let kv = dir.path().join("profiles/kv");
    std::fs::create_dir_all(&kv).unwrap();
    std::fs::set_permissions(&kv, std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .profile_key("320k", "kv_checkpoint", "{ dir: kv }")
        .wrapper(&["/bin/sh", "-c", "umask 000; exec \"$0\" \"$@\""]);
    s.default_profile = "320k".into();
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}");
    d.log_with(&["was open to group or others (mode 0777): made private (0700)"])
        .await;
    assert_eq!(mode(&kv), 0o700);
    let dir = d.stop().await;
    let files: Vec<std::path::PathBuf> = ["bin", "json"]
        .iter()
        .flat_map(|ext| files_with_extension(&kv, ext))
        .collect();
    assert!(files.len() >= 2, "{files:?}");
    for f in &files {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }

    // Another user's folder, open to others: neither restored from nor saved to.
    std::os::unix::fs::chown(&kv, Some(65534), None).expect("chown (the tests run as root)");
    std::fs::set_permissions(&kv, std::fs::Permissions::from_mode(0o755)).unwrap();
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let restore = kv_of(&d, "320k").await["last_restore"].clone();
    let why = restore["result"].as_str().unwrap_or_default().to_string();
    assert!(
        why.contains("is uid 65534's, not dsv4d's") && why.contains("chmod 700"),
        "{restore}"
    );
    assert_eq!(std::fs::metadata(&kv).unwrap().uid(), 65534);
    assert_eq!(mode(&kv), 0o755);
}

/// A request that arrives while the idle stop saves the KV cache calls the stop off: the
/// save ends and the same engine serves it, with no reload (54 s on the target machine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_during_the_idle_stops_save_is_served_by_the_same_engine() {
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .profile_key("320k", "kv_checkpoint", "{ dir: kv }")
        .knob("save_ms", "5000");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}");
    // The idle stop's save has begun (the engine takes 2 s over it).
    d.wait_fake_log("slot 0 save", PATIENCE).await;
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let st = d.status().await;
    assert_eq!(st["generation"], 1, "{st}");
    assert_eq!(d.spawns(), 1, "{}", d.log());
    assert!(!d.fake_log().contains("SIGTERM"), "{}", d.fake_log());
    // The save was kept.
    let saved = wait_saved(&d, "320k", PATIENCE).await;
    assert_eq!(saved["last_save"]["result"], "saved", "{saved}");
}

/// On the real llama-server: validating the active profile reuses its running engine, and
/// the user's checkpoint of a 2,800-token prompt is byte for byte the same afterwards; the
/// next start gives the user's prompt back (its `cache_n` covers it), not the benchmark's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validating_the_active_profile_keeps_the_users_checkpoint_on_the_real_engine() {
    let bus = PrivateBus::start();
    // Room for the suite's 4,096-token prefill beside what the user's prompt holds.
    let mut s = real_setup("10m").session_bus(&bus);
    let dir = temp_dir("daemon");
    let model = crate::validate::tiny_16k(dir.path());
    s.custom_profiles
        .insert("tiny".into(), real_profile(&model, 8192, "{ dir: kv }"));
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    let (_, _, prompt_n) = complete(&d, &long_prompt(), true).await;
    assert!(prompt_n > 2000, "{prompt_n}");
    let run = |args: &[&str]| {
        let out = ctl(&bus.address, args, None);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let stop = || run(&["stop"]);
    stop();
    d.wait_state(State::Stopped, PATIENCE).await;
    let kv = d.dir().join("profiles/kv");
    let users = files_in(&kv);
    assert!(users.keys().any(|n| n.ends_with(".bin")), "{users:?}");
    // The engine again (the user's cache restored), and the validation on it.
    complete(&d, "count 1", true).await;
    run(&["validate", "--profile", "tiny", "--runs", "1"]);
    stop();
    d.wait_state(State::Stopped, PATIENCE).await;
    assert_eq!(files_in(&kv), users, "the user's checkpoint changed");
    assert_prefix_kept(&d, prompt_n).await;
}
