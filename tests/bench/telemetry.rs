//! Telemetry benchmark: what sampling the host costs, and what an idle daemon costs.
//!
//! Prints, in one run:
//! - one full sample (every reader, as the monitor takes it) against the Strix Halo fixture
//!   tree, beside the same files merely read (the floor any sampler pays), in microseconds;
//! - the daemon's own CPU and resident memory while the engine is stopped and it samples at
//!   `monitor.idle_interval` (its default, 10 s), over `BENCH_IDLE_SECONDS` (default 60);
//! - what one open dashboard (`GET /events`) costs the daemon, engine ready and idle.
//!
//! Run: `cargo bench -p dsv4-tests --bench telemetry` (env `BENCH_SAMPLES`,
//! `BENCH_IDLE_SECONDS`, `BENCH_DASHBOARD_SECONDS`). Targets: a sample under 100 us; idle CPU
//! under 0.05% of a core and RSS under 10 MiB; an open dashboard under 1% of a core.

#[path = "../integration/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsv4::host::hw::Sampler;
use dsv4::host::sysroot::SysRoot;
use support::{env_or, fixture_tree, Daemon, Setup};

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The files one sample reads on the fixture, for the "read only" floor.
fn sampled_files(root: &Path) -> Vec<PathBuf> {
    let dev = "sys/class/drm/card1/device";
    [
        "proc/meminfo",
        "proc/pressure/memory",
        &format!("{dev}/mem_info_gtt_used"),
        &format!("{dev}/mem_info_gtt_total"),
        &format!("{dev}/mem_info_vram_used"),
        &format!("{dev}/mem_info_vram_total"),
        &format!("{dev}/gpu_busy_percent"),
        &format!("{dev}/power_dpm_force_performance_level"),
        &format!("{dev}/gpu_metrics"),
        &format!("{dev}/hwmon/hwmon3/temp1_input"),
        &format!("{dev}/hwmon/hwmon3/power1_average"),
        "sys/class/hwmon/hwmon2/temp1_input",
        "sys/class/hwmon/hwmon2/temp3_input",
        "sys/class/hwmon/hwmon2/temp4_input",
    ]
    .iter()
    .map(|f| root.join(f))
    .collect()
}

fn sample_cost() {
    let n = env_or::<u64>("BENCH_SAMPLES", 5000) as usize;
    let fixture = fixture_tree("strix-halo");
    let mut sampler = Sampler::new(SysRoot::new(&fixture).unwrap());
    let files = sampled_files(&fixture);
    // Warm up (and find the devices, which happens once).
    for i in 0..100 {
        std::hint::black_box(sampler.sample(None, i as f64));
    }
    let mut full = Vec::with_capacity(n);
    let mut reads = Vec::with_capacity(n);
    for i in 0..n {
        // Interleaved, so that drift hits both.
        let t = Instant::now();
        std::hint::black_box(sampler.sample(None, i as f64));
        full.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        for f in &files {
            std::hint::black_box(std::fs::read(f).unwrap());
        }
        reads.push(t.elapsed().as_secs_f64() * 1e6);
    }
    full.sort_by(f64::total_cmp);
    reads.sort_by(f64::total_cmp);
    println!(
        "one sample of the Strix Halo fixture ({n} samples, {} files):",
        files.len()
    );
    for (name, v) in [("full sample", &full), ("files read only", &reads)] {
        println!(
            "  {name:<16} p50 {:>7.1} us  p90 {:>7.1} us  p99 {:>7.1} us",
            percentile(v, 0.5),
            percentile(v, 0.9),
            percentile(v, 0.99)
        );
    }
    let p50 = percentile(&full, 0.5);
    println!(
        "  parsing and bookkeeping add {:.1} us; target < 100 us: {}",
        p50 - percentile(&reads, 0.5),
        if p50 < 100.0 { "met" } else { "MISSED" }
    );
    println!(
        "BENCH section=sample samples={n} full_p50_us={p50:.1} full_p99_us={:.1} reads_p50_us={:.1}",
        percentile(&full, 0.99),
        percentile(&reads, 0.5)
    );
}

/// CPU time of every thread of `pid` in nanoseconds (`/proc/PID/task/*/schedstat`, the
/// first field: time on a CPU; clock ticks would round an idle daemon's to nothing).
fn cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Resident memory from `/proc/PID/status`, KiB: all, anonymous (the daemon's own heap and
/// stacks), and file-backed (its code and libraries' pages, shared with any other process
/// mapping them).
fn rss(pid: u32) -> (u64, u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("RssAnon:"), field("RssFile:"))
}

