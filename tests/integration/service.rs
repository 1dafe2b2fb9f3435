//! What systemd hears (`sd_notify`), read off a real notification socket as systemd has it
//! (`NOTIFY_SOCKET`, a datagram socket): READY with the first status, STATUS lines that
//! follow the state, watchdog pings only while the lifecycle actor answers, and STOPPING
//! with more time for the engine's stop.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::support::*;

const SEC: Duration = Duration::from_secs(1);

/// The service manager's end: the messages as they come.
struct NotifySocket {
    _dir: TempDir,
    path: String,
    socket: UnixDatagram,
}

impl NotifySocket {
    fn new() -> NotifySocket {
        let dir = temp_dir("notify");
        let path = dir.path().join("notify.sock");
        let socket = UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        NotifySocket {
            _dir: dir,
            path: path.to_str().unwrap().to_string(),
            socket,
        }
    }

    /// Every message until one contains `needle`, within `within`.
    fn until(&self, needle: &str, within: Duration) -> Vec<String> {
        let t = Instant::now();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = self.socket.recv(&mut buf) {
                let m = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = m.contains(needle);
                seen.push(m);
                if done {
                    return seen;
                }
            }
            assert!(
                t.elapsed() < within,
                "no {needle:?} within {within:?}: {seen:?}"
            );
        }
    }

    /// Reads away what has come so far.
    fn drain(&self) {
        let mut buf = [0u8; 4096];
        self.socket.set_nonblocking(true).unwrap();
        while self.socket.recv(&mut buf).is_ok() {}
        self.socket.set_nonblocking(false).unwrap();
    }

    /// How many messages containing `needle` come within `during`.
    fn count(&self, needle: &str, during: Duration) -> usize {
        let t = Instant::now();
        let mut n = 0;
        let mut buf = [0u8; 4096];
        while t.elapsed() < during {
            if let Ok(len) = self.socket.recv(&mut buf) {
                if String::from_utf8_lossy(&buf[..len]).contains(needle) {
                    n += 1;
                }
            }
        }
        n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn systemd_hears_ready_the_status_and_stopping() {
    let sock = NotifySocket::new();
    let d = Daemon::start(&Setup::default().daemon_env("NOTIFY_SOCKET", &sock.path));
    let first = sock.until("READY=1", PATIENCE);
    let ready = first.last().unwrap();
    assert!(ready.contains("STATUS=engine stopped"), "{ready:?}");
    let (status, _, _) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    assert_eq!(status, 200);
    sock.until("STATUS=engine ready (320k)", PATIENCE);
    d.signal(Signal::SIGTERM);
    let last = sock.until("STOPPING=1", PATIENCE);
    let stopping = last.last().unwrap();
    assert!(stopping.contains("EXTEND_TIMEOUT_USEC="), "{stopping:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watchdog_is_fed_only_while_the_lifecycle_actor_answers() {
    let sock = NotifySocket::new();
    let mut setup = Setup::default()
        .daemon_env("NOTIFY_SOCKET", &sock.path)
        .daemon_env("DSV4_TEST_FAULTS", "stall-actor-on-sigusr2");
    setup.watchdog_usec = Some(400_000);
    let d = Daemon::start(&setup);
    sock.until("READY=1", PATIENCE);
    // Every 200 ms.
    let fed = sock.count("WATCHDOG=1", SEC);
    assert!(fed >= 3, "{fed} pings in a second");
    d.signal(Signal::SIGUSR2);
    // Once the daemon has seen the actor not answer, what was sent before is read away:
    // from then on nothing may feed the watchdog.
    d.log_with(&["the lifecycle actor did not answer"]).await;
    sock.drain();
    let fed = sock.count("WATCHDOG=1", SEC);
    assert_eq!(fed, 0, "pings for a stalled actor");
}
