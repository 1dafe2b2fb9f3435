//! Client connections against the open-file limit: the daemon raises its soft
//! `RLIMIT_NOFILE`, caps open connections (`api.max_connections`), and answers one over the cap
//! at once with a 503 instead of leaving it in the backlog.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_max_connections_get_503_at_once() {
    raise_own_nofile(4096);
    let setup = Setup::default()
        .listen_flag()
        .api("max_connections", "50")
        .log_level("info");
    let d = Daemon::start(&setup);
    let mut held = idle_connections(d.addr, 50).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
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
    // Refusals never start the engine.
    assert_eq!(d.spawns(), 0);
    // A connection that closes gives its slot back.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    chat_served(&d).await;
    drop(held);
    d.stop().await;
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
    // (1024 - 64) / 2 = 480 client connections; the 1,100 - 480 others are refused at once.
    let mut held = idle_connections(d.addr, 1100).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut refused = 0;
    for s in held.iter_mut().skip(400) {
        let mut buf = [0u8; 64];
        if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            if buf[..n].starts_with(b"HTTP/1.1 503") {
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 1100 - 480, "{}", d.log());
    // Closing some leaves room for a client, with the descriptors to start the engine.
    held.truncate(400);
    tokio::time::sleep(Duration::from_millis(200)).await;
    chat_served(&d).await;
    drop(held);
    d.stop().await;
}
