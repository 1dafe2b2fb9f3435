//! Relay benchmark: what the way through dsv4d between two boxes costs the engine, against
//! the same engines connected directly over the same link.
//!
//! Two boxes (network namespaces joined by a veth pair, as the cluster tests make them), the
//! real llama-server on the tiny model in the coordinator's box with every layer on the real
//! rpc-server in the worker's box, twice, side by side:
//! - **direct**: rpc-server bound on the worker's link address, llama-server `--rpc` to it
//!   (what a user without dsv4 runs, with rpc-server open on the link);
//! - **relay**: each box's dsv4d, the coordinator's profile with `workers:`; llama-server
//!   `--rpc` to the coordinator's relay, which reaches the worker's rpc-server through the
//!   worker's dsv4d.
//!
//! Requests go to each llama-server itself (not through dsv4d's API), from the coordinator's
//! box, interleaved in rounds so that drift hits both: `BENCH_ROUNDS` (5) rounds of
//! `BENCH_REQUESTS` (10) completions of 32 tokens each (`ignore_eos`, no prompt cache).
//! Prints each path's median wall time a request and the engine's decode rate, and the relay's
//! added time. Needs root (namespaces) and `tests/engine/prepare`.
//!
//! Run: `cargo bench -p dsv4-tests --bench relay`.

#[path = "../integration/support/mod.rs"]
mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::boxes::{coordinator_setup, key_file, worker, Boxes, KEY};
use support::{env_or, real, temp_dir, Daemon};

/// The direct path's ports, in their boxes.
const DIRECT_RPC_PORT: u16 = 7171;
const DIRECT_ENGINE_PORT: u16 = 18090;

/// One engine to measure: where it listens in the coordinator's box, and its key.
struct Target {
    name: &'static str,
    port: u16,
    key: Option<String>,
    wall_ms: Vec<f64>,
    decode: Vec<f64>,
}

fn main() {
    let rounds = env_or::<usize>("BENCH_ROUNDS", 5).max(1);
    let per_round = env_or::<usize>("BENCH_REQUESTS", 10).max(1);
    let rt = support::bench_runtime();
    rt.block_on(async {
        let boxes = Boxes::new(1);
        let direct = start_direct(&boxes);
        let keys = temp_dir("relay-bench-keys");
        let worker_keys = key_file(&keys, "peers.keys", KEY);
        let coordinator_key = key_file(&keys, "worker.key", KEY);
        let _w = worker(&boxes, 1, &worker_keys).await;
        // Its engine must outlive the rounds of the direct path.
        let setup = coordinator_setup(&boxes, &[1], &coordinator_key).engine("idle_timeout", "1h");
        let c = Daemon::start(&setup);
        // The first request starts both; the engine's port and key are in dsv4d's log.
        let body = serde_json::json!({"prompt": "hi", "n_predict": 1});
        let resp = c.post("/completion", body).await;
        assert_eq!(resp.status(), 200, "{}", c.log());
        let log = c.log();
        let started = log
            .lines()
            .find(|l| l.contains("starting engine:"))
            .unwrap_or_else(|| panic!("no start in the log:\n{log}"));
        let word_after = |flag: &str| -> String {
            let rest = started.split(flag).nth(1).unwrap_or_default();
            rest.split_whitespace()
                .next()
                .unwrap_or_default()
                .to_string()
        };
        let relay_port: u16 = word_after("--port ").parse().unwrap();
        let key = std::fs::read_to_string(word_after("--api-key-file ")).unwrap();
        let mut targets = vec![
            Target {
                name: "direct",
                port: DIRECT_ENGINE_PORT,
                key: None,
                wall_ms: Vec::new(),
                decode: Vec::new(),
            },
            Target {
                name: "relay (dsv4d)",
                port: relay_port,
                key: Some(key.trim().to_string()),
                wall_ms: Vec::new(),
                decode: Vec::new(),
            },
        ];
        let netns = std::fs::File::open(format!("/var/run/netns/{}", boxes.name(0))).unwrap();
        targets = std::thread::spawn(move || {
            // SAFETY: setns on this thread alone, a thread of the bench's own, with an open fd.
            let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
            wait_healthy(DIRECT_ENGINE_PORT);
            for _ in 0..rounds {
                for t in targets.iter_mut() {
                    for _ in 0..per_round {
                        let (ms, tps) = complete(t.port, t.key.as_deref());
                        t.wall_ms.push(ms);
                        t.decode.push(tps);
                    }
                }
            }
            targets
        })
        .join()
        .unwrap();
        report(&targets, rounds, per_round);
        stop(direct);
    });
}

