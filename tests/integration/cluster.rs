//! A profile whose engine spans several boxes (`workers:`, `peers:`), each box a network
//! namespace of its own with its own dsv4d (support::boxes), with the real llama-server as
//! the coordinator's engine and the real rpc-server as each worker's.
//!
//! Each dsv4d gets its API socket from the test (bound on this namespace's loopback, so the
//! test reaches it), and makes every other socket in its box: the worker's peers port on its
//! link, the engines on the box's own loopback.

use std::time::{Duration, Instant};

use dsv4_client::State;
use serde_json::json;

use crate::support::boxes::{coordinator, key_file, worker, Boxes, Keys, KEY, PEERS_PORT};
use crate::support::{real, temp_dir, Daemon, PATIENCE};

async fn chat(d: &Daemon) -> (u16, serde_json::Value) {
    let body = json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    });
    let resp = d.post("/v1/chat/completions", body).await;
    let status = resp.status().as_u16();
    let bytes = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let v =
        serde_json::from_slice(&bytes).unwrap_or(json!({"raw": String::from_utf8_lossy(&bytes)}));
    (status, v)
}

/// Where `needle` first is in `log`, or a panic naming it.
fn at(log: &str, needle: &str) -> usize {
    log.find(needle)
        .unwrap_or_else(|| panic!("no {needle:?} in the log:\n{log}"))
}

/// The engine processes (rpc-server, llama-server) running in box `i`.
fn engines_in(boxes: &Boxes, i: usize) -> Vec<String> {
    boxes
        .pids(i)
        .into_iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.contains("rpc-server") || c.contains("llama-server"))
        .collect()
}

async fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < within, "not so within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first request starts the worker's engine, then the coordinator's with its layers on
/// the worker; the answer is the one-box answer; only dsv4d's port is open on the link; after
/// the idle time every engine on both boxes is gone, and the next request starts them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_starts_the_worker_then_the_coordinator_and_idle_stops_both() {
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let w = worker(&boxes, 1, &keys.worker).await;
    let c = coordinator(&boxes, &[1], &keys.coordinator);

    let (status, v) = chat(&c).await;
    assert_eq!(status, 200, "{v}\n{}\n--- worker:\n{}", c.log(), w.log());
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let log = c.log();
    // The worker first, then the coordinator's engine, with its layers on the worker.
    let held = at(&log, &format!("worker box {} held", boxes.worker(1)));
    let started = at(&log, "starting engine:");
    assert!(held < started, "{log}");
    assert!(
        log.contains("RPC0[127.0.0.1:") && log.contains("model buffer size"),
        "{log}"
    );
    let worker_log = w.log();
    at(&worker_log, &format!("peer {}", boxes.coordinator(1)));
    // The coordinator's status shows its worker, serving.
    let status = c.status().await;
    let shown = &status["workers"][0];
    assert_eq!(shown["box"], boxes.worker(1).to_string(), "{status}");
    assert_eq!(shown["state"], "serving", "{status}");
    assert!(shown["load_seconds"].as_f64().is_some(), "{status}");
    let status = w.status().await;
    assert_eq!(status["state"], State::Ready.as_str(), "{status}");
    assert_eq!(status["holds"][0]["profile"], "rpc", "{status}");
    assert_eq!(
        status["holds"][0]["from"],
        boxes.coordinator(1).to_string(),
        "{status}"
    );
    // Nothing of the worker box but dsv4d's peers port listens off its loopback.
    let open: Vec<_> = boxes
        .listening(1)
        .into_iter()
        .filter(|(addr, _)| !addr.is_loopback())
        .collect();
    assert_eq!(open, [(boxes.worker(1), PEERS_PORT)], "{open:?}");
    // The relay on the coordinator's loopback takes only dsv4d's user's connections.
    let relay = log
        .split("--rpc ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no --rpc in the log:\n{log}"))
        .to_string();
    let port = relay.rsplit_once(':').unwrap().1;
    let relayed = w.log().matches("relaying to the engine").count();
    let other_user = boxes.run(
        0,
        "setpriv",
        &[
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/127.0.0.1/{port}; echo hello >&3; sleep 0.2"),
        ],
    );
    assert!(other_user.status.success(), "{other_user:?}");
    c.log_with(&["refused 127.0.0.1:", "it is uid 65534's"])
        .await;
    assert_eq!(w.log().matches("relaying to the engine").count(), relayed);

    // Idle: the coordinator's engine stops, lets the worker go, whose engine stops after
    // its own idle time.
    c.wait_state(State::Stopped, PATIENCE).await;
    w.wait_state(State::Stopped, PATIENCE).await;
    until("no engine left in either box", PATIENCE, || {
        engines_in(&boxes, 0).is_empty() && engines_in(&boxes, 1).is_empty()
    })
    .await;
    let status = w.status().await;
    assert!(status.get("holds").is_none(), "{status}");
    let status = c.status().await;
    assert!(status.get("workers").is_none(), "{status}");

    // The next request starts them all again.
    let (status, v) = chat(&c).await;
    assert_eq!(status, 200, "{v}\n{}", c.log());
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let worker_log = w.log();
    assert_eq!(
        worker_log.matches("starting engine:").count(),
        2,
        "{worker_log}"
    );
}

