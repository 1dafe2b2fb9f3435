//! Streamed answers that never go silent: clients (the `openai` packages, most agents) give up
//! on a stream that sends no byte for their read timeout, and an engine may send none for
//! minutes (a cold start of an 80 GiB model, a prefill of hours).
//!
//! Only a request that asks for a stream (`"stream": true`, on a path of a streamed
//! [`ApiProtocol`]) comes here, and only while `api.stream_keepalive` is set; every other request
//! is answered as it always was. A streamed answer goes through these states, all owned by
//! its [`Keepalive`] body once its head is out:
//!
//! - **waiting for the engine** (before any head): the request waits for a lease (a cold
//!   start, a profile switch, a validation) or for the engine's head (ds4-server sends none
//!   until its prefill ends). When the engine's head comes within `stream_keepalive`, the
//!   answer is the engine's, relayed as below (or, not being an event stream, as it is).
//!   Otherwise dsv4d sends a head of its own (`200`, `text/event-stream`) and a comment
//!   saying what goes on (`: dsv4 loading 320k: 23 s of about 54 s`), and goes on waiting,
//!   with a comment at each tick of the period. With `api.loading_reasoning`, on a chat
//!   stream, each of these comments goes with the same words as a `reasoning_content` delta
//!   ([`Reasoning`], [`sse::reasoning_chunk`]), which chat UIs show; these stop with this
//!   state, so the engine's first event comes after whole chunks of dsv4d's own;
//! - **own head sent, the answer came**: an event stream is relayed (its head dropped); any
//!   other answer (an engine's 400, dsv4d's own 503) is read (its first
//!   [`ERROR_BODY_MAX`] bytes) and becomes one error event in the client's protocol
//!   ([`sse::error_event`]), and the stream ends;
//! - **relaying the engine's events**: each chunk passes as the answer's reader lets it
//!   ([`crate::http::watch`], which also says where the stream stands: [`Relayed`]). One
//!   interval per stream ticks every period; a tick that finds no engine byte since the one
//!   before, with the stream between events, writes a comment (and, where the API's clients
//!   count events, an event of its own: [`Opening`], which the reader follows the engine's
//!   events with). No timer is reset and nothing is allocated per chunk;
//! - **ended**: the engine's end, its break (told by the body below, see
//!   [`crate::http::answer`]), or the error event.
//!
//! A client that leaves drops the body, and with it the wait, its lease and the engine's
//! connection, as for any answer.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dsv4_client::duration::{brief, whole_seconds};
use http::{header, HeaderValue, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::http::events::Place;
use crate::http::opening::Opening;
use crate::http::protocol::{Api, ApiProtocol, KeepAlive};
use crate::http::sse::{self, ERROR_BODY_MAX};

/// What a keep-alive needs of the answer it relays: where the stream the client got stands,
/// and the reader of the engine's events, which follows the stream's [`Opening`] once the
/// engine's stream has come.
pub trait Relayed {
    /// Where the stream the client got stands.
    fn place(&self) -> Place;
    /// Hands `opening` to the reader of the engine's events; given back when the answer is
    /// not the engine's event stream.
    fn adopt(&mut self, opening: Opening) -> Option<Opening>;
    /// The opening the reader follows.
    fn opening(&mut self) -> Option<&mut Opening>;
}
use crate::lifecycle::Handle;

/// The answer a streamed request waits for: the engine's, or dsv4d's own error.
pub type Answer<B> = Pin<Box<dyn Future<Output = Response<B>> + Send>>;

/// A chat stream's loading words as `reasoning_content` deltas too (`api.loading_reasoning`):
/// the stream's number and the model its chunks name.
#[derive(Debug, Clone, PartialEq)]
pub struct Reasoning {
    /// `dsv4-loading-<id>`, one for all of a stream's chunks.
    id: u64,
    /// The request's model, if its body names one; else the profile loading or active.
    model: Option<String>,
}

impl Reasoning {
    /// For the next stream, whose request names `model`.
    pub fn new(model: Option<String>) -> Reasoning {
        static STREAMS: AtomicU64 = AtomicU64::new(1);
        Reasoning {
            id: STREAMS.fetch_add(1, Ordering::Relaxed),
            model,
        }
    }
}

/// What a stream's keep-alives carry besides the comment.
#[derive(Debug, Default)]
pub struct Extra {
    /// `api.loading_reasoning`, on a chat stream: the waiting's words as reasoning too.
    pub reasoning: Option<Reasoning>,
    /// An API whose clients count events: events of its own ([`crate::http::opening`]).
    pub opening: Option<Opening>,
}

/// The opening of a streamed request of `protocol` with `body`, for the APIs whose clients
/// count events (the row's keep-alive: Anthropic Messages, OpenAI Responses): named by the
/// request's model.
pub fn opening(protocol: ApiProtocol, body: &[u8]) -> Option<Opening> {
    static STREAMS: AtomicU64 = AtomicU64::new(1);
    let KeepAlive::Events(api) = protocol.spec().keepalive else {
        return None;
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = sse::model_of(body).unwrap_or_else(|| "dsv4".into());
    let stream = STREAMS.fetch_add(1, Ordering::Relaxed);
    Some(Opening::new(api, model, stream, created))
}

/// What a streamed request is answered with: the engine's answer when it comes within
/// `period`, else dsv4d's own head at once and the answer later (see the module docs).
/// `wrap` makes a body of the kind `B` of a [`Keepalive`]; `extra` is what its keep-alives
/// carry besides the comment.
pub async fn respond<B>(
    mut answer: Answer<B>,
    period: Duration,
    protocol: ApiProtocol,
    lifecycle: Handle,
    since: Instant,
    wrap: fn(Keepalive<B>) -> B,
    extra: Extra,
) -> Response<B>
where
    B: Body<Data = Bytes, Error = io::Error> + Relayed + Unpin + Send + 'static,
{
    let Extra { reasoning, opening } = extra;
    let keepalive = |phase| Keepalive {
        phase,
        tick: {
            let mut tick = tokio::time::interval_at(Instant::now() + period, period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            tick
        },
        heard: false,
        protocol,
        lifecycle: lifecycle.clone(),
        since,
        quiet_since: Instant::now(),
        first: None,
        reasoning,
        opening,
    };
    match tokio::time::timeout(period, &mut answer).await {
        Ok(resp) if is_event_stream(&resp) => resp.map(|body| {
            let mut k = keepalive(Phase::Ended);
            k.phase = k.relay(body);
            wrap(k)
        }),
        Ok(resp) => resp,
        Err(_) => {
            let mut k = keepalive(Phase::Waiting(answer));
            k.first = Some(k.waiting_words());
            let mut r = Response::new(wrap(k));
            let h = r.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            r
        }
    }
}

fn is_event_stream<B>(resp: &Response<B>) -> bool {
    resp.status().is_success()
        && resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"))
}

/// An answer that is not an event stream, after dsv4d's own head: its body read (its first
/// [`ERROR_BODY_MAX`] bytes, into `got`) until it ends or fills the bound, then told as one
/// error event in `protocol`.
fn collect<B>(
    protocol: ApiProtocol,
    status: StatusCode,
    content_type: Option<&str>,
    body: &mut B,
    got: &mut Vec<u8>,
    cx: &mut Context<'_>,
) -> Poll<Bytes>
where
    B: Body<Data = Bytes, Error = io::Error> + Unpin,
{
    loop {
        match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    let room = ERROR_BODY_MAX.saturating_sub(got.len());
                    got.extend_from_slice(&d[..d.len().min(room)]);
                }
                if got.len() < ERROR_BODY_MAX {
                    continue;
                }
            }
            Poll::Ready(_) => {}
            Poll::Pending => return Poll::Pending,
        }
        tracing::debug!(
            "a streamed request got {status} after dsv4d's own head: told as an error event"
        );
        return Poll::Ready(sse::error_event(
            protocol,
            status.as_u16(),
            content_type,
            got,
        ));
    }
}

