//! Request bodies are read whole before a request takes a lease or reaches the engine: a slow
//! or stalled client gets 408 and never starts or holds the engine; the bodies held at once
//! stay within `api.max_buffered`; `Expect: 100-continue` is answered; and a client that
//! leaves while its request waits (for the engine to start, or through a silent prefill)
//! lets go of everything at once, the engine's work included.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use dsv4_client::State;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// A raw client connection that has sent `head` (and `body`, when given) and no more.
async fn send_raw(addr: SocketAddr, head: &str, body: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    if !body.is_empty() {
        s.write_all(body).await.unwrap();
    }
    s
}

/// The head of a chat POST with this `Content-Length` (`None`: chunked) and more headers.
fn chat_head(addr: SocketAddr, length: Option<usize>, more: &str) -> String {
    let framing = match length {
        Some(n) => format!("Content-Length: {n}"),
        None => "Transfer-Encoding: chunked".to_string(),
    };
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {framing}\r\n{more}\r\n"
    )
}

/// One response read off `s`: status, the head as text, and the body (by its Content-Length).
async fn read_response(s: &mut TcpStream, within: Duration) -> (u16, String, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let deadline = tokio::time::Instant::now() + within;
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no answer within {within:?}: {got:?}"))
            .unwrap();
        assert!(n > 0, "closed before an answer: {got:?}");
        got.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
    let status: u16 = head[9..12].parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(String::from)
        })
        .map(|n| n.trim().parse().unwrap())
        .unwrap_or(0);
    let mut body = got[head_end..].to_vec();
    while body.len() < length {
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .expect("the whole body")
            .unwrap();
        assert!(n > 0, "closed inside the body");
        body.extend_from_slice(&buf[..n]);
    }
    (status, head, String::from_utf8_lossy(&body).into_owned())
}

fn chat_bytes(max_tokens: u32) -> Vec<u8> {
    chat(max_tokens, false).to_string().into_bytes()
}