/// A key the worker does not hold: the start fails with a 503 naming the box and the
/// refusal, and nothing is left running in either box.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_fails_the_start_naming_the_box() {
    let boxes = Boxes::new(1);
    let keys = temp_dir("cluster-keys");
    let worker_keys = key_file(&keys, "peers.keys", KEY);
    let wrong = key_file(&keys, "worker.key", "another-key-that-is-long-enough-0");
    let w = worker(&boxes, 1, &worker_keys).await;
    let c = coordinator(&boxes, &[1], &wrong);
    let (status, v) = chat(&c).await;
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("worker box {}", boxes.worker(1)))
            && message.contains("peers.keys_file"),
        "{v}"
    );
    // Its lines reach the test a moment after the worker acts: waited for.
    w.log_with(&["the key is not one of peers.keys_file"]).await;
    assert!(!w.log().contains("starting engine:"), "{}", w.log());
    let status = c.status().await;
    assert_eq!(status["workers"][0]["state"], "lost", "{status}");
    let error = status["workers"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("refused the hold"), "{status}");
    assert!(engines_in(&boxes, 0).is_empty() && engines_in(&boxes, 1).is_empty());

    // The worker box takes that key, and reloads: the keys are read again, and the next
    // start holds it.
    std::fs::write(&worker_keys, "another-key-that-is-long-enough-0\n").unwrap();
    w.signal(nix::sys::signal::Signal::SIGHUP);
    w.log_with(&["SIGHUP: configuration reloaded"]).await;
    let t = Instant::now();
    loop {
        let (status, v) = chat(&c).await;
        if status == 200 {
            break;
        }
        // The coordinator's crash-loop guard holds the first tries back, for a second.
        assert_eq!(v["error"]["code"], "engine_backoff", "{v}");
        assert!(t.elapsed() < PATIENCE, "{v}\n{}", w.log());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let reads = w
        .log_with_count("peer keys required: 1 key(s)", 2)
        .await
        .matches("peer keys required: 1 key(s)")
        .count();
    assert_eq!(
        reads,
        2,
        "read at the start and at the reload:\n{}",
        w.log()
    );
}

/// A worker box that is down: the start fails with a 503 naming the box, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_box_that_is_down_fails_the_start_naming_it() {
    let boxes = Boxes::new(1);
    let keys = temp_dir("cluster-keys");
    let coordinator_key = key_file(&keys, "worker.key", KEY);
    let c = coordinator(&boxes, &[1], &coordinator_key);
    let (status, v) = chat(&c).await;
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("worker box {}", boxes.worker(1)))
            && message.contains("cannot connect"),
        "{v}"
    );
    assert!(engines_in(&boxes, 0).is_empty());
}

