//! Client connections against the open-file limit.
//!
//! Owns: raising the soft `RLIMIT_NOFILE` at start, the open client connections (how many,
//! which carry a request, which are still sending a request body and how much of it came,
//! which have shown an API key), the cap (`api.max_connections`, lowered to what the
//! open-file limit covers), and what happens at the cap: the connection that has held its
//! place longest without using it is closed to make room (see [`victim`]), as mature servers
//! reuse idle keep-alive connections. Idle connections (no request, or a head not finished)
//! and connections still sending a request body both count: a body earns its connection a
//! second for every `api.min_body_rate` bytes that came, so a trickle is chosen long before a
//! fast upload, and one carrying a request (its body whole) never is. When every one carries
//! a request, the new one gets a complete 503, written at once, and is closed. With API keys
//! configured, a connection that has not shown a valid key is kept alive only
//! [`UNKEYED_KEEP_ALIVE`] between requests: anyone may poll `/health` without a key, and must
//! not hold the door that way.
//!
//! Every client connection is a file descriptor, and so is the engine connection a request
//! it carries holds while the engine answers: a client connection may cost two. The daemon's
//! own files (the listener, the runtime's, the engine's pipes, the bus, the config watcher)
//! need [`RESERVE`] more. Past the open-file limit `accept` fails and clients wait in the
//! kernel's backlog, unanswered; the cap keeps the daemon short of it and answers them.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
use slab::Slab;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::http_error::{ApiError, ErrorCode, ErrorType};
use crate::http::intake::earned;

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
    /// The order of the last connection opened.
    next: u64,
    /// By slot key: found by index, where a hash of the id cost each of a request's five
    /// looks ~100 instructions (callgrind).
    entries: Slab<Entry>,
    /// The daemon is stopping: each connection ends once its exchange in flight is done.
    closing: bool,
}

#[derive(Debug)]
struct Entry {
    /// The order it was opened in (a smaller one earlier).
    opened: u64,
    /// Requests in flight (their response bodies not ended).
    busy: u32,
    /// The body of the request in flight, while it is still being read.
    body: Option<BodyIntake>,
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
    /// What its requests' body readings share with the registry.
    reading: Arc<Reading>,
}

/// A request body being read on a connection, as the registry sees it.
#[derive(Debug)]
struct BodyIntake {
    /// When its reading began.
    since: Instant,
    /// Asked to stop, to make room.
    evict: bool,
}

/// The part of a connection's body readings its task writes without the registry's lock:
/// made once with the connection, for each of its requests in turn.
#[derive(Debug, Default)]
struct Reading {
    /// Bytes of the body being read that came so far.
    got: AtomicU64,
    /// Rung to stop the reading.
    stop: Bell,
}

/// What an open connection does with its place, as far as making room is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// No request in flight (an idle keep-alive, or a head not finished) since then.
    Idle { since: Instant },
    /// Sending the body of its request: since then, with this many bytes come.
    Body { since: Instant, got: u64 },
    /// Carries a request (its body whole), or already asked to close: never chosen.
    Kept,
}

impl Standing {
    /// How long it has held its place without using it, at `now`: idle, for as long as it
    /// has been; sending a body, for as long as that has taken, less a second for every
    /// `min_rate` bytes that came (none when `min_rate` is 0). `None`: not to be chosen.
    pub fn owed(self, now: Instant, min_rate: u64) -> Option<Duration> {
        match self {
            Standing::Idle { since } => Some(now.saturating_duration_since(since)),
            Standing::Body { since, got } => Some(match since.checked_add(earned(got, min_rate)) {
                Some(paid_until) => now.saturating_duration_since(paid_until),
                None => Duration::ZERO,
            }),
            Standing::Kept => None,
        }
    }
}

/// The connection to close to make room, of `entries` (key, standing; a smaller key opened
/// earlier): the one that owes the most time (see [`Standing::owed`]); on a tie an idle one
/// before one sending a body (it loses no request), then the one opened first. `None` when
/// every one is [`Standing::Kept`].
pub fn victim<K: Ord + Copy>(
    entries: impl IntoIterator<Item = (K, Standing)>,
    now: Instant,
    min_rate: u64,
) -> Option<K> {
    entries
        .into_iter()
        .filter_map(|(k, s)| {
            let owed = s.owed(now, min_rate)?;
            let idle = matches!(s, Standing::Idle { .. });
            Some((owed, idle, std::cmp::Reverse(k)))
        })
        .max()
        .map(|(_, _, std::cmp::Reverse(k))| k)
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

    /// Forgets a ring not yet heard.
    fn reset(&self) {
        self.rung.store(false, Ordering::Relaxed);
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
    /// Its key in the registry's entries.
    id: usize,
    wake: Arc<Bell>,
    reading: Arc<Reading>,
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
        lock(&self.registry).entries.try_remove(self.id);
        if self.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.none_open.notify_waiters();
        }
    }
}

fn lock(r: &Mutex<Registry>) -> std::sync::MutexGuard<'_, Registry> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

