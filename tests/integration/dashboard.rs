//! The dashboard: `GET /ui` and its files (open, built in, light) and `GET /events` (keyed,
//! never starting the engine), and the page itself in a real browser (Debian's Chromium,
//! headless) against a daemon with the fake engine and the Strix Halo sysroot fixture.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;
use dsv4_client::State;

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
    assert!(events.contains("event: hello\ndata: {"), "{events}");
    for part in ["\"history\":[", "\"alerts\":[", "\"validations\":["] {
        assert!(events.contains(part), "no {part} in {events}");
    }
    assert!(events.contains("\"thresholds\":{\"critical_c\":95.0,\"warn_c\":85.0}"));
    assert_eq!(d.spawns(), 0, "the dashboard started the engine");
    assert_eq!(d.get("/health").await.1["engine"], State::Stopped.as_str());
}

/// Opening the page in a real browser, which loads all it asks for (an icon too, were one
/// asked for: a request for it would go to the engine), never starts the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_the_page_in_a_browser_never_starts_the_engine() {
    let d = Daemon::start(&Setup::default());
    let dom = chromium(&format!("http://{}/ui", d.addr));
    assert!(dom.contains("data-state=\"stopped\">stopped<"), "{dom}");
    assert_eq!(
        d.status().await["state"],
        State::Stopped.as_str(),
        "{}",
        d.log()
    );
    assert_eq!(d.spawns(), 0, "opening the page started the engine");
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

/// Chromium, headless, driven over its DevTools pipe (`--remote-debugging-pipe`: commands
/// on its fd 3, answers on its fd 4, each a JSON message ended by a NUL byte).
struct Browser {
    child: std::process::Child,
    commands: std::fs::File,
    answers: std::io::BufReader<std::fs::File>,
    next_id: u64,
    session: Option<String>,
    _profile: TempDir,
}

impl Browser {
    fn start() -> Browser {
        use std::os::fd::{AsRawFd, OwnedFd};
        use std::os::unix::process::CommandExt;
        let (cmd_read, cmd_write): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
        let (ans_read, ans_write): (OwnedFd, OwnedFd) = nix::unistd::pipe().unwrap();
        let profile = temp_dir("chromium-cdp");
        let (r, w) = (cmd_read.as_raw_fd(), ans_write.as_raw_fd());
        let mut command = std::process::Command::new("chromium");
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-pipe",
                "--window-size=1280,1700",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // SAFETY: only dup2 between fork and exec, which is async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command
            .spawn()
            .expect("chromium (Debian's package `chromium`; .ci/run installs it)");
        drop((cmd_read, ans_write));
        Browser {
            child,
            commands: std::fs::File::from(cmd_write),
            answers: std::io::BufReader::new(std::fs::File::from(ans_read)),
            next_id: 1,
            session: None,
            _profile: profile,
        }
    }