/// The pids of the engine processes named `name` in box `i`.
fn pids_named(boxes: &Boxes, i: usize, name: &str) -> Vec<u32> {
    boxes
        .pids(i)
        .into_iter()
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim().contains(name))
        })
        .collect()
}

/// SIGKILLs the rpc-server of worker box `i`, its only one.
fn kill_worker_engine(boxes: &Boxes, i: usize) {
    let rpc = pids_named(boxes, i, "rpc-server");
    assert_eq!(rpc.len(), 1, "{rpc:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(rpc[0] as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

/// Two workers, each a box of its own: both held before the coordinator's engine starts,
/// which places its layers on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_are_both_held_and_both_take_layers() {
    let boxes = Boxes::new(2);
    let keys = Keys::new();
    let w1 = worker(&boxes, 1, &keys.worker).await;
    let w2 = worker(&boxes, 2, &keys.worker).await;
    let c = coordinator(&boxes, &[1, 2], &keys.coordinator);
    let (status, v) = chat(&c).await;
    assert_eq!(status, 200, "{v}\n{}", c.log());
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let log = c.log();
    let started = at(&log, "starting engine:");
    for i in [1, 2] {
        assert!(at(&log, &format!("worker box {} held", boxes.worker(i))) < started);
    }
    // Layers on both: each relay has a model buffer (llama.cpp names each RPC0[address]).
    let relays = log
        .split("--rpc ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no --rpc in the log:\n{log}"));
    let relays: Vec<&str> = relays.split(',').collect();
    assert_eq!(relays.len(), 2, "{relays:?}");
    for relay in relays {
        assert!(
            log.contains(&format!("[{relay}] model buffer size")),
            "{relay}\n{log}"
        );
    }
    for w in [&w1, &w2] {
        assert_eq!(w.status().await["holds"][0]["profile"], "rpc");
    }
}

/// The worker's engine dies while the coordinator's serves: the coordinator's engine is
/// ended, its exit naming the box, and the next request starts both again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_engine_that_dies_ends_the_coordinators_and_the_next_request_starts_both() {
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let w = worker(&boxes, 1, &keys.worker).await;
    let c = coordinator(&boxes, &[1], &keys.coordinator);
    assert_eq!(chat(&c).await.0, 200, "{}", c.log());
    kill_worker_engine(&boxes, 1);
    let lost = format!("worker box {} went away", boxes.worker(1));
    c.log_with(&[&lost]).await;
    until("the coordinator's engine ended", PATIENCE, || {
        pids_named(&boxes, 0, "llama-server").is_empty()
    })
    .await;
    // Its exit is told with the reason.
    let log = c.log_with(&["the engine exited unexpectedly"]).await;
    let exit = log
        .lines()
        .find(|l| l.contains("the engine exited unexpectedly"))
        .unwrap_or_default();
    assert!(exit.contains(&lost), "{log}");
    let (code, v) = chat(&c).await;
    assert_eq!(code, 200, "{v}\n{}\n--- worker:\n{}", c.log(), w.log());
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
}

/// The coordinator's dsv4d is killed: its hold's connection closes, the worker lets go by
/// itself, and its engine stops after its idle time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_that_dies_lets_go_and_the_worker_stops_its_engine() {
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let w = worker(&boxes, 1, &keys.worker).await;
    let c = coordinator(&boxes, &[1], &keys.coordinator);
    assert_eq!(chat(&c).await.0, 200, "{}", c.log());
    assert_eq!(w.status().await["holds"][0]["profile"], "rpc");
    let _dir = c.kill_and_keep_dir().await;
    w.log_with(&["let go of profile rpc"]).await;
    w.wait_state(State::Stopped, PATIENCE).await;
    until("no rpc-server in the worker box", PATIENCE, || {
        pids_named(&boxes, 1, "rpc-server").is_empty()
    })
    .await;
    assert!(w.status().await.get("holds").is_none());
}

