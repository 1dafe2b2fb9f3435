//! Client connections against the open-file limit.
//!
//! Owns: raising the soft `RLIMIT_NOFILE` at start, the open client connections (how many,
//! which carry a request, which have shown an API key), the cap (`api.max_connections`,
//! lowered to what the open-file limit covers), and what happens at the cap: the connection
//! idle the longest (no request in flight) is closed to make room, as mature servers reuse
//! idle keep-alive connections; when every one carries a request, the new one gets a
//! complete 503, written at once, and is closed. With API keys configured, a connection that
//! has not shown a valid key is kept alive only [`UNKEYED_KEEP_ALIVE`] between requests:
//! anyone may poll `/health` without a key, and must not hold the door that way.
//!
//! Every client connection is a file descriptor, and so is the engine connection a request
//! it carries holds while the engine answers: a client connection may cost two. The daemon's
//! own files (the listener, the runtime's, the engine's pipes, the bus, the config watcher)
//! need [`RESERVE`] more. Past the open-file limit `accept` fails and clients wait in the
//! kernel's backlog, unanswered; the cap keeps the daemon short of it and answers them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::http_error::{ApiError, ErrorCode, ErrorType};

/// File descriptors kept for the daemon itself, beyond what the client connections use.
pub const RESERVE: u64 = 64;

/// A connection must send a complete request head within this long, from its start or from
/// the end of its previous exchange (keep-alive), or it is closed. hyper's default, written
/// out: slow or idle clients give their slot back.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// The most of a request head a connection buffers (hyper's read buffer): request heads are
/// a few KiB; a longer one gets 431.
pub const HEAD_BUFFER: usize = 16 * 1024;

/// How long a connection that has not shown a valid API key stays open between requests,
/// when keys are configured.
pub const UNKEYED_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// Refused connections whose requests are read (and dropped) for a moment after the 503, so
/// that closing them does not reset the answer away; past this many they close at once.
const LINGERING: usize = 16;

/// How long a refused connection may linger.
const LINGER: Duration = Duration::from_secs(1);

/// Raises the soft open-file limit to the hard one, and logs both values. A failure is
/// logged and otherwise ignored: the cap then follows the lower limit.
pub fn raise_nofile_limit() {
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!("cannot read the open-file limit: {e}");
            return;
        }
    };
    if soft >= hard {
        tracing::info!("open-file limit: {} (the hard limit)", shown(soft));
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::info!(
            "open-file limit raised from {} to {} (the hard limit)",
            shown(soft),
            shown(hard)
        ),
        Err(e) => tracing::warn!(
            "open-file limit stays {} (raising it to the hard limit {} failed: {e})",
            shown(soft),
            shown(hard)
        ),
    }
}

fn shown(limit: u64) -> String {
    match limit {
        RLIM_INFINITY => "unlimited".into(),
        n => n.to_string(),
    }
}

/// The open-file limits in force, for the status.
pub fn limits() -> dsv4_client::Limits {
    let finite = |n: u64| (n != RLIM_INFINITY).then_some(n);
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => dsv4_client::Limits {
            open_files: finite(soft),
            open_files_hard: finite(hard),
        },
        Err(_) => dsv4_client::Limits::default(),
    }
}

/// The client connections the current soft open-file limit covers: two descriptors each
/// (the client's and the engine connection its request holds), after [`RESERVE`].
pub fn fd_cap() -> usize {
    let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
    let cap = soft.saturating_sub(RESERVE) / 2;
    usize::try_from(cap).unwrap_or(usize::MAX).max(1)
}

/// The open client connections.
#[derive(Debug, Default, Clone)]
pub struct Connections {
    open: Arc<AtomicUsize>,
    lingering: Arc<AtomicUsize>,
    registry: Arc<Mutex<Registry>>,
    /// Woken when the last open connection closes.
    none_open: Arc<tokio::sync::Notify>,
}

/// What is known of each open connection.
#[derive(Debug, Default)]
struct Registry {
    next: u64,
    entries: HashMap<u64, Entry>,
    /// The daemon is stopping: each connection ends once its exchange in flight is done.
    closing: bool,
}

