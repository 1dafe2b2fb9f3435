//! The monitor end to end: `dsv4d --sysroot` on a copy of the Strix Halo fixture tree, changed
//! while the daemon runs; `/metrics`, `/status` and the per-request figures follow it. And a
//! bare tree (a machine without an AMD GPU): the daemon serves and reports the hardware absent.

use std::time::{Duration, Instant};

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);
const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

fn sampled(sysroot: &std::path::Path) -> Setup {
    Setup::default()
        .args(&["--sysroot", sysroot.to_str().unwrap()])
        .top_level("monitor", "{ interval: 200ms, idle_interval: 200ms }")
}

async fn metrics(d: &Daemon) -> String {
    let (status, headers, body) = d.send("GET", "/metrics", &[], None).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"),
        "{headers:?}"
    );
    body.as_str().unwrap().to_string()
}

/// Waits until `/metrics` has the line `line`; how long it took.
async fn wait_metric(d: &Daemon, line: &str, within: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let text = metrics(d).await;
        if text.lines().any(|l| l == line) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < within,
            "no {line:?} within {within:?}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_the_hardware_within_two_intervals() {
    let tree = fixture_copy("strix-halo");
    let dev = tree.path().join(DEVICE);
    let d = Daemon::start(&sampled(tree.path()));
    wait_metric(&d, "dsv4_gtt_used_bytes 644874240.0", PATIENCE).await;
    for line in [
        "dsv4_gtt_total_bytes 120259084288.0",
        "dsv4_memory_available_bytes 120844845056.0",
        "dsv4_swap_free_bytes 8589930496.0",
        "dsv4_temperature_celsius{sensor=\"edge\"} 73.0",
        "dsv4_temperature_celsius{sensor=\"tctl\"} 74.25",
        "dsv4_power_watts{source=\"soc\"} 69.6",
        "dsv4_gpu_busy_ratio 0.97",
        "dsv4_memory_pressure_ratio{kind=\"some\"} 0.0125",
        "dsv4_throttle_seconds_total{kind=\"thermal\"} 0.0",
        "dsv4_throttling 0.0",
    ] {
        let text = metrics(&d).await;
        assert!(text.lines().any(|l| l == line), "missing {line:?}:\n{text}");
    }
    // The engine loads: GTT grows, it warms up.
    std::fs::write(dev.join("mem_info_gtt_used"), "87389609984\n").unwrap();
    std::fs::write(dev.join("hwmon/hwmon3/temp1_input"), "78500\n").unwrap();
    let took = wait_metric(&d, "dsv4_gtt_used_bytes 87389609984.0", PATIENCE).await;
    // Two 200 ms intervals, and room for a loaded machine's scheduling and this loop's polls
    // (an idle_interval taken for the interval would be a minute).
    assert!(
        took <= Duration::from_millis(400) + LOAD_MARGIN,
        "{took:?} for two 200 ms intervals"
    );
    wait_metric(
        &d,
        "dsv4_temperature_celsius{sensor=\"edge\"} 78.5",
        PATIENCE,
    )
    .await;

    // A thermal residency counter rises: throttle seconds go up.
    let metrics_file = dev.join("gpu_metrics");
    let mut blob = std::fs::read(&metrics_file).unwrap();
    for bump in 4u32..10 {
        blob[248..252].copy_from_slice(&bump.to_le_bytes());
        std::fs::write(&metrics_file, &blob).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let text = metrics(&d).await;
    let seconds: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("dsv4_throttle_seconds_total{kind=\"thermal\"} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!((0.6..=1.6).contains(&seconds), "{seconds}\n{text}");
    // /status shows the same sample.
    let status = d.status().await;
    let t = &status["telemetry"];
    assert_eq!(t["gpu"]["gtt_used"], 87389609984u64, "{status}");
    assert_eq!(t["temperatures"]["edge"], 78.5);
    assert_eq!(t["throttle"]["supported"], true);
    assert!(
        t["throttle"]["seconds"]["thermal"].as_f64().unwrap() > 0.5,
        "{t}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_records_what_its_span_cost() {
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(&sampled(tree.path()).knob("token_ms", "100"));
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(8, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    let s = d.status().await;
    let r = &s["requests"]["recent"][0]["resources"];
    assert!(r["samples"].as_u64().unwrap() >= 2, "{s}");
    assert_eq!(r["edge_max_c"], 73.0, "{r}");
    assert_eq!(r["edge_mean_c"], 73.0, "{r}");
    assert_eq!(r["soc_power_mean_w"], 69.6, "{r}");
    assert_eq!(r["gtt_peak_bytes"], 644874240u64, "{r}");
    assert_eq!(r["throttle_seconds"], 0.0, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_bare_machine_the_daemon_serves_and_reports_the_hardware_absent() {
    let d = Daemon::start(&sampled(&fixture_tree("bare")));
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    // A sample taken while the engine runs (it stays up for its idle timeout).
    let t = Instant::now();
    let s = loop {
        let s = d.status().await;
        if !s["telemetry"]["engine"].is_null() {
            break s;
        }
        assert!(t.elapsed() < PATIENCE, "{s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let tel = &s["telemetry"];
    for group in ["memory", "pressure", "gpu"] {
        assert!(tel[group].is_null(), "{group}: {tel}");
    }
    assert!(tel["temperatures"]["edge"].is_null(), "{tel}");
    assert_eq!(tel["throttle"]["supported"], false);
    // The engine's own process is still measured, from the real /proc.
    let engine = &tel["engine"];
    assert_eq!(engine["pid"], s["engine_pid"], "{s}");
    assert!(engine["rss_bytes"].as_u64().unwrap() > 0, "{tel}");
    let text = metrics(&d).await;
    assert!(!text.contains("dsv4_gtt_used_bytes"), "{text}");
    assert!(!text.contains("dsv4_temperature_celsius{"), "{text}");
    assert!(
        text.contains("dsv4_engine_state{state=\"ready\"} 1"),
        "{text}"
    );
    let log = d.log();
    assert!(!log.contains("panicked"), "{log}");
}

/// Sets `MemAvailable` in a fixture tree's meminfo.
fn set_available(tree: &std::path::Path, gib: u64) {
    let path = tree.join("proc/meminfo");
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = text
        .lines()
        .map(|l| {
            if l.starts_with("MemAvailable:") {
                format!("MemAvailable:   {} kB\n", gib << 20)
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(path, text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_does_not_fit_in_memory_is_refused_with_its_figures() {
    let bus = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    set_available(tree.path(), 52);
    let d = Daemon::start(&sampled(tree.path()).session_bus(&bus).profile_key(
        "320k",
        "planned_memory",
        "87.82GiB",
    ));
    let mut alerts = alert_stream(&bus, &d).await;
    let (status, headers, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "insufficient_memory", "{v}");
    assert_eq!(
        v["error"]["message"],
        "not enough memory to start profile 320k: it needs 87.8 GiB (planned_memory), 52.0 GiB \
         is available, and memory.reserve keeps 8.0 GiB free; nothing was started, and the next \
         request tries again"
    );
    assert_eq!(headers["retry-after"], "10");
    assert_eq!(d.spawns(), 0, "{}", d.fake_log());
    let alert = tokio::time::timeout(PATIENCE, futures_util::StreamExt::next(&mut alerts))
        .await
        .expect("an Alert")
        .unwrap();
    let args = alert.args().unwrap();
    assert_eq!(args.kind, dsv4_client::AlertKind::Memory);
    assert!(
        args.message.contains("52.0 GiB is available"),
        "{}",
        args.message
    );
    // More refused requests: refused alike, but alerted once a minute at most.
    for _ in 0..3 {
        let (status, _, _) = d
            .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
            .await;
        assert_eq!(status, 503);
    }
    let again = tokio::time::timeout(SEC / 2, futures_util::StreamExt::next(&mut alerts)).await;
    assert!(again.is_err(), "another alert for the same refusal");
    // Not a failed start: no backoff, the state stays stopped.
    let s = d.status().await;
    assert_eq!(s["state"], dsv4_client::State::Stopped.as_str(), "{s}");
    assert_eq!(s["failures"], 0, "{s}");

    // Memory freed: the next request starts the engine.
    set_available(tree.path(), 110);
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(d.spawns(), 1);
}

/// A profile without `planned_memory` is charged the estimate from its files, and what is
/// available leaves the CMA area out: a 60 GiB model on a box with 110 GiB available, 60 of
/// them CMA, is refused, and says both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_planned_memory_the_estimate_is_charged_against_memory_less_cma() {
    let bus = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    set_available(tree.path(), 110);
    let meminfo = tree.path().join("proc/meminfo");
    let text = std::fs::read_to_string(&meminfo).unwrap();
    std::fs::write(
        &meminfo,
        format!("{text}CmaTotal: {0} kB\nCmaFree: {0} kB\n", 60u64 << 20),
    )
    .unwrap();
    let d = Daemon::start(&sampled(tree.path()).session_bus(&bus));
    // The fake engine's model, made as large as 60 GiB of weights (sparse).
    let model = d.dir().join("profiles/models/320k.gguf");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&model)
        .unwrap()
        .set_len(60 << 30)
        .unwrap();
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "insufficient_memory", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "not enough memory to start profile 320k: it needs 60.0 GiB (estimated from its \
             files and flags; set planned_memory to override), 50.0 GiB is available"
        ),
        "{message}"
    );
    assert_eq!(d.spawns(), 0, "{}", d.fake_log());
}

/// An engine started on a fixture copy, with a 1 s `memory.return_timeout`, and the stop to
/// call once the test has changed the tree: what it returns is the first alert within `wait`.
struct Returning {
    tree: TempDir,
    d: Daemon,
    alerts: dsv4_client::AlertStream,
    proxy: dsv4_client::Supervisor1Proxy<'static>,
    _bus: PrivateBus,
}

impl Returning {
    async fn start() -> Returning {
        let bus = PrivateBus::start();
        let tree = fixture_copy("strix-halo");
        let d = Daemon::start(
            &sampled(tree.path())
                .session_bus(&bus)
                .top_level("memory", "{ reserve: 8GiB, return_timeout: 1s }"),
        );
        let alerts = alert_stream(&bus, &d).await;
        let proxy = live_proxy(&bus, &d).await;
        proxy.start_and_wait().await.unwrap();
        Returning {
            tree,
            d,
            alerts,
            proxy,
            _bus: bus,
        }
    }

    async fn stop(mut self, wait: Duration) -> Option<(dsv4_client::AlertKind, String)> {
        self.proxy.stop().await.unwrap();
        let got = tokio::time::timeout(wait, futures_util::StreamExt::next(&mut self.alerts)).await;
        let alert = got.ok().flatten()?;
        let args = alert.args().unwrap();
        Some((args.kind, args.message.to_string()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_that_does_not_come_back_after_a_stop_raises_an_alert() {
    let r = Returning::start().await;
    // The engine "holds" 81 GiB of GTT, and keeps it after it exits.
    let gtt = r.tree.path().join(DEVICE).join("mem_info_gtt_used");
    std::fs::write(gtt, "87389609984\n").unwrap();
    let log = r.d.log();
    let (kind, message) = r
        .stop(PATIENCE)
        .await
        .unwrap_or_else(|| panic!("no Alert\n{log}"));
    assert_eq!(kind, dsv4_client::AlertKind::Memory);
    assert!(
        message.contains("did not come back within 1s")
            && message.contains("GTT in use is 81.4 GiB, 0.6 GiB before it started"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_that_comes_back_raises_no_alert() {
    let r = Returning::start().await;
    if let Some((_, message)) = r.stop(2 * SEC).await {
        panic!("an alert: {message}");
    }
}

/// amdgpu frees a process's GTT some time after the process is gone. Here the fixture's GTT
/// use drops 2 s after the old engine has exited: the profile switch's start waits for it,
/// and the request that came meanwhile is served, with no 503 and no alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switch_waits_for_the_old_engines_gtt_to_come_back() {
    let bus = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(
        &sampled(tree.path())
            .session_bus(&bus)
            .profile_key("320k", "planned_memory", "60GiB")
            .profile_key("64k", "planned_memory", "60GiB"),
    );
    let mut alerts = alert_stream(&bus, &d).await;
    let proxy = live_proxy(&bus, &d).await;
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    let old = d.status().await["engine_pid"].as_u64().unwrap();
    // The engine holds 81.4 GiB of the 112 GiB of GTT: 60 GiB more would not fit.
    let gtt = tree.path().join(DEVICE).join("mem_info_gtt_used");
    let before = std::fs::read_to_string(&gtt).unwrap();
    replace_file(&gtt, "87389609984\n");
    proxy.set_profile("64k").await.unwrap();
    let freed = tokio::spawn(async move {
        let proc = std::path::PathBuf::from(format!("/proc/{old}"));
        let t = Instant::now();
        while proc.exists() {
            assert!(t.elapsed() < PATIENCE, "engine {old} never exited");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(2 * SEC).await;
        replace_file(&gtt, &before);
        Instant::now()
    });
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let freed_at = freed.await.unwrap();
    assert_eq!(d.spawns(), 2);
    let s = d.status().await;
    assert_eq!(s["engine_profile"], "64k", "{s}");
    // The new engine was spawned after the GTT came back, not on the figures at the exit.
    let log = d
        .log_with(&["the start waits for the last engine's memory to come back"])
        .await;
    assert!(!log.contains("not enough GPU memory"), "{log}");
    assert!(freed_at.elapsed() < PATIENCE);
    let alert = tokio::time::timeout(SEC, futures_util::StreamExt::next(&mut alerts)).await;
    if let Ok(Some(a)) = alert {
        panic!("an alert: {:?}", a.args().unwrap().message);
    }
}

/// The GPU firmware can stall a `gpu_metrics` read. With a FIFO in its place, whose read
/// never returns, a stream keeps flowing and `/health` answers within 50 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hardware_read_that_hangs_stalls_no_stream_and_no_health_check() {
    use http_body_util::BodyExt;
    let tree = fixture_copy("strix-halo");
    let metrics = tree.path().join(DEVICE).join("gpu_metrics");
    std::fs::remove_file(&metrics).unwrap();
    nix::unistd::mkfifo(&metrics, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let d = Daemon::start(&sampled(tree.path()).knob("token_ms", "20"));
    // The sampler is held in that read (the daemon says so after 5 s).
    d.log_with(&["a hardware read has not returned for 5s"])
        .await;
    let resp = d.post("/v1/chat/completions", chat(100, true)).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    // Frames, not events, are counted for the pacing: dsv4d joins events that arrive
    // together into one frame, so under load there are fewer frames than events.
    let (mut frames, mut health, mut bytes) = (0, Vec::new(), Vec::new());
    while let Some(frame) = tokio::time::timeout(PATIENCE, body.frame())
        .await
        .expect("the stream stalled")
    {
        if let Ok(data) = frame.unwrap().into_data() {
            bytes.extend_from_slice(&data);
        }
        frames += 1;
        if frames % 5 == 0 {
            let t = Instant::now();
            let (status, _) = d.get("/health").await;
            health.push(t.elapsed());
            assert_eq!(status, 200);
        }
    }
    let text = String::from_utf8_lossy(&bytes);
    let events = text.matches("data: ").count();
    assert!(events >= 100, "{events} events in {frames} frames:\n{text}");
    assert!(text.contains("data: [DONE]"), "{text}");
    health.sort();
    let median = health[health.len() / 2];
    let max = *health.last().unwrap();
    assert!(median < Duration::from_millis(50), "{health:?}");
    assert!(max < Duration::from_millis(50) + LOAD_MARGIN, "{health:?}");
    // Still held: nothing read it meanwhile.
    assert!(
        !d.log().contains("the hardware read returned"),
        "{}",
        d.log()
    );
}

/// A Strix Halo set to a 96 GiB VRAM carve-out in its BIOS: 32 GiB of system RAM left (25 GiB
/// available), 16 GiB of GTT. The model lives in VRAM: admission and `/status` count VRAM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_large_vram_carve_out_admission_and_status_count_vram() {
    let tree = fixture_copy("strix-halo");
    let dev = tree.path().join(DEVICE);
    let gib = |n: u64| format!("{}\n", n << 30);
    replace_file(&dev.join("mem_info_vram_total"), &gib(96));
    replace_file(&dev.join("mem_info_vram_used"), "322961408\n");
    replace_file(&dev.join("mem_info_gtt_total"), &gib(16));
    set_available(tree.path(), 25);
    let d = Daemon::start(
        &sampled(tree.path())
            .profile_key("320k", "planned_memory", "60GiB")
            .engine("idle_timeout", "1s")
            .top_level("memory", "{ reserve: 8GiB, return_timeout: 1s }"),
    );
    // 60 GiB fit in the 95.7 GiB of free VRAM (not in the 16 GiB of GTT, nor in the 25 GiB
    // of system memory).
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    let s = d.status().await;
    assert_eq!(s["telemetry"]["gpu"]["pool"], "vram", "{s}");
    // The engine holds 81 GiB of VRAM and keeps it after its idle stop.
    replace_file(&dev.join("mem_info_vram_used"), &gib(81));
    d.wait_state(dsv4_client::State::Stopped, PATIENCE).await;
    d.log_with(&["VRAM in use is 81.0 GiB, 0.3 GiB before it started"])
        .await;
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "not enough GPU memory to start profile 320k: it needs 60.0 GiB (planned_memory), \
             and the GPU has 15.0 GiB of VRAM free of 96.0 GiB"
        ),
        "{message}"
    );
    assert_eq!(d.spawns(), 1);
}
