//! Request bodies, read whole before a request goes any further.
//!
//! Owns: reading a client's body to its end within `api.max_body` and `api.body_timeout`, and
//! the budget of bytes that all bodies held at once may take (`api.max_buffered`). Must not:
//! take a lease, touch the engine, or answer the client (the proxy turns each refusal into
//! its HTTP answer).
//!
//! Why: an engine serves each connection with a thread of its own (llama-server), and a
//! request holds a lease, which keeps the engine from stopping when idle. A client that sends
//! its head and then a slow or missing body would hold both for as long as it likes, and a
//! handful of them make the engine unreachable. Read here first, as nginx does, a body costs
//! dsv4d memory alone (bounded by the budget) and time alone (bounded by the timeout), and
//! the engine sees only complete requests, sent in one go. A body held whole can also go
//! again, unchanged, when a kept-alive engine connection turns out closed.
//!
//! `Expect: 100-continue` needs nothing here: hyper sends the `100 Continue` the first time
//! the body is read, so a request refused before that (its key, its declared size, the
//! budget) is answered without its body ever being asked for.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;

/// The limits one body is read under, from `api:` as in force when its request came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `api.max_body`.
    pub max_body: u64,
    /// `api.body_timeout`, counted from the start of the read.
    pub timeout: Duration,
    /// `api.max_buffered`.
    pub max_buffered: u64,
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

/// Reads `body` whole. `declared` is its `Content-Length`, when it has one: a body declared
/// too large is refused before it is read, and a declared one takes its whole share of the
/// budget up front, so that it is refused before the client sends it rather than half-way.
pub async fn read<B>(
    body: B,
    declared: Option<u64>,
    limits: Limits,
    budget: &Arc<Budget>,
) -> Result<Held, IntakeError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let max_body = limits.max_body;
    let mut charge = Charge::none(budget);
    if let Some(n) = declared.or(body.size_hint().exact()) {
        if n > max_body {
            return Err(IntakeError::TooLarge {
                declared: Some(n),
                max_body,
            });
        }
        if n == 0 {
            return Ok(Held {
                bytes: Bytes::new(),
                charge,
            });
        }
        if !charge.grow(n, limits.max_buffered) {
            return Err(IntakeError::OverBudget {
                max_buffered: limits.max_buffered,
            });
        }
    }
    let deadline = Instant::now() + limits.timeout;
    let mut body = body;
    let mut got: u64 = 0;
    let mut first: Option<Bytes> = None;
    let mut rest: Option<BytesMut> = None;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                return Err(IntakeError::TimedOut {
                    timeout: limits.timeout,
                    got,
                    expected: declared,
                })
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(IntakeError::Client(e.into())),
            Ok(Some(Ok(frame))) => frame,
        };
        // Trailers, which no engine reads, are dropped.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let len = data.len() as u64;
        got += len;
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
        match (&first, &mut rest) {
            // The common case, one frame: its bytes are shared, not copied.
            (None, _) => first = Some(data),
            (Some(f), None) => {
                let want = usize::try_from(declared.unwrap_or(0)).unwrap_or(0);
                let mut m = BytesMut::with_capacity(want.max(f.len() + data.len()));
                m.extend_from_slice(f);
                m.extend_from_slice(&data);
                rest = Some(m);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&data),
        }
        if body.is_end_stream() {
            break;
        }
    }
    let bytes = match (first, rest) {
        (_, Some(m)) => m.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    };
    Ok(Held { bytes, charge })
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
        let held = read(chunks(&[b"abc", b"def", b"g"]), None, LIMITS, &budget)
            .await
            .unwrap();
        assert_eq!(held.bytes, "abcdefg");
        assert_eq!(budget.used(), 7);
        let one = read(Full::new(Bytes::from_static(b"xyz")), None, LIMITS, &budget)
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
        let e = read(chunks(&[]), Some(101), LIMITS, &budget)
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
        let e = read(chunks(&[big, big]), None, LIMITS, &budget)
            .await
            .unwrap_err();
        assert!(matches!(e, IntakeError::TooLarge { declared: None, .. }));
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn the_budget_refuses_what_would_pass_it() {
        let budget = Arc::new(Budget::default());
        let big: &'static [u8] = &[b'x'; 100];
        let first = read(chunks(&[big]), Some(100), LIMITS, &budget)
            .await
            .unwrap();
        // Declared: refused up front, before a byte is read.
        let e = read(chunks(&[]), Some(51), LIMITS, &budget)
            .await
            .unwrap_err();
        assert!(matches!(e, IntakeError::OverBudget { max_buffered: 150 }));
        // Chunked: refused once the bytes that came pass it.
        let half: &'static [u8] = &[b'y'; 30];
        let e = read(chunks(&[half, half]), None, LIMITS, &budget)
            .await
            .unwrap_err();
        assert!(matches!(e, IntakeError::OverBudget { .. }));
        assert_eq!(budget.used(), 100);
        let fits = read(chunks(&[half]), Some(30), LIMITS, &budget)
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
        let held = read(chunks(&[b"abcd", b"ef"]), Some(4), LIMITS, &budget)
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
        let e = read(body, Some(10), limits, &budget).await.unwrap_err();
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

    #[tokio::test]
    async fn an_empty_body_takes_nothing() {
        let budget = Arc::new(Budget::default());
        let held = read(Full::new(Bytes::new()), None, LIMITS, &budget)
            .await
            .unwrap();
        assert!(held.bytes.is_empty());
        assert_eq!(held.charge.bytes(), 0);
        let held = read(chunks(&[]), None, LIMITS, &budget).await.unwrap();
        assert!(held.bytes.is_empty());
    }
}
