//! Client connections against the open-file limit: the daemon raises its soft
//! `RLIMIT_NOFILE`, caps open connections (`api.max_connections`), makes room at the cap by
//! closing the connection idle the longest, and answers one over the cap, when every open one
//! carries a request, at once with a 503 instead of leaving it in the backlog.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// Lets this test process hold `n` more connections than the common default allows.
fn raise_own_nofile(n: u64) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    if soft < n {
        setrlimit(Resource::RLIMIT_NOFILE, n.min(hard), hard).unwrap();
    }
}

async fn idle_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        held.push(TcpStream::connect(addr).await.expect("connect"));
    }
    held
}

/// A chat request answered 200 within a second (and a loaded machine's margin), engine start
/// included.
async fn chat_served(d: &Daemon) -> Duration {
    let t = Instant::now();
    let within = Duration::from_secs(1) + LOAD_MARGIN;
    let answer = tokio::time::timeout(
        within,
        d.send("POST", "/v1/chat/completions", &[], Some(chat(3, false))),
    )
    .await;
    let (status, _, body) =
        answer.unwrap_or_else(|_| panic!("no answer in {within:?}:\n{}", d.log()));
    assert_eq!(status, 200, "{body}");
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_under_a_1024_soft_limit_leave_other_clients_served() {
    raise_own_nofile(4096);
    let d = Daemon::start(
        &Setup::default()
            .listen_flag()
            .nofile(1024, 4096)
            .log_level("info"),
    );
    let held = idle_connections(d.addr, 1100).await;
    // Let the daemon accept them all.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let took = chat_served(&d).await;
    eprintln!("1,100 idle connections open: chat answered in {took:?}");
    // It said what it did with its limit.
    d.log_with(&["open-file limit raised from 1024 to 4096"])
        .await;
    drop(held);
    d.stop().await;
}

/// `n` connections, each sending a chat request.
async fn busy_connections(d: &Daemon, n: usize) -> Vec<TcpStream> {
    use tokio::io::AsyncWriteExt;
    let body = chat(3, false).to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        d.addr,
        body.len()
    );
    let mut held = idle_connections(d.addr, n).await;
    for s in &mut held {
        s.write_all(request.as_bytes()).await.unwrap();
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_max_connections_get_503_at_once() {
    raise_own_nofile(4096);
    let bus = PrivateBus::start();
    let setup = Setup::default()
        .listen_flag()
        .session_bus(&bus)
        .api("max_connections", "50")
        .engine("max_waiting", "100")
        .knob("load_ms", "5000")
        .log_level("info");
    let d = Daemon::start(&setup);
    let proxy = live_proxy(&bus, &d).await;
    // 50 connections carry a request each, waiting for the engine; counted over D-Bus, so
    // that no HTTP connection of the test's own stays open.
    let held = busy_connections(&d, 50).await;
    let t = Instant::now();
    loop {
        let status: serde_json::Value =
            serde_json::from_str(&proxy.status().await.unwrap()).unwrap();
        if status["waiting"] == 50 {
            break;
        }
        assert!(t.elapsed() < PATIENCE, "{status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = Instant::now();
    for _ in 0..20 {
        let mut over = TcpStream::connect(d.addr).await.unwrap();
        let mut text = String::new();
        // At once: a connection over the cap is never queued behind the held ones.
        tokio::time::timeout(LOAD_MARGIN, over.read_to_string(&mut text))
            .await
            .expect("no 503 at once")
            .unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("a complete response");
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        let head = format!("{}\r\n", head.to_ascii_lowercase());
        assert!(head.contains("\r\nretry-after: 1\r\n"), "{head}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("api.max_connections"), "{message}");
    }
    eprintln!(
        "20 connections over the cap answered 503 in {:?}",
        t.elapsed()
    );
    // Refusals start no engine beyond the one the held requests wait for.
    assert_eq!(d.spawns(), 1);
    drop(held);
    d.stop().await;
}

/// With API keys, `GET /health` needs none: a client that polls it on `max_connections`
/// idle keep-alive connections must not lock keyed clients out. The one idle the longest
/// makes room, and connections that showed no key are not kept alive long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_make_room_for_a_keyed_client() {
    use tokio::io::AsyncWriteExt;
    raise_own_nofile(4096);
    const KEY: &str = "sk-dsv4-test-0123456789abcdef";
    let d = Daemon::start(
        &Setup::default()
            .listen_flag()
            .api("max_connections", "64")
            .api_keys_file(&format!("{KEY}\n"), 0o600)
            .log_level("debug"),
    );
    let health = format!("GET /health HTTP/1.1\r\nhost: {}\r\n\r\n", d.addr);
    let mut held = idle_connections(d.addr, 64).await;
    for s in &mut held {
        s.write_all(health.as_bytes()).await.unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
    }
    // All 64 are open and idle; a keyed client still gets in, at once.
    let t = Instant::now();
    let (status, _, v) = d
        .send(
            "GET",
            "/v1/models",
            &[("authorization", &format!("Bearer {KEY}"))],
            None,
        )
        .await;
    let took = t.elapsed();
    assert_eq!(status, 200, "{v}");
    eprintln!(
        "64 idle keep-alive connections at max_connections 64: keyed client served in {took:?}"
    );
    assert!(took < Duration::from_millis(100) + LOAD_MARGIN, "{took:?}");
    d.log_with(&["closed, idle the longest, to make room"])
        .await;
    // The first one (idle the longest) was closed to make room: it reads the end.
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(PATIENCE, held[0].read(&mut buf))
        .await
        .expect("the longest idle connection stays open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    // The others showed no key: they are closed once idle for 5 s, not 30.
    let t = Instant::now();
    let n = tokio::time::timeout(PATIENCE, held[63].read(&mut buf))
        .await
        .expect("an unkeyed idle connection kept open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert!(
        t.elapsed() < Duration::from_secs(5) + LOAD_MARGIN,
        "{:?}",
        t.elapsed()
    );
    d.log_with(&["closed: idle, and no API key shown"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_that_cannot_be_raised_lowers_the_cap() {
    raise_own_nofile(4096);
    let d = Daemon::start(
        &Setup::default()
            .listen_flag()
            .nofile(1024, 1024)
            .log_level("info"),
    );
    // (1024 - 64) / 2 = 480 client connections: of 1,100 idle ones, each past the 480th
    // closes the one idle the longest, so the first 620 are closed and the last 480 open.
    let mut held = idle_connections(d.addr, 1100).await;
    let mut closed = 0;
    for s in held.iter_mut().take(620) {
        let mut buf = [0u8; 64];
        match tokio::time::timeout(PATIENCE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            other => panic!("an early connection not closed: {other:?}"),
        }
    }
    assert_eq!(closed, 620, "{}", d.log());
    // The cap is what the limit covers: the last 480 are still open...
    let reads = held.iter_mut().skip(620).map(|s| async move {
        let mut buf = [0u8; 64];
        tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf))
            .await
            .is_err()
    });
    let open = futures_util::future::join_all(reads).await;
    assert_eq!(open.iter().filter(|o| **o).count(), 480);
    // ...and a client still gets in (the oldest idle one makes room), with the descriptors
    // to start the engine.
    chat_served(&d).await;
    drop(held);
    d.stop().await;
}

/// The resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    kb << 10
}

/// The bytes still queued for dsv4d on its connections at `port` (what it has not read),
/// and how many such connections there are, from `/proc/net/tcp`.
fn unread(port: u16) -> (u64, usize) {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    let mut queued = 0;
    let mut count = 0;
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let local_port = f[1]
            .rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok());
        // 01: ESTABLISHED; the field is tx_queue:rx_queue, in hex.
        if local_port == Some(port) && f[3] == "01" {
            let rx = f[4].rsplit(':').next().unwrap();
            queued += u64::from_str_radix(rx, 16).unwrap();
            count += 1;
        }
    }
    (queued, count)
}

/// Request heads that never finish cost each connection at most its head buffer
/// (`HEAD_BUFFER`, 16 KiB), outside `api.max_buffered`: 4,096 connections holding 15 KiB of
/// an unfinished head each keep dsv4d within the figure docs/security.md states, and a head past the
/// buffer gets 431 instead of growing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_request_heads_cost_a_bounded_buffer_each() {
    use tokio::io::AsyncWriteExt;
    raise_own_nofile(10_000);
    let d = Daemon::start(
        &Setup::default()
            .listen_flag()
            .nofile(10_000, 10_000)
            .log_level("info"),
    );
    let (status, _) = d.get("/health").await;
    assert_eq!(status, 200);
    let before = rss(d.pid());
    let mut head = format!("POST /v1/chat/completions HTTP/1.1\r\nhost: {}\r\n", d.addr);
    while head.len() < 15 << 10 {
        head.push_str(&format!("x-pad-{}: {}\r\n", head.len(), "p".repeat(100)));
    }
    let mut held = idle_connections(d.addr, 4096).await;
    for s in &mut held {
        s.write_all(head.as_bytes()).await.unwrap();
    }
    // Until dsv4d has read every byte of every head.
    let t = Instant::now();
    loop {
        let (queued, count) = unread(d.addr.port());
        if queued == 0 && count >= 4096 {
            break;
        }
        assert!(
            t.elapsed() < PATIENCE,
            "{queued} bytes unread on {count} connections"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held_rss = rss(d.pid());
    let grown = held_rss.saturating_sub(before);
    eprintln!(
        "4,096 unfinished 15 KiB heads: dsv4d RSS {} MiB -> {} MiB (+{} MiB, {} KiB a connection)",
        before >> 20,
        held_rss >> 20,
        grown >> 20,
        (grown >> 10) / 4096
    );
    // The bound docs/security.md states: 40 KiB a connection (the head buffer and the
    // connection's own state).
    assert!(grown < 4096 * (40 << 10), "+{} MiB", grown >> 20);
    drop(held);
    // A head that outgrows the buffer is answered 431 and closed.
    let mut big = TcpStream::connect(d.addr).await.unwrap();
    let mut long = format!("GET /health HTTP/1.1\r\nhost: {}\r\n", d.addr);
    long.push_str(&format!("x-long: {}\r\n\r\n", "l".repeat(64 << 10)));
    let _ = big.write_all(long.as_bytes()).await;
    let mut answer = String::new();
    let _ = tokio::time::timeout(PATIENCE, big.read_to_string(&mut answer)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer:?}");
}

/// What a slow-body client was told when its turn ended.
#[derive(Debug, Default)]
struct SlowBodies {
    /// Holding a place now: their head sent, their body being read (dsv4d asked for it with
    /// `100 Continue`), no answer yet.
    holding: std::sync::atomic::AtomicUsize,
    /// The answers they got (status, code, message), in order.
    answers: std::sync::Mutex<Vec<(u16, String, String)>>,
    stop: std::sync::atomic::AtomicBool,
}

/// One client that holds a place with a slow body, again and again: a complete head that
/// declares 1 MB (with `Expect: 100-continue`, so that it knows when dsv4d reads the body),
/// then a byte a second; once answered or closed, it comes back 100 ms later.
async fn slow_body_client(addr: SocketAddr, shared: std::sync::Arc<SlowBodies>) {
    use std::sync::atomic::Ordering::SeqCst;
    use tokio::io::AsyncWriteExt;
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 1048576\r\nExpect: 100-continue\r\n\r\n"
    );
    while !shared.stop.load(SeqCst) {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let mut holding = false;
        let answered = loop {
            tokio::select! {
                n = s.read(&mut buf) => match n {
                    Ok(0) | Err(_) => break false,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                },
                _ = tokio::time::sleep(Duration::from_secs(1)), if holding => {
                    if s.write_all(b"x").await.is_err() {
                        break false;
                    }
                    continue;
                }
            }
            if !holding && got.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n") {
                got.drain(..25);
                holding = true;
                shared.holding.fetch_add(1, SeqCst);
            }
            // An answer (not the 100 Continue, or not only).
            if !got.starts_with(b"HTTP/1.1 100") && got.windows(4).any(|w| w == b"\r\n\r\n") {
                break true;
            }
        };
        if holding {
            shared.holding.fetch_sub(1, SeqCst);
        }
        if answered {
            // The rest of the answer, to the close.
            let _ = tokio::time::timeout(PATIENCE, async {
                while let Ok(n @ 1..) = s.read(&mut buf).await {
                    got.extend_from_slice(&buf[..n]);
                }
            })
            .await;
            let text = String::from_utf8_lossy(&got).into_owned();
            let (head, body) = text.split_once("\r\n\r\n").unwrap();
            let status = head[9..12].parse().unwrap();
            let v: serde_json::Value = serde_json::from_str(body)
                .unwrap_or_else(|e| panic!("{e}: a slow body was answered {text:?}"));
            let field = |f: &str| v["error"][f].as_str().unwrap_or_default().to_string();
            shared
                .answers
                .lock()
                .unwrap()
                .push((status, field("code"), field("message")));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A chat request on a connection of its own that asks to be closed after the answer;
/// the status and the body.
async fn chat_on_its_own_connection(addr: SocketAddr) -> (u16, String) {
    use tokio::io::AsyncWriteExt;
    let body = chat(2, false).to_string();
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.unwrap();
    let status = answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, answer)
}

/// 64 clients sending a byte a second of their bodies fill `max_connections: 64`: each new
/// client still gets in at once, the slowest body making room with a 503 that says why, and
/// a slow client that comes back cannot take the door again for long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_make_room_for_a_new_client() {
    use std::sync::atomic::Ordering::SeqCst;
    raise_own_nofile(4096);
    let d = Daemon::start(
        &Setup::default()
            .listen_flag()
            .api("max_connections", "64")
            .log_level("info"),
    );
    let shared = std::sync::Arc::new(SlowBodies::default());
    let clients: Vec<_> = (0..64)
        .map(|_| tokio::spawn(slow_body_client(d.addr, shared.clone())))
        .collect();
    let full = || async {
        let t = Instant::now();
        while shared.holding.load(SeqCst) < 64 {
            assert!(
                t.elapsed() < PATIENCE,
                "the slow bodies never held 64 places"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let made_room = || {
        let answers = shared.answers.lock().unwrap();
        answers
            .iter()
            .filter(|(_, code, _)| code == "too_many_connections")
            .count()
    };
    let mut took = Vec::new();
    for i in 0..10 {
        // Every place is held by a body being read.
        full().await;
        let before = made_room();
        let t = Instant::now();
        let within = Duration::from_secs(1) + LOAD_MARGIN;
        let (status, answer) = tokio::time::timeout(within, chat_on_its_own_connection(d.addr))
            .await
            .unwrap_or_else(|_| panic!("try {i}: no answer within {within:?}"));
        assert_eq!(status, 200, "try {i}: {answer}");
        took.push(t.elapsed());
        // It got in by making room: a slow body was stopped, and is told so.
        while made_room() == before {
            assert!(t.elapsed() < PATIENCE, "try {i}: no slow body made room");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!("64 slow bodies at max_connections 64: 10 new clients served in {took:?}");
    shared.stop.store(true, SeqCst);
    // What the slow bodies were told: why each was stopped.
    let answers = shared.answers.lock().unwrap().clone();
    for (status, code, message) in &answers {
        match code.as_str() {
            "too_many_connections" => {
                assert_eq!(*status, 503, "{message}");
                assert!(
                    message.contains("api.max_connections")
                        && message.contains("body was the slowest to come"),
                    "{message}"
                );
            }
            // Cut for its rate, had the test run past the grace.
            "body_too_slow" => assert_eq!(*status, 408, "{message}"),
            other => panic!("a slow body was answered {status} {other}: {message}"),
        }
    }
    for c in clients {
        c.abort();
    }
}
