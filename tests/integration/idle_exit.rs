//! `exit_when_idle` under socket activation, with the test playing systemd's part: it holds
//! the listening socket, starts dsv4d on it when a connection waits, and again after each
//! exit. Requests sent across several idle exits are all answered.

use std::io::Read;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::*;

const DSV4D: &str = env!("CARGO_BIN_EXE_dsv4d-under-test");

/// systemd's part for one socket: dsv4d started on it whenever a connection waits and none
/// runs. Stops (and kills what it started) on drop.
struct Activator {
    starts: Arc<AtomicUsize>,
    exits_clean: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    log: Arc<Mutex<String>>,
}

fn spawn_on(listener: &TcpListener, config: &Path) -> Child {
    let fd = listener.as_raw_fd();
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg("LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=api exec \"$0\" \"$@\"")
        .arg(DSV4D)
        .args(["--config", config.to_str().unwrap(), "--bus", "none"])
        .env("DSV4_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    hand_over_listener(&mut cmd, fd);
    cmd.spawn().expect("spawn dsv4d")
}

/// Whether a connection waits in the listener's backlog.
fn pending(listener: &TcpListener) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    // SAFETY: the listener outlives this call.
    let fd = unsafe { BorrowedFd::borrow_raw(listener.as_raw_fd()) };
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::ZERO).unwrap_or(0) > 0
}

impl Activator {
    fn start(listener: TcpListener, config: PathBuf) -> Activator {
        let starts = Arc::new(AtomicUsize::new(0));
        let exits_clean = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(String::new()));
        let (s, e, st, l) = (
            starts.clone(),
            exits_clean.clone(),
            stop.clone(),
            log.clone(),
        );
        let thread = std::thread::spawn(move || {
            let mut child: Option<Child> = None;
            while !st.load(Ordering::Relaxed) {
                if let Some(c) = child.as_mut() {
                    if let Some(status) = c.try_wait().unwrap() {
                        let mut out = String::new();
                        if let Some(mut err) = c.stderr.take() {
                            let _ = err.read_to_string(&mut out);
                        }
                        l.lock().unwrap().push_str(&out);
                        if status.success() {
                            e.fetch_add(1, Ordering::Relaxed);
                        }
                        child = None;
                    }
                }
                if child.is_none() && pending(&listener) {
                    s.fetch_add(1, Ordering::Relaxed);
                    child = Some(spawn_on(&listener, &config));
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if let Some(mut c) = child {
                let _ = c.kill();
                let _ = c.wait();
            }
        });
        Activator {
            starts,
            exits_clean,
            stop,
            thread: Some(thread),
            log,
        }
    }
}

impl Drop for Activator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[test]
fn requests_across_idle_exits_are_all_answered() {
    let dir = temp_dir("idle-exit");
    std::fs::create_dir_all(dir.path().join("logs")).unwrap();
    let setup = Setup::default()
        .top_level("exit_when_idle", "300ms")
        .engine("idle_timeout", "100ms");
    let config = setup.write(dir.path(), &dir.path().join("logs/fake-engine.log"));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let activator = Activator::start(listener, config);
    let mut answered = 0;
    let mut failures = Vec::new();
    let t0 = Instant::now();
    for burst in 0..20 {
        for _ in 0..10 {
            match chat_on_fresh_connection(addr) {
                Ok(200) => answered += 1,
                other => failures.push((burst, other)),
            }
        }
        // Long enough for the engine to stop and the daemon to exit.
        std::thread::sleep(Duration::from_millis(700));
    }
    let starts = activator.starts.load(Ordering::Relaxed);
    let clean = activator.exits_clean.load(Ordering::Relaxed);
    eprintln!(
        "{answered} answered in {:?}, {starts} daemon starts, {clean} idle exits",
        t0.elapsed()
    );
    let log = activator.log.lock().unwrap().clone();
    assert!(failures.is_empty(), "{failures:?}\n{log}");
    assert_eq!(answered, 200);
    assert!(
        starts >= 5 && clean >= 4,
        "{starts} starts, {clean} exits\n{log}"
    );
    assert!(
        log.contains("no engine and no client for 300ms: exiting"),
        "{log}"
    );
}