/// Waits until `/status` has `field` equal to `want`.
async fn wait_status(d: &Daemon, field: &str, want: u64, within: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let s = d.status().await;
        if s[field] == want {
            return t.elapsed();
        }
        assert!(t.elapsed() < within, "{field} never {want}: {s}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_get_408_and_never_start_or_hold_the_engine() {
    let d = Daemon::start(&Setup::default().api("body_timeout", "1s"));
    let full = chat_bytes(3);
    let mut slow = Vec::new();
    for i in 0..16 {
        // Half declare their length and send part of it; half are chunked and stall after
        // a first chunk.
        let s = if i % 2 == 0 {
            let head = chat_head(d.addr, Some(full.len()), "");
            send_raw(d.addr, &head, &full[..10]).await
        } else {
            let head = chat_head(d.addr, None, "");
            send_raw(
                d.addr,
                &head,
                format!("a\r\n{}\r\n", "x".repeat(10)).as_bytes(),
            )
            .await
        };
        slow.push(s);
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let s = d.status().await;
    assert_eq!(s["state"], State::Stopped.as_str(), "{s}");
    assert_eq!(s["in_flight"], 0, "{s}");
    assert_eq!(s["waiting"], 0, "{s}");
    for s in &mut slow {
        let (status, head, body) = read_response(s, PATIENCE).await;
        assert_eq!(status, 408, "{head}{body}");
        assert!(head.contains("connection: close"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "body_timeout", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("the request body did not arrive within api.body_timeout (1s)"),
            "{message}"
        );
        // And the connection is closed after it.
        let mut rest = [0u8; 16];
        let n = tokio::time::timeout(PATIENCE, s.read(&mut rest)).await;
        assert!(matches!(n, Ok(Ok(0)) | Ok(Err(_))), "{n:?}");
    }
    // The timeout is the figure: not before it, and not long after.
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < SEC + LOAD_MARGIN,
        "{took:?}"
    );
    assert_eq!(d.spawns(), 0, "a slow body started the engine");
    assert!(!d.fake_log().contains("request POST"), "{}", d.fake_log());
    // A whole request still goes through.
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
}

/// A body that trickles gets 408 `body_too_slow` once it is 5 s behind `api.min_body_rate`,
/// long before `api.body_timeout`; one that keeps the rate is read whole however long it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickle_is_cut_after_the_grace_and_a_body_at_the_rate_goes_through() {
    let d = Daemon::start(
        &Setup::default()
            .api("body_timeout", "30s")
            .api("min_body_rate", "1KiB/s"),
    );
    let t0 = Instant::now();
    let trickle = async {
        let head = chat_head(d.addr, Some(1 << 20), "");
        let s = send_raw(d.addr, &head, b"").await.into_std().unwrap();
        // Read on one handle, written on another.
        let w = TcpStream::from_std(s.try_clone().unwrap()).unwrap();
        let mut s = TcpStream::from_std(s).unwrap();
        let reading = async {
            let answer = read_response(&mut s, PATIENCE).await;
            (answer, t0.elapsed())
        };
        let trickling = async {
            loop {
                tokio::time::sleep(SEC).await;
                // dsv4d may have closed the connection already.
                let _ = w.try_write(b"x");
            }
        };
        tokio::select! {
            answer = reading => answer,
            () = trickling => unreachable!(),
        }
    };
    // 1,200 bytes a second (the minimum is 1,024) for 8 s: past the grace, at the rate.
    let steady = async {
        let mut body = chat_bytes(3);
        let pad = 9600 - body.len();
        body.splice(
            1..1,
            format!("\"pad\":\"{}\",", "p".repeat(pad - 9)).into_bytes(),
        );
        assert_eq!(body.len(), 9600);
        let head = chat_head(d.addr, Some(body.len()), "");
        let mut s = send_raw(d.addr, &head, b"").await;
        for part in body.chunks(120) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.write_all(part).await.unwrap();
        }
        let sent = t0.elapsed();
        (read_response(&mut s, PATIENCE).await, sent)
    };
    let (((status, head, body), cut_after), ((steady_status, _, steady_body), sent)) =
        tokio::join!(trickle, steady);
    assert_eq!(status, 408, "{head}{body}");
    assert!(head.contains("connection: close"), "{head}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "body_too_slow", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with(
            "the request body came slower than api.min_body_rate (1.0 KiB/s) allows after its \
             first 5s:"
        ),
        "{message}"
    );
    // The grace and the few bytes' credit, not the 30 s body_timeout.
    assert!(
        cut_after >= 5 * SEC && cut_after < 5 * SEC + LOAD_MARGIN,
        "cut after {cut_after:?}"
    );
    eprintln!("a trickle of a byte a second cut after {cut_after:?}");
    assert!(sent >= 8 * SEC, "{sent:?}");
    assert_eq!(steady_status, 200, "{steady_body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_sees_a_request_only_once_its_body_is_whole() {
    let d = Daemon::start(&Setup::default());
    let (status, _, _) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(1, false)))
        .await;
    assert_eq!(status, 200);
    let body = chat_bytes(3);
    let head = chat_head(d.addr, Some(body.len()), "");
    let (first, last) = body.split_at(body.len() / 2);
    let mut s = send_raw(d.addr, &head, first).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = d
        .fake_log()
        .matches("request POST /v1/chat/completions")
        .count();
    assert_eq!(
        seen,
        1,
        "the engine saw a request before its body:\n{}",
        d.fake_log()
    );
    assert_eq!(d.status().await["in_flight"], 0);
    s.write_all(last).await.unwrap();
    let (status, _, body) = read_response(&mut s, PATIENCE).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abc", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_held_at_once_stay_within_max_buffered() {
    let d = Daemon::start(
        &Setup::default()
            .api("max_body", "1MiB")
            .api("max_buffered", "1MiB"),
    );
    let pad = "x".repeat(600 * 1024);
    let big = serde_json::json!({
        "messages": [{"role": "user", "content": pad}],
        "max_tokens": 3,
    })
    .to_string()
    .into_bytes();
    // The first holds 600 KiB of the budget while its body comes.
    let head = chat_head(d.addr, Some(big.len()), "");
    let mut first = send_raw(d.addr, &head, &big[..1000]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A second that would pass the budget is refused at once, before its body is read.
    let mut second = send_raw(d.addr, &head, b"").await;
    let t = Instant::now();
    let (status, h, body) = read_response(&mut second, PATIENCE).await;
    // At once, not after the first body is whole or the second's body_timeout (30 s).
    assert!(t.elapsed() < LOAD_MARGIN, "{:?}", t.elapsed());
    assert_eq!(status, 503, "{h}{body}");
    assert!(h.contains("retry-after: 1"), "{h}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "bodies_over_budget", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("api.max_buffered"),
        "{v}"
    );
    // A small one fits beside it.
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    // The first completes and is served; then the budget is free again.
    first.write_all(&big[1000..]).await.unwrap();
    let (status, _, body) = read_response(&mut first, PATIENCE).await;
    assert_eq!(status, 200, "{body}");
    let mut again = send_raw(d.addr, &head, &big).await;
    let (status, _, body) = read_response(&mut again, PATIENCE).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_and_refusals_come_before_it() {
    let d = Daemon::start(&Setup::default().api("max_body", "1KiB"));
    let body = chat_bytes(3);
    let head = chat_head(d.addr, Some(body.len()), "Expect: 100-continue\r\n");
    let mut s = send_raw(d.addr, &head, b"").await;
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(PATIENCE, s.read(&mut buf))
        .await
        .expect("100 Continue")
        .unwrap();
    assert_eq!(&buf[..n], b"HTTP/1.1 100 Continue\r\n\r\n");
    s.write_all(&body).await.unwrap();
    let (status, _, text) = read_response(&mut s, PATIENCE).await;
    assert_eq!(status, 200, "{text}");
    // The engine was not asked to agree to anything: dsv4d had the body already.
    let fake = d.fake_log();
    assert!(fake.contains("request POST /v1/chat/completions"), "{fake}");
    assert!(!fake.contains("expect="), "{fake}");

    // Too large: 413 at once, and no 100 Continue before it.
    let head = chat_head(d.addr, Some(5000), "Expect: 100-continue\r\n");
    let mut s = send_raw(d.addr, &head, b"").await;
    let (status, h, text) = read_response(&mut s, PATIENCE).await;
    assert_eq!(status, 413, "{h}{text}");
    assert!(
        text.contains("the request body of 5000 bytes is larger than api.max_body (1024 bytes)"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_checked_before_100_continue() {
    let d = Daemon::start(&Setup::default().api_keys_file("sk-right\n", 0o600));
    let body = chat_bytes(3);
    let head = chat_head(d.addr, Some(body.len()), "Expect: 100-continue\r\n");
    let mut s = send_raw(d.addr, &head, b"").await;
    let (status, h, _) = read_response(&mut s, PATIENCE).await;
    assert_eq!(status, 401, "{h}");
    assert_eq!(d.spawns(), 0);
}

/// Sends a whole chat request on a raw connection and returns the connection, unread.
async fn chat_on_raw(d: &Daemon, stream: bool) -> TcpStream {
    let body = chat(3, stream).to_string();
    let head = chat_head(d.addr, Some(body.len()), "");
    send_raw(d.addr, &head, body.as_bytes()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_a_silent_prefill_lets_go_within_a_second() {
    // The engine says nothing for a minute, as llama-server does through a long prefill.
    let d = Daemon::start(&Setup::default().knob("prefill_ms", "60000"));
    for (n, stream) in [false, true].into_iter().enumerate() {
        let before = d.fake_log().matches("client-closed").count();
        let s = chat_on_raw(&d, stream).await;
        // The engine has the request (the lease is granted before it gets there).
        d.wait_fake_log_count("request POST /v1/chat/completions", n + 1, PATIENCE)
            .await;
        assert_eq!(d.status().await["in_flight"], 1);
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(s);
        let took = wait_status(&d, "in_flight", 0, PATIENCE).await;
        assert!(
            took < SEC + LOAD_MARGIN,
            "stream={stream}: the lease went only after {took:?}"
        );
        // The engine heard of it: its connection closed, and it dropped the work.
        let t = Instant::now();
        while d.fake_log().matches("client-closed").count() == before {
            assert!(
                t.elapsed() < SEC + LOAD_MARGIN,
                "stream={stream}: the engine never saw the client go:\n{}",
                d.fake_log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(!d.fake_log().contains("done /v1/chat"), "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_while_the_engine_loads_stops_waiting() {
    let d = Daemon::start(&Setup::default().knob("load_ms", "60000"));
    let s = chat_on_raw(&d, false).await;
    wait_status(&d, "waiting", 1, PATIENCE).await;
    drop(s);
    let took = wait_status(&d, "waiting", 0, PATIENCE).await;
    assert!(
        took < SEC + LOAD_MARGIN,
        "the waiter went only after {took:?}"
    );
    assert_eq!(d.status().await["in_flight"], 0);
}

/// The acceptance case against the real engine: slow-body clients leave llama-server serving
/// everyone else, and get 408 themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_leave_the_real_engine_serving_others() {
    // body_timeout alone (no minimum rate): the slow clients are answered at its end.
    let d = Daemon::start(
        &real::setup()
            .api("body_timeout", "10s")
            .api("min_body_rate", "0")
            .engine("idle_timeout", "1m"),
    );
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(8, false)))
        .await;
    assert_eq!(status, 200, "{v}");
    let generation = d.status().await["generation"].clone();
    assert!(generation.is_u64(), "{generation}");
    let mut slow = Vec::new();
    for _ in 0..16 {
        let head = chat_head(d.addr, None, "");
        slow.push(send_raw(d.addr, &head, b"5\r\n{\"mes\r\n").await);
    }
    // Everyone else is served meanwhile, one request after another, streams too, each well
    // before the slow clients' body_timeout (10 s) could have freed anything.
    for i in 0..10 {
        let t = Instant::now();
        let stream = i % 2 == 1;
        let resp = d.post("/v1/chat/completions", chat(8, stream)).await;
        assert_eq!(resp.status(), 200);
        if stream {
            let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
            assert_eq!(content, "abcdefgh");
            assert!(done);
        } else {
            let (_, _, v) = body_json(resp).await;
            assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
        }
        assert!(
            t.elapsed() < SEC + LOAD_MARGIN,
            "request {i} took {:?}",
            t.elapsed()
        );
        let s = d.status().await;
        assert!(s["in_flight"].as_u64().unwrap() <= 1, "{s}");
    }
    // The slow clients still hold their connections: nothing has been said to them yet.
    for s in &slow {
        let mut byte = [0u8; 1];
        match s.try_read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a slow client was answered before its body_timeout: {other:?}"),
        }
    }
    for s in &mut slow {
        let (status, h, body) = read_response(s, PATIENCE).await;
        assert_eq!(status, 408, "{h}{body}");
    }
    // The same engine served it all.
    assert_eq!(d.status().await["generation"], generation);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_content_lengths_are_refused_before_any_byte_of_body() {
    let d = Daemon::start(&Setup::default().api("max_body", "1KiB"));
    // hyper keeps the two largest values for itself and refuses them while parsing, with
    // its own 431 (a hostile head), and closes the connection.
    for len in [u64::MAX, u64::MAX - 1] {
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\ncontent-length: {len}\r\n\r\n",
            d.addr
        );
        let mut s = send_raw(d.addr, &head, b"").await;
        let (status, h, body) = read_response(&mut s, PATIENCE).await;
        assert_eq!(status, 431, "{len}: {h}{body}");
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(PATIENCE, s.read_to_end(&mut rest)).await;
        assert!(
            matches!(closed, Ok(Ok(_))),
            "{len}: the connection stayed open"
        );
    }
    // Every other length over api.max_body gets dsv4d's 413.
    for len in [u64::MAX - 2, 5000] {
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\ncontent-length: {len}\r\n\r\n",
            d.addr
        );
        let mut s = send_raw(d.addr, &head, b"").await;
        let (status, h, body) = read_response(&mut s, PATIENCE).await;
        assert_eq!(status, 413, "{len}: {h}{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "body_too_large", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        let want = format!("the request body of {len} bytes is larger than api.max_body");
        assert!(message.starts_with(&want), "{message}");
    }
    // A head that is really too large still gets hyper's 431.
    let big = "x".repeat(500 * 1024);
    let head = format!(
        "GET /v1/models HTTP/1.1\r\nHost: {}\r\nX-Big: {big}\r\n\r\n",
        d.addr
    );
    let mut s = send_raw(d.addr, &head, b"").await;
    let (status, h, _) = read_response(&mut s, PATIENCE).await;
    assert_eq!(status, 431, "{h}");
    assert_eq!(d.spawns(), 0);
    // And the connections after them are served as usual.
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_beside_chunked_is_not_the_length() {
    // RFC 9112 6.3: with Transfer-Encoding, a Content-Length is ignored. The whole chunked
    // body reaches the engine, with the length of what was read.
    let d = Daemon::start(&Setup::default());
    for declared in [0, 3] {
        let head = format!(
            "POST /echo HTTP/1.1\r\nHost: {}\r\nContent-Length: {declared}\r\n\
             Transfer-Encoding: chunked\r\nContent-Type: text/plain\r\n\r\n",
            d.addr
        );
        let body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n";
        let mut s = send_raw(d.addr, &head, body).await;
        let (status, _, echoed) = read_response(&mut s, PATIENCE).await;
        assert_eq!(status, 200, "{declared}: {echoed}");
        assert_eq!(echoed, "hello world", "Content-Length: {declared}");
    }
}
