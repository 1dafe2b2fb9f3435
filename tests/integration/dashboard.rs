//! The dashboard: `GET /ui` and its files (open, built in, light) and `GET /events` (keyed,
//! never starting the engine), and the page itself in a real browser (Debian's Chromium,
//! headless) against a daemon with the fake engine and the Strix Halo sysroot fixture.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

const KEY: &str = "sk-dsv4-test-0123456789abcdef";

/// The first `want` bytes' worth of a GET that may never end (an event stream): the head
/// and what of the body came, read until `until` appears in it.
async fn get_start(d: &Daemon, path: &str, headers: &[(&str, &str)], until: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\n", d.addr);
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let t = Instant::now();
    while !String::from_utf8_lossy(&got).contains(until) {
        assert!(
            t.elapsed() < PATIENCE,
            "no {until:?} in {}",
            String::from_utf8_lossy(&got)
        );
        let mut buf = [0u8; 16 << 10];
        match tokio::time::timeout(PATIENCE, s.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => panic!("reading {path}: {e}"),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// The page and its files need no key and hold no data; the event stream is an API path
/// like any other. Nothing here starts the engine, and the page's files are light.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_open_the_events_are_keyed_and_nothing_starts_the_engine() {
    let d = Daemon::start(&Setup::default().api_keys_file(&format!("{KEY}\n"), 0o600));
    let mut total = 0;
    for (path, kind) in [
        ("/ui", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let head = get_start(&d, path, &[], "\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        assert!(
            head.to_ascii_lowercase()
                .contains(&format!("content-type: {kind}")),
            "{path}: {head}"
        );
        assert!(
            head.contains("default-src 'none'; script-src 'self'"),
            "{path}: no CSP: {head}"
        );
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length: ")
                    .map(String::from)
            })
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("{path}: no length: {head}"));
        total += len;
    }
    assert!(total < 200 << 10, "the page's files are {total} bytes");
    let refused = get_start(&d, "/events", &[], "\r\n\r\n").await;
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    let bearer = format!("Bearer {KEY}");
    let events = get_start(
        &d,
        "/events",
        &[("Authorization", &bearer)],
        "event: status",
    )
    .await;
    assert!(events.starts_with("HTTP/1.1 200"), "{events}");
    assert!(events.contains("text/event-stream"), "{events}");
    assert!(
        events.contains("event: hello\ndata: {\"history\":"),
        "{events}"
    );
    assert!(events.contains("\"thresholds\":{\"critical_c\":95.0,\"warn_c\":85.0}"));
    assert_eq!(d.spawns(), 0, "the dashboard started the engine");
    assert_eq!(d.get("/health").await.1["engine"], "stopped");
}

/// The number in `data-points="N"` of the chart `id`.
fn points(dom: &str, id: &str) -> usize {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no {id} in the page"));
    let tag = &dom[dom[..at].rfind('<').unwrap()..];
    let tag = &tag[..tag.find('>').unwrap()];
    tag.split("data-points=\"")
        .nth(1)
        .and_then(|r| r.split('"').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{id} has no points: {tag}"))
}

/// In a real browser, the page shows the engine's state, the machine's charts with their
/// points (GTT, memory, temperatures, SoC power from the fixture), and the requests with
/// their tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_browser_shows_the_state_the_charts_and_the_requests() {
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(
        &Setup::default()
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 200ms, idle_interval: 200ms }"),
    );
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    // Samples to draw: a few, of the running engine.
    let t = Instant::now();
    while d.status().await["telemetry"]["gpu"]["gtt_used"].is_null() {
        assert!(t.elapsed() < PATIENCE, "no sample");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dom = chromium(&format!("http://{}/ui", d.addr));
    assert!(
        dom.contains("data-state=\"ready\">ready<"),
        "the state is not shown:\n{dom}"
    );
    assert!(dom.contains("class=\"live on\">live<"), "not live:\n{dom}");
    for chart in [
        "chart-gtt",
        "chart-memory",
        "chart-temperature",
        "chart-power",
    ] {
        assert!(points(&dom, chart) > 0, "{chart} has no points:\n{dom}");
    }
    assert!(
        dom.contains("<td>/v1/chat/completions</td>"),
        "the request is not in the table:\n{dom}"
    );
    assert!(dom.contains("1 requests:"), "no totals:\n{dom}");
    assert_eq!(d.spawns(), 1);
}
