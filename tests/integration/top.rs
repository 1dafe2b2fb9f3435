//! `dsv4ctl top`, as a person sees it: in a real terminal (tmux, read back with
//! capture-pane, driven with send-keys), and as plain lines through a pipe.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::State;

const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");
const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

/// A daemon with a ready engine on a fixture copy whose GTT use and temperature moved over
/// a few samples.
async fn busy_daemon(bus: &PrivateBus) -> (TempDir, Daemon) {
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(
        &Setup::default()
            .session_bus(bus)
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 100ms, idle_interval: 100ms }")
            .engine("idle_timeout", "10m"),
    );
    live_proxy(bus, &d).await.start_and_wait().await.unwrap();
    let dev = tree.path().join(DEVICE);
    for (gtt, edge) in [(20u64, 60_000), (40, 66_000), (60, 71_000), (81, 73_000)] {
        std::fs::write(dev.join("mem_info_gtt_used"), format!("{}\n", gtt << 30)).unwrap();
        std::fs::write(dev.join("hwmon/hwmon3/temp1_input"), format!("{edge}\n")).unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    (tree, d)
}

/// A tmux server of this test's own (its own socket), killed on drop.
struct Tmux {
    socket: String,
}

impl Tmux {
    /// A server of its own for each test: the tests of one process run at the same time, and
    /// two on one socket each made the session `top` ("duplicate session: top").
    fn new() -> Tmux {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Tmux {
            socket: format!("dsv4-test-{}-{n}", std::process::id()),
        }
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux (apt-get install tmux)")
    }

    /// Runs `command` in a new session `top` of `width` x `height` cells.
    fn start(&self, width: u16, height: u16, command: &str) {
        let (w, h) = (width.to_string(), height.to_string());
        let out = self.run(&[
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            &w,
            "-y",
            &h,
            command,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }

    fn alive(&self) -> bool {
        self.run(&["has-session", "-t", "top"]).status.success()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_in_a_terminal_shows_the_state_and_sparklines_and_q_quits() {
    let bus = PrivateBus::start();
    let (_tree, _d) = busy_daemon(&bus).await;
    let tmux = Tmux::new();
    let command = format!(
        "env DBUS_SESSION_BUS_ADDRESS='{}' TERM=xterm-256color {DSV4CTL} --bus session top",
        bus.address
    );
    tmux.start(120, 36, &command);
    let t = Instant::now();
    let screen = loop {
        let screen = tmux.screen();
        if screen.contains("dsv4 top") && screen.contains("GTT used 81.0 GiB") {
            break screen;
        }
        assert!(t.elapsed() < PATIENCE, "top did not show up:\n{screen}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("{screen}");
    assert!(screen.contains(State::Ready.as_str()), "{screen}");
    assert!(screen.contains("profile 320k"), "{screen}");
    assert!(screen.contains("of 112.0 GiB"), "{screen}");
    assert!(screen.contains("edge 73.0 C (60.0 .. 73.0)"), "{screen}");
    assert!(screen.contains("SoC power 69.6 W"), "{screen}");
    assert!(screen.contains("not throttling"), "{screen}");
    assert!(screen.contains("q quits"), "{screen}");
    // The GTT sparkline rises: its top row starts further right than its bottom row.
    let rows: Vec<&str> = screen
        .lines()
        .skip_while(|l| !l.contains("GTT used"))
        .skip(1)
        .take_while(|l| !l.starts_with('└'))
        .collect();
    let first_bar = |row: &str| row.chars().skip(1).position(|c| "▁▂▃▄▅▆▇█".contains(c));
    let (top, bottom) = (rows.first().copied(), rows.last().copied());
    let (top, bottom) = (top.and_then(first_bar), bottom.and_then(first_bar));
    assert!(
        matches!((top, bottom), (Some(t), Some(b)) if t > b),
        "no rising sparkline under GTT ({top:?}, {bottom:?}):\n{screen}"
    );
    tmux.run(&["send-keys", "-t", "top", "q"]);
    let t = Instant::now();
    while tmux.alive() {
        assert!(t.elapsed() < PATIENCE, "q did not quit:\n{}", tmux.screen());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_through_a_pipe_prints_a_line_per_sample() {
    let bus = PrivateBus::start();
    let (_tree, _d) = busy_daemon(&bus).await;
    let mut child = Command::new(DSV4CTL)
        .args(["--bus", "session", "top"])
        .env("DBUS_SESSION_BUS_ADDRESS", &bus.address)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The samples of the last ten minutes first, oldest first (those taken while the engine
    // started show the GTT before the writes), then each new one: lines until the first
    // written GTT shows, a minute of samples at most.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut got = Vec::new();
    while got.len() < 600
        && !got
            .iter()
            .any(|l: &String| l.contains("GTT 20.0/112.0 GiB"))
    {
        match lines.next() {
            Some(Ok(l)) => got.push(l),
            _ => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(got.len() >= 2, "{got:?}");
    for l in &got {
        let state = format!(" UTC  {}  GTT ", State::Ready);
        assert!(l.contains(&state), "{l}");
        assert!(
            l.contains("Tctl 74.2 C  SoC 69.6 W  busy 97 %  throttling no"),
            "{l}"
        );
    }
    assert!(
        got.iter().any(|l| l.contains("GTT 20.0/112.0 GiB")),
        "{got:?}"
    );
}

/// An engine's output can hold a client's text (llama-server echoes a grammar it cannot
/// parse). `dsv4ctl logs` in a real terminal shows it as text: a backspace does not
/// overwrite, and an escape sequence neither clears the screen nor colors it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_output_reaches_the_terminal_as_text() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&Setup::default().session_bus(&bus));
    live_proxy(&bus, &d).await;
    // (A carriage return is a progress bar's redraw to dsv4d's reader: the line is what
    // follows it, as a terminal would show it.)
    let hostile = "FIRST\u{1b}[2J\u{1b}[31mRED\u{1b}]0;title\u{7}AAAA\u{8}\u{8}BB";
    let grammar = serde_json::json!({ "prompt": "x", "grammar": hostile });
    let (status, _, v) = d.send("POST", "/completion", &[], Some(grammar)).await;
    assert_eq!(status, 400, "{v}");
    let tmux = Tmux::new();
    // Followed: the engine's stderr line can reach dsv4d after the client has its 400, so
    // a one-shot `logs` could run before the line is there.
    let command = format!(
        "env DBUS_SESSION_BUS_ADDRESS='{}' TERM=xterm-256color {DSV4CTL} --bus session logs -f",
        bus.address
    );
    tmux.start(200, 40, &command);
    let t = Instant::now();
    let screen = loop {
        let screen = tmux.screen();
        if screen.contains("expecting name at") {
            break screen;
        }
        assert!(t.elapsed() < PATIENCE, "no echo on the screen:\n{screen}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The lines before it are still there (no clear), and the echo is whole (no overwrite).
    assert!(screen.contains("server is listening"), "{screen}");
    assert!(
        screen.contains("expecting name at FIRST[2J[31mRED]0;titleAAAABB"),
        "{screen}"
    );
    // Nothing was colored.
    let colors = tmux.run(&["capture-pane", "-p", "-e", "-t", "top"]);
    let colored = String::from_utf8_lossy(&colors.stdout);
    assert!(!colored.contains("\u{1b}[31m"), "{colored:?}");
}