/// A streamed answer kept from going silent (see the module docs).
pub struct Keepalive<B> {
    phase: Phase<B>,
    /// Ticks every `api.stream_keepalive`.
    tick: Interval,
    /// A byte of the engine's came since the last tick.
    heard: bool,
    protocol: ApiProtocol,
    lifecycle: Handle,
    /// When the request came.
    since: Instant,
    /// The tick that last found the engine quiet after it had sent something.
    quiet_since: Instant,
    /// The first bytes after dsv4d's own head.
    first: Option<Bytes>,
    /// `api.loading_reasoning`, on a chat stream.
    reasoning: Option<Reasoning>,
    /// An API whose clients count events: its events among the keep-alives (the engine's
    /// opening changed to follow them), held here until the engine's stream comes.
    opening: Option<Opening>,
}

enum Phase<B> {
    /// dsv4d's own head is out; the answer is still to come.
    Waiting(Answer<B>),
    /// The answer is not an event stream: its body, read for the error event.
    Collecting {
        status: StatusCode,
        content_type: Option<String>,
        body: B,
        got: Vec<u8>,
    },
    Relaying(B),
    Ended,
}

impl<B: Relayed> Keepalive<B> {
    /// What a comment says now.
    fn words(&self) -> String {
        match &self.phase {
            Phase::Relaying(_) | Phase::Ended => format!(
                "dsv4 waiting for the engine's answer: {}",
                brief(whole_seconds(self.quiet_since.elapsed()))
            ),
            Phase::Waiting(_) | Phase::Collecting { .. } => {
                if let Some(loading) = self.lifecycle.loading() {
                    return loading.describe(loading.since.elapsed());
                }
                let waited = brief(whole_seconds(self.since.elapsed()));
                match self.lifecycle.state() {
                    dsv4_client::State::Ready => {
                        format!("dsv4 waiting for the engine's answer: {waited}")
                    }
                    state => format!("dsv4 waiting for the engine ({state}): {waited}"),
                }
            }
        }
    }

