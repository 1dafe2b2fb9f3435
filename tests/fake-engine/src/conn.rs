//! Connection behaviour of the fake engine (`--connections SPEC`): when it
//! closes a TCP connection on its own, as real engines do.
//!
//! This file owns the SPEC grammar ([`Connections`]), the seeded PRNG behind the
//! `random:` breaks ([`Rng`]), the per-connection shared state that the request
//! handlers report to ([`ConnState`]), the socket wrapper that watches reads
//! and writes ([`ConnIo`]), and the task driving one connection ([`run`]),
//! which is where connections are actually closed: by dropping hyper's
//! connection, and with it the socket, as soon as hyper's output so far is in
//! the kernel. Unread request bytes make the kernel send a reset, as with a
//! real engine. (Not hyper's `graceful_shutdown()`: on a connection holding
//! part of a request it waits for the rest, then answers with `Connection: close`.)
//!
//! SPEC grammar (comma-separated, case-insensitive, blanks around entries ignored):
//!
//! * `keep` — keep-alive forever (the default); cannot be combined with the
//!   closing entries below, only with `keep-alive-header` and `random:`;
//! * `close-after-stream` — close after the last chunk of a chunked (streamed) response;
//! * `close-after-response` — close after every response;
//! * `max:N` (N >= 1) — close after the N-th response on a connection;
//! * `idle:MS` (MS >= 1) — close a connection with no request in flight and
//!   no byte received for MS milliseconds;
//! * `keep-alive-header` — send `Keep-Alive: timeout=5, max=100` with every response;
//! * `llama` — `close-after-stream,idle:5000,max:100,keep-alive-header`;
//! * `random:PCT@WHERE` (PCT 0..=100, WHERE `before-read`, `after-read` or
//!   `mid-response`) — break that share of requests at that point.
//!
//! A later `max:`, `idle:` or `random:…@WHERE` overrides an earlier one with the
//! same key, so `llama,idle:300` is llama-server with a 300 ms keep-alive timeout.
//! Random breaks never hit `GET /health`, so a supervisor's readiness probe
//! keeps working.

use std::io;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::body::{Body, Incoming};
use hyper::service::HttpService;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::server::Engine;

/// Value of the `Keep-Alive` header llama-server sends.
pub const KEEP_ALIVE_VALUE: &str = "timeout=5, max=100";

/// The parsed `--connections` SPEC.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Connections {
    pub close_after_stream: bool,
    pub close_after_response: bool,
    /// Close after this many responses on one connection.
    pub max: Option<u64>,
    /// Close after this long idle, ms.
    pub idle_ms: Option<u64>,
    pub keep_alive_header: bool,
    /// Percent of follow-up requests dropped as their first bytes arrive.
    pub before_read: Option<u8>,
    /// Percent of requests dropped once fully read, unanswered.
    pub after_read: Option<u8>,
    /// Percent of responses cut off after the head and part of the body.
    pub mid_response: Option<u8>,
}

const EXPECTED: &str = "expected keep, close-after-stream, close-after-response, max:N, \
    idle:MS, keep-alive-header, llama or random:PCT@before-read|after-read|mid-response";

fn positive(entry: &str, v: &str, what: &str) -> Result<u64, String> {
    match v.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "bad {what} in {entry:?} (expected a whole number >= 1)"
        )),
    }
}