#[derive(Debug)]
struct Entry {
    /// Requests in flight (their response bodies not ended).
    busy: u32,
    /// Since when no request has been in flight.
    idle_since: Instant,
    /// It has shown a valid API key.
    keyed: bool,
    /// Asked to close, to make room.
    evict: bool,
    /// Its task must look again when its last request ends (a keep-alive without a key
    /// starts then).
    wake_when_idle: bool,
    wake: Arc<Bell>,
}

/// What rings a connection's task to look at its verdict again: cheaper to listen to than
/// tokio's `Notify`, which the task's every wake-up polled under a lock (a thousand
/// instructions a request, callgrind).
#[derive(Debug, Default)]
pub struct Bell {
    rung: AtomicBool,
    waker: AtomicWaker,
}

impl Bell {
    fn ring(&self) {
        self.rung.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Resolves once it has rung since it last resolved.
    pub fn heard(&self) -> impl Future<Output = ()> + '_ {
        std::future::poll_fn(move |cx| {
            if self.rung.swap(false, Ordering::AcqRel) {
                return std::task::Poll::Ready(());
            }
            self.waker.register(cx.waker());
            match self.rung.swap(false, Ordering::AcqRel) {
                true => std::task::Poll::Ready(()),
                false => std::task::Poll::Pending,
            }
        })
    }
}

/// One open client connection: it frees its place when dropped (when its task ends), and
/// tells the registry what the connection does.
#[derive(Debug)]
pub struct Slot {
    open: Arc<AtomicUsize>,
    none_open: Arc<tokio::sync::Notify>,
    registry: Arc<Mutex<Registry>>,
    id: u64,
    wake: Arc<Bell>,
}

/// What a connection's task is to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Serve on, looking again at this instant (or when woken).
    Serve(Option<Instant>),
    /// Close: the room was needed.
    Evicted,
    /// Close: idle too long without having shown a key.
    Unkeyed,
    /// Close once the exchange in flight is done: the daemon is stopping.
    Closing,
}

impl Drop for Slot {
    fn drop(&mut self) {
        lock(&self.registry).entries.remove(&self.id);
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.none_open.notify_waiters();
        }
    }
}

fn lock(r: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

impl Slot {
    fn with<T>(&self, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        lock(&self.registry).entries.get_mut(&self.id).map(f)
    }

    /// A request begins; the guard ends it (drop it when its response body ends).
    pub fn busy(&self) -> Busy {
        self.with(|e| e.busy += 1);
        Busy {
            registry: self.registry.clone(),
            id: self.id,
            wake: self.wake.clone(),
        }
    }

    /// The connection showed a valid API key.
    pub fn keyed(&self) {
        self.with(|e| e.keyed = true);
    }

    /// Rings when the verdict may have changed (an eviction asked, the last request ended
    /// where that starts a keep-alive without a key, the daemon stopping).
    pub fn changed(&self) -> Arc<Bell> {
        self.wake.clone()
    }

    /// What to do now; `unkeyed`: the keep-alive of connections without a key, when keys
    /// are configured.
    pub fn next(&self, unkeyed: Option<Duration>, now: Instant) -> Next {
        let mut registry = lock(&self.registry);
        if registry.closing {
            return Next::Closing;
        }
        registry
            .entries
            .get_mut(&self.id)
            .map(|e| {
                e.wake_when_idle = unkeyed.is_some() && !e.keyed;
                if e.busy > 0 {
                    e.evict = false;
                    return Next::Serve(None);
                }
                if e.evict {
                    return Next::Evicted;
                }
                match unkeyed.filter(|_| !e.keyed) {
                    Some(d) if now >= e.idle_since + d => Next::Unkeyed,
                    Some(d) => Next::Serve(Some(e.idle_since + d)),
                    None => Next::Serve(None),
                }
            })
            .unwrap_or(Next::Evicted)
    }
}

/// A request in flight on a connection; dropping it ends it.
#[derive(Debug)]
pub struct Busy {
    registry: Arc<Mutex<Registry>>,
    id: u64,
    wake: Arc<Bell>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let wake = lock(&self.registry).entries.get_mut(&self.id).map(|e| {
            e.busy = e.busy.saturating_sub(1);
            if e.busy == 0 {
                e.idle_since = Instant::now();
            }
            e.busy == 0 && e.wake_when_idle
        });
        if wake == Some(true) {
            self.wake.ring();
        }
    }
}

