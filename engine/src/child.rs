//! The engine child process: spawn, output capture, signals to its process group, exit.
//!
//! Owns: one engine OS process and the pipes of its stdout/stderr. Must not: decide when to
//! stop (the lifecycle actor does), or outlive its owner: the child runs in its own process
//! group, gets `PR_SET_PDEATHSIG` = SIGKILL so a SIGKILLed daemon leaves no engine behind,
//! and dropping an [`EngineChild`] whose process still runs kills the whole group.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked exits (prctl(2)), so spawn only from
//! threads that live as long as the daemon: tokio worker threads or the main thread, never a
//! `spawn_blocking` pool thread.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::sync::watch;

use crate::procs;

/// Longest line kept from the engine's output; longer lines are cut (a runaway log line must
/// not grow the daemon's memory).
const MAX_LINE: usize = 4096;
/// How long an engine line may wait to be logged, and how many may wait (see [`LogBatch`]).
const LOG_BATCH: std::time::Duration = std::time::Duration::from_millis(20);
const LOG_BATCH_LINES: usize = 256;
/// Room for output that arrives while a batch is written (a pipe holds 64 KiB).
const READ_BUFFER: usize = 64 * 1024;
/// The longest the exit waits for the output readers to reach the end of the pipes.
const PUMP_DRAIN: std::time::Duration = std::time::Duration::from_millis(500);
/// How often an engine whose first process has exited is looked for among the processes,
/// while some of its marked ones still live.
const MARKED_POLL: std::time::Duration = std::time::Duration::from_millis(100);
/// The processes are this machine's own.
const PROC: &str = "/proc";

/// What to run.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    /// Added to the daemon's environment (minus systemd's per-service variables).
    pub env: Vec<(OsString, OsString)>,
    /// How many of the last output lines to keep for error messages.
    pub tail_lines: usize,
    /// A second tail that also gets every line (a log that runs across engine restarts).
    pub also: Option<OutputTail>,
    /// The secrets taken out of every output line before it is kept or logged.
    pub redact: crate::Redactor,
    /// The mark every process of this engine carries ([`crate::procs::MARK_VAR`]): with one,
    /// the engine is all its marked processes, wherever they went (see [`EngineChild`]).
    pub mark: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("engine command {program:?} not found (is it installed, and is the profile's `command` right?)")]
    NotFound { program: PathBuf },
    #[error("engine command {program:?} is not executable by the daemon: permission denied")]
    PermissionDenied { program: PathBuf },
    #[error("cannot start engine command {program:?}: {source}")]
    Io { program: PathBuf, source: io::Error },
}

impl SpawnError {
    fn new(program: &Path, source: io::Error) -> Self {
        let program = program.to_path_buf();
        match source.kind() {
            io::ErrorKind::NotFound => SpawnError::NotFound { program },
            io::ErrorKind::PermissionDenied => SpawnError::PermissionDenied { program },
            _ => SpawnError::Io { program, source },
        }
    }
}

/// How the engine process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitReport {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl ExitReport {
    fn from_status(st: ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        ExitReport {
            code: st.code(),
            signal: st.signal(),
        }
    }

    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

impl fmt::Display for ExitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.code, self.signal) {
            (Some(c), _) => write!(f, "exit code {c}"),
            (None, Some(s)) => match Signal::try_from(s) {
                Ok(sig) => write!(f, "killed by {}", sig.as_str()),
                Err(_) => write!(f, "killed by signal {s}"),
            },
            (None, None) => f.write_str("unknown exit status"),
        }
    }
}

/// The last lines the engine wrote (stdout and stderr interleaved as they arrived).
#[derive(Debug, Clone, Default)]
pub struct OutputTail {
    inner: Arc<Mutex<Tail>>,
    /// Woken on every new line: the readiness probe looks again at once when the engine
    /// says something (llama-server logs as it finishes loading), instead of waiting out its
    /// poll interval.
    news: Arc<tokio::sync::Notify>,
    /// Tasks waiting for news: with none (nearly always), a line wakes nobody, and skips
    /// the notify's lock (a lock per line, and llama-server writes ten a request).
    waiting: Arc<AtomicUsize>,
}