impl FromStr for Connections {
    type Err = String;
    fn from_str(s: &str) -> Result<Connections, String> {
        let mut c = Connections::default();
        if s.trim().is_empty() {
            return Ok(c);
        }
        let mut keep = false;
        let mut closing: Option<String> = None;
        for raw in s.split(',') {
            let entry = raw.trim().to_ascii_lowercase();
            let entry = entry.as_str();
            if entry.is_empty() {
                return Err(format!("empty entry in {s:?} ({EXPECTED})"));
            }
            let mut closes = true;
            match entry {
                "keep" => {
                    keep = true;
                    closes = false;
                }
                "close-after-stream" => c.close_after_stream = true,
                "close-after-response" => c.close_after_response = true,
                "keep-alive-header" => {
                    c.keep_alive_header = true;
                    closes = false;
                }
                "llama" => {
                    c.close_after_stream = true;
                    c.idle_ms = Some(5000);
                    c.max = Some(100);
                    c.keep_alive_header = true;
                }
                _ => {
                    if let Some(n) = entry.strip_prefix("max:") {
                        c.max = Some(positive(entry, n, "count")?);
                    } else if let Some(ms) = entry.strip_prefix("idle:") {
                        c.idle_ms = Some(positive(entry, ms, "time")?);
                    } else if let Some(rest) = entry.strip_prefix("random:") {
                        closes = false;
                        let Some((pct, place)) = rest.split_once('@') else {
                            return Err(format!("bad {entry:?} (expected random:PCT@WHERE)"));
                        };
                        let pct = match pct.trim().parse::<u8>() {
                            Ok(p) if p <= 100 => p,
                            _ => {
                                return Err(format!(
                                    "bad percentage in {entry:?} (expected 0..100)"
                                ))
                            }
                        };
                        let slot = match place.trim() {
                            "before-read" => &mut c.before_read,
                            "after-read" => &mut c.after_read,
                            "mid-response" => &mut c.mid_response,
                            other => {
                                return Err(format!(
                                    "bad place {other:?} in {entry:?} \
                                     (expected before-read, after-read or mid-response)"
                                ))
                            }
                        };
                        *slot = Some(pct);
                    } else {
                        return Err(format!("unknown entry {entry:?} ({EXPECTED})"));
                    }
                }
            }
            if closes {
                closing = Some(entry.to_string());
            }
        }
        if let (true, Some(other)) = (keep, closing) {
            return Err(format!("keep cannot be combined with {other:?}"));
        }
        Ok(c)
    }
}

/// splitmix64 over an atomic counter: one deterministic sequence per process
/// (`--seed`), shared by all connections.
pub struct Rng(AtomicU64);

impl Rng {
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    pub fn new(seed: u64) -> Rng {
        Rng(AtomicU64::new(seed))
    }

    pub fn next_u64(&self) -> u64 {
        let mut z = self
            .0
            .fetch_add(Self::GAMMA, Ordering::Relaxed)
            .wrapping_add(Self::GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// True with probability `pct` percent (100: always, 0: never).
    pub fn chance(&self, pct: u8) -> bool {
        self.next_u64() % 100 < u64::from(pct)
    }
}

/// Why the engine closed a connection; the word after `close reason=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    AfterStream,
    AfterResponse,
    Max,
    Idle,
    BeforeRead,
    AfterRead,
    MidResponse,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::AfterStream => "after-stream",
            Reason::AfterResponse => "after-response",
            Reason::Max => "max",
            Reason::Idle => "idle",
            Reason::BeforeRead => "before-read",
            Reason::AfterRead => "after-read",
            Reason::MidResponse => "mid-response",
        }
    }
}

struct Inner {
    /// Requests being answered.
    in_flight: u32,
    /// Responses completed on this connection.
    responses: u64,
    /// Last byte received, or last response ended.
    last_activity: Instant,
    /// The next bytes to arrive start a follow-up request (before-read applies).
    follow_up: bool,
    /// The last write to the socket would have blocked.
    write_blocked: bool,
    /// Why the engine is closing this connection (decided once).
    closing: Option<Reason>,
}

/// State shared by one connection's task, its socket wrapper and its handlers.
pub struct ConnState {
    engine: Arc<Engine>,
    inner: Mutex<Inner>,
    /// Wakes the connection task to look at `inner` again.
    wake: Notify,
}

impl ConnState {
    pub fn new(engine: Arc<Engine>) -> Arc<ConnState> {
        Arc::new(ConnState {
            engine,
            inner: Mutex::new(Inner {
                in_flight: 0,
                responses: 0,
                last_activity: Instant::now(),
                follow_up: false,
                write_blocked: false,
                closing: None,
            }),
            wake: Notify::new(),
        })
    }

