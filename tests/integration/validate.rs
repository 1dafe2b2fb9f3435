//! `dsv4ctl validate`: the suite on the real llama-server and the tiny model, interrupted
//! runs that switch back and let waiting clients through, and `--compare` against an earlier
//! run with the fake engine made slower.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");

use crate::control::wait_bus_name;
use crate::support::real::engine;
use crate::support::*;
use dsv4_client::validate::{mean_sd, ValidationResult};
use serde_json::Value;

/// Runs dsv4ctl on `bus` (killed if it hangs).
pub(crate) fn ctl(bus: &PrivateBus, args: &[&str]) -> Output {
    Command::new(DSV4CTL)
        .args(["--bus", "session"])
        .args(args)
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .stdin(Stdio::null())
        .output_within(HANG)
}

pub(crate) fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The results the daemon kept, oldest first.
pub(crate) fn kept(d: &Daemon) -> Vec<ValidationResult> {
    let dir = d.dir().join("state/validations");
    let mut runs: Vec<ValidationResult> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap())
                .collect()
        })
        .unwrap_or_default();
    runs.sort_by(|a, b| a.started.total_cmp(&b.started));
    runs
}

/// The tiny model declaring a 16K training context (llama-server caps a slot's context at
/// it), so that a 4,096-token prompt fits.
pub(crate) fn tiny_16k(dir: &Path) -> std::path::PathBuf {
    let out = dir.join("tiny-16k.gguf");
    let python = crate::support::real::cache_dir().join("venv/bin/python");
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/make_tiny_gguf.py");
    let st = Command::new(&python)
        .arg(&generator)
        .arg(&out)
        .args(["--ctx", "16384"])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(st.success());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validate_runs_the_suite_cold_on_the_real_engine_and_switches_back() {
    let bus = PrivateBus::start();
    let (_, model) = engine();
    let dir = temp_dir("daemon");
    let model_16k = tiny_16k(dir.path());
    let profile = |model: &Path, context: u32| {
        let more = "kv_cache: f16\nbatch: 2048\nubatch: 512\n";
        crate::support::real::profile(model, context, more)
    };
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .session_bus(&bus);
    s.custom_profiles
        .insert("svc".into(), profile(&model, 4096));
    // A 64K-shaped validation profile, on the small model's scale.
    s.custom_profiles
        .insert("64k".into(), profile(&model_16k, 16384));
    s.default_profile = "svc".into();
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    // The service profile is running when the validation begins.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);

    let out = ctl(&bus, &["validate", "--runs", "3"]);
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{stderr}\n{}",
        d.log()
    );
    assert!(stderr.contains("decode run 3/3"), "{stderr}");
    let runs = kept(&d);
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!(r.profile, "64k");
    assert_eq!(r.previous_profile, "svc");
    assert!(r.error.is_none(), "{:?}", r.error);
    assert!(!r.engine_build.is_empty());
    assert!(!r.kernel.is_empty());
    assert_eq!(r.settings["context"], 16384);
    let names: Vec<&str> = r.tests.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["decode", "prefill"]);
    for t in &r.tests {
        assert_eq!(t.runs.len(), 3);
        assert_eq!(t.unit, "tok/s");
        // The table shows what the runs give, recomputed here.
        let (mean, sd) = mean_sd(&t.runs);
        assert!(
            (mean - t.mean).abs() < 1e-9 && (sd - t.sd).abs() < 1e-9,
            "{t:?}"
        );
        let row = format!("{:<14} {:>12.3} {:>10.3} {:>5}  tok/s", t.name, mean, sd, 3);
        assert!(stdout.contains(&row), "no `{row}` in\n{stdout}");
        for d in &t.details {
            assert_eq!(d.cache_n, 0, "a run was not cold: {d:?}");
            assert!(d.value > 0.0);
        }
    }
    for d in &r.tests[0].details {
        assert_eq!(d.predicted_n, 256, "{d:?}");
    }
    for d in &r.tests[1].details {
        assert_eq!(
            d.prompt_n, 4096,
            "the prefill prompt is not exactly 4,096 tokens"
        );
    }
    // The service profile is back, and serves.
    let st = d.status().await;
    assert_eq!(st["profile"], "svc", "{st}");
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(d.status().await["engine_profile"], "svc");

    // --json prints the result document.
    let out = ctl(&bus, &["--json", "validate", "--runs", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["profile"], "64k");
    assert_eq!(v["tests"][1]["name"], "prefill");
    assert_eq!(v["tests"][1]["runs"].as_array().unwrap().len(), 1);
    assert!(v["tests"][0]["telemetry"].is_object());
}