/// A worker box that does not answer is sent a Wake-on-LAN packet with its MAC; once its
/// dsv4d is up (the box woke), the waiting request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_worker_is_woken_and_the_waiting_request_served() {
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    const WAKE_PORT: u16 = 9009;
    // The worker box's network card, as far as the packet goes: a UDP socket in its box.
    let netns = std::fs::File::open(format!("/var/run/netns/{}", boxes.name(1))).unwrap();
    let at = std::net::SocketAddr::from((boxes.worker(1), WAKE_PORT));
    let card = std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: setns on this thread alone (a thread of the test's own), with an open fd.
        let entered = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "setns: {}", std::io::Error::last_os_error());
        let socket = std::net::UdpSocket::bind(at).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut packet = [0u8; 200];
        let (n, _) = socket.recv_from(&mut packet).unwrap();
        packet[..n].to_vec()
    });
    let mut s = real::setup_with_args(&["-ngl", "99"]).api("stream_keepalive", "1s");
    let profile = s.custom_profiles.get_mut("tiny").unwrap();
    profile.push_str(&format!(
        "workers:\n  - {{ at: \"{}:{PEERS_PORT}\", profile: rpc, key_file: {}, \
         wake: {{ mac: \"02:00:5e:10:00:01\", broadcast: \"{at}\" }} }}\n",
        boxes.worker(1),
        keys.coordinator.display()
    ));
    s.wrapper = boxes.exec(0);
    let c = Daemon::start(&s);
    let request = tokio::spawn({
        let url = c.url("/v1/chat/completions");
        async move {
            let body = json!({
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": true,
            });
            post_with_curl(&url, &body).await
        }
    });
    let packet = tokio::task::spawn_blocking(move || card.join().unwrap())
        .await
        .unwrap();
    let mac = [0x02, 0x00, 0x5e, 0x10, 0x00, 0x01];
    assert_eq!(packet.len(), 102);
    assert_eq!(&packet[..6], &[0xff; 6]);
    assert!(packet[6..].chunks(6).all(|c| c == mac), "{packet:?}");
    // The box wakes: its dsv4d starts, and the request that waited is served.
    let _w = worker(&boxes, 1, &keys.worker).await;
    let (code, stream) = request.await.unwrap();
    assert_eq!(code, 200, "{stream}\n{}", c.log());
    // Meanwhile the stream said what it waited for.
    let waking = format!(": dsv4 loading tiny: waking {}", boxes.worker(1));
    assert!(stream.contains(&waking), "{stream}");
    let content: String = stream
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(content, "abcdefgh", "{stream}");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");
}

/// A POST of `body` as JSON to `url` by curl, on a connection of its own: the status and
/// the body as it came.
async fn post_with_curl(url: &str, body: &serde_json::Value) -> (u16, String) {
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "120", "-w", "\n%{http_code}", "-H"])
        .arg("Content-Type: application/json")
        .arg("-d")
        .arg(body.to_string())
        .arg(url)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or((&text, "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// A request to a worker box's own API while its active profile lends its devices: 503
/// engine_lends, and its rpc-server (which would read the request as commands) never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_boxs_own_api_refuses_requests_while_it_lends() {
    let boxes = Boxes::new(1);
    let keys = temp_dir("cluster-keys");
    let worker_keys = key_file(&keys, "peers.keys", KEY);
    let w = worker(&boxes, 1, &worker_keys).await;
    let (status, v) = chat(&w).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "engine_lends", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("`rpc` runs rpc-server"), "{v}");
    assert!(!w.log().contains("starting engine:"), "{}", w.log());
    assert!(pids_named(&boxes, 1, "rpc-server").is_empty());
}