    fn spec(&self) -> &Connections {
        &self.engine.cfg.connections
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides to close the connection (the first reason wins), logs it and
    /// wakes the connection task to do it.
    fn close(&self, inner: &mut Inner, reason: Reason) {
        if inner.closing.is_none() {
            inner.closing = Some(reason);
            say!("fake-engine: closing connection: {}", reason.as_str());
            self.engine
                .log
                .line(&format!("close reason={}", reason.as_str()));
        }
        self.wake.notify_one();
    }

    /// True with the configured chance for `pct`, i.e. never if unset.
    pub fn roll(&self, pct: Option<u8>) -> bool {
        pct.is_some_and(|p| self.engine.rng.chance(p))
    }

    /// Random break after the whole request was read?
    pub fn roll_after_read(&self) -> bool {
        self.roll(self.spec().after_read)
    }

    /// Random break in the middle of the response?
    pub fn roll_mid_response(&self) -> bool {
        self.roll(self.spec().mid_response)
    }

    pub fn keep_alive_header(&self) -> bool {
        self.spec().keep_alive_header
    }

    /// Breaks the exchange now: the connection is dropped without a response
    /// (or the rest of it).
    pub fn break_now(&self, reason: Reason) {
        let mut inner = self.lock();
        self.close(&mut inner, reason);
    }

    /// Whether the engine is closing this connection on purpose (so a
    /// response cut short is not the client's doing).
    pub fn closing(&self) -> bool {
        self.lock().closing.is_some()
    }

    pub fn request_started(&self) {
        let mut inner = self.lock();
        inner.in_flight += 1;
        inner.follow_up = false;
    }

    /// A response went out whole (`streamed`: chunked): closes if the spec says so.
    pub fn response_finished(&self, streamed: bool) {
        let spec = self.spec();
        let mut inner = self.lock();
        inner.in_flight = inner.in_flight.saturating_sub(1);
        inner.responses += 1;
        inner.last_activity = Instant::now();
        inner.follow_up = spec.before_read.is_some();
        let reason = if spec.close_after_response {
            Some(Reason::AfterResponse)
        } else if spec.close_after_stream && streamed {
            Some(Reason::AfterStream)
        } else if spec.max.is_some_and(|m| inner.responses >= m) {
            Some(Reason::Max)
        } else {
            None
        };
        match reason {
            Some(r) => self.close(&mut inner, r),
            // Restart the idle clock.
            None if spec.idle_ms.is_some() => self.wake.notify_one(),
            None => {}
        }
    }

    /// A response was dropped unfinished (client gone, or a break).
    pub fn response_abandoned(&self) {
        let mut inner = self.lock();
        inner.in_flight = inner.in_flight.saturating_sub(1);
        inner.last_activity = Instant::now();
        self.wake.notify_one();
    }

    /// When the idle limit would be reached, if it applies now.
    fn idle_deadline(&self) -> Option<Instant> {
        let ms = self.spec().idle_ms?;
        let inner = self.lock();
        (inner.in_flight == 0 && inner.closing.is_none())
            .then(|| inner.last_activity + Duration::from_millis(ms))
    }

    /// The idle timer fired: closes if the connection really was idle that long.
    fn idle_expired(&self) {
        let Some(ms) = self.spec().idle_ms else {
            return;
        };
        let mut inner = self.lock();
        if inner.in_flight == 0
            && inner.closing.is_none()
            && inner.last_activity.elapsed() >= Duration::from_millis(ms)
        {
            self.close(&mut inner, Reason::Idle);
        }
    }

    /// Whether the connection task should drop the connection now: a close
    /// was decided and hyper's output so far went into the socket.
    fn drop_now(&self) -> bool {
        let inner = self.lock();
        inner.closing.is_some() && !inner.write_blocked
    }
}

/// The TCP stream as hyper sees it: reads restart the idle clock and may drop a
/// follow-up request as it arrives (before-read); blocked writes hold a close
/// back until hyper's output is in the kernel.
pub struct ConnIo {
    stream: TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for ConnIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before_read = {
            let inner = this.state.lock();
            if inner.closing.is_some() {
                // Being closed: read nothing more.
                return Poll::Pending;
            }
            inner.follow_up
        };
        if before_read {
            let mut peek = [0u8; 16];
            let mut peek_buf = ReadBuf::new(&mut peek);
            match this.stream.poll_peek(cx, &mut peek_buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                // End of stream: let the read below report it.
                Poll::Ready(Ok(0)) => {}
                Poll::Ready(Ok(n)) => {
                    this.state.lock().follow_up = false;
                    let health = peek[..n].starts_with(b"GET /health");
                    if !health && this.state.roll(this.state.spec().before_read) {
                        // Leave the request unread: closing then resets the connection.
                        this.state.break_now(Reason::BeforeRead);
                        return Poll::Pending;
                    }
                }
            }
        }
        let filled = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > filled {
            this.state.lock().last_activity = Instant::now();
        }
        polled
    }
}

impl ConnIo {
    /// Records whether a write blocked; wakes the task once a blocked write
    /// went through, in case a close waits for it.
    fn note_write<T>(&self, polled: &Poll<io::Result<T>>) {
        let mut inner = self.state.lock();
        let blocked = polled.is_pending();
        if inner.write_blocked && !blocked && inner.closing.is_some() {
            self.state.wake.notify_one();
        }
        inner.write_blocked = blocked;
    }
}