    /// Sends `method` (to the page once one is open) and returns its result, skipping the
    /// events that come meanwhile.
    fn call(&mut self, method: &str, params: serde_json::Value) -> serde_json::Value {
        use std::io::{BufRead, Write};
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = serde_json::json!({ "id": id, "method": method, "params": params });
        if let Some(s) = &self.session {
            msg["sessionId"] = s.clone().into();
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.commands.write_all(&bytes).unwrap();
        loop {
            let mut buf = Vec::new();
            let n = self.answers.read_until(0, &mut buf).unwrap();
            assert!(n > 0, "chromium closed its DevTools pipe");
            buf.pop();
            let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
            if v["id"] == id {
                assert!(v["error"].is_null(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Opens `url` in a new page and talks to that page from then on.
    fn open(&mut self, url: &str) {
        let target = self.call("Target.createTarget", serde_json::json!({ "url": url }));
        let attached = self.call(
            "Target.attachToTarget",
            serde_json::json!({ "targetId": target["targetId"], "flatten": true }),
        );
        self.session = attached["sessionId"].as_str().map(String::from);
    }

    /// The value of a JavaScript expression in the page.
    fn eval(&mut self, expression: &str) -> serde_json::Value {
        let r = self.call(
            "Runtime.evaluate",
            serde_json::json!({ "expression": expression, "returnByValue": true }),
        );
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page; how long that took.
    fn wait_for(&mut self, expression: &str, within: Duration) -> Duration {
        let t = Instant::now();
        while self.eval(expression) != true {
            assert!(t.elapsed() < within, "never true in the page: {expression}");
            std::thread::sleep(Duration::from_millis(20));
        }
        t.elapsed()
    }

    /// A PNG of the page as it is shown.
    fn screenshot(&mut self, path: &std::path::Path) {
        use base64::Engine;
        let shot = self.call(
            "Page.captureScreenshot",
            serde_json::json!({ "format": "png" }),
        );
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// With the page open in a real browser, a request made meanwhile shows up in its table
/// within 2 s, without reloading it. A screenshot of the page is kept
/// (`target/dashboard.png`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_made_while_the_page_is_open_shows_up_in_it_within_2_s() {
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(
        &Setup::default()
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 200ms, idle_interval: 200ms }"),
    );
    let url = format!("http://{}/ui", d.addr);
    let mut browser = tokio::task::block_in_place(|| {
        let mut b = Browser::start();
        b.open(&url);
        b.wait_for(
            "document.getElementById('live').textContent === 'live' && \
             document.getElementById('state').textContent === 'stopped'",
            PATIENCE,
        );
        b
    });
    let rows = "document.querySelectorAll('#requests tbody tr').length";
    assert_eq!(tokio::task::block_in_place(|| browser.eval(rows)), 0);
    // Loaded whole (an icon too, were one asked for), and the engine still stopped.
    tokio::task::block_in_place(|| {
        browser.wait_for("document.readyState === 'complete'", PATIENCE)
    });
    assert_eq!(d.spawns(), 0, "opening the page started the engine");
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    let took = tokio::task::block_in_place(|| {
        browser.wait_for(
            "document.querySelectorAll('#requests tbody tr').length === 1 && \
             document.querySelector('#requests tbody td:nth-child(3)').textContent === \
             '/v1/chat/completions'",
            Duration::from_secs(2),
        )
    });
    tokio::task::block_in_place(|| {
        browser.wait_for(
            "document.getElementById('state').textContent === 'ready' && \
             document.getElementById('chart-gtt').dataset.points > 0",
            PATIENCE,
        );
        let shot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/dashboard.png");
        browser.screenshot(&shot);
        assert!(
            std::fs::metadata(&shot).unwrap().len() > 10_000,
            "an empty screenshot"
        );
    });
    println!("the request showed up in the open page {took:?} after its answer");
}

/// Alerts raised while the page is open show up in it as they come, and a page opened later
/// lists the latest ones; saved validation runs are listed with their decode and prefill
/// trend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_and_validation_runs_show_up_in_the_page() {
    let d = Daemon::start(&Setup::default());
    // Two saved validation runs, as `dsv4ctl validate` leaves them.
    let runs = d.dir().join("state/validations");
    std::fs::create_dir_all(&runs).unwrap();
    for (i, decode) in [38.5, 41.0].into_iter().enumerate() {
        let test = |name: &str, mean: f64| dsv4_client::validate::TestResult {
            name: name.into(),
            unit: "tok/s".into(),
            runs: vec![mean],
            mean,
            ..Default::default()
        };
        let run = dsv4_client::validate::ValidationResult {
            profile: "64k".into(),
            started: 1_790_000_000.0 + i as f64 * 3600.0,
            finished: 1_790_000_100.0 + i as f64 * 3600.0,
            tests: vec![test("decode", decode), test("prefill", 240.0 + i as f64)],
            ..Default::default()
        };
        let file = runs.join(format!("run-{i}.json"));
        std::fs::write(file, serde_json::to_vec(&run).unwrap()).unwrap();
    }
    let url = format!("http://{}/ui", d.addr);
    let mut browser = tokio::task::block_in_place(|| {
        let mut b = Browser::start();
        b.open(&url);
        b.wait_for(
            "document.getElementById('live').textContent === 'live'",
            PATIENCE,
        );
        b
    });
    let shown = tokio::task::block_in_place(|| {
        browser.eval(
            "[document.querySelectorAll('#validations tbody tr').length, \
              document.getElementById('chart-validation').dataset.points, \
              document.querySelector('#validations tbody td:nth-child(3)').textContent]",
        )
    });
    assert_eq!(shown[0], 2, "{shown}");
    assert_eq!(shown[1], "4", "{shown}");
    assert_eq!(
        shown[2], "decode 41.0 tok/s; prefill 241.0 tok/s",
        "{shown}"
    );
    // A rejected configuration raises an alert.
    replace_file(&d.dir().join("supervisor.yaml"), "api: [not, a, mapping]\n");
    tokio::task::block_in_place(|| {
        browser.wait_for(
            "document.getElementById('alerts').textContent.includes('configuration change rejected')",
            PATIENCE,
        )
    });
    // A page opened afterwards lists it too.
    let dom = chromium(&url);
    assert!(
        dom.contains("configuration change rejected"),
        "the alert is not listed in a new page:\n{dom}"
    );
}