/// rpc-server on the worker's link address and llama-server on it, as a user without dsv4
/// would run them.
fn start_direct(boxes: &Boxes) -> [Child; 2] {
    let (server, model) = real::engine();
    let in_box = |i: usize| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", boxes.name(i)])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    };
    let rpc = in_box(1)
        .arg(real::rpc_server())
        .args(["--host", &boxes.worker(1).to_string()])
        .args(["--port", &DIRECT_RPC_PORT.to_string()])
        .spawn()
        .unwrap();
    let link = format!("{}:{DIRECT_RPC_PORT}", boxes.worker(1));
    let t = Instant::now();
    while !boxes
        .run(
            0,
            "bash",
            &[
                "-c",
                &format!("exec 3<>/dev/tcp/{}", link.replace(':', "/")),
            ],
        )
        .status
        .success()
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "rpc-server did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let engine = in_box(0)
        .arg(server)
        .args(["-m", &model.display().to_string(), "-c", "1024", "-np", "1"])
        .args([
            "--no-webui",
            "--threads",
            "1",
            "--threads-batch",
            "1",
            "-ngl",
            "99",
        ])
        .args(["--rpc", &link, "--host", "127.0.0.1"])
        .args(["--port", &DIRECT_ENGINE_PORT.to_string()])
        .spawn()
        .unwrap();
    [engine, rpc]
}

fn stop(children: [Child; 2]) {
    // The engine first: at its exit it asks the rpc-server for its memory.
    for mut c in children {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = c.wait();
    }
}

/// Waits until the engine on `port` (in this thread's box) answers `/health` with 200.
fn wait_healthy(port: u16) {
    let t = Instant::now();
    loop {
        if let Ok((200, _)) = http(port, "GET", "/health", None, "") {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "engine on {port} not healthy"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One completion of 32 tokens: its wall time in ms and the engine's decode rate.
fn complete(port: u16, key: Option<&str>) -> (f64, f64) {
    let body = r#"{"prompt":"hi","n_predict":32,"ignore_eos":true,"cache_prompt":false}"#;
    let t = Instant::now();
    let (status, text) = http(port, "POST", "/completion", key, body).unwrap();
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    (
        ms,
        v["timings"]["predicted_per_second"].as_f64().unwrap_or(0.0),
    )
}

/// A request on a connection of its own: the status and the body.
fn http(
    port: u16,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((status, body.to_string()))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(targets: &[Target], rounds: usize, per_round: usize) {
    println!(
        "relay: {rounds} rounds of {per_round} completions of 32 tokens, each path in turn \
         (tiny model, every layer on the worker)"
    );
    println!(
        "  {:<16} {:>14} {:>16}",
        "path", "wall ms (p50)", "decode tok/s (p50)"
    );
    for t in targets {
        println!(
            "  {:<16} {:>14.2} {:>16.1}",
            t.name,
            median(&t.wall_ms),
            median(&t.decode)
        );
        println!(
            "BENCH section=relay path={:?} wall_ms_p50={:.3} decode_tps_p50={:.2} n={}",
            t.name,
            median(&t.wall_ms),
            median(&t.decode),
            t.wall_ms.len()
        );
    }
    let (direct, relay) = (median(&targets[0].wall_ms), median(&targets[1].wall_ms));
    println!(
        "  the relay adds {:.2} ms a request ({:.2}x the direct wall time)",
        relay - direct,
        relay / direct
    );
}