impl AsyncWrite for ConnIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, data);
        this.note_write(&polled);
        polled
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.note_write(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Serves one connection as HTTP/1.1 with keep-alive, closing it when `state`
/// says so. Returning drops the connection and with it the socket.
pub async fn run<S, B>(state: Arc<ConnState>, stream: TcpStream, svc: S)
where
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = ConnIo {
        stream,
        state: state.clone(),
    };
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), svc);
    let mut conn = std::pin::pin!(conn);
    loop {
        let deadline = state.idle_deadline();
        let idle = async {
            match deadline {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            // The connection first: a close decided while hyper was writing a
            // response (its end, or its first part for mid-response) is carried
            // out only after hyper wrote and flushed what it could.
            biased;
            res = conn.as_mut() => {
                if let Err(e) = res {
                    if !e.is_incomplete_message() && !e.is_canceled() {
                        say!("fake-engine: connection error: {e}");
                    }
                }
                return;
            }
            () = state.wake.notified() => {}
            () = idle => state.idle_expired(),
        }
        if state.drop_now() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Connections, String> {
        s.parse::<Connections>()
    }

    #[test]
    fn keep_and_empty_are_the_default() {
        assert_eq!(parse("keep"), Ok(Connections::default()));
        assert_eq!(parse(""), Ok(Connections::default()));
        assert_eq!(parse("  "), Ok(Connections::default()));
        assert_eq!(
            parse("keep,keep-alive-header,random:5@after-read"),
            Ok(Connections {
                keep_alive_header: true,
                after_read: Some(5),
                ..Connections::default()
            })
        );
    }

    #[test]
    fn llama_expands() {
        let llama = Connections {
            close_after_stream: true,
            idle_ms: Some(5000),
            max: Some(100),
            keep_alive_header: true,
            ..Connections::default()
        };
        assert_eq!(parse("llama"), Ok(llama.clone()));
        assert_eq!(
            parse("close-after-stream,idle:5000,max:100,keep-alive-header"),
            Ok(llama.clone())
        );
        // A later entry overrides the shorthand's value.
        assert_eq!(
            parse("LLAMA, idle:300"),
            Ok(Connections {
                idle_ms: Some(300),
                ..llama
            })
        );
    }

    #[test]
    fn entries_combine() {
        assert_eq!(
            parse("close-after-stream,idle:300,random:20@before-read"),
            Ok(Connections {
                close_after_stream: true,
                idle_ms: Some(300),
                before_read: Some(20),
                ..Connections::default()
            })
        );
        assert_eq!(
            parse("close-after-response,max:3,random:0@mid-response,random:100@after-read"),
            Ok(Connections {
                close_after_response: true,
                max: Some(3),
                mid_response: Some(0),
                after_read: Some(100),
                ..Connections::default()
            })
        );
        assert_eq!(
            parse("random:10@before-read,random:30@before-read")
                .unwrap()
                .before_read,
            Some(30)
        );
    }

    #[test]
    fn bad_specs_are_refused() {
        for bad in [
            "nope",
            "close",
            "max:0",
            "max:",
            "max:x",
            "max:-1",
            "idle:0",
            "idle:1.5",
            "random:20",
            "random:101@after-read",
            "random:-1@after-read",
            "random:x@after-read",
            "random:20@somewhere",
            "random:20@",
            "keep,close-after-stream",
            "llama,keep",
            "keep,max:5",
            "close-after-stream,,max:5",
            "close-after-stream,",
        ] {
            assert!(
                parse(bad).is_err(),
                "{bad:?} was accepted: {:?}",
                parse(bad)
            );
        }
        let e = parse("explode").unwrap_err();
        assert!(
            e.contains("\"explode\"") && e.contains("close-after-stream"),
            "{e}"
        );
    }

    #[test]
    fn rng_is_seeded_and_bounded() {
        let (a, b) = (Rng::new(1), Rng::new(1));
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(Rng::new(2).next_u64(), xs[0]);
        let r = Rng::new(7);
        assert!((0..1000).all(|_| r.chance(100)));
        assert!((0..1000).all(|_| !r.chance(0)));
        let hits = (0..10_000).filter(|_| r.chance(20)).count();
        assert!((1700..2300).contains(&hits), "{hits}");
    }
}