impl Connections {
    /// How many client connections are open.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A slot for one more connection: when fewer than `cap` are open, or else when one of
    /// them carries no request (the one idle the longest is asked to close, and this one
    /// takes its place).
    pub fn admit(&self, cap: usize) -> Option<Slot> {
        let mut registry = lock(&self.registry);
        if self.open.load(Ordering::Relaxed) >= cap {
            let longest_idle = registry
                .entries
                .values_mut()
                .filter(|e| e.busy == 0 && !e.evict)
                .min_by_key(|e| e.idle_since)?;
            longest_idle.evict = true;
            longest_idle.wake.ring();
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        registry.next += 1;
        let id = registry.next;
        let wake = Arc::new(Bell::default());
        registry.entries.insert(
            id,
            Entry {
                busy: 0,
                idle_since: Instant::now(),
                keyed: false,
                evict: false,
                wake_when_idle: false,
                wake: wake.clone(),
            },
        );
        Some(Slot {
            open: self.open.clone(),
            none_open: self.none_open.clone(),
            registry: self.registry.clone(),
            id,
            wake,
        })
    }

    /// Asks every open connection to close once its exchange in flight is done (an idle
    /// one closes at once).
    pub fn close(&self) {
        let mut registry = lock(&self.registry);
        registry.closing = true;
        for e in registry.entries.values() {
            e.wake.ring();
        }
    }

    /// Returns once no connection is open.
    pub async fn closed(&self) {
        let none_open = self.none_open.notified();
        tokio::pin!(none_open);
        // Registered before the count is read, so the last close cannot be missed.
        none_open.as_mut().enable();
        if self.open() > 0 {
            none_open.await;
        }
    }

    /// Answers `stream` with a 503 (`too_many_connections`) without reading its request, and
    /// closes it. The answer fits in the empty send buffer of a new connection, so it is
    /// written without waiting; what the client may have sent is then read and dropped for
    /// a moment, so that closing does not reset the connection before the answer is read.
    pub fn refuse(&self, stream: TcpStream, max_connections: usize, cap: usize) {
        let answer = refusal(max_connections, cap);
        if stream.try_write(&answer).is_err() {
            return;
        }
        let lingering = self.lingering.clone();
        let count = |n: usize| (n < LINGERING).then_some(n + 1);
        if lingering
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, count)
            .is_err()
        {
            return;
        }
        tokio::spawn(async move {
            let mut stream = stream;
            let mut sink = [0u8; 4096];
            let drain = async {
                let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                let mut left = 64usize << 10;
                while left > 0 {
                    match stream.read(&mut sink).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => left = left.saturating_sub(n),
                    }
                }
            };
            let _ = tokio::time::timeout(LINGER, drain).await;
            lingering.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// The complete response to a connection over the cap.
fn refusal(max_connections: usize, cap: usize) -> Vec<u8> {
    let message = if cap < max_connections {
        format!(
            "too many open connections: {cap}, the most the open-file limit allows \
             (api.max_connections is {max_connections}); retry shortly"
        )
    } else {
        format!("too many open connections: api.max_connections is {cap}; retry shortly")
    };
    let body = ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Unavailable,
        ErrorCode::TooManyConnections,
        message,
    )
    .body();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

/// When something last came in: a connection, a request, a D-Bus call. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Activity {
    base: Instant,
    /// Milliseconds after `base`.
    last: Arc<AtomicU64>,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            base: Instant::now(),
            last: Arc::default(),
        }
    }
}