async fn idle_daemon() {
    let seconds = env_or::<u64>("BENCH_IDLE_SECONDS", 60);
    let fixture = fixture_tree("strix-halo");
    let d = Daemon::start(
        &Setup::default()
            .args(&["--sysroot", fixture.to_str().unwrap()])
            .log_level("warn"),
    );
    // Let it settle: the first sample, the watcher, the allocator's first pages.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = d.child.id();
    let cpu0 = cpu_ns(pid);
    let t0 = Instant::now();
    let mut peak = (0, 0, 0);
    while t0.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = rss(pid);
        if now.0 > peak.0 {
            peak = now;
        }
    }
    let cpu_s = (cpu_ns(pid) - cpu0) as f64 / 1e9;
    let wall = t0.elapsed().as_secs_f64();
    let share = cpu_s / wall * 100.0;
    let status = d.status().await;
    assert_eq!(status["state"], dsv4_client::State::Stopped.as_str());
    let mib = |k: u64| k as f64 / 1024.0;
    println!("idle daemon (engine stopped, sampling every 10 s, over {wall:.0} s):");
    println!(
        "  CPU {:.2} ms = {share:.4}% of a core (target < 0.05%: {})",
        cpu_s * 1000.0,
        if share < 0.05 { "met" } else { "MISSED" }
    );
    println!(
        "  RSS at most {:.1} MiB: {:.1} MiB its own (anonymous), {:.1} MiB of code and \
         libraries (file-backed, shared) (target < 10 MiB: {})",
        mib(peak.0),
        mib(peak.1),
        mib(peak.2),
        if peak.0 < 10 * 1024 { "met" } else { "MISSED" }
    );
    println!(
        "BENCH section=idle seconds={wall:.0} cpu_ms={:.2} cpu_share_pct={share:.4} \
         rss_kib={} rss_anon_kib={} rss_file_kib={}",
        cpu_s * 1000.0,
        peak.0,
        peak.1,
        peak.2
    );
}

/// Reads `GET /events` until `stop`; the bytes and status events it got.
async fn follow_events(
    addr: std::net::SocketAddr,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (usize, usize) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let (mut bytes, mut events) = (0, 0);
    let mut buf = vec![0u8; 64 << 10];
    let mut stop = stop;
    loop {
        tokio::select! {
            n = s.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    bytes += n;
                    events += buf[..n].windows(13).filter(|w| w == b"event: status").count();
                }
            },
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    (bytes, events)
}

/// What one open dashboard costs the daemon: its CPU with the engine ready and idle (the
/// monitor sampling every second), without and then with one `/events` stream open, over
/// `BENCH_DASHBOARD_SECONDS` (default 30) each.
async fn dashboard() {
    let seconds = env_or::<u64>("BENCH_DASHBOARD_SECONDS", 30);
    let fixture = fixture_tree("strix-halo");
    let d = Daemon::start(
        &Setup::default()
            .args(&["--sysroot", fixture.to_str().unwrap()])
            .engine("idle_timeout", "1h")
            .log_level("warn"),
    );
    let resp = d
        .post("/v1/chat/completions", support::chat(2, false))
        .await;
    assert_eq!(resp.status(), 200);
    let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pid = d.child.id();
    let measure = |label: &'static str| async move {
        let cpu0 = cpu_ns(pid);
        let t0 = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let share = (cpu_ns(pid) - cpu0) as f64 / 1e9 / t0.elapsed().as_secs_f64() * 100.0;
        println!("  {label}: {share:.3}% of a core");
        share
    };
    println!("dashboard (engine ready and idle, a sample a second, {seconds} s each):");
    let without = measure("no page open").await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let reader = tokio::spawn(follow_events(d.addr, stop_rx));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let with = measure("one /events stream open").await;
    stop_tx.send_replace(true);
    let (bytes, events) = reader.await.unwrap();
    let cost = with - without;
    println!(
        "  one open page costs dsv4d {cost:.3}% of a core ({events} status events, {} KiB) \
         (target < 1%: {})",
        bytes >> 10,
        if cost < 1.0 { "met" } else { "MISSED" }
    );
    println!(
        "BENCH section=dashboard seconds={seconds} without_pct={without:.4} with_pct={with:.4} \
         cost_pct={cost:.4} status_events={events} bytes={bytes}"
    );
}

fn main() {
    sample_cost();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(idle_daemon());
    rt.block_on(dashboard());
}