/// One task counted as waiting for news while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Default)]
struct Tail {
    cap: usize,
    /// Shared with the log batch and the second tail: one allocation per line.
    lines: VecDeque<Arc<str>>,
    /// Lines pushed so far: the number of the next line.
    total: u64,
}

impl OutputTail {
    pub fn new(cap: usize) -> Self {
        OutputTail {
            inner: Arc::new(Mutex::new(Tail {
                cap: cap.max(1),
                lines: VecDeque::new(),
                total: 0,
            })),
            news: Arc::default(),
            waiting: Arc::default(),
        }
    }

    pub fn push(&self, line: Arc<str>) {
        let mut t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if t.lines.len() == t.cap {
            t.lines.pop_front();
        }
        t.lines.push_back(line);
        t.total += 1;
        drop(t);
        // A waiter counts itself after it registered and before it looks at the lines (see
        // `since_or_wait`): seen here as none, it looks after this line was pushed.
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.news.notify_waiters();
        }
    }

    /// The number of the next line to come: how many were pushed so far.
    pub fn written(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// Lines numbered `since` and later that are still kept, at most the last `max` of them,
    /// and the number of the next line to come. Lines are numbered from 0 in push order.
    pub fn since(&self, since: u64, max: usize) -> (u64, Vec<String>) {
        let t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let first_kept = t.total - t.lines.len() as u64;
        let from = since.max(first_kept).min(t.total);
        let available = (t.total - from) as usize;
        let skip = t.lines.len() - available + available.saturating_sub(max);
        (
            t.total,
            t.lines.iter().skip(skip).map(|l| l.to_string()).collect(),
        )
    }

    /// Resolves at the next line the engine writes.
    pub async fn next_line(&self) {
        let news = self.news.notified();
        tokio::pin!(news);
        news.as_mut().enable();
        let _waiting = Waiting::new(&self.waiting);
        news.await
    }

    /// As [`since`](Self::since), but when no line numbered `since` or later exists yet (the
    /// caller has seen everything), waits up to `wait` for the next one. A `since` beyond the
    /// lines pushed so far (numbers from an earlier process) is answered at once.
    pub async fn since_or_wait(
        &self,
        since: u64,
        max: usize,
        wait: std::time::Duration,
    ) -> (u64, Vec<String>) {
        let news = self.news.notified();
        tokio::pin!(news);
        // Registered before looking, so a line pushed in between still wakes this waiter.
        news.as_mut().enable();
        let _waiting = Waiting::new(&self.waiting);
        let (next, lines) = self.since(since, max);
        if next != since {
            return (next, lines);
        }
        let _ = tokio::time::timeout(wait, news).await;
        self.since(since, max)
    }

    /// The last `n` lines, oldest first.
    pub fn last(&self, n: usize) -> Vec<String> {
        let t = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let skip = t.lines.len().saturating_sub(n);
        t.lines.iter().skip(skip).map(|l| l.to_string()).collect()
    }
}

/// A running (or just ended) engine process, leader of its own process group.
///
/// With a mark ([`SpawnSpec::mark`]), the engine is every live process that carries it: a
/// process that left the group (a `setsid` wrapper's engine, a double fork, a daemon) gets
/// the same signals as the group, and the engine has ended only once the last of them has.
#[derive(Debug)]
pub struct EngineChild {
    pid: u32,
    exit: watch::Receiver<Option<ExitReport>>,
    output: OutputTail,
    mark: Option<Arc<str>>,
}

