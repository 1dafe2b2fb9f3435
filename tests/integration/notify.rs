//! `dsv4ctl notify-agent` with a real notification server: dunst under Xvfb on a private
//! session bus, printing every notification it gets (`dunst -print`); the daemon on another
//! private bus, used as the system bus, as the system service is.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;

const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");
const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

/// One notification as dunst printed it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shown {
    pub(crate) appname: String,
    pub(crate) summary: String,
    pub(crate) body: String,
    pub(crate) urgency: String,
    pub(crate) id: String,
}

/// Lines collected from a child's output.
type Lines = Arc<Mutex<Vec<String>>>;

fn collect(out: impl std::io::Read + Send + 'static) -> Lines {
    let lines: Lines = Arc::default();
    let sink = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(line);
        }
    });
    lines
}

/// Xvfb and dunst on a session bus of their own; killed on drop.
pub(crate) struct Desktop {
    pub(crate) bus: PrivateBus,
    children: Vec<Child>,
    printed: Lines,
    _xvfb_out: std::process::ChildStdout,
}

impl Desktop {
    pub(crate) fn start() -> Desktop {
        let bus = PrivateBus::start();
        // Xvfb picks a free display and says which (-displayfd): tests run side by side.
        let mut xvfb = Command::new("Xvfb")
            .args([
                "-displayfd",
                "1",
                "-screen",
                "0",
                "800x600x24",
                "-nolisten",
                "tcp",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("Xvfb (apt-get install xvfb)");
        let mut number = String::new();
        // Kept open for Xvfb's life: a write to a closed pipe would end it.
        let xvfb_out = {
            use std::io::BufRead;
            let mut out = std::io::BufReader::new(xvfb.stdout.take().unwrap());
            let _ = out.read_line(&mut number);
            out.into_inner()
        };
        let number = number.trim();
        if number.is_empty() {
            let _ = xvfb.kill();
            panic!("Xvfb did not say its display");
        }
        let display = format!(":{number}");
        let mut dunst = Command::new("dunst")
            .arg("-print")
            .env("DISPLAY", &display)
            .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("dunst (apt-get install dunst)");
        let printed = collect(dunst.stdout.take().unwrap());
        let desktop = Desktop {
            bus,
            children: vec![dunst, xvfb],
            printed,
            _xvfb_out: xvfb_out,
        };
        // A notification sent before dunst has its name on the bus is not shown.
        let t = Instant::now();
        while !desktop.has_notification_server() {
            assert!(
                t.elapsed() < PATIENCE,
                "dunst never took org.freedesktop.Notifications"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        desktop
    }

    fn has_notification_server(&self) -> bool {
        Command::new("dbus-send")
            .args([
                "--session",
                "--print-reply",
                "--dest=org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus.NameHasOwner",
                "string:org.freedesktop.Notifications",
            ])
            .env("DBUS_SESSION_BUS_ADDRESS", &self.bus.address)
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("boolean true"))
    }

    /// The notifications printed so far.
    fn shown(&self) -> Vec<Shown> {
        let mut all = Vec::new();
        let mut cur: Option<Shown> = None;
        for l in self.printed.lock().unwrap().iter() {
            let l = l.trim();
            if l == "{" {
                cur = Some(Shown::default());
            } else if l == "}" {
                all.extend(cur.take());
            } else if let (Some(c), Some((k, v))) = (cur.as_mut(), l.split_once(": ")) {
                let v = v.trim_matches('\'').to_string();
                match k {
                    "appname" => c.appname = v,
                    "summary" => c.summary = v,
                    "body" => c.body = v,
                    "urgency" => c.urgency = v,
                    "id" => c.id = v,
                    _ => {}
                }
            }
        }
        all
    }

    /// Waits for the notification number `n` (from 0) and returns it.
    pub(crate) fn wait(&self, n: usize, within: Duration) -> Shown {
        let t = Instant::now();
        loop {
            let all = self.shown();
            if let Some(s) = all.get(n) {
                return s.clone();
            }
            assert!(
                t.elapsed() < within,
                "no notification #{n}; shown: {all:#?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Desktop {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `dsv4ctl --bus system notify-agent` between the daemon's bus and a desktop's.
pub(crate) struct Agent {
    child: Child,
    log: Lines,
}

impl Agent {
    pub(crate) fn start(system: &PrivateBus, session: &str) -> Agent {
        let mut child = Command::new(DSV4CTL)
            .args(["--bus", "system", "notify-agent"])
            .env("DBUS_SYSTEM_BUS_ADDRESS", &system.address)
            .env("DBUS_SESSION_BUS_ADDRESS", session)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = collect(child.stderr.take().unwrap());
        let agent = Agent { child, log };
        agent.wait_log("listening to dsv4d", PATIENCE);
        agent
    }

    fn wait_log(&self, needle: &str, within: Duration) {
        let t = Instant::now();
        while !self.log.lock().unwrap().iter().any(|l| l.contains(needle)) {
            assert!(
                t.elapsed() < within,
                "the agent never said {needle:?}: {:?}",
                self.log
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn daemon(system: &PrivateBus, tree: &TempDir) -> Daemon {
    Daemon::start(
        &Setup::default()
            .system_bus(system)
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 100ms, idle_interval: 100ms }"),
    )
}

/// Waits until `d` has its name on `system` and has taken a sample at `celsius` (edge).
async fn settled(d: &Daemon, system: &PrivateBus, celsius: f64) {
    live_proxy(system, d).await;
    let t = Instant::now();
    loop {
        let s = d.status().await;
        if s["telemetry"]["temperatures"]["edge"].as_f64() == Some(celsius) {
            return;
        }
        assert!(t.elapsed() < PATIENCE, "no sample at {celsius} C: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn edge(tree: &TempDir, celsius: f64) {
    let file = tree.path().join(DEVICE).join("hwmon/hwmon3/temp1_input");
    std::fs::write(file, format!("{}\n", (celsius * 1000.0) as i64)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thermal_events_become_desktop_notifications_and_survive_a_daemon_restart() {
    let desktop = Desktop::start();
    let system = PrivateBus::start();
    // The agent first: it waits for the daemon.
    let _agent = Agent::start(&system, &desktop.bus.address);
    let tree = fixture_copy("strix-halo");
    let d = daemon(&system, &tree);
    // The daemon has its name and a first sample at the fixture's 73 C.
    settled(&d, &system, 73.0).await;

    edge(&tree, 86.0);
    let warn = desktop.wait(0, PATIENCE);
    assert_eq!(warn.appname, "dsv4");
    assert_eq!(warn.summary, "dsv4: GPU hot: 86 C");
    assert!(warn.body.contains("86.0 C"), "{warn:?}");
    assert_eq!(warn.urgency, "NORMAL");
    // Exactly one for the warn level.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(desktop.shown().len(), 1, "{:#?}", desktop.shown());

    edge(&tree, 96.0);
    let critical = desktop.wait(1, PATIENCE);
    assert_eq!(critical.summary, "dsv4: GPU critically hot: 96 C");
    assert_eq!(critical.urgency, "CRITICAL");
    assert_eq!(
        critical.id, warn.id,
        "it did not replace the earlier bubble"
    );
    assert!(
        critical
            .body
            .ends_with("dsv4d: only notifies (thermal.on_critical: notify)."),
        "{critical:?}"
    );

    edge(&tree, 79.0);
    let normal = desktop.wait(2, PATIENCE);
    assert_eq!(normal.summary, "dsv4: GPU temperature back to normal: 79 C");

    let metrics = tree.path().join(DEVICE).join("gpu_metrics");
    let mut blob = std::fs::read(&metrics).unwrap();
    blob[248..252].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&metrics, &blob).unwrap();
    let throttling = desktop.wait(3, PATIENCE);
    assert_eq!(throttling.summary, "dsv4: the hardware is throttling");

    // The daemon restarts under the agent: its events still arrive.
    let _ = d.stop().await;
    let d = daemon(&system, &tree);
    settled(&d, &system, 79.0).await;
    edge(&tree, 87.0);
    let t = Instant::now();
    while !desktop
        .shown()
        .iter()
        .any(|s| s.summary == "dsv4: GPU hot: 87 C")
    {
        assert!(
            t.elapsed() < PATIENCE,
            "nothing after the restart: {:#?}\n{}",
            desktop.shown(),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_that_starts_on_a_hot_machine_says_so() {
    // Hot before the daemon runs: its first sample is warn, taken before it has its name on
    // the bus. The event still goes out once it has.
    let desktop = Desktop::start();
    let system = PrivateBus::start();
    let _agent = Agent::start(&system, &desktop.bus.address);
    let tree = fixture_copy("strix-halo");
    edge(&tree, 86.0);
    let d = daemon(&system, &tree);
    let warn = desktop.wait(0, PATIENCE);
    assert_eq!(warn.summary, "dsv4: GPU hot: 86 C", "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_notification_server_the_agent_says_so_and_keeps_running() {
    let system = PrivateBus::start();
    let empty_session = PrivateBus::start();
    let mut agent = Agent::start(&system, &empty_session.address);
    let tree = fixture_copy("strix-halo");
    let d = daemon(&system, &tree);
    settled(&d, &system, 73.0).await;
    edge(&tree, 90.0);
    agent.wait_log("cannot show \"dsv4: GPU hot: 90 C\"", PATIENCE);
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent exited"
    );
}

/// llama-server echoes a grammar it cannot parse into its output, and a crash's alert carries
/// the output's last lines to the desktop: a client's markup and escape sequences arrive
/// there as text (dunst reads markup), never as a link, an image or a terminal control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_text_in_the_engines_output_reaches_the_desktop_as_text() {
    let desktop = Desktop::start();
    let system = PrivateBus::start();
    let d = Daemon::start(
        &Setup::default()
            .system_bus(&system)
            .knob("die_after_tokens", "1"),
    );
    live_proxy(&system, &d).await;
    let _agent = Agent::start(&system, &desktop.bus.address);
    let hostile = "<a href=\"http://evil.example/\">click</a><img src=\"file:///etc/passwd\">\
                   \u{1b}]8;;http://evil.example/\u{1b}\\link\u{1b}]8;;\u{1b}\\\u{8}OVER";
    let grammar = serde_json::json!({ "prompt": "x", "grammar": hostile });
    let (status, _, v) = d.send("POST", "/completion", &[], Some(grammar)).await;
    assert_eq!(status, 400, "{v}");
    // The next request kills the engine: its last lines go out in an alert.
    let _ = d
        .send(
            "POST",
            "/completion",
            &[],
            Some(serde_json::json!({ "prompt": "x" })),
        )
        .await;
    desktop.wait(0, PATIENCE);
    // dunst prints the body as it received it, over several lines.
    let printed = desktop.printed.lock().unwrap().join("\n");
    assert!(
        printed.contains("summary: 'dsv4: the engine crashed'"),
        "{printed}"
    );
    let echo = printed
        .lines()
        .find(|l| l.contains("expecting name at"))
        .unwrap_or_else(|| panic!("the echo is not in the notification:\n{printed}"))
        .to_string();
    assert!(
        echo.contains(
            "&lt;a href=\"http://evil.example/\"&gt;click&lt;/a&gt;&lt;img src=\"file:///etc/passwd\"&gt;"
        ),
        "{echo:?}"
    );
    assert!(!echo.contains(['<', '\u{1b}', '\r']), "{echo:?}");
    assert!(
        echo.contains("]8;;http://evil.example/\\link]8;;\\OVER"),
        "{echo:?}"
    );
}

/// A request whose prefill outlasts `notify.long_request` (the real llama-server, a prompt
/// of 14,000 tokens on one thread) is told on the desktop when its prefill ends and when
/// its answer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_reaches_the_desktop_when_it_ends_and_when_its_answer_does() {
    use crate::keepalive::{chat_request, long_context_setup, long_prompt, raw_stream, started};
    let desktop = Desktop::start();
    let system = PrivateBus::start();
    let dir = temp_dir("daemon");
    let s = long_context_setup()
        .system_bus(&system)
        .top_level("notify", "{ long_request: 2s }");
    let d = started(Daemon::start_in(&s, dir)).await;
    live_proxy(&system, &d).await;
    let _agent = Agent::start(&system, &desktop.bus.address);
    // A decode long enough for the first notification to be shown before the second
    // replaces it (one bubble per topic).
    let mut body = chat_request(&long_prompt(), 1500);
    body["stream"] = serde_json::json!(true);
    let stream = raw_stream(&d.url("/v1/chat/completions"), &body).await;
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");
    let prefilled = desktop.wait(0, PATIENCE);
    assert_eq!(prefilled.summary, "dsv4: a long request", "{prefilled:?}");
    // The prompt's tokens as the engine counted them, and its time.
    let words: Vec<&str> = prefilled.body.split(' ').collect();
    let tokens: u64 = words[0]
        .strip_suffix("-token")
        .unwrap_or_else(|| panic!("{prefilled:?}"))
        .replace(',', "")
        .parse()
        .unwrap();
    let long = crate::keepalive::LONG_PROMPT_TOKENS as u64;
    assert!(
        (long - 1000..long + 1000).contains(&tokens),
        "{prefilled:?}"
    );
    assert!(
        prefilled.body.contains(" prefill done in "),
        "{prefilled:?}"
    );
    assert!(
        prefilled.body.ends_with(", decode started"),
        "{prefilled:?}"
    );
    let answered = desktop.wait(1, PATIENCE);
    assert_eq!(answered.summary, "dsv4: a long request", "{answered:?}");
    assert!(
        answered.body.contains("-token prefill) answered in ")
            && answered.body.ends_with(" events"),
        "{answered:?}"
    );
    // Requests under the threshold say nothing.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(desktop.shown().len(), 2, "{:#?}", desktop.shown());
}
