//! The dashboard's event streams (`GET /events`) hold little whatever their clients do:
//! clients that never read cost the daemon a bounded amount each, the memory comes back
//! when they leave, and at most `api.max_event_streams` are open at once.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

/// Resident memory of `pid` (`VmRSS`), in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in {status}"))
}

/// Bytes that came to `s` and were not read yet.
fn unread(s: &TcpStream) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer.
    let r = unsafe { libc::ioctl(s.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n
}

/// A connection that asked for `/events` (and reads nothing yet).
async fn subscribe(d: &Daemon) -> TcpStream {
    let mut s = TcpStream::connect(d.addr).await.unwrap();
    let req = format!("GET /events HTTP/1.1\r\nHost: {}\r\n\r\n", d.addr);
    s.write_all(req.as_bytes()).await.unwrap();
    s
}

/// What came on `s` until `until` appears in it (or it ends).
async fn read_until(s: &mut TcpStream, until: &str) -> String {
    let mut got = Vec::new();
    let t = Instant::now();
    let mut buf = vec![0u8; 256 << 10];
    let until = until.as_bytes();
    loop {
        assert!(
            t.elapsed() < PATIENCE,
            "no {:?} in {} bytes",
            String::from_utf8_lossy(until),
            got.len()
        );
        let n = match tokio::time::timeout(PATIENCE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => n,
            Ok(Err(e)) => panic!("reading /events: {e}"),
        };
        // Only where the new bytes could complete it.
        let from = got.len().saturating_sub(until.len());
        got.extend_from_slice(&buf[..n]);
        if got[from..].windows(until.len()).any(|w| w == until) {
            break;
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// The body of a chunked response `raw` (head and all), as far as it came.
fn dechunk(raw: &str) -> String {
    let mut rest = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let mut body = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size, 16).unwrap_or_else(|_| panic!("chunk {size:?}"));
        let Some(chunk) = after.get(..size) else {
            break;
        };
        body.push_str(chunk);
        rest = after.get(size + 2..).unwrap_or("");
    }
    body
}

/// The `hello` of a new stream, read whole and parsed.
async fn hello(d: &Daemon) -> serde_json::Value {
    let mut s = subscribe(d).await;
    let got = dechunk(&read_until(&mut s, "event: status").await);
    let data = got
        .split("event: hello\ndata: ")
        .nth(1)
        .and_then(|r| r.split("\n\n").next())
        .unwrap_or_else(|| panic!("no hello in {}", &got[..got.len().min(2000)]));
    serde_json::from_str(data).unwrap_or_else(|e| panic!("the hello is not JSON: {e}"))
}

/// 50 clients open `/events` against an hour's worth of samples (3,700, taken every
/// millisecond from the Strix Halo fixture) and never read. Each used to hold the whole
/// `hello` for as long as it stayed, about 19 MB; now a stream holds a few pieces of it, and
/// what the daemon takes while they stay comes back once they leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_streams_that_never_read_hold_little_and_give_it_back() {
    const STREAMS: usize = 50;
    const FULL: usize = 3600;
    let tree = fixture_copy("strix-halo");
    let setup = Setup::default()
        .args(&["--sysroot", tree.path().to_str().unwrap()])
        .api("max_event_streams", "64")
        .top_level("monitor", "{ interval: 1ms, idle_interval: 1ms }");
    let d = Daemon::start(&setup);
    // The ring fills: the hello carries an hour's worth of samples.
    let t = Instant::now();
    let hello = loop {
        let h = hello(&d).await;
        let n = h["history"].as_array().map_or(0, Vec::len);
        if n >= FULL {
            break h;
        }
        assert!(t.elapsed() < 4 * PATIENCE, "{n} samples only");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    for part in ["thresholds", "alerts", "thermal", "validations", "profiles"] {
        assert!(!hello[part].is_null(), "no {part} in the hello");
    }
    assert!(
        hello["history"][0]["gpu"].is_object(),
        "{}",
        hello["history"][0]
    );
    let hello_bytes = hello.to_string().len();
    drop(hello);
    // Sampling slows down so that the ring holds still.
    d.reconfigure(
        &setup
            .clone()
            .top_level("monitor", "{ interval: 10s, idle_interval: 10s }"),
    )
    .await;
    let pid = d.pid();
    let before = rss_kib(pid);

    let mut streams = Vec::new();
    for _ in 0..STREAMS {
        streams.push(subscribe(&d).await);
    }
    // Each stream has written what its socket takes: every client has more unread than a
    // response head (part of the hello has come), and the same over a second. The highest
    // resident memory seen meanwhile is the figure.
    // A stream holds a few pieces of the hello, not the hello (each took about 20 MB).
    let bound = before + STREAMS as u64 * 256;
    let mut during = before;
    let mut last = Vec::new();
    let mut still_since = Instant::now();
    let t = Instant::now();
    while during <= bound {
        during = during.max(rss_kib(pid));
        let now: Vec<i32> = streams.iter().map(unread).collect();
        if now != last || now.iter().any(|&n| n < 32 << 10) {
            (last, still_since) = (now, Instant::now());
        } else if still_since.elapsed() >= Duration::from_secs(1) {
            break;
        }
        assert!(
            t.elapsed() < PATIENCE,
            "the streams never settled: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    during = during.max(rss_kib(pid));
    let unread_total: i64 = last.iter().map(|&n| i64::from(n)).sum();

    drop(streams);
    // Back near where it was: wait for it, up to the test's patience.
    let near = before + 2 * 1024;
    let t = Instant::now();
    let mut after = rss_kib(pid);
    while after > near && t.elapsed() < PATIENCE {
        tokio::time::sleep(Duration::from_millis(100)).await;
        after = rss_kib(pid);
    }
    println!(
        "dsv4d resident memory with a {hello_bytes}-byte hello: before {before} KiB, with \
         {STREAMS} streams that never read {during} KiB ({} KiB each; their clients hold \
         {unread_total} bytes unread), after they left {after} KiB",
        (during.saturating_sub(before)) / STREAMS as u64
    );
    assert!(
        during <= bound,
        "{STREAMS} streams took dsv4d from {before} to {during} KiB (at most {bound})"
    );
    assert!(
        after <= near,
        "dsv4d kept {after} KiB after the streams left (before: {before} KiB)"
    );
}

/// One stream more than `api.max_event_streams` gets 503 `too_many_event_streams`, naming
/// the cap, and never the stream; once one leaves, a new one is let in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_more_than_the_cap_gets_503_naming_it() {
    let d = Daemon::start(&Setup::default().api("max_event_streams", "2"));
    let mut first = subscribe(&d).await;
    assert!(read_until(&mut first, "event: hello")
        .await
        .starts_with("HTTP/1.1 200"));
    let mut second = subscribe(&d).await;
    assert!(read_until(&mut second, "event: hello")
        .await
        .starts_with("HTTP/1.1 200"));
    // Read as far as the end of an error body: a stream (a 200) would never end.
    let mut third = subscribe(&d).await;
    let refused = read_until(&mut third, "}}").await;
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1"),
        "{refused}"
    );
    let body = refused.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(body["error"]["code"], "too_many_event_streams", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("api.max_event_streams is 2"), "{message}");
    drop(first);
    // Its place comes back once its stream has ended.
    let t = Instant::now();
    loop {
        let mut s = subscribe(&d).await;
        let head = read_until(&mut s, "\r\n\r\n").await;
        if head.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert!(t.elapsed() < PATIENCE, "the place never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(d.spawns(), 0, "an event stream started the engine");
}
