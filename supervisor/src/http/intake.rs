//! Request bodies, read whole before a request goes any further.
//!
//! Owns: reading a client's body to its end within `api.max_body`, `api.body_timeout` and
//! `api.min_body_rate` (after its first [`GRACE`]), and the budget of bytes that all bodies
//! held at once may take (`api.max_buffered`); counting what came where its connection sees
//! it, and stopping when the connection is chosen to make room (see
//! `connections::victim`). Must not: take a lease, touch the engine, or answer the client
//! (the proxy turns each refusal into its HTTP answer).
//!
//! Why: an engine serves each connection with a thread of its own (llama-server), and a
//! request holds a lease, which keeps the engine from stopping when idle. A client that sends
//! its head and then a slow or missing body would hold both for as long as it likes, and a
//! handful of them make the engine unreachable. Read here first, as nginx does, a body costs
//! dsv4d memory alone (bounded by the budget) and time alone (bounded by the timeout), and
//! the engine sees only complete requests, sent in one go. A body held whole can also go
//! again, unchanged, when a kept-alive engine connection turns out closed.
//!
//! A connection sending a body still holds one of the `api.max_connections` places, so time
//! alone is not enough: a trickle is cut once it is more than [`GRACE`] behind
//! `api.min_body_rate` (as Apache's mod_reqtimeout `MinRate` does), and at the cap the
//! slowest body makes room for a new connection.
//!
//! `Expect: 100-continue` needs nothing here: hyper sends the `100 Continue` the first time
//! the body is read, so a request refused before that (its key, its declared size, the
//! budget) is answered without its body ever being asked for.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;

/// How long a body may come at any rate before `api.min_body_rate` applies: from then on it
/// must be no more than this far behind it.
pub const GRACE: Duration = Duration::from_secs(5);

/// The limits one body is read under, from `api:` as in force when its request came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `api.max_body`.
    pub max_body: u64,
    /// `api.body_timeout`, counted from the start of the read.
    pub timeout: Duration,
    /// `api.max_buffered`.
    pub max_buffered: u64,
    /// `api.min_body_rate`, bytes a second (0: none).
    pub min_rate: u64,
}

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    /// Larger than `api.max_body`: declared so, or found so while reading a chunked body.
    #[error("the request body{} is larger than api.max_body ({max_body} bytes)", declared.map(|n| format!(" of {n} bytes")).unwrap_or_default())]
    TooLarge {
        declared: Option<u64>,
        max_body: u64,
    },
    /// Not complete within `api.body_timeout`.
    #[error(
        "the request body did not arrive within api.body_timeout ({}): {got} of {} bytes \
         came",
        dsv4_client::duration::format(*timeout),
        expected.map(|n| n.to_string()).unwrap_or_else(|| "its".into())
    )]
    TimedOut {
        timeout: Duration,
        got: u64,
        expected: Option<u64>,
    },
    /// More than [`GRACE`] behind `api.min_body_rate`.
    #[error(
        "the request body came slower than api.min_body_rate ({}/s) allows after its first \
         {}: {got} of {} bytes came in {}",
        dsv4_client::units::format_size(*min_rate),
        dsv4_client::duration::format(GRACE),
        expected.map(|n| n.to_string()).unwrap_or_else(|| "its".into()),
        dsv4_client::duration::brief(*elapsed)
    )]
    TooSlow {
        min_rate: u64,
        got: u64,
        expected: Option<u64>,
        elapsed: Duration,
    },
    /// Its connection was chosen to make room at the connection cap.
    #[error(
        "the connection limit (api.max_connections) was reached and this request's body was \
         the slowest to come: {got} of {} bytes came in {}; send the body promptly",
        expected.map(|n| n.to_string()).unwrap_or_else(|| "its".into()),
        dsv4_client::duration::brief(*elapsed)
    )]
    Evicted {
        got: u64,
        expected: Option<u64>,
        elapsed: Duration,
    },
    /// Holding it would take the bodies held at once past `api.max_buffered`.
    #[error(
        "dsv4d is holding as many request bodies as api.max_buffered allows ({max_buffered} \
         bytes) while earlier requests wait for the engine; try again shortly"
    )]
    OverBudget { max_buffered: u64 },
    /// The client's connection failed while sending it (gone, or a broken chunked encoding).
    #[error("the request body could not be read: {0}")]
    Client(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The bytes of all bodies held at once, shared by every connection.
#[derive(Debug, Default)]
pub struct Budget {
    used: AtomicU64,
}

impl Budget {
    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes of the budget, unless that would pass `limit`.
    fn take(&self, n: u64, limit: u64) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|total| *total <= limit)
            })
            .is_ok()
    }
}