/// Each box runs its own power policy while its part of the engine runs: the worker's CPU
/// on power-saver from the hold, the coordinator's from its engine's start (each box's own
/// fixture tree as its sysfs, cpufreq without a power-profiles-daemon), and each given back
/// after its own stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_box_runs_its_own_power_policy_while_its_part_runs() {
    use crate::support::boxes::{coordinator_setup, start_worker, worker_setup};
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let trees = [
        crate::support::fixture_copy("strix-halo"),
        crate::support::fixture_copy("strix-halo"),
    ];
    let epp = |i: usize| {
        let file = "sys/devices/system/cpu/cpufreq/policy0/energy_performance_preference";
        std::fs::read_to_string(trees[i].path().join(file))
            .unwrap()
            .trim()
            .to_string()
    };
    let before = [epp(0), epp(1)];
    assert!(before.iter().all(|g| g != "power"), "{before:?}");
    let own_power = |s: crate::support::Setup, tree: &crate::support::TempDir| {
        s.args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("power", "{ method: cpufreq }")
            .daemon_env(
                "DBUS_SYSTEM_BUS_ADDRESS",
                "unix:path=/nonexistent/dsv4-no-bus",
            )
    };
    let w = start_worker(&own_power(worker_setup(&boxes, 1, &keys.worker), &trees[1])).await;
    let c = Daemon::start(&own_power(
        coordinator_setup(&boxes, &[1], &keys.coordinator),
        &trees[0],
    ));
    let (status, v) = chat(&c).await;
    assert_eq!(status, 200, "{v}\n{}", c.log());
    until(
        "both boxes' CPUs on power-saver (EPP power)",
        PATIENCE,
        || epp(0) == "power" && epp(1) == "power",
    )
    .await;
    c.wait_state(State::Stopped, PATIENCE).await;
    w.wait_state(State::Stopped, PATIENCE).await;
    until("each box's EPP given back", PATIENCE, || {
        [epp(0), epp(1)] == before
    })
    .await;
}