    /// What a keep-alive writes with the stream between events at `place`: the comment, and
    /// after it, in one frame, the API's own event ([`Opening`]) where its clients count
    /// events.
    fn keepalive(&mut self, place: Place) -> Bytes {
        let comment = sse::comment(place, &self.words());
        let opening = match &mut self.phase {
            Phase::Relaying(body) => body.opening(),
            _ => self.opening.as_mut(),
        };
        let Some(opening) = opening else {
            return comment;
        };
        let event = opening.keepalive();
        let mut both = Vec::with_capacity(comment.len() + event.len());
        both.extend_from_slice(&comment);
        both.extend_from_slice(&event);
        Bytes::from(both)
    }

    /// What a tick writes while the answer is still to come, with dsv4d's own head out and
    /// the stream between events: the keep-alive, and with [`Reasoning`] the same words as a
    /// `reasoning_content` delta after it, in one frame.
    fn waiting_words(&mut self) -> Bytes {
        let words = self.words();
        let comment = self.keepalive(Place::Between);
        let Some(reasoning) = &self.reasoning else {
            return comment;
        };
        let model = match &reasoning.model {
            Some(model) => model.clone(),
            None => match self.lifecycle.loading() {
                Some(loading) => loading.profile,
                None => self.lifecycle.profile(),
            },
        };
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let chunk = sse::reasoning_chunk(reasoning.id, created, &model, &words);
        let mut both = Vec::with_capacity(comment.len() + chunk.len());
        both.extend_from_slice(&comment);
        both.extend_from_slice(&chunk);
        Bytes::from(both)
    }

    /// Relaying the engine's stream `body`, whose reader follows the stream's opening.
    fn relay(&mut self, mut body: B) -> Phase<B> {
        if let Some(opening) = self.opening.take() {
            self.opening = body.adopt(opening);
        }
        Phase::Relaying(body)
    }

    /// Where the stream the client got stands.
    fn place(&self) -> Place {
        match &self.phase {
            Phase::Relaying(body) => body.place(),
            _ => Place::Between,
        }
    }

    /// The phase after the answer `resp` came, with dsv4d's own head out.
    fn answered(&mut self, resp: Response<B>) -> Phase<B> {
        let stream = is_event_stream(&resp);
        let (parts, body) = resp.into_parts();
        if stream {
            return self.relay(body);
        }
        let content_type = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        Phase::Collecting {
            status: parts.status,
            content_type,
            body,
            got: Vec::new(),
        }
    }
}

impl<B> Body for Keepalive<B>
where
    B: Body<Data = Bytes, Error = io::Error> + Relayed + Unpin,
{
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        loop {
            match &mut this.phase {
                Phase::Waiting(answer) => {
                    if let Poll::Ready(resp) = answer.as_mut().poll(cx) {
                        this.phase = this.answered(resp);
                        // The answer's coming counts as a sound: the next words come after
                        // a full period of silence, not at the next tick.
                        this.quiet_since = Instant::now();
                        this.heard = true;
                        continue;
                    }
                }
                Phase::Collecting {
                    status,
                    content_type,
                    body,
                    got,
                } => {
                    let (protocol, ct) = (this.protocol, content_type.as_deref());
                    if let Poll::Ready(event) = collect(protocol, *status, ct, body, got, cx) {
                        this.phase = Phase::Ended;
                        return Poll::Ready(Some(Ok(Frame::data(event))));
                    }
                }
                Phase::Relaying(body) => match Pin::new(body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        this.heard = true;
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    Poll::Ready(end) => {
                        this.phase = Phase::Ended;
                        return Poll::Ready(end);
                    }
                    Poll::Pending => {}
                },
                Phase::Ended => return Poll::Ready(None),
            }
            // Nothing to pass on now: the clock's turn.
            match this.tick.poll_tick(cx) {
                Poll::Ready(_) if std::mem::take(&mut this.heard) => {
                    this.quiet_since = Instant::now();
                }
                // Before any byte of the answer's: the stream is between events.
                Poll::Ready(_) if matches!(this.phase, Phase::Waiting(_)) => {
                    return Poll::Ready(Some(Ok(Frame::data(this.waiting_words()))));
                }
                Poll::Ready(_) if this.place().between() => {
                    let keepalive = this.keepalive(this.place());
                    return Poll::Ready(Some(Ok(Frame::data(keepalive))));
                }
                // Within an event: only its end may come next.
                Poll::Ready(_) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.phase {
            Phase::Relaying(body) => self.first.is_none() && body.is_end_stream(),
            Phase::Ended => true,
            Phase::Waiting(_) | Phase::Collecting { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        // Comments may come in: no length is known.
        SizeHint::default()
    }
}