impl Entry {
    fn standing(&self) -> Standing {
        match &self.body {
            _ if self.evict => Standing::Kept,
            None if self.busy == 0 => Standing::Idle {
                since: self.idle_since,
            },
            Some(b) if self.busy > 0 && !b.evict => Standing::Body {
                since: b.since,
                got: self.reading.got.load(Ordering::Relaxed),
            },
            _ => Standing::Kept,
        }
    }
}

/// The body of a request on a connection being read: while it lives, the connection may be
/// chosen to make room (see [`victim`]); dropping it ends that.
#[derive(Debug)]
pub struct Intake<'a> {
    slot: &'a Slot,
}

impl Intake<'_> {
    /// Where the reader counts the bytes of the body that came.
    pub fn got(&self) -> &AtomicU64 {
        &self.slot.reading.got
    }

    /// Resolves when the connection is chosen to make room: the reading must stop.
    pub fn evicted(&self) -> impl Future<Output = ()> + '_ {
        self.slot.reading.stop.heard()
    }
}

impl Drop for Intake<'_> {
    fn drop(&mut self) {
        self.slot.with(|e| e.body = None);
    }
}

impl Slot {
    fn with<T>(&self, f: impl FnOnce(&mut Entry) -> T) -> Option<T> {
        lock(&self.registry).entries.get_mut(self.id).map(f)
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

    /// The body of the request in flight begins to be read (drop the guard when it is whole
    /// or refused).
    pub fn intake(&self) -> Intake<'_> {
        self.with(|e| {
            // Under the lock, as a ring is: one left from an earlier body of this connection
            // is not heard by this one.
            self.reading.got.store(0, Ordering::Relaxed);
            self.reading.stop.reset();
            e.body = Some(BodyIntake {
                since: Instant::now(),
                evict: false,
            })
        });
        Intake { slot: self }
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
            .get_mut(self.id)
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
    id: usize,
    wake: Arc<Bell>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let wake = lock(&self.registry).entries.get_mut(self.id).map(|e| {
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
    /// them carries no request with its body whole (the [`victim`] is asked to close, and
    /// this one takes its place: an idle one closes, one sending a body has its reading
    /// stopped, is answered and closes). `min_rate`: `api.min_body_rate`.
    pub fn admit(&self, cap: usize, min_rate: u64) -> Option<Slot> {
        let mut registry = lock(&self.registry);
        if self.open.load(Ordering::Relaxed) >= cap {
            let now = Instant::now();
            let standings = registry
                .entries
                .iter()
                .map(|(id, e)| ((e.opened, id), e.standing()));
            let (_, id) = victim(standings, now, min_rate)?;
            let e = registry.entries.get_mut(id)?;
            match &mut e.body {
                Some(body) if e.busy > 0 => {
                    body.evict = true;
                    e.reading.stop.ring();
                }
                _ => {
                    e.evict = true;
                    e.wake.ring();
                }
            }
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        registry.next += 1;
        let opened = registry.next;
        let (wake, reading) = (Arc::new(Bell::default()), Arc::new(Reading::default()));
        let id = registry.entries.insert(Entry {
            opened,
            busy: 0,
            body: None,
            idle_since: Instant::now(),
            keyed: false,
            evict: false,
            wake_when_idle: false,
            wake: wake.clone(),
            reading: reading.clone(),
        });
        Some(Slot {
            open: self.open.clone(),
            none_open: self.none_open.clone(),
            registry: self.registry.clone(),
            id,
            wake,
            reading,
        })
    }

    /// Asks every open connection to close once its exchange in flight is done (an idle
    /// one closes at once).
    pub fn close(&self) {
        let mut registry = lock(&self.registry);
        registry.closing = true;
        for (_, e) in &registry.entries {
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
    // No request has been read: no path, no protocol but OpenAI's.
    .body(None);
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

    /// `api.min_body_rate` in these tests: 1,000 bytes a second.
    const RATE: u64 = 1000;

    #[test]
    fn the_one_that_has_held_its_place_longest_without_using_it_makes_room() {
        let now = Instant::now() + Duration::from_secs(100);
        let ago = |s: f64| now - Duration::from_secs_f64(s);
        let idle = |s: f64| Standing::Idle { since: ago(s) };
        let body = |s: f64, got: u64| Standing::Body { since: ago(s), got };
        let kept = Standing::Kept;
        // (the standings, keys 0, 1, 2...; the one chosen)
        let table: &[(&[Standing], Option<usize>)] = &[
            (&[], None),
            (&[kept, kept], None),
            // Idle ones: the one idle the longest, as ever.
            (&[idle(1.0), idle(3.0), idle(2.0)], Some(1)),
            // Every other one carries a request: a body still coming is chosen, however
            // young; a connection carrying a request never is.
            (&[kept, body(0.01, 0), kept], Some(1)),
            // Slow bodies against a new connection that has not sent its head yet: the
            // slow bodies have held their places longer.
            (&[body(3.0, 3), idle(0.001), body(2.0, 2)], Some(0)),
            // A fast upload earns its place (40 KB in 4 s at 1,000 B/s: owed nothing); a
            // trickle of the same age does not.
            (&[body(4.0, 40_000), body(4.0, 4)], Some(1)),
            // An idle keep-alive of 2 s against a body 3 s along that has earned 1.5 s.
            (&[idle(2.0), body(3.0, 1500)], Some(0)),
            // ...and against one that has earned less than a second.
            (&[idle(2.0), body(3.0, 500)], Some(1)),
            // A tie (both owe nothing): the idle one, which loses no request.
            (&[body(1.0, 5000), idle(0.0)], Some(1)),
            // A tie between two of a kind: the one opened first.
            (&[idle(1.0), idle(1.0)], Some(0)),
            (&[body(1.0, 0), body(1.0, 0)], Some(0)),
        ];
        for (i, (standings, want)) in table.iter().enumerate() {
            let got = victim(standings.iter().copied().enumerate(), now, RATE);
            assert_eq!(got, *want, "row {i}: {standings:?}");
        }
        // Without a minimum rate, a body earns nothing: the longest at it is chosen.
        let fast_and_old = [body(4.0, 1 << 30), body(3.0, 0)];
        assert_eq!(
            victim(fast_and_old.into_iter().enumerate(), now, 0),
            Some(0)
        );
        // Earned time beyond any clock owes nothing, and does not overflow.
        let huge = body(1.0, u64::MAX);
        assert_eq!(huge.owed(now, 1), Some(Duration::ZERO));
        assert_eq!(earned(2500, RATE), Duration::from_millis(2500));
        assert_eq!(earned(2500, 0), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_a_slow_body_is_stopped_to_make_room() {
        let c = Connections::default();
        let (slow, fast, carrying) = (
            c.admit(3, RATE).unwrap(),
            c.admit(3, RATE).unwrap(),
            c.admit(3, RATE).unwrap(),
        );
        let _requests = (slow.busy(), fast.busy(), carrying.busy());
        let (slow_body, fast_body) = (slow.intake(), fast.intake());
        tokio::time::advance(Duration::from_secs(2)).await;
        slow_body.got().store(10, Ordering::Relaxed);
        fast_body.got().store(100_000, Ordering::Relaxed);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let stopped = |i: &Intake, cx: &mut std::task::Context| {
            std::pin::pin!(i.evicted()).poll(cx).is_ready()
        };
        let new = c.admit(3, RATE).expect("room made");
        let _carries = new.busy();
        assert!(stopped(&slow_body, &mut cx), "the trickle is stopped");
        assert!(!stopped(&fast_body, &mut cx), "the fast upload reads on");
        // The connection itself serves on: its request answers, then it closes.
        assert_eq!(slow.next(None, Instant::now()), Next::Serve(None));
        // Asked once: the next one over the cap takes the fast body, then nothing is left.
        let newer = c.admit(3, RATE).expect("room made");
        let _carries_too = newer.busy();
        assert!(stopped(&fast_body, &mut cx));
        assert!(c.admit(3, RATE).is_none(), "the rest carry requests");
        // A body read whole: its connection carries a request and is never chosen.
        drop((slow_body, fast_body));
        assert!(c.admit(3, RATE).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn slots_are_counted_and_freed() {
        let c = Connections::default();
        let a = c.admit(2, RATE).unwrap();
        let b = c.admit(2, RATE).unwrap();
        let (_a, _b) = (a.busy(), b.busy());
        // Both carry a request: no room.
        assert!(c.admit(2, RATE).is_none());
        assert_eq!(c.open(), 2);
        drop(a);
        assert_eq!(c.open(), 1);
        assert!(c.admit(2, RATE).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn at_the_cap_the_connection_idle_the_longest_makes_room() {
        let c = Connections::default();
        let first = c.admit(3, RATE).unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        let second = c.admit(3, RATE).unwrap();
        let busy = c.admit(3, RATE).unwrap();
        let _request = busy.busy();
        // `first` has been idle the longest; `busy` is never chosen.
        tokio::time::advance(Duration::from_secs(1)).await;
        let now = Instant::now();
        let fourth = c.admit(3, RATE).expect("room made");
        assert_eq!(first.next(None, now), Next::Evicted);
        assert_eq!(second.next(None, now), Next::Serve(None));
        assert_eq!(busy.next(None, now), Next::Serve(None));
        drop(first);
        // Then `second`; a request that begins before its task looks calls it off.
        let _fifth = c.admit(3, RATE).expect("room made");
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
        let (unkeyed, keyed) = (c.admit(8, RATE).unwrap(), c.admit(8, RATE).unwrap());
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
            c.admit(8, RATE).unwrap(),
            c.admit(8, RATE).unwrap(),
            c.admit(8, RATE).unwrap(),
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
        let _full = c.admit(3, RATE).expect("room made");
        assert!(rung(&unkeyed));
    }

    #[tokio::test(start_paused = true)]
    async fn at_a_stop_every_connection_is_rung_to_close_and_the_last_one_ends_the_wait() {
        let c = Connections::default();
        let (idle, busy) = (c.admit(8, RATE).unwrap(), c.admit(8, RATE).unwrap());
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