impl Activity {
    pub fn touch(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long since the last activity.
    pub fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn slots_are_counted_and_freed() {
        let c = Connections::default();
        let a = c.admit(2).unwrap();
        let b = c.admit(2).unwrap();
        let (_a, _b) = (a.busy(), b.busy());
        // Both carry a request: no room.
        assert!(c.admit(2).is_none());
        assert_eq!(c.open(), 2);
        drop(a);
        assert_eq!(c.open(), 1);
        assert!(c.admit(2).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_connection_idle_the_longest_makes_room() {
        let c = Connections::default();
        let first = c.admit(3).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        let second = c.admit(3).unwrap();
        let busy = c.admit(3).unwrap();
        let _request = busy.busy();
        // `first` has been idle the longest; `busy` is never chosen.
        tokio::time::advance(Duration::from_secs(1)).await;
        let now = Instant::now();
        let fourth = c.admit(3).expect("room made");
        assert_eq!(first.next(None, now), Next::Evicted);
        assert_eq!(second.next(None, now), Next::Serve(None));
        assert_eq!(busy.next(None, now), Next::Serve(None));
        drop(first);
        // Then `second`; a request that begins before its task looks calls it off.
        let _fifth = c.admit(3).expect("room made");
        let call_off = second.busy();
        assert_eq!(second.next(None, now), Next::Serve(None));
        drop(call_off);
        assert_eq!(second.next(None, now), Next::Serve(None));
        // second, busy, fourth and fifth: one over the cap until an evicted one closes.
        assert_eq!(c.open(), 4);
        drop(fourth);
        assert_eq!(c.open(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_key_a_connection_is_kept_alive_briefly() {
        let c = Connections::default();
        let (unkeyed, keyed) = (c.admit(8).unwrap(), c.admit(8).unwrap());
        keyed.keyed();
        let d = Some(UNKEYED_KEEP_ALIVE);
        let t0 = Instant::now();
        assert_eq!(
            unkeyed.next(d, t0),
            Next::Serve(Some(t0 + UNKEYED_KEEP_ALIVE))
        );
        let later = t0 + UNKEYED_KEEP_ALIVE;
        assert_eq!(unkeyed.next(d, later), Next::Unkeyed);
        assert_eq!(keyed.next(d, later), Next::Serve(None));
        // No keys configured: no short keep-alive.
        assert_eq!(unkeyed.next(None, later), Next::Serve(None));
        // Busy: never closed.
        let _r = unkeyed.busy();
        assert_eq!(unkeyed.next(d, later), Next::Serve(None));
    }

    /// Whether `slot`'s bell has rung since it was last heard.
    fn rung(slot: &Slot) -> bool {
        let bell = slot.changed();
        let heard = std::pin::pin!(bell.heard());
        let waker = std::task::Waker::noop();
        heard
            .poll(&mut std::task::Context::from_waker(waker))
            .is_ready()
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_a_request_rings_only_where_a_short_keep_alive_starts() {
        let c = Connections::default();
        let (unkeyed, keyed, free) = (
            c.admit(8).unwrap(),
            c.admit(8).unwrap(),
            c.admit(8).unwrap(),
        );
        keyed.keyed();
        let d = Some(UNKEYED_KEEP_ALIVE);
        let now = Instant::now();
        for (slot, keep_alive) in [(&unkeyed, d), (&keyed, d), (&free, None)] {
            let request = slot.busy();
            slot.next(keep_alive, now);
            drop(request);
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert!(rung(&unkeyed), "its keep-alive starts: its task must look");
        assert!(!rung(&keyed) && !rung(&free), "nothing changed for them");
        assert!(!rung(&unkeyed), "heard once");
        // Asked to make room (idle the longest): rung, whatever it is.
        let _full = c.admit(3).expect("room made");
        assert!(rung(&unkeyed));
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_stop_every_connection_is_rung_to_close_and_the_last_one_ends_the_wait() {
        let c = Connections::default();
        let (idle, busy) = (c.admit(8).unwrap(), c.admit(8).unwrap());
        let request = busy.busy();
        c.close();
        assert!(rung(&idle) && rung(&busy));
        let now = Instant::now();
        assert_eq!(idle.next(None, now), Next::Closing);
        assert_eq!(busy.next(None, now), Next::Closing);
        let mut closed = std::pin::pin!(c.closed());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(closed.as_mut().poll(&mut cx).is_pending());
        drop(idle);
        assert!(closed.as_mut().poll(&mut cx).is_pending());
        drop(request);
        drop(busy);
        assert!(closed.as_mut().poll(&mut cx).is_ready());
        // Nothing open: at once.
        assert!(std::pin::pin!(c.closed()).poll(&mut cx).is_ready());
    }

    #[test]
    fn the_refusal_is_a_complete_response() {
        let text = String::from_utf8(refusal(50, 50)).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("api.max_connections"));
    }
}
