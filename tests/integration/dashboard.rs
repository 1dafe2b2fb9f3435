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
    let dom = page_once(
        &format!("http://{}/ui", d.addr),
        "document.readyState === 'complete' && \
         document.getElementById('live').textContent === 'live' && \
         document.getElementById('state').textContent === 'stopped'",
    );
    assert!(dom.contains("data-state=\"stopped\">stopped<"), "{dom}");
    // Without admin keys it only looks, and names the command for each action.
    assert!(dom.contains("<div id=\"actions-on\" hidden=\"\">"), "{dom}");
    for command in [
        "dsv4ctl start",
        "dsv4ctl stop --now",
        "dsv4ctl profile 320k",
    ] {
        assert!(dom.contains(command), "{command} not in\n{dom}");
    }
    assert_eq!(
        d.status().await["state"],
        State::Stopped.as_str(),
        "{}",
        d.log()
    );
    assert_eq!(d.spawns(), 0, "opening the page started the engine");
}

/// The page at `url` in a real browser once `condition` (JavaScript) holds in it, as HTML:
/// the page fills itself from an event stream, so it is read when what the test looks for
/// has come, not after a fixed time.
pub(crate) fn page_once(url: &str, condition: &str) -> String {
    tokio::task::block_in_place(|| {
        Browser::opened(url, condition)
            .eval("document.documentElement.outerHTML")
            .as_str()
            .unwrap_or_default()
            .to_string()
    })
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
    let dom = page_once(
        &format!("http://{}/ui", d.addr),
        "document.getElementById('state').textContent === 'ready' && \
         document.getElementById('live').textContent === 'live' && \
         ['gtt', 'memory', 'temperature', 'power'].every(c => \
           document.getElementById('chart-' + c).dataset.points > 0) && \
         document.querySelectorAll('#requests tbody tr').length === 1",
    );
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
pub(crate) struct Browser {
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

    /// A browser with `url` open, once `condition` (JavaScript) holds in the page.
    pub(crate) fn opened(url: &str, condition: &str) -> Browser {
        let mut b = Browser::start();
        b.open(url);
        b.wait_for(condition, PATIENCE);
        b
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
    pub(crate) fn eval(&mut self, expression: &str) -> serde_json::Value {
        let r = self.call(
            "Runtime.evaluate",
            serde_json::json!({ "expression": expression, "returnByValue": true }),
        );
        r["result"]["value"].clone()
    }

    /// The value of a JavaScript expression that gives a promise, once it settles.
    fn eval_await(&mut self, expression: &str) -> serde_json::Value {
        let r = self.call(
            "Runtime.evaluate",
            serde_json::json!({
                "expression": expression,
                "returnByValue": true,
                "awaitPromise": true,
            }),
        );
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true in the page; how long that took.
    pub(crate) fn wait_for(&mut self, expression: &str, within: Duration) -> Duration {
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
        Browser::opened(
            &url,
            "document.getElementById('live').textContent === 'live' && \
             document.getElementById('state').textContent === 'stopped'",
        )
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
             document.querySelector('#requests tbody td:nth-child(4)').textContent === \
             '/v1/chat/completions'",
            Duration::from_secs(2) + LOAD_MARGIN,
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
    // Live as soon as the stream answers; the runs once its hello (in pieces) has come.
    let mut browser = tokio::task::block_in_place(|| {
        Browser::opened(
            &url,
            "document.getElementById('live').textContent === 'live' && \
             document.querySelectorAll('#validations tbody tr').length > 0",
        )
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
    let dom = page_once(
        &url,
        "document.getElementById('alerts').textContent.includes('configuration change rejected')",
    );
    assert!(
        dom.contains("configuration change rejected"),
        "the alert is not listed in a new page:\n{dom}"
    );
}

/// The last matrix run shows with a row per cell, its pick marked, the verdict and the
/// suggested change, even when a plain validation ran after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_matrix_shows_its_cells_and_verdict_in_the_page() {
    use dsv4_client::validate::{Cell, CellSettings, Matrix, TestResult, ValidationResult};
    let d = Daemon::start(&Setup::default());
    let runs = d.dir().join("state/validations");
    std::fs::create_dir_all(&runs).unwrap();
    let cell = |index: u32, cpu: &str, decode: f64, watts: f64| Cell {
        index,
        settings: CellSettings {
            cpu: Some(cpu.into()),
            ..Default::default()
        },
        tests: vec![TestResult {
            name: "decode".into(),
            runs: vec![decode],
            mean: decode,
            telemetry: dsv4_client::validate::TestTelemetry {
                soc_power_mean_w: Some(watts),
                joules_per_token: Some(watts / decode),
                ..Default::default()
            },
            ..Default::default()
        }],
        ..Default::default()
    };
    let mut m = Matrix {
        cells: vec![
            cell(1, "performance", 16.02, 102.0),
            cell(2, "power-saver", 16.0, 85.0),
        ],
        planned: 2,
        snippet: Some("power:\n  cpu: power-saver\n".into()),
        ..Default::default()
    };
    m.verdict = dsv4_client::validate::verdict(&m.cells);
    let matrix = ValidationResult {
        profile: "64k".into(),
        started: 1_790_000_000.0,
        matrix: Some(m),
        ..Default::default()
    };
    let plain = ValidationResult {
        profile: "64k".into(),
        started: 1_790_003_600.0,
        ..Default::default()
    };
    for (name, run) in [("matrix", &matrix), ("plain", &plain)] {
        let file = runs.join(format!("{name}.json"));
        std::fs::write(file, serde_json::to_vec(run).unwrap()).unwrap();
    }
    let url = format!("http://{}/ui", d.addr);
    let mut browser = tokio::task::block_in_place(|| {
        Browser::opened(
            &url,
            "document.querySelectorAll('#matrix tbody tr').length > 0",
        )
    });
    let shown = tokio::task::block_in_place(|| {
        browser.eval(
            "[document.querySelectorAll('#matrix tbody tr').length, \
              document.querySelector('#matrix tbody tr.picked td:nth-child(2)').textContent, \
              document.getElementById('matrix-verdict').textContent, \
              document.getElementById('matrix-snippet').textContent, \
              document.getElementById('matrix-none').hidden]",
        )
    });
    assert_eq!(shown[0], 2, "{shown}");
    assert_eq!(shown[1], "cpu=power-saver", "{shown}");
    assert!(
        shown[2].as_str().unwrap().contains("Verdict: cell 2:"),
        "{shown}"
    );
    assert_eq!(shown[3], "power:\n  cpu: power-saver\n", "{shown}");
    assert_eq!(shown[4], true, "{shown}");
}

const ADMIN: &str = "sk-dsv4-admin-fedcba9876543210";

/// POSTs the dashboard action `name` with `headers` and a JSON `body`.
async fn action(
    d: &Daemon,
    name: &str,
    headers: &[(&str, &str)],
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    let (status, _, v) = d
        .send("POST", &format!("/ui/actions/{name}"), headers, Some(body))
        .await;
    (status, v)
}

/// Headers of a request, as pairs.
type Headers<'a> = &'a [(&'a str, &'a str)];

/// POSTs the dashboard action `name` and checks that it is refused with `status` and
/// `code`; the error's message.
async fn refused(
    d: &Daemon,
    name: &str,
    headers: Headers<'_>,
    body: serde_json::Value,
    (status, code): (u16, &str),
) -> String {
    let (got, v) = action(d, name, headers, body).await;
    assert_eq!(
        (got, v["error"]["code"].as_str()),
        (status, Some(code)),
        "{name} {headers:?}: {v}"
    );
    v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The dashboard's actions: off without admin keys; with them, only with an admin key (an
/// API key is not one) and only from dsv4d's own page, whatever `api.cors_origins` says;
/// and then they act, through the same path as D-Bus, and the log says who asked. Nothing
/// under /ui reaches the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_actions_need_an_admin_key_and_its_own_page() {
    let d = Daemon::start(
        &Setup::default()
            .api_keys_file(&format!("{KEY}\n"), 0o600)
            .admin_keys_file(&format!("{ADMIN}\n")),
    );
    let own = format!("http://{}", d.addr);
    let admin = format!("Bearer {ADMIN}");
    let api = format!("Bearer {KEY}");
    let switch = serde_json::json!({ "profile": "64k" });
    let refusals: [(Headers, u16, &str); 7] = [
        // A tool, without the page.
        (&[("authorization", &admin)], 403, "not_same_origin"),
        // Another page.
        (
            &[("authorization", &admin), ("origin", "http://127.0.0.2:9")],
            403,
            "origin_not_allowed",
        ),
        (
            &[
                ("authorization", &admin),
                ("origin", &own),
                ("sec-fetch-site", "cross-site"),
            ],
            403,
            "not_same_origin",
        ),
        // The page, without the admin key.
        (&[("origin", &own)], 401, "invalid_admin_key"),
        (
            &[("origin", &own), ("authorization", &api)],
            401,
            "invalid_admin_key",
        ),
        (
            &[
                ("origin", &own),
                ("authorization", "Bearer sk-dsv4-admin-guess-000000"),
            ],
            401,
            "invalid_admin_key",
        ),
        (
            &[
                ("origin", &own),
                ("authorization", &admin),
                ("x-api-key", ADMIN),
            ],
            400,
            "several_credentials",
        ),
    ];
    for (headers, status, code) in refusals {
        refused(&d, "profile", headers, switch.clone(), (status, code)).await;
    }
    let page = [("origin", own.as_str()), ("authorization", admin.as_str())];
    let same = [
        ("origin", own.as_str()),
        ("authorization", admin.as_str()),
        ("sec-fetch-site", "same-origin"),
    ];
    for (name, body, status, code) in [
        (
            "profile",
            serde_json::json!({ "profile": "1m" }),
            404,
            "unknown_profile",
        ),
        ("profile", serde_json::json!({}), 400, "bad_body"),
        (
            "profile",
            serde_json::json!({ "profile": "64k", "now": true }),
            400,
            "bad_body",
        ),
        (
            "validate",
            serde_json::json!({ "runs": 0 }),
            400,
            "bad_body",
        ),
        ("reboot", serde_json::json!({}), 404, "not_found"),
    ] {
        refused(&d, name, &page, body, (status, code)).await;
    }
    let (got, headers, v) = d.send("GET", "/ui/actions/start", &page, None).await;
    assert_eq!(got, 405, "{v}");
    assert_eq!(headers["allow"], "POST");
    let (got, headers, v) = d
        .send("POST", "/ui/actions/start", &[("origin", &own)], None)
        .await;
    assert_eq!(got, 401, "{v}");
    assert_eq!(headers["www-authenticate"], "Bearer");
    // Encoded, the path is judged as decoded: still the actions, never the engine.
    for path in [
        "/%75i/actions/start",
        "/ui%2Factions%2Fstart",
        "/UI/../ui/actions/start",
    ] {
        let (got, _, v) = d.send("POST", path, &[("origin", &own)], None).await;
        assert!(got == 401 || got == 400, "{path}: {got} {v}");
    }
    for (name, body) in [
        ("start", serde_json::json!({ "profile": "64k" })),
        ("cancel-validation", serde_json::json!({ "now": true })),
    ] {
        refused(&d, name, &page, body, (400, "bad_body")).await;
    }
    let message = refused(
        &d,
        "drop-checkpoint",
        &page,
        serde_json::json!({ "what": "320k" }),
        (404, "not_found"),
    )
    .await;
    assert!(
        message.contains("no KV checkpoint matches `320k`"),
        "{message}"
    );
    let (got, v) = action(&d, "cancel-validation", &page, serde_json::json!({})).await;
    assert_eq!(got, 200, "{v}");
    assert_eq!(v["cancelled"], false, "{v}");
    let (got, _, v) = d.send("POST", "/ui/other", &page, None).await;
    assert_eq!(
        (got, v["error"]["code"].as_str()),
        (404, Some("not_found")),
        "{v}"
    );
    let keyed = [("authorization", api.as_str())];
    let (_, _, st) = d.send("GET", "/status", &keyed, None).await;
    assert_eq!(st["profile"], "320k", "{st}");
    assert_eq!(
        d.spawns(),
        0,
        "a refused action or a /ui path reached the engine"
    );

    // From the page, with the admin key: it acts.
    let (got, v) = action(&d, "profile", &same, switch.clone()).await;
    assert_eq!(got, 200, "{v}");
    assert_eq!(
        v,
        serde_json::json!({ "action": "profile", "profile": "64k" })
    );
    let (_, _, st) = d.send("GET", "/status", &keyed, None).await;
    assert_eq!(st["profile"], "64k", "{st}");
    let state_is = |want: State| {
        let (d, keyed) = (&d, &keyed);
        async move {
            let t = Instant::now();
            loop {
                let (_, _, st) = d.send("GET", "/status", keyed, None).await;
                if st["state"] == want.as_str() {
                    return;
                }
                assert!(t.elapsed() < PATIENCE, "never {want:?}: {st}\n{}", d.log());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let (got, v) = action(&d, "start", &page, serde_json::json!({})).await;
    assert_eq!(got, 200, "{v}");
    state_is(State::Ready).await;
    assert!(d.starts()[0].contains("64k"), "{:?}", d.starts());
    let (got, v) = action(&d, "stop-now", &page, serde_json::json!({})).await;
    assert_eq!(got, 200, "{v}");
    state_is(State::Stopped).await;
    d.log_with(&[
        "profile \"64k\", asked by the dashboard (admin key)",
        "start, asked by the dashboard (admin key)",
        "stop now, asked by the dashboard (admin key)",
    ])
    .await;

    // A validation from the page runs, and is kept.
    let (got, v) = action(
        &d,
        "validate",
        &page,
        serde_json::json!({ "profile": "64k", "runs": 1, "prefill": 64 }),
    )
    .await;
    assert_eq!(got, 200, "{v}");
    assert_eq!(v["profile"], "64k", "{v}");
    let runs = d.dir().join("state/validations");
    let t = Instant::now();
    while !runs.is_dir() || files_with_extension(&runs, "json").is_empty() {
        assert!(t.elapsed() < PATIENCE, "no validation kept\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.log_with(&["validation of \"64k\", asked by the dashboard (admin key)"])
        .await;
    // An admin key file made unusable (open to others) refuses every action at the next
    // reload, with 503 and the reason, until it is fixed.
    let admin_file = d.dir().join(ADMIN_KEYS_FILE);
    std::fs::set_permissions(
        &admin_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .unwrap();
    d.signal(nix::sys::signal::Signal::SIGHUP);
    d.log_with(&["every action of the dashboard now gets 503"])
        .await;
    let message = refused(
        &d,
        "start",
        &page,
        serde_json::json!({}),
        (503, "api_keys_unavailable"),
    )
    .await;
    assert!(
        message.contains("the admin keys cannot be loaded"),
        "{message}"
    );

    // `*` in cors_origins lets other pages use the API, never the actions.
    let open = Daemon::start(
        &Setup::default()
            .admin_keys_file(&format!("{ADMIN}\n"))
            .api("cors_origins", "[\"*\"]"),
    );
    let other_page = [("origin", "http://127.0.0.2:9"), ("authorization", &admin)];
    let start = serde_json::json!({});
    refused(
        &open,
        "start",
        &other_page,
        start.clone(),
        (403, "not_same_origin"),
    )
    .await;
    // Without admin keys there are no actions, and the page says so.
    let off = Daemon::start(&Setup::default());
    let own = format!("http://{}", off.addr);
    let message = refused(
        &off,
        "start",
        &[("origin", &own), ("authorization", &admin)],
        start,
        (403, "actions_off"),
    )
    .await;
    assert!(message.contains("api.admin_keys_file"), "{message}");
    assert_eq!(open.spawns() + off.spawns(), 0);
}

/// In a real browser: the page shows its actions once admin keys are configured; a wrong
/// admin key typed in is refused and changes nothing; the right one switches the profile.
/// A page of another origin (the same daemon named `localhost`) cannot act with the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_key_in_the_page_switches_the_profile_and_without_one_it_is_refused() {
    let d = Daemon::start(&Setup::default().admin_keys_file(&format!("{ADMIN}\n")));
    let url = format!("http://{}/ui", d.addr);
    let mut browser = tokio::task::block_in_place(|| {
        Browser::opened(
            &url,
            "document.getElementById('live').textContent === 'live' && \
             !document.getElementById('actions-on').hidden && \
             document.getElementById('profile-choice').options.length === 2",
        )
    });
    let switch = |b: &mut Browser, key: &str| {
        b.eval(&format!(
            "document.getElementById('admin-key').value = {key:?}; \
             document.getElementById('profile-choice').value = '64k'; \
             document.querySelector('#profile-form button').click(); true"
        ));
    };
    let result = "document.getElementById('action-result').textContent";
    tokio::task::block_in_place(|| {
        switch(&mut browser, "sk-dsv4-admin-wrong-0000000000");
        browser.wait_for(&format!("{result}.includes('invalid admin key')"), PATIENCE);
    });
    assert_eq!(d.status().await["profile"], "320k");
    tokio::task::block_in_place(|| {
        switch(&mut browser, ADMIN);
        browser.wait_for(&format!("{result} === 'profile 64k: done'"), PATIENCE);
        browser.wait_for(
            "document.getElementById('profile').textContent === '64k'",
            PATIENCE,
        );
    });
    assert_eq!(d.status().await["profile"], "64k");
    assert_eq!(d.spawns(), 0);
    // Another page, on a daemon whose API any page may use (`cors_origins: ["*"]`), with
    // the key: the browser's preflight passes, and the action itself is refused.
    let open = Daemon::start(
        &Setup::default()
            .admin_keys_file(&format!("{ADMIN}\n"))
            .api("cors_origins", "[\"*\"]"),
    );
    let outcome = tokio::task::block_in_place(|| {
        browser.open("about:blank");
        browser.eval_await(&format!(
            "fetch('http://{}/ui/actions/profile', {{ method: 'POST', \
               headers: {{ Authorization: 'Bearer {ADMIN}', 'Content-Type': 'application/json' }}, \
               body: JSON.stringify({{ profile: '64k' }}) }}) \
             .then(async r => r.status + ' ' + (await r.json()).error.code, e => 'failed: ' + e)",
            open.addr
        ))
    });
    assert_eq!(outcome, "403 not_same_origin", "{}", open.log());
    assert_eq!(open.status().await["profile"], "320k");
    assert_eq!(open.spawns(), 0);
}