/// The coordinator shows what each worker box says of itself while held (its GTT,
/// temperatures and power, read there), and a worker box's thermal event reaches the
/// coordinator's desktop alerts, named by box.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_boxs_telemetry_and_heat_reach_the_coordinator() {
    use crate::support::boxes::{coordinator_setup, start_worker, worker_setup};
    const EDGE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0/hwmon/hwmon3/temp1_input";
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let tree = crate::support::fixture_copy("strix-halo");
    let w = start_worker(
        &worker_setup(&boxes, 1, &keys.worker)
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 100ms, idle_interval: 100ms }")
            .top_level("thermal", "{ warn: 85C, critical: 95C, hysteresis: 5C }")
            .daemon_env(
                "DBUS_SYSTEM_BUS_ADDRESS",
                "unix:path=/nonexistent/dsv4-no-bus",
            ),
    )
    .await;
    let bus = crate::support::PrivateBus::start();
    let c = Daemon::start(
        &coordinator_setup(&boxes, &[1], &keys.coordinator)
            .engine("idle_timeout", "10m")
            .session_bus(&bus),
    );
    let proxy = crate::support::live_proxy(&bus, &c).await;
    let mut alerts = proxy.receive_alert().await.unwrap();
    let (status, v) = chat(&c).await;
    assert_eq!(status, 200, "{v}\n{}", c.log());

    // What the worker's own status says is what the coordinator's says of it.
    let worker_gtt = w.status().await["telemetry"]["gpu"]["gtt_used"].clone();
    assert!(worker_gtt.is_u64(), "{worker_gtt}");
    let t = Instant::now();
    let said = loop {
        let s = c.status().await;
        if s["workers"][0]["telemetry"].is_object() {
            break s["workers"][0].clone();
        }
        assert!(t.elapsed() < PATIENCE, "no telemetry from the worker: {s}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(said["telemetry"]["gpu"]["gtt_used"], worker_gtt, "{said}");
    assert!(said["telemetry"]["temperatures"].is_object(), "{said}");
    assert!(said["telemetry"]["power"]["soc"].is_number(), "{said}");
    assert_eq!(said["thermal"]["level"], "normal", "{said}");
    let (_, _, metrics) = c.send("GET", "/metrics", &[], None).await;
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    let host = boxes.worker(1).to_string();
    assert!(
        metrics.contains(&format!(
            "dsv4_worker_gtt_used_bytes{{box=\"{host}\"}} {worker_gtt}"
        )),
        "{metrics}"
    );

    // The worker box heats up: the coordinator's desktop hears it, named by box.
    std::fs::write(tree.path().join(EDGE), "91000\n").unwrap();
    let args = crate::support::next_alert(&mut alerts, &c).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Worker);
    assert!(
        args.message.starts_with(&format!("worker box {host}: ")),
        "{}",
        args.message
    );
    assert!(
        args.message.contains("edge temperature 91.0 C: hot"),
        "{}",
        args.message
    );
    let t = Instant::now();
    while c.status().await["workers"][0]["thermal"]["level"] != "warn" {
        assert!(t.elapsed() < PATIENCE, "{}", c.status().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The dashboard, in a real browser, has a row for the worker box with what it said.
    let row = format!("document.querySelector('#workers tr[data-box=\"{host}\"]')");
    let dom = crate::dashboard::page_once(
        &format!("http://{}/ui", c.addr),
        &format!("{row} !== null && {row}.textContent.includes('warn')"),
    );
    let at = dom
        .find(&format!("data-box=\"{host}\""))
        .unwrap_or_else(|| panic!("{dom}"));
    let row = &dom[at..at + dom[at..].find("</tr>").unwrap()];
    for said in ["rpc", "serving", "iB<", "edge 91.0 C", " W<", "warn"] {
        assert!(row.contains(said), "{said} not in {row}");
    }
}

/// The worker's engine dies in the middle of a streamed answer: the client gets an error
/// event that names the worker box, the coordinator's engine is ended, and nothing of the
/// engines is left running but what the next request starts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_dies_mid_answer_is_named_in_the_clients_error_event() {
    use http_body_util::BodyExt;
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let _w = worker(&boxes, 1, &keys.worker).await;
    // A context long enough for an answer of seconds, whatever the machine's load: the
    // worker dies well before its end.
    let mut s = crate::support::boxes::coordinator_setup(&boxes, &[1], &keys.coordinator);
    let model = real::tiny_with_context(32_768);
    let profile = s.custom_profiles.get_mut("tiny").unwrap();
    let (_, rest) = profile.split_once("\nmodel: ").unwrap();
    let (old, _) = rest.split_once('\n').unwrap();
    *profile = profile
        .replace(old, &model.display().to_string())
        .replace("context: 1024", "context: 32768");
    let c = Daemon::start(&s);
    let body = json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 30_000,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    });
    let resp = c.post("/v1/chat/completions", body).await;
    assert_eq!(resp.status(), 200, "{}", c.log());
    let mut body = resp.into_body();
    let mut got = String::new();
    // A few tokens in, the worker's engine dies.
    while got.matches("\"content\":").count() < 3 {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("no event")
            .expect("the stream ended before its third token")
            .unwrap();
        if let Some(data) = frame.data_ref() {
            got.push_str(&String::from_utf8_lossy(data));
        }
    }
    kill_worker_engine(&boxes, 1);
    // The rest of the stream: its error event, then the break.
    loop {
        match tokio::time::timeout(PATIENCE, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    got.push_str(&String::from_utf8_lossy(data));
                }
            }
            Ok(Some(Err(_)) | None) => break,
            Err(_) => panic!("the stream neither ended nor broke:\n{got}\n{}", c.log()),
        }
    }
    assert!(
        !got.contains("[DONE]"),
        "the answer ended as if whole:\n{got}"
    );
    let error = got
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| panic!("no error event:\n{got}\n{}", c.log()));
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("worker box {}", boxes.worker(1))),
        "the error event does not name the box: {message}"
    );
    until("the coordinator's engine ended", PATIENCE, || {
        pids_named(&boxes, 0, "llama-server").is_empty()
    })
    .await;
}

/// `dsv4d --doctor --part service` of box `i` for the daemon `d`, its checks as JSON.
fn doctor_in(boxes: &Boxes, i: usize, d: &Daemon) -> Vec<serde_json::Value> {
    doctor_part_in(boxes, i, d, "service")
}