/// Fake-engine profiles: `320k` (the service) and `64k` (validation; decode at `token_ms`
/// per token, prefill 200 ms).
pub(crate) fn fake_setup(bus: &PrivateBus, token_ms: &str) -> Setup {
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .session_bus(bus);
    let knobs = s.profiles.get_mut("64k").unwrap();
    knobs.insert("token_ms", token_ms.to_string());
    knobs.insert("prefill_ms", "200".to_string());
    s
}

/// Runs `dsv4ctl validate ARGS` in a thread.
pub(crate) fn validate_in_background(
    bus: &PrivateBus,
    args: &[&str],
) -> std::thread::JoinHandle<Output> {
    let address = bus.address.clone();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    std::thread::spawn(move || {
        Command::new(DSV4CTL)
            .args(["--bus", "session", "validate"])
            .args(&args)
            .env("DBUS_SESSION_BUS_ADDRESS", address)
            .output_within(HANG)
    })
}

pub(crate) async fn wait_log(d: &Daemon, needle: &str, within: Duration) {
    let t = Instant::now();
    while !d.log().contains(needle) {
        assert!(t.elapsed() < within, "no `{needle}` in\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_validation_switches_back_and_the_waiting_client_is_served() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&fake_setup(&bus, "20"));
    wait_bus_name(&d, &bus).await;
    let run = validate_in_background(&bus, &["--runs", "3"]);
    wait_log(&d, "validation: decode run 1/3", PATIENCE).await;
    // A client request during the run waits for it.
    let addr = d.addr;
    let client = tokio::task::spawn_blocking(move || chat_on_fresh_connection(addr));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !client.is_finished(),
        "the client was served during the validation"
    );
    let out = ctl(&bus, &["stop", "--now"]);
    assert_eq!(out.status.code(), Some(0));
    let out = run.join().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("the validation ended early"), "{stderr}");
    assert!(stderr.contains("the engine went away"), "{stderr}");
    assert!(stderr.contains("profile 320k is active again"), "{stderr}");
    assert_eq!(client.await.unwrap(), Ok(200));
    let st = d.status().await;
    assert_eq!(st["profile"], "320k");
    assert_eq!(st["engine_profile"], "320k", "{st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validation_whose_engine_crashes_switches_back_and_exits_1() {
    let bus = PrivateBus::start();
    let mut s = fake_setup(&bus, "1");
    s.profiles
        .get_mut("64k")
        .unwrap()
        .insert("die_after_tokens", "300".to_string());
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus, &["validate", "--runs", "3"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("decode run 2: the engine went away"),
        "{stderr}"
    );
    assert_eq!(d.status().await["profile"], "320k");
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    // The run is kept with the tests it finished and the reason.
    let r = kept(&d).pop().unwrap();
    assert!(r.error.unwrap().contains("decode run 2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_last_flags_a_slower_engine_and_passes_an_unchanged_one() {
    let bus = PrivateBus::start();
    let s = fake_setup(&bus, "2");
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus, &["validate", "--runs", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // The same engine with decode twice as slow.
    let dir = d.stop().await;
    let slow = fake_setup(&bus, "4");
    let d = Daemon::start_in(&slow, dir);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus, &["validate", "--runs", "3", "--compare", "last"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("slower than the earlier run beyond the noise: decode"),
        "{stderr}"
    );
    let decode = stdout
        .lines()
        .find(|l| l.starts_with("decode") && l.contains("->"))
        .unwrap_or_else(|| panic!("no comparison in\n{stdout}\n{stderr}"));
    assert!(decode.contains("SLOWER"), "{stdout}");
    let prefill = stdout
        .lines()
        .find(|l| l.starts_with("prefill") && l.contains("->"))
        .unwrap_or_else(|| panic!("no comparison in\n{stdout}\n{stderr}"));
    assert!(prefill.ends_with("ok"), "{stdout}");
    // Unchanged against that slow run: passes.
    let out = ctl(&bus, &["validate", "--runs", "3", "--compare", "last"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    // A result file works as well.
    let file = kept(&d).pop().unwrap().file.unwrap();
    let out = ctl(&bus, &["validate", "--runs", "3", "--compare", &file]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("compared with the run of 64k"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_during_a_validation_comes_back_on_the_previous_profile() {
    let bus = PrivateBus::start();
    let s = fake_setup(&bus, "20");
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let run = validate_in_background(&bus, &["--runs", "3"]);
    wait_log(&d, "validation: decode run 1/3", PATIENCE).await;
    let dir = d.kill_and_keep_dir().await;
    // Another dsv4d takes the name at once: the waiting dsv4ctl must not wait for ever for
    // a result this one will never send.
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    let out = run.join().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("dsv4d went away during the validation"),
        "{stderr}"
    );
    assert_eq!(d.status().await["profile"], "320k", "{}", d.log());
    d.log_with(&["a validation did not finish"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_with_mmproj_gets_the_vision_tests() {
    let bus = PrivateBus::start();
    let s = fake_setup(&bus, "1").profile_key("64k", "mmproj", "models/64k.gguf");
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let out = ctl(&bus, &["--json", "validate", "--runs", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let r: ValidationResult = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = r.tests.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["decode", "prefill", "vision_prefill", "vision_decode"]
    );
    // The image went in: its tokens are in the prompt, and the decode ran its 256 tokens.
    for d in &r.tests[2].details {
        assert!(d.prompt_n >= 256, "{d:?}");
    }
    for d in &r.tests[3].details {
        assert_eq!(d.predicted_n, 256, "{d:?}");
    }
    let log = d.fake_log();
    assert!(
        log.lines()
            .filter(|l| l.contains("request POST /v1/chat/completions"))
            .count()
            >= 4,
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validation_leaves_the_kv_checkpoints_alone() {
    let bus = PrivateBus::start();
    let s = fake_setup(&bus, "1")
        .profile_key("320k", "kv_checkpoint", "{ dir: kv }")
        .profile_key("64k", "kv_checkpoint", "{ dir: kv }");
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    // The service engine serves, then the validation switches away from it.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let out = ctl(&bus, &["validate", "--runs", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let kv = d.status().await["kv"]["profiles"].clone();
    let of = |name: &str| {
        kv.as_array()
            .unwrap()
            .iter()
            .find(|p| p["profile"] == name)
            .cloned()
            .unwrap()
    };
    // The service profile's cache was saved at the switch; the validation engine neither
    // restored nor saved one.
    assert_eq!(of("320k")["last_save"]["result"], "saved", "{kv}");
    assert!(of("64k")["last_save"].is_null(), "{kv}");
    assert!(of("64k")["last_restore"].is_null(), "{kv}");
    assert!(of("64k")["checkpoint"].is_null(), "{kv}");
}

/// Validating the active profile while its engine runs reuses that engine: it must never save
/// its KV cache afterwards (its slots hold the benchmark's prompts), so the user's checkpoint
/// is byte for byte what it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validating_the_running_profile_never_replaces_its_checkpoint() {
    let bus = PrivateBus::start();
    let mut s = fake_setup(&bus, "1").profile_key("320k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    // The user's checkpoint, made by a planned stop.
    let out = ctl(&bus, &["stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    d.wait_state(dsv4_client::State::Stopped, PATIENCE).await;
    let kv = d.dir().join("profiles/kv");
    let users = files_in(&kv);
    assert!(users.keys().any(|n| n.ends_with(".json")), "{users:?}");
    // The engine serves again (restoring it), and the validation begins on that same engine.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200);
    let generation = d.status().await["generation"].clone();
    let out = ctl(&bus, &["validate", "--profile", "320k", "--runs", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // Three restarts, the load test's cold one and its two after an idle stop; no engine
    // touched the checkpoint.
    let after = d.status().await["generation"].as_u64();
    assert_eq!(after, generation.as_u64().map(|g| g + 3));
    // Its stop saves nothing: the folder is as the user's stop left it.
    let out = ctl(&bus, &["stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    d.wait_state(dsv4_client::State::Stopped, PATIENCE).await;
    assert_eq!(files_in(&kv), users);
    d.log_with(&["a validation runs on this engine: it will not save its KV cache"])
        .await;
}

/// Requests that already wait for an engine when a validation begins (here, during a cold
/// start of the service profile) are never served by the validation's engine: they wait, and
/// the service profile answers them once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_when_a_validation_begins_get_the_service_profile() {
    let bus = PrivateBus::start();
    let mut s = fake_setup(&bus, "1");
    s.profiles
        .get_mut("320k")
        .unwrap()
        .insert("load_ms", "1500".to_string());
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let requests = async {
        futures_util::future::join_all((0..3).map(|_| async {
            body_json(d.post("/v1/chat/completions", chat(2, false)).await).await
        }))
        .await
    };
    let validation = async {
        // Once the three wait for the service engine's cold start.
        let t = Instant::now();
        while d.status().await["waiting"] != 3 {
            assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let run = validate_in_background(&bus, &["--runs", "1"]);
        tokio::task::spawn_blocking(move || run.join().unwrap())
            .await
            .unwrap()
    };
    let (answers, out) = tokio::join!(requests, validation);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    for (status, _, v) in answers {
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], "320k.gguf", "{v}");
    }
    // The load test's stop and cold start, in between, kept them waiting, not refused.
    let load = kept(&d).pop().unwrap().load.unwrap();
    assert!(load.cold_seconds > 0.0, "{load:?}");
}

/// A ds4-server profile (the fake engine in its ds4 mode: the OpenAI API only, no timings,
/// no tokenizer) is validated from streamed completions: the decode rate from the time
/// between its first and last tokens, the prefill rate from the time to the first, the
/// counts from its `usage`, and a prefill prompt within 2% of the tokens asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ds4_profile_is_validated_from_its_stream() {
    let bus = PrivateBus::start();
    let mut s = Setup::default()
        .ds4()
        .engine("idle_timeout", "10m")
        .session_bus(&bus);
    let knobs = s.profiles.get_mut("64k").unwrap();
    knobs.insert("token_ms", "5".to_string());
    knobs.insert("prefill_ms", "100".to_string());
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    let out = ctl(
        &bus,
        &["--json", "validate", "--runs", "2", "--long", "2000"],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        text(&out.stderr),
        d.log()
    );
    let r: ValidationResult = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = r.tests.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["decode", "prefill", "long_prefill"]);
    // 256 tokens 5 ms apart: about 200 tok/s. A loaded machine slows it, and can deliver
    // the first chunks late and together, which shortens the span they are timed over:
    // only the order of magnitude is asserted.
    for run in &r.tests[0].details {
        assert_eq!(run.predicted_n, 256, "{run:?}");
        assert!(run.value > 20.0 && run.value < 2000.0, "decode {run:?}");
    }
    for (test, asked) in [(&r.tests[1], 4096.0), (&r.tests[2], 2000.0)] {
        for run in &test.details {
            let n = run.prompt_n as f64;
            assert!((n - asked).abs() <= asked * 0.02, "{} {run:?}", test.name);
            // The prompt in 100 ms at the fastest.
            assert!(run.value > 0.0 && run.value <= n * 10.0 * 1.01, "{run:?}");
        }
    }
    // Only what ds4-server serves was asked for.
    let log = d.fake_log();
    let asked: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("request "))
        .collect();
    assert!(
        asked.iter().any(|l| l.starts_with("POST /v1/completions")),
        "{log}"
    );
    for l in &asked {
        assert!(
            !l.starts_with("POST /completion ") && !l.contains("/tokenize"),
            "{l}"
        );
    }
    assert_eq!(d.status().await["profile"], "320k");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_test_reports_joules_per_token_and_where_the_power_was_read() {
    let bus = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let hwmon = tree
        .path()
        .join("sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0/hwmon/hwmon3");
    let s = fake_setup(&bus, "10")
        .args(&["--sysroot", tree.path().to_str().unwrap()])
        .top_level("monitor", "{ interval: 200ms, idle_interval: 200ms }");
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    for (file, watts, source) in [
        ("power1_average", 85.0, "power1_average"),
        // A driver without the average: the instant reading, named so.
        ("power1_input", 61.0, "power1_input"),
    ] {
        if file == "power1_input" {
            std::fs::remove_file(hwmon.join("power1_average")).unwrap();
        }
        std::fs::write(hwmon.join(file), format!("{}\n", (watts * 1e6) as u64)).unwrap();
        let out = ctl(&bus, &["--json", "validate", "--runs", "2"]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let r: ValidationResult = serde_json::from_slice(&out.stdout).unwrap();
        // Decode runs for seconds: the monitor's samples cover it.
        let decode = &r.tests[0];
        assert_eq!(decode.name, "decode");
        assert_eq!(decode.telemetry.soc_power_mean_w, Some(watts), "{decode:?}");
        for t in &r.tests {
            let m = &t.telemetry;
            let Some(w) = m.soc_power_mean_w else {
                continue;
            };
            let j = m.joules_per_token.expect("a power figure and no J/token");
            assert!((j - w / t.mean).abs() < 1e-9, "{t:?}");
            let shown = serde_json::to_value(m.soc_power_source).unwrap();
            assert_eq!(shown, source, "{t:?}");
        }
        // The table says it too.
        let out = ctl(&bus, &["validate", "--runs", "1"]);
        let table = text(&out.stdout);
        assert!(table.contains(&format!("W ({source})")), "{table}");
        assert!(table.contains(" J/token"), "{table}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_load_is_timed_warm_then_with_the_model_dropped_from_the_page_cache() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&fake_setup(&bus, "1"));
    wait_bus_name(&d, &bus).await;
    // A model of 8 MiB, read once: in the page cache when the validation begins.
    let model = d.dir().join("profiles/models/64k.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.resize(8 << 20, 0);
    std::fs::write(&model, &bytes).unwrap();
    std::fs::File::open(&model).unwrap().sync_all().unwrap();
    let _ = std::fs::read(&model).unwrap();
    let spawns = d.spawns();

    let out = ctl(&bus, &["validate", "--runs", "1"]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    let r = kept(&d).pop().unwrap();
    let load = r.load.expect("no load test in the result");
    assert!(load.warm_seconds > 0.0, "{load:?}");
    assert!(load.cold_seconds > 0.0, "{load:?}");
    assert_eq!(load.files, [model.display().to_string()]);
    assert_eq!(load.bytes, 8 << 20);
    assert!(load.method.contains("llama.cpp's default mmap"), "{load:?}");
    // The cold load began with the model out of the page cache.
    assert!(
        load.cached_before_cold < load.cached_before_warm,
        "{load:?}"
    );
    // The fake engine reads nothing of its model: its run leaves none of it in the page
    // cache for the start after an idle stop, and the prewarm reads all of it back before
    // the last start, as it was before the test (fincore says so, not dsv4d).
    assert_eq!(load.cached_after_stop, Some(0), "{load:?}");
    assert_eq!(load.read_back, 8 << 20, "{load:?}");
    assert_eq!(load.cached_after_prewarm, Some(8 << 20), "{load:?}");
    assert!(load.after_stop_seconds.is_some_and(|s| s > 0.0), "{load:?}");
    assert!(load.prewarmed_seconds.is_some_and(|s| s > 0.0), "{load:?}");
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("engine.prewarm before it: read 8.0 MiB of 8.0 MiB"),
        "{stderr}"
    );
    // fincore says so too, once the validation is over: all of it, but for the few pages
    // the kernel may have taken back meanwhile (tests beside this one read hundreds of MiB;
    // 17 of its 2,048 pages were seen gone once).
    let resident = fincore(&model);
    assert!(
        resident >= load.cached_before_warm / 10 * 9,
        "the model is not back in the page cache ({resident} bytes): {load:?}"
    );
    // The switch's start, the cold one, and the two after an idle stop: four engines of the
    // validation profile.
    assert_eq!(d.spawns(), spawns + 4, "{load:?}");
    assert!(
        stdout.contains(&format!(
            "after an idle stop: {} as the engine's run left the page cache (0 B cached), {} \
             with engine.prewarm (8.0 MiB read, 8.0 MiB cached)",
            dsv4_client::duration::brief_secs(load.after_stop_seconds.unwrap()),
            dsv4_client::duration::brief_secs(load.prewarmed_seconds.unwrap()),
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!(
            "load: {} with the page cache as it was",
            dsv4_client::duration::brief_secs(load.warm_seconds)
        )),
        "{stdout}"
    );
    d.log_with(&["load after 8.0 MiB dropped from the page cache"])
        .await;
}

/// MiB of padding in the model of the cold-load test: enough that reading it from the disk
/// takes clearly longer than mapping it from the page cache, also with every core busy. On
/// a 2-core VM whose virtio disk reads about 2 GB/s, with both cores kept busy: warm
/// 0.16-0.32 s, cold 0.49-0.71 s (with 384 MiB, warm 0.29 s and cold 0.36 s in one run).
pub(crate) const PAD_MIB: u32 = 768;

/// The tiny model with `mib` MiB more weights (the generator's `--pad-mib`), kept in the
/// engine cache beside the tiny model and made again when the generator changes. The cache
/// is on the disk, not a tmpfs: a tmpfs file's pages are the file, and no advice drops them.
pub(crate) fn padded_model(mib: u32) -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    let dir = crate::support::real::cache_dir().join("models");
    let out = dir.join(format!("tiny-pad-{mib}mib.gguf"));
    let stamp = dir.join(format!("tiny-pad-{mib}mib.gguf.stamp"));
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/make_tiny_gguf.py");
    let text = std::fs::read(&generator).unwrap();
    // The hash only has to notice a change of the generator.
    let mut hasher = std::hash::DefaultHasher::new();
    text.hash(&mut hasher);
    let want = format!("make_tiny_gguf.py {:016x} --pad-mib {mib}", hasher.finish());
    if out.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return out;
    }
    // Written beside, then renamed: a run cut short leaves no half model.
    std::fs::create_dir_all(&dir).unwrap();
    let tmp = dir.join(format!("tiny-pad-{mib}mib.gguf.tmp.{}", std::process::id()));
    let python = crate::support::real::cache_dir().join("venv/bin/python");
    let st = Command::new(&python)
        .arg(&generator)
        .arg(&tmp)
        .args(["--pad-mib", &mib.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    if !st.success() {
        let _ = std::fs::remove_file(&tmp);
        panic!("make_tiny_gguf.py --pad-mib {mib} failed ({st})");
    }
    // On the disk before it is used: the kernel drops only clean pages from the cache.
    std::fs::File::open(&tmp).unwrap().sync_all().unwrap();
    std::fs::rename(&tmp, &out).unwrap();
    std::fs::write(&stamp, want).unwrap();
    out
}

/// Reads `path` to its end, so that its pages are in the page cache.
pub(crate) fn read_through(path: &Path) {
    use std::io::Read;
    let mut file = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    while file.read(&mut buf).unwrap() > 0 {}
}

/// On the real engine and a model of a few hundred MiB on the disk, the load after the model
/// was dropped from the page cache takes longer than the one that found it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_load_of_a_large_model_takes_longer_than_a_warm_one() {
    let bus = PrivateBus::start();
    let (_, tiny) = engine();
    let model = padded_model(PAD_MIB);
    let len = std::fs::metadata(&model).unwrap().len();
    // llama.cpp's default: the model mapped, and the whole mapping filled at load
    // (MAP_POPULATE), so the load reads every byte and the warm one only maps the cached
    // pages. Its copy into memory (`--load-mode none`, once `--no-mmap`) costs a VM as much
    // CPU as the disk costs time, and its warm and cold figures cross.
    let big = crate::support::real::profile(&model, 1024, "");
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .session_bus(&bus);
    s.custom_profiles
        .insert("svc".into(), crate::support::real::profile(&tiny, 1024, ""));
    s.custom_profiles.insert("64k".into(), big);
    s.default_profile = "svc".into();
    let d = Daemon::start(&s);
    wait_bus_name(&d, &bus).await;
    // Read once: all in the page cache when the validation begins, so the first load is warm.
    read_through(&model);

    let out = ctl(&bus, &["validate", "--runs", "1", "--prefill", "64"]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}\n{}",
        text(&out.stderr),
        d.log()
    );
    let load = kept(&d)
        .pop()
        .unwrap()
        .load
        .expect("no load test in the result");
    eprintln!(
        "load of {} MiB: warm {:.3} s ({} MiB cached before), cold {:.3} s ({} MiB cached before)",
        len >> 20,
        load.warm_seconds,
        load.cached_before_warm >> 20,
        load.cold_seconds,
        load.cached_before_cold >> 20
    );
    assert_eq!(load.files, [model.display().to_string()]);
    assert_eq!(load.bytes, len);
    assert!(load.method.contains("llama.cpp's default mmap"), "{load:?}");
    // The warm load found the file in the page cache, and the cold one did not: the drop
    // worked, which it does not on a tmpfs.
    assert!(load.cached_before_warm >= len / 10 * 9, "{load:?}");
    assert!(
        load.cached_before_cold <= len / 10,
        "the page cache kept the model (is {} on a tmpfs?): {load:?}",
        model.display()
    );
    assert!(load.cold_seconds > load.warm_seconds, "{load:?}");
    // llama.cpp's mmap reads through the page cache: the cold load's run left the model
    // there for the start after an idle stop, and the prewarm found it all.
    let left = load.cached_after_stop.expect("no start after an idle stop");
    assert!(left >= len / 10 * 9, "{load:?}");
    assert!(load.read_back <= len / 10, "{load:?}");
    assert!(
        load.cached_after_prewarm.unwrap() >= len / 10 * 9,
        "{load:?}"
    );
}