impl EngineChild {
    /// Starts the engine. Must be called inside a tokio runtime, from a long-lived thread
    /// (see the module header).
    pub fn spawn(spec: &SpawnSpec) -> Result<EngineChild, SpawnError> {
        let mut cmd = tokio::process::Command::new(&spec.program);
        cmd.args(&spec.args)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_PID")
            .env_remove("WATCHDOG_USEC")
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .envs(spec.mark.iter().map(|tag| (procs::MARK_VAR, tag)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let parent = nix::unistd::getpid();
        // SAFETY: the closure runs in the forked child before exec and calls only
        // async-signal-safe syscalls (umask, prctl, getppid); it allocates nothing (the error
        // is a raw OS error).
        unsafe {
            cmd.pre_exec(move || {
                // What the engine writes (llama-server's slot files: a conversation's KV
                // cache) is private, whatever umask dsv4d was started with.
                nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)?;
                // The parent may have died between fork and prctl: then nobody will ever
                // send the death signal, so give up now.
                if nix::unistd::getppid() != parent {
                    return Err(nix::errno::Errno::ESRCH.into());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| SpawnError::new(&spec.program, e))?;
        let pid = child.id().unwrap_or(0);
        let output = OutputTail::new(spec.tail_lines);
        let sinks = Sinks {
            tail: output.clone(),
            also: spec.also.clone(),
            redact: spec.redact.clone(),
        };
        // Each reader holds a sender and drops it when its pipe ends.
        let mut pumps_done = Vec::new();
        if let Some(out) = child.stdout.take() {
            let (done, rx) = tokio::sync::oneshot::channel::<()>();
            pumps_done.push(rx);
            spawn_pump(out.into_owned_fd(), sinks.clone(), pid, "stdout", done);
        }
        if let Some(err) = child.stderr.take() {
            let (done, rx) = tokio::sync::oneshot::channel::<()>();
            pumps_done.push(rx);
            spawn_pump(err.into_owned_fd(), sinks.clone(), pid, "stderr", done);
        }
        let (tx, rx) = watch::channel(None);
        let mark: Option<Arc<str>> = spec.mark.as_deref().map(Into::into);
        let marked = mark.clone();
        tokio::spawn(async move {
            let report = match child.wait().await {
                Ok(st) => ExitReport::from_status(st),
                Err(e) => {
                    tracing::error!(pid, "waiting for the engine failed: {e}");
                    ExitReport {
                        code: None,
                        signal: None,
                    }
                }
            };
            // Its marked processes outside it (or still in it) are the engine too: it has
            // ended once they have. Signals reach them meanwhile (see `signal`).
            if let Some(tag) = &marked {
                let mut survivors = procs::Survivors::default();
                while !survivors.look(Path::new(PROC), tag) {
                    tokio::time::sleep(MARKED_POLL).await;
                }
            }
            // Anything the engine left in its group goes with it.
            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
            // The exit is told once the engine's last words are in the tail (its error
            // messages quote them), which the readers see a moment after the exit itself;
            // bounded, in case something outside the group still holds a pipe.
            let drained = async {
                for done in pumps_done {
                    let _ = done.await;
                }
            };
            let _ = tokio::time::timeout(PUMP_DRAIN, drained).await;
            let _ = tx.send(Some(report));
        });
        Ok(EngineChild {
            pid,
            exit: rx,
            output,
            mark,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn output(&self) -> &OutputTail {
        &self.output
    }

    /// How the process ended, once it has.
    pub fn exit_status(&self) -> Option<ExitReport> {
        self.exit.borrow().clone()
    }

    /// A receiver that turns `Some` when the process has ended.
    pub fn exit_watch(&self) -> watch::Receiver<Option<ExitReport>> {
        self.exit.clone()
    }

    /// Waits for the process to end.
    pub async fn wait(&self) -> ExitReport {
        let mut rx = self.exit.clone();
        let report = match rx.wait_for(Option::is_some).await {
            Ok(r) => r.clone(),
            Err(_) => None,
        };
        report.unwrap_or(ExitReport {
            code: None,
            signal: None,
        })
    }

    /// The mark its processes carry, if it was given one.
    pub fn mark(&self) -> Option<&str> {
        self.mark.as_deref()
    }

    /// Sends `sig` to the engine's whole process group, and to each of its marked processes
    /// outside the group, once (an engine takes a second SIGTERM or SIGINT as "quit now").
    /// Does nothing once it has ended.
    pub fn signal(&self, sig: Signal) {
        if self.exit.borrow().is_some() {
            return;
        }
        if let Err(e) = killpg(Pid::from_raw(self.pid as i32), sig) {
            tracing::debug!(
                pid = self.pid,
                "signal {} to the engine's group failed: {e}",
                sig.as_str()
            );
        }
        for pid in self.strays() {
            tracing::debug!(
                pid,
                "signal {} to an engine process outside its group",
                sig.as_str()
            );
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// The engine's marked processes that are not in its process group.
    fn strays(&self) -> Vec<u32> {
        let Some(tag) = &self.mark else {
            return Vec::new();
        };
        let proc = Path::new(PROC);
        procs::marked(proc, tag)
            .into_iter()
            .filter(|p| procs::stat(proc, *p).is_some_and(|s| s.pgrp != self.pid))
            .collect()
    }
}

impl Drop for EngineChild {
    fn drop(&mut self) {
        if self.exit.borrow().is_none() {
            let _ = killpg(Pid::from_raw(self.pid as i32), Signal::SIGKILL);
            for pid in self.strays() {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
    }
}

/// Reads one of the engine's output pipes on a thread of its own: an engine that logs a
/// lot (llama-server writes several lines per request) never wakes the thread that carries
/// requests. The thread ends when the pipe closes.
fn spawn_pump(
    fd: io::Result<std::os::fd::OwnedFd>,
    sinks: Sinks,
    pid: u32,
    which: &'static str,
    done: tokio::sync::oneshot::Sender<()>,
) {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let fd = match fd {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!(pid, "cannot read the engine's {which}: {e}");
            return;
        }
    };
    // tokio made the pipe non-blocking; this thread wants plain blocking reads.
    if let Ok(bits) = fcntl(&fd, FcntlArg::F_GETFL) {
        let flags = OFlag::from_bits_truncate(bits) - OFlag::O_NONBLOCK;
        let _ = fcntl(&fd, FcntlArg::F_SETFL(flags));
    }
    let file = std::fs::File::from(fd);
    // Its lines are logged in the span it was started in (the daemon's, of this engine).
    let span = tracing::Span::current();
    let spawned = std::thread::Builder::new()
        .name(format!("engine-{which}"))
        .spawn(move || {
            let _in = span.enter();
            pump(file, sinks, pid, which);
            drop(done);
        });
    if let Err(e) = spawned {
        tracing::warn!(pid, "cannot start the reader of the engine's {which}: {e}");
    }
}

/// Where each output line goes: the engine's tail, the daemon's log across engines, and
/// the journal, secrets taken out first.
#[derive(Clone)]
struct Sinks {
    tail: OutputTail,
    also: Option<OutputTail>,
    redact: crate::Redactor,
}

impl Sinks {
    fn push(&self, raw: &[u8], batch: &mut LogBatch) {
        // Valid UTF-8 (nearly always) is checked by the fast path for ASCII.
        let text = match std::str::from_utf8(raw) {
            Ok(text) => std::borrow::Cow::Borrowed(text),
            Err(_) => String::from_utf8_lossy(raw),
        };
        let line: Arc<str> = self.redact.line(&text).into();
        if let Some(also) = &self.also {
            also.push(line.clone());
        }
        self.tail.push(line.clone());
        batch.push(line);
    }
}

fn pump(file: std::fs::File, sinks: Sinks, pid: u32, which: &'static str) {
    use std::os::fd::AsFd;
    let mut reader = std::io::BufReader::with_capacity(READ_BUFFER, file);
    let mut buf = Vec::with_capacity(256);
    // A line after a quiet spell goes to the tail at once (the readiness probe looks again
    // when the engine speaks); lines that follow within [`LOG_BATCH`] gather in the pipe and
    // are read together when the batch is due, then go to the tail and, as one event, to the
    // log. Waking for each line cost more CPU than proxying the request that caused it
    // (measured: 14 us per request, its poll, read and wake-up, for an engine that logs a
    // line per request, at 5,000 requests/s).
    let mut batch = LogBatch::new(pid, which);
    // The last line ended by `\r`, while no `\n` has come after it.
    let mut redrawn = Vec::with_capacity(256);
    let mut has_redrawn = false;
    loop {
        if reader.buffer().is_empty() {
            if let Some(due) = batch.due() {
                // Nothing left to read and a batch is held: let more gather until it is due,
                // then take what came without waiting.
                let left = due.saturating_duration_since(std::time::Instant::now());
                if !left.is_zero() {
                    std::thread::sleep(left);
                }
                let mut fds = [nix::poll::PollFd::new(
                    reader.get_ref().as_fd(),
                    nix::poll::PollFlags::POLLIN,
                )];
                match nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO) {
                    Ok(0) => {
                        batch.flush();
                        continue;
                    }
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(_) => batch.flush(),
                }
            }
        }
        buf.clear();
        match read_line_bounded(&mut reader, &mut buf, MAX_LINE) {
            Ok(None) | Err(_) => break,
            Ok(Some(end)) => {
                // A line ended by `\r` is redrawn by the next (a progress bar): only the last
                // one before a `\n` is kept, and only when nothing came between (`\r\n`).
                if end == b'\r' {
                    std::mem::swap(&mut redrawn, &mut buf);
                    has_redrawn = true;
                    continue;
                }
                let kept = if buf.is_empty() && has_redrawn {
                    &redrawn
                } else {
                    &buf
                };
                sinks.push(kept, &mut batch);
                has_redrawn = false;
            }
        }
    }
    // An engine that ended while drawing a progress bar: its last state belongs in the tail.
    if has_redrawn && !redrawn.is_empty() {
        sinks.push(&redrawn, &mut batch);
    }
    batch.flush();
}

/// Reads one line into `buf`, keeping at most `max` bytes of it and skipping the rest, so
/// that output without a line end cannot grow the daemon's memory. A line ends at `\n` or
/// at `\r` (a progress bar redraws itself with `\r` and never writes `\n`). Returns what
/// ended it (`0`: the end of the output), or `None` at the end with nothing read.
fn read_line_bounded(
    reader: &mut impl std::io::BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<Option<u8>> {
    let mut read_any = false;
    loop {
        let available = match reader.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(read_any.then_some(0));
        }
        read_any = true;
        let end = available.iter().position(|&b| b == b'\n' || b == b'\r');
        let upto = end.unwrap_or(available.len());
        let room = max.saturating_sub(buf.len());
        buf.extend_from_slice(&available[..upto.min(room)]);
        match end {
            Some(i) => {
                let terminator = available[i];
                reader.consume(i + 1);
                return Ok(Some(terminator));
            }
            None => {
                let n = available.len();
                reader.consume(n);
            }
        }
    }
}

/// The engine's lines on their way to the log, written a few at a time: llama-server logs
/// several lines per request, and waking the log writer for each one cost the daemon more
/// than proxying the request (measured: 12 to 24 us of CPU per line, one line per request,
/// on 2 cores). A line waits at most [`LOG_BATCH`].
struct LogBatch {
    pid: u32,
    which: &'static str,
    lines: Vec<Arc<str>>,
    since: Option<std::time::Instant>,
}

impl LogBatch {
    fn new(pid: u32, which: &'static str) -> Self {
        LogBatch {
            pid,
            which,
            lines: Vec::new(),
            since: None,
        }
    }

    fn push(&mut self, line: Arc<str>) {
        self.since.get_or_insert_with(std::time::Instant::now);
        self.lines.push(line);
        if self.lines.len() >= LOG_BATCH_LINES {
            self.flush();
        }
    }

    /// When the lines held must go out, if any are held.
    fn due(&self) -> Option<std::time::Instant> {
        self.since.map(|t| t + LOG_BATCH)
    }

    /// One log event for the batch: a line alone as before, several under one heading, each
    /// on a line of its own (the journal keeps each as an entry). An event costs the log
    /// formatter about 8,000 instructions whatever its length, so one per line was the
    /// largest part of dsv4d's CPU for a chatty engine (llama-server writes about ten lines
    /// per request).
    fn flush(&mut self) {
        let (pid, which) = (self.pid, self.which);
        match self.lines.len() {
            0 => {}
            1 => {
                let line = &self.lines[0];
                tracing::info!(target: crate::LOG_TARGET, pid, stream = which, "{line}");
            }
            n => {
                let mut text = String::with_capacity(self.lines.iter().map(|l| l.len() + 1).sum());
                for line in &self.lines {
                    text.push('\n');
                    text.push_str(line);
                }
                // The text format writes the pid and stream in a heading (fields would follow
                // the last line); the journal makes an entry of each line.
                tracing::info!(target: crate::LOG_TARGET, pid, stream = which, lines = n, "{text}");
            }
        }
        self.lines.clear();
        self.since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn sh(script: &str) -> SpawnSpec {
        SpawnSpec {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            env: vec![("DSV4_TEST_VAR".into(), "hello".into())],
            tail_lines: 3,
            also: None,
            redact: Default::default(),
            mark: None,
        }
    }

    /// A fresh mark, unique to one test.
    fn new_mark() -> String {
        use std::time::{SystemTime, UNIX_EPOCH};
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        format!("test-{}-{nanos}", std::process::id())
    }

    /// A wrapper that starts the engine in a session of its own and waits for it: the
    /// engine (here a `sleep`) leaves the process group, and writes its pid to `pidfile`.
    fn setsid_wrapper(pidfile: &Path) -> SpawnSpec {
        let script = format!(
            "setsid sh -c 'echo $$ > {}; exec sleep 300' & wait",
            pidfile.display()
        );
        SpawnSpec {
            redact: Default::default(),
            mark: Some(new_mark()),
            ..sh(&script)
        }
    }

    /// The engine's pid from `file`, once it runs `sleep 300`: the shell writes the file just
    /// before it execs, and a process that is in the middle of `exec` shows no mark.
    async fn pid_from(file: &Path) -> u32 {
        for _ in 0..500 {
            let pid: Option<u32> = std::fs::read_to_string(file)
                .ok()
                .and_then(|t| t.trim().parse().ok());
            if let Some(pid) = pid.filter(|p| procs::cmdline(Path::new(PROC), *p) == "sleep 300") {
                return pid;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("no engine running sleep 300 in {}", file.display());
    }

    #[tokio::test]
    async fn an_engine_that_left_its_group_is_signalled_and_waited_for() {
        let dir = std::env::temp_dir().join(format!("dsv4-setsid-{}", new_mark()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("engine.pid");
        let child = EngineChild::spawn(&setsid_wrapper(&pidfile)).unwrap();
        let engine = pid_from(&pidfile).await;
        assert_ne!(
            procs::stat(Path::new(PROC), engine).unwrap().pgrp,
            child.pid(),
            "the engine left the group"
        );
        assert_eq!(child.strays(), vec![engine]);
        child.signal(Signal::SIGTERM);
        let report = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("the engine ends with its wrapper");
        assert!(
            report.signal.is_some() || report.code.is_some(),
            "{report:?}"
        );
        assert!(
            !alive(engine),
            "the engine outside the group was stopped too"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_engine_that_left_its_group_is_killed_when_dropped() {
        let dir = std::env::temp_dir().join(format!("dsv4-setsid-drop-{}", new_mark()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("engine.pid");
        let child = EngineChild::spawn(&setsid_wrapper(&pidfile)).unwrap();
        let engine = pid_from(&pidfile).await;
        drop(child);
        let mut gone = false;
        for _ in 0..500 {
            if !alive(engine) {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(gone, "pid {engine} outlived its dropped child");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_exit_waits_for_the_last_marked_process() {
        let dir = std::env::temp_dir().join(format!("dsv4-daemon-{}", new_mark()));
        std::fs::create_dir_all(&dir).unwrap();
        let pidfile = dir.join("engine.pid");
        // A daemonizing engine: its launcher exits at once, the daemon lives on.
        let script = format!(
            "setsid sh -c 'echo $$ > {}; exec sleep 300' >/dev/null 2>&1 </dev/null & exit 0",
            pidfile.display()
        );
        let child = EngineChild::spawn(&SpawnSpec {
            mark: Some(new_mark()),
            ..sh(&script)
        })
        .unwrap();
        let engine = pid_from(&pidfile).await;
        // The launcher is gone, the engine is not: it has not ended (a moment more for an
        // exit that would be told wrongly).
        while alive(child.pid()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            child.exit_status().is_none(),
            "ended while pid {engine} lives"
        );
        child.signal(Signal::SIGKILL);
        let report = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("ended once its daemon was");
        assert_eq!(report.code, Some(0), "the launcher's own exit");
        assert!(!alive(engine));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lines_are_bounded_and_end_at_a_newline_or_a_carriage_return() {
        let mut input: Vec<u8> = b"one\r\ntwo\rthree\n".to_vec();
        // A million bytes with no line end at all, then one more line.
        input.extend(std::iter::repeat_n(b'x', 1 << 20));
        input.extend_from_slice(b"\nlast");
        let mut reader = std::io::BufReader::with_capacity(64, &input[..]);
        let mut got = Vec::new();
        let mut buf = Vec::new();
        while let Some(end) = read_line_bounded(&mut reader, &mut buf, 16).unwrap() {
            assert!(buf.len() <= 16, "{}", buf.len());
            got.push((String::from_utf8_lossy(&buf).into_owned(), end));
            buf.clear();
        }
        assert_eq!(
            got,
            [
                ("one".to_string(), b'\r'),
                (String::new(), b'\n'),
                ("two".into(), b'\r'),
                ("three".into(), b'\n'),
                ("x".repeat(16), b'\n'),
                ("last".into(), 0),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_waits_for_the_next_line_and_no_longer() {
        let tail = OutputTail::new(10);
        tail.push("one".into());
        // Lines it has not seen: at once.
        assert_eq!(
            tail.since_or_wait(0, 10, Duration::from_secs(5)).await,
            (1, vec!["one".to_string()])
        );
        // Numbers from an earlier daemon (beyond what exists): at once, nothing.
        assert_eq!(
            tail.since_or_wait(7, 10, Duration::from_secs(5)).await,
            (1, vec![])
        );
        // Nothing new: waits the whole time, then nothing.
        let t0 = tokio::time::Instant::now();
        assert_eq!(
            tail.since_or_wait(1, 10, Duration::from_secs(5)).await,
            (1, vec![])
        );
        assert_eq!(t0.elapsed(), Duration::from_secs(5));
        // A line written while it waits ends the wait at once.
        let writer = tail.clone();
        let t0 = tokio::time::Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            writer.push("two".into());
        });
        assert_eq!(
            tail.since_or_wait(1, 10, Duration::from_secs(5)).await,
            (2, vec!["two".to_string()])
        );
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        // The same for the next line alone; a wait given up counts no more.
        let writer = tail.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            writer.push("three".into());
        });
        tail.next_line().await;
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        let given_up = tokio::time::timeout(Duration::from_secs(1), tail.next_line()).await;
        assert!(given_up.is_err());
        assert_eq!(tail.waiting.load(Ordering::SeqCst), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_exit_is_told_after_the_last_words() {
        // The engine exits at once; something it started outside its group still holds its
        // stderr and writes a moment later. The exit waits for the pipe to end...
        let child = EngineChild::spawn(&sh(
            // (It leaves the group before the engine exits, or the group's kill takes it.)
            "setsid sh -c 'sleep 0.3; echo late words >&2' & sleep 0.1; echo first >&2; exit 3",
        ))
        .expect("spawn");
        let report = child.wait().await;
        assert_eq!(report.code, Some(3));
        assert_eq!(child.output().last(1), vec!["late words".to_string()]);
        // ...but not for ever: a pipe held much longer does not hold the exit back.
        let t0 = std::time::Instant::now();
        let child = EngineChild::spawn(&sh(
            "setsid sh -c 'sleep 3; echo too late >&2' & sleep 0.1; exit 4",
        ))
        .expect("spawn");
        let report = child.wait().await;
        assert_eq!(report.code, Some(4));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[tokio::test]
    async fn captures_the_output_tail_and_exit_code() {
        let mut spec =
            // One line that is not UTF-8: kept, its bad byte replaced.
            sh("for i in 1 2 3 4 5; do echo line$i; done; printf 'bad \\377 byte\\n'; \
                echo $DSV4_TEST_VAR >&2; exit 7");
        spec.tail_lines = 10;
        let c = EngineChild::spawn(&spec).unwrap();
        let r = c.wait().await;
        assert_eq!(
            r,
            ExitReport {
                code: Some(7),
                signal: None
            }
        );
        assert_eq!(r.to_string(), "exit code 7");
        // The readers may lag the exit by a moment; stdout and stderr are separate pipes, so
        // their lines interleave in no fixed order (the ring's own order is tested below).
        for _ in 0..300 {
            if c.output().last(10).len() == 7 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut tail = c.output().last(10);
        tail.sort();
        let bad = "bad \u{fffd} byte";
        assert_eq!(
            tail,
            [bad, "hello", "line1", "line2", "line3", "line4", "line5"]
        );
    }

    #[tokio::test]
    async fn signal_reaches_the_whole_group() {
        // The shell starts a grandchild in the same group; SIGTERM to the group ends both.
        let c = EngineChild::spawn(&sh("sleep 30 & echo $!; wait")).unwrap();
        let mut gc = None;
        for _ in 0..200 {
            if let Some(l) = c.output().last(1).first() {
                gc = l.parse::<i32>().ok();
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let gc = gc.expect("grandchild pid");
        c.signal(Signal::SIGTERM);
        let r = c.wait().await;
        assert_eq!(r.signal, Some(libc::SIGTERM), "{r}");
        assert_eq!(r.to_string(), "killed by SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!alive(gc), "grandchild {gc} survived");
    }

    #[tokio::test]
    async fn dropping_a_running_child_kills_it() {
        let c = EngineChild::spawn(&sh("exec sleep 30")).unwrap();
        let pid = c.pid() as i32;
        let watch = c.exit_watch();
        drop(c);
        let mut watch = watch;
        tokio::time::timeout(Duration::from_secs(5), watch.wait_for(Option::is_some))
            .await
            .expect("child still running after drop")
            .unwrap();
        assert!(!alive(pid), "engine {pid} survived");
    }

    #[test]
    fn lines_are_numbered_across_the_ring() {
        let t = OutputTail::new(3);
        assert_eq!(t.since(0, 10), (0, vec![]));
        for i in 0..5 {
            t.push(format!("l{i}").into());
        }
        // l0 and l1 fell out of the ring
        assert_eq!(
            t.since(0, 10),
            (5, vec!["l2".into(), "l3".into(), "l4".into()])
        );
        assert_eq!(t.since(3, 10), (5, vec!["l3".into(), "l4".into()]));
        assert_eq!(t.since(0, 1), (5, vec!["l4".into()]));
        assert_eq!(t.since(5, 10), (5, vec![]));
        assert_eq!(t.since(99, 10), (5, vec![]));
    }

    /// Whether a process is alive: not gone, not a zombie (an orphan waits for a reaper that
    /// may be slow).
    fn alive(pid: impl TryInto<u32>) -> bool {
        pid.try_into()
            .ok()
            .and_then(|pid| procs::stat(Path::new(PROC), pid))
            .is_some_and(|s| s.state != 'Z' && s.state != 'X')
    }

    #[tokio::test]
    async fn a_missing_program_is_named() {
        let spec = SpawnSpec {
            program: "/nonexistent/llama-server".into(),
            args: vec![],
            env: vec![],
            tail_lines: 10,
            also: None,
            redact: Default::default(),
            mark: None,
        };
        let err = EngineChild::spawn(&spec).unwrap_err();
        assert!(matches!(err, SpawnError::NotFound { .. }));
        assert!(
            err.to_string().contains("/nonexistent/llama-server"),
            "{err}"
        );
    }
}