/// A share of the budget, given back when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Charge {
    fn none(budget: &Arc<Budget>) -> Charge {
        Charge {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    /// Grows the share by `n` bytes, unless the budget is spent.
    fn grow(&mut self, n: u64, limit: u64) -> bool {
        let ok = self.budget.take(n, limit);
        if ok {
            self.bytes += n;
        }
        ok
    }

    /// Bytes held by this share.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A body read whole, and its share of the budget (keep it as long as the bytes).
#[derive(Debug)]
pub struct Held {
    pub bytes: Bytes,
    pub charge: Charge,
}

/// The time `got` bytes earn at `min_rate` bytes a second (none at a rate of 0): how far a
/// body may be behind the start of its reading and still be on time.
pub fn earned(got: u64, min_rate: u64) -> Duration {
    if min_rate == 0 {
        return Duration::ZERO;
    }
    let nanos = u128::from(got) * 1_000_000_000 / u128::from(min_rate);
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// When reading must stop, `start` being when it began, `got` bytes having come: at
/// `api.body_timeout`, or earlier once the body is [`GRACE`] behind `api.min_body_rate`.
/// `true`: the rate is what stops it.
pub fn deadline(start: Instant, got: u64, limits: &Limits) -> (Instant, bool) {
    let timeout = start + limits.timeout;
    if limits.min_rate == 0 {
        return (timeout, false);
    }
    let behind = GRACE.saturating_add(earned(got, limits.min_rate));
    match start.checked_add(behind) {
        Some(slow) if slow < timeout => (slow, true),
        _ => (timeout, false),
    }
}

/// Reads `body` whole. `declared` is its `Content-Length`, when it has one: a body declared
/// too large is refused before it is read, and a declared one takes its whole share of the
/// budget up front, so that it is refused before the client sends it rather than half-way.
/// `seen` counts the bytes that came, for its connection to see; the reading stops when
/// `stop` resolves (its connection makes room).
pub async fn read<B>(
    body: B,
    declared: Option<u64>,
    limits: Limits,
    budget: &Arc<Budget>,
    seen: &AtomicU64,
    stop: impl Future<Output = ()>,
) -> Result<Held, IntakeError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let max_body = limits.max_body;
    let mut charge = Charge::none(budget);
    if let Some(n) = declared.or(body.size_hint().exact()) {
        if charge_up_front(n, &limits, &mut charge)? {
            let bytes = Bytes::new();
            return Ok(Held { bytes, charge });
        }
    }
    let start = Instant::now();
    let mut stop = std::pin::pin!(stop);
    let mut body = body;
    let mut got: u64 = 0;
    let want = usize::try_from(declared.unwrap_or(0)).unwrap_or(0);
    let mut gathered = Gathered::new(want);
    loop {
        let (until, too_slow) = deadline(start, got, &limits);
        let frame = tokio::select! {
            biased;
            frame = body.frame() => frame,
            () = &mut stop => {
                return Err(IntakeError::Evicted {
                    got,
                    expected: declared,
                    elapsed: start.elapsed(),
                })
            }
            () = tokio::time::sleep_until(until) => {
                return Err(match too_slow {
                    true => IntakeError::TooSlow {
                        min_rate: limits.min_rate,
                        got,
                        expected: declared,
                        elapsed: start.elapsed(),
                    },
                    false => IntakeError::TimedOut {
                        timeout: limits.timeout,
                        got,
                        expected: declared,
                    },
                })
            }
        };
        let frame = match frame {
            None => break,
            Some(Err(e)) => return Err(IntakeError::Client(e.into())),
            Some(Ok(frame)) => frame,
        };
        // Trailers, which no engine reads, are dropped.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = data.len() as u64;
        got += len;
        seen.fetch_add(len, Ordering::Relaxed);
        if got > max_body {
            return Err(IntakeError::TooLarge {
                declared: None,
                max_body,
            });
        }
        let charged = charge.bytes();
        if got > charged && !charge.grow(got - charged, limits.max_buffered) {
            return Err(IntakeError::OverBudget {
                max_buffered: limits.max_buffered,
            });
        }
        gathered.push(data);
        if body.is_end_stream() {
            break;
        }
    }
    let bytes = gathered.bytes();
    Ok(Held { bytes, charge })
}

/// A body of `n` bytes declared: refused when larger than `api.max_body` or than the
/// budget leaves, else charged whole now; whether it is empty.
fn charge_up_front(n: u64, limits: &Limits, charge: &mut Charge) -> Result<bool, IntakeError> {
    if n > limits.max_body {
        return Err(IntakeError::TooLarge {
            declared: Some(n),
            max_body: limits.max_body,
        });
    }
    if n > 0 && !charge.grow(n, limits.max_buffered) {
        return Err(IntakeError::OverBudget {
            max_buffered: limits.max_buffered,
        });
    }
    Ok(n == 0)
}

/// A body's bytes as they come: the common case, one frame, is kept as it came (shared, not
/// copied); more are copied into one buffer of the declared size.
struct Gathered {
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    want: usize,
}

impl Gathered {
    fn new(want: usize) -> Gathered {
        Gathered {
            first: None,
            rest: None,
            want,
        }
    }

    fn push(&mut self, data: Bytes) {
        match (&self.first, &mut self.rest) {
            (None, _) => self.first = Some(data),
            (Some(f), None) => {
                let mut m = BytesMut::with_capacity(self.want.max(f.len() + data.len()));
                m.extend_from_slice(f);
                m.extend_from_slice(&data);
                self.rest = Some(m);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&data),
        }
    }

    fn bytes(self) -> Bytes {
        match (self.first, self.rest) {
            (_, Some(m)) => m.freeze(),
            (Some(f), None) => f,
            (None, None) => Bytes::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use http_body::Frame;
    use http_body_util::{Full, StreamBody};
    use std::convert::Infallible;

    const LIMITS: Limits = Limits {
        max_body: 100,
        timeout: Duration::from_secs(30),
        max_buffered: 150,
        min_rate: 10,
    };

    type Chunks = StreamBody<
        futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>,
    >;

    /// A body of these frames, with no declared length (as a chunked one).
    fn chunks(parts: &[&'static [u8]]) -> Chunks {
        let frames: Vec<_> = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_body_is_read_whole_and_holds_its_share_until_dropped() {
        let budget = Arc::new(Budget::default());
        let held = read(
            chunks(&[b"abc", b"def", b"g"]),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert_eq!(held.bytes, "abcdefg");
        assert_eq!(budget.used(), 7);
        let one = read(
            Full::new(Bytes::from_static(b"xyz")),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert_eq!(one.bytes, "xyz");
        assert_eq!(budget.used(), 10);
        drop(held);
        assert_eq!(budget.used(), 3);
        drop(one);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn too_large_declared_or_found() {
        let budget = Arc::new(Budget::default());
        let e = read(
            chunks(&[]),
            Some(101),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert!(matches!(
            e,
            IntakeError::TooLarge {
                declared: Some(101),
                max_body: 100
            }
        ));
        assert_eq!(
            e.to_string(),
            "the request body of 101 bytes is larger than api.max_body (100 bytes)"
        );
        let big: &'static [u8] = &[b'x'; 60];
        let e = read(
            chunks(&[big, big]),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, IntakeError::TooLarge { declared: None, .. }));
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn the_budget_refuses_what_would_pass_it() {
        let budget = Arc::new(Budget::default());
        let big: &'static [u8] = &[b'x'; 100];
        let first = read(
            chunks(&[big]),
            Some(100),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        // Declared: refused up front, before a byte is read.
        let e = read(
            chunks(&[]),
            Some(51),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, IntakeError::OverBudget { max_buffered: 150 }));
        // Chunked: refused once the bytes that came pass it.
        let half: &'static [u8] = &[b'y'; 30];
        let e = read(
            chunks(&[half, half]),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, IntakeError::OverBudget { .. }));
        assert_eq!(budget.used(), 100);
        let fits = read(
            chunks(&[half]),
            Some(30),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert_eq!(budget.used(), 130);
        drop((first, fits));
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_declared_body_that_sends_more_is_charged_for_it() {
        // hyper stops at the declared length; another body type might not.
        let budget = Arc::new(Budget::default());
        let held = read(
            chunks(&[b"abcd", b"ef"]),
            Some(4),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert_eq!(held.bytes, "abcdef");
        assert_eq!(budget.used(), 6);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stalls_times_out_with_what_came() {
        let budget = Arc::new(Budget::default());
        // Three bytes, then nothing more, ever.
        let frames = futures_util::stream::iter([Ok::<_, Infallible>(Frame::data(
            Bytes::from_static(b"abc"),
        ))]);
        let body = StreamBody::new(frames.chain(futures_util::stream::pending()));
        let limits = Limits {
            timeout: Duration::from_secs(2),
            ..LIMITS
        };
        let t0 = Instant::now();
        let e = read(
            body,
            Some(10),
            limits,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        assert!(matches!(
            e,
            IntakeError::TimedOut {
                got: 3,
                expected: Some(10),
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            "the request body did not arrive within api.body_timeout (2s): 3 of 10 bytes came"
        );
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_body_may_fall_behind_the_minimum_rate_by_the_grace_and_no_more() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let limits = |min_rate, timeout| Limits {
            min_rate,
            timeout: s(timeout),
            ..LIMITS
        };
        // (min_rate, body_timeout, bytes come; when reading stops, after t0; by the rate?)
        let table = [
            // Nothing came: the grace, then cut.
            (10, 30, 0, s(5), true),
            // Each 10 bytes earn a second.
            (10, 30, 45, Duration::from_millis(9500), true),
            // Never past body_timeout, whatever came.
            (10, 30, 1000, s(30), false),
            (10, 3, 0, s(3), false),
            // No minimum rate: body_timeout alone.
            (0, 30, 0, s(30), false),
        ];
        for (rate, timeout, got, after, by_rate) in table {
            let (until, slow) = deadline(t0, got, &limits(rate, timeout));
            assert_eq!(
                (until - t0, slow),
                (after, by_rate),
                "{rate} {timeout} {got}"
            );
        }
        // A rate of 1 byte a second with u64::MAX bytes come does not overflow.
        assert_eq!(deadline(t0, u64::MAX, &limits(1, 30)), (t0 + s(30), false));
    }

    type Paced = StreamBody<
        std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>>>>,
    >;

    /// A body of `n` one-byte frames, one every `every`, then its end (`ends`) or nothing
    /// more, ever.
    fn paced(n: usize, every: Duration, ends: bool) -> Paced {
        let frames = futures_util::stream::iter(0..n).then(move |_| async move {
            tokio::time::sleep(every).await;
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"x")))
        });
        match ends {
            true => StreamBody::new(Box::pin(frames)),
            false => StreamBody::new(Box::pin(frames.chain(futures_util::stream::pending()))),
        }
    }

    fn trickle(n: usize, every: Duration) -> Paced {
        paced(n, every, false)
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_is_cut_once_the_grace_behind_the_minimum_rate() {
        let budget = Arc::new(Budget::default());
        // One byte a second against 10 bytes a second: each byte earns 0.1 s, so the cut
        // comes when 5 + 0.1 n < n, between the 5th and 6th byte.
        let t0 = Instant::now();
        let e = read(
            trickle(100, Duration::from_secs(1)),
            Some(100),
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap_err();
        assert_eq!(t0.elapsed(), Duration::from_millis(5500));
        assert!(
            matches!(
                e,
                IntakeError::TooSlow {
                    got: 5,
                    expected: Some(100),
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            "the request body came slower than api.min_body_rate (10 B/s) allows after its \
             first 5s: 5 of 100 bytes came in 5.5s"
        );
        assert_eq!(budget.used(), 0);
        // As slow, but within the grace: read whole.
        let t0 = Instant::now();
        let body = paced(4, Duration::from_secs(1), true);
        let held = read(
            body,
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await;
        assert_eq!(held.unwrap().bytes, "xxxx");
        // Past the grace, at the minimum rate or faster: read whole.
        let body = paced(80, Duration::from_millis(100), true);
        let held = read(
            body,
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await;
        assert_eq!(held.unwrap().bytes.len(), 80);
        assert_eq!(t0.elapsed(), Duration::from_secs(12));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_whose_connection_makes_room_stops_at_once() {
        let budget = Arc::new(Budget::default());
        let c = crate::http::connections::Connections::default();
        let slow = c.admit(2, 10).unwrap();
        let other = c.admit(2, 10).unwrap();
        let (_r1, _r2) = (slow.busy(), other.busy());
        let on = slow.intake();
        let body = trickle(100, Duration::from_secs(1));
        let reading = read(body, Some(100), LIMITS, &budget, on.got(), on.evicted());
        let mut reading = std::pin::pin!(reading);
        // Three bytes in, a third connection comes at the cap.
        let (e, _third) = tokio::join!(&mut reading, async {
            tokio::time::sleep(Duration::from_millis(3500)).await;
            c.admit(2, 10).expect("room made")
        });
        let e = e.unwrap_err();
        assert!(matches!(e, IntakeError::Evicted { got: 3, .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the connection limit (api.max_connections) was reached and this request's body \
             was the slowest to come: 3 of 100 bytes came in 3.5s; send the body promptly"
        );
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn an_empty_body_takes_nothing() {
        let budget = Arc::new(Budget::default());
        let held = read(
            Full::new(Bytes::new()),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert!(held.bytes.is_empty());
        assert_eq!(held.charge.bytes(), 0);
        let held = read(
            chunks(&[]),
            None,
            LIMITS,
            &budget,
            &AtomicU64::default(),
            std::future::pending(),
        )
        .await
        .unwrap();
        assert!(held.bytes.is_empty());
    }
}