fn doctor_part_in(boxes: &Boxes, i: usize, d: &Daemon, part: &str) -> Vec<serde_json::Value> {
    let config = d.dir().join("supervisor.yaml");
    let o = boxes.run(
        i,
        "env",
        &[
            "DBUS_SYSTEM_BUS_ADDRESS=unix:path=/nonexistent/dsv4-no-bus",
            env!("CARGO_BIN_EXE_dsv4d-under-test"),
            "--doctor",
            "--part",
            part,
            "--config",
            config.to_str().unwrap(),
        ],
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

/// The check `id` among `checks`: its verdict and what it found.
fn check_of<'c>(checks: &'c [serde_json::Value], id: &str) -> (&'c str, &'c str) {
    let c = checks
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {checks:#?}"));
    (
        c["verdict"].as_str().unwrap_or_default(),
        c["found"].as_str().unwrap_or_default(),
    )
}

/// The coordinator's doctor checks each worker box over its peers port: reachable, the key
/// accepted, the profile one it lends, the same dsv4, and that box's own doctor (what the
/// worker's own `dsv4d --doctor` says); a wrong key and a box that is down each fail by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinators_doctor_checks_each_worker_box() {
    let boxes = Boxes::new(1);
    let keys = Keys::new();
    let w = worker(&boxes, 1, &keys.worker).await;
    let c = coordinator(&boxes, &[1], &keys.coordinator);
    let host = boxes.worker(1).to_string();
    let checks = doctor_in(&boxes, 0, &c);
    for id in [
        "workers.reach",
        "workers.key",
        "workers.profile",
        "workers.version",
    ] {
        let (verdict, found) = check_of(&checks, id);
        assert_eq!(verdict, "ok", "{id}: {found}");
        assert!(found.contains(&host), "{id}: {found}");
    }
    // That box's own doctor, summed up: as its own run says.
    let own = doctor_in(&boxes, 1, &w);
    let worst = if own.iter().any(|c| c["verdict"] == "fail") {
        "fail"
    } else if own.iter().any(|c| c["verdict"] == "warn") {
        "warn"
    } else {
        "ok"
    };
    let (verdict, found) = check_of(&checks, "workers.doctor");
    println!("workers.doctor: {verdict}: {found}");
    assert_eq!(verdict, worst, "{found}");
    let oks = own.iter().filter(|c| c["verdict"] == "ok").count();
    assert!(
        found.contains(&format!(" {oks} ok")) || worst == "fail",
        "{found} (its own run: {oks} ok)"
    );
    assert!(
        found.starts_with(&format!("worker box {host}'s own doctor: ")),
        "{found}"
    );
    if let Some(failed) = own.iter().find(|c| c["verdict"] == "fail") {
        let id = failed["id"].as_str().unwrap();
        assert!(found.contains(id), "{id} not in {found}");
    }
    // The check started nothing on either box.
    assert!(engines_in(&boxes, 0).is_empty() && engines_in(&boxes, 1).is_empty());
    // What a worker box runs for a check leaves its own workers out: two boxes that list
    // each other never check each other round and round.
    let alone = doctor_part_in(&boxes, 0, &c, "box");
    assert!(
        !alone
            .iter()
            .any(|c| c["id"].as_str().unwrap_or_default().starts_with("workers.")),
        "{alone:#?}"
    );
    w.log_with(&["checks profile rpc"]).await;

    // A key the worker does not hold: refused, by name.
    let wrong_dir = temp_dir("cluster-wrong-key");
    let wrong = key_file(
        &wrong_dir,
        "worker.key",
        "another-key-that-is-long-enough-0",
    );
    let c2 = coordinator(&boxes, &[1], &wrong);
    let checks = doctor_in(&boxes, 0, &c2);
    let (verdict, found) = check_of(&checks, "workers.key");
    assert_eq!(verdict, "fail", "{found}");
    assert!(
        found.contains("the key is not one of peers.keys_file"),
        "{found}"
    );

    // The worker box down: unreachable, with what to do.
    drop(w);
    let checks = doctor_in(&boxes, 0, &c);
    let (verdict, found) = check_of(&checks, "workers.reach");
    assert_eq!(verdict, "fail", "{found}");
    assert!(found.contains(&format!("worker box {host}:")), "{found}");
}
