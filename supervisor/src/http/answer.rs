//! The answers' bodies: a small body of dsv4d's own, or the engine's stream, which holds the
//! request's lease until it ends or is dropped, records the request's timings, and turns an
//! engine that breaks off into an error event the client can read.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use dsv4_engine::OutputTail;
use http_body::{Body, Frame, SizeHint};
use serde_json::Value;
use std::task::ready;
use tokio::time::Instant;

use crate::http::body::{End, OnEnd, Settle};
use crate::http::events::Place;
use crate::http::http_error::{with_tail, ErrorCode, ErrorType};
use crate::http::keepalive::{Keepalive, Relayed};
use crate::http::opening::Opening;
use crate::http::protocol::{Api, ApiProtocol, Failure};
use crate::http::watch::{Fed, Watch};
use crate::lifecycle::upstream::UpstreamBody;
use crate::lifecycle::{Lease, ERROR_TAIL_LINES};
use crate::observe::flights::Ticket;
use crate::observe::monitor::Telemetry;
use crate::observe::stats::{Count, Stats};

/// The response body: a small body of our own, or the engine's, streamed with its lease.
// The engine's variant is the common one; boxing it would cost an allocation per request.
#[allow(clippy::large_enum_variant)]
pub enum ProxyBody {
    Full(Option<Bytes>),
    Upstream(OnEnd<EngineStream, Release>),
    /// An event stream of dsv4d's own (`GET /events`).
    Events(crate::http::dashboard::Events),
    /// A streamed answer kept from going silent (see [`crate::http::keepalive`]).
    Streamed(Box<Keepalive<ProxyBody>>),
}

/// The engine's body on its way to the client: read once by its [`Watch`] (its events to the
/// statistics, the request's flight and the end check; progress events taken out, an
/// opening of dsv4d's own followed), and a break in an event stream told as an error event
/// first.
pub struct EngineStream {
    pub(crate) inner: UpstreamBody,
    /// The answer's reader and its observers; `None` for an answer nothing reads (a plain
    /// answer with no figures to count).
    pub(crate) watch: Option<Box<Watch>>,
    /// Where the answer's figures go, once it is complete.
    pub(crate) tap: Option<Box<Tapped>>,
    /// An event stream: the engine's output, to quote in the error event of a break.
    pub(crate) sse: Option<OutputTail>,
    /// The break, held back while its error event goes out.
    pub(crate) broken: Option<Broken>,
    /// The protocol the client speaks: its error event tells a break.
    pub(crate) protocol: ApiProtocol,
    /// An event stream the engine ends by closing its connection (ds4-server: no chunked
    /// framing, so its end and a cut look alike), whose protocol has a last event: it is
    /// whole only if that was its last event.
    pub(crate) unframed: bool,
    /// The request's place among those in flight, moved along as its answer comes.
    pub(crate) flight: Option<Ticket>,
    /// The engine's body has ended (what the watch held has gone out).
    pub(crate) drained: bool,
    /// What went wrong, as the error event told the client.
    pub(crate) failed: Option<Box<str>>,
}

/// A stream the engine broke off, between its error event and the failure after it.
pub enum Broken {
    Unflushed(io::Error),
    Flushed(io::Error),
}

/// The request's hold on the engine, let go when its body ends however it ends (the last byte,
/// a break, a client that left); the figures of a complete answer go to the statistics.
pub struct Release {
    pub(crate) lease: Lease,
}

impl Settle<EngineStream> for Release {
    fn settle(mut self, how: End, body: &mut EngineStream) {
        // A client that leaves once the last event is out leaves a complete answer (Codex
        // closes at `response.completed`, before the body's last chunk).
        let ended = body.watch.as_ref().is_some_and(|w| w.ended());
        let how = match (how, ended) {
            (End::Dropped, true) => End::Completed,
            (how, _) => how,
        };
        if how == End::Completed {
            self.lease.served();
        }
        drop(self.lease);
        if let Some(flight) = body.flight.take() {
            let failed = match how {
                End::Completed => body.failed.as_deref(),
                End::Errored => Some(
                    body.failed
                        .as_deref()
                        .unwrap_or("the engine broke off the answer"),
                ),
                End::Dropped => Some("the client left before the answer's end"),
            };
            flight.ended(failed);
        }
        if let (End::Completed, Some(t)) = (how, body.tap.take()) {
            if let Some(count) = body.watch.as_mut().and_then(|w| w.take_count()) {
                t.finish(&count);
            }
        }
    }
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody::Full(Some(b))
    }
}

impl Relayed for ProxyBody {
    fn place(&self) -> Place {
        match self {
            ProxyBody::Upstream(body) => body
                .get_ref()
                .watch
                .as_ref()
                .map_or(Place::Between, |w| w.place()),
            ProxyBody::Full(_) | ProxyBody::Events(_) | ProxyBody::Streamed(_) => Place::Between,
        }
    }

    fn adopt(&mut self, opening: Opening) -> Option<Opening> {
        match self {
            ProxyBody::Upstream(body) => match body.get_mut().watch.as_mut() {
                Some(w) if w.is_stream() => {
                    w.adopt(opening);
                    None
                }
                _ => Some(opening),
            },
            _ => Some(opening),
        }
    }

    fn opening(&mut self) -> Option<&mut Opening> {
        match self {
            ProxyBody::Upstream(body) => body.get_mut().watch.as_mut()?.opening(),
            _ => None,
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match &mut *self {
            ProxyBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ProxyBody::Upstream(body) => Pin::new(body).poll_frame(cx),
            ProxyBody::Events(events) => Pin::new(events).poll_frame(cx),
            ProxyBody::Streamed(body) => Pin::new(&mut **body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ProxyBody::Full(b) => b.is_none(),
            ProxyBody::Upstream(body) => body.is_end_stream(),
            ProxyBody::Events(_) => false,
            ProxyBody::Streamed(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ProxyBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ProxyBody::Full(None) => SizeHint::with_exact(0),
            ProxyBody::Upstream(body) => body.size_hint(),
            ProxyBody::Events(_) => SizeHint::default(),
            ProxyBody::Streamed(body) => body.size_hint(),
        }
    }
}

impl Body for EngineStream {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        match this.broken.take() {
            // hyper drops what it has not yet written when a body fails, so the error event
            // is let out (one turn, in which hyper flushes) before the failure that breaks the
            // connection.
            Some(Broken::Unflushed(e)) => {
                this.broken = Some(Broken::Flushed(e));
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Some(Broken::Flushed(e)) => return Poll::Ready(Some(Err(e))),
            None => {}
        }
        if this.drained {
            return Poll::Ready(None);
        }
        loop {
            let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                None => return Poll::Ready(this.end()),
                Some(Err(e)) => return Poll::Ready(Some(this.broke(e))),
            };
            let Some(watch) = this.watch.as_mut() else {
                return Poll::Ready(Some(Ok(frame)));
            };
            let data = match frame.into_data() {
                Ok(data) => data,
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            };
            let fed = watch.feed(data);
            this.tell(&fed);
            // What the watch holds (an event not yet whole) leaves nothing to send: the next.
            if !fed.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(fed.out))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A break held back behind its error event is still to come, and so is what an
        // event stream's watch holds, and its end's check.
        self.drained
            || (self.broken.is_none()
                && self.watch.as_ref().is_none_or(|w| !w.is_stream())
                && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match self.watch.as_ref().is_some_and(|w| w.is_stream()) {
            // Events may be taken out or changed.
            true => SizeHint::default(),
            false => self.inner.size_hint(),
        }
    }
}

impl EngineStream {
    /// What a chunk told, to the request's flight.
    fn tell(&self, fed: &Fed) {
        let Some(f) = &self.flight else { return };
        if let Some(p) = fed.prefill {
            f.prefill(p);
        }
        if fed.tokens > 0 {
            f.tokens(fed.tokens);
        }
        if fed.ended {
            f.ending();
        }
    }

    /// The engine's body ended: what the watch held goes out, and a stream that only the
    /// connection's close ends, cut before its last event, is told as a break.
    fn end(&mut self) -> Option<Result<Frame<Bytes>, io::Error>> {
        self.drained = true;
        let fed = self.watch.as_mut()?.finish();
        self.tell(&fed);
        let mut out = fed.out;
        let whole = self
            .watch
            .as_ref()
            .is_some_and(|w| w.ended_with_its_last_event());
        if self.unframed && !whole {
            // Stopped (or crashed) mid-answer: told as llama-server's breaks are, then the
            // end. (There is no failure to break the connection with: the engine's close
            // was the end of its body.)
            self.tap = None;
            let tail = self.sse.as_ref().map(|o| o.last(ERROR_TAIL_LINES));
            let what = format!(
                "the engine ended the answer before its end ({}): it was stopped or failed",
                self.protocol.spec().end_name
            );
            let event = api_error_event(
                self.protocol,
                what.clone(),
                tail.as_deref().unwrap_or_default(),
            );
            self.failed = Some(what.into());
            out = [out, event].concat().into();
        }
        (!out.is_empty()).then(|| Ok(Frame::data(out)))
    }

    /// The engine's body failed with `e`: an event stream tells it in an error event first.
    fn broke(&mut self, e: io::Error) -> Result<Frame<Bytes>, io::Error> {
        self.tap = None;
        let Some(output) = &self.sse else {
            return Err(e);
        };
        // Clients show an error event's message; a stream that merely stops looks like a
        // complete, cut-off answer. The connection still breaks after it, so nothing
        // mistakes it for an end.
        self.failed = Some(format!("the engine broke off the answer: {}", describe(&e)).into());
        let event = error_event(self.protocol, &e, &output.last(ERROR_TAIL_LINES));
        self.broken = Some(Broken::Unflushed(e));
        Ok(Frame::data(event))
    }
}

/// Where a complete answer's figures go.
pub struct Tapped {
    pub(crate) stats: Stats,
    pub(crate) telemetry: Telemetry,
    pub(crate) profile: String,
    pub(crate) path: String,
    pub(crate) started: Instant,
    /// A KV restore of the profile's that waits for a request sharing its tokens to check it.
    pub(crate) check: Option<CheckRestore>,
}

impl Tapped {
    fn finish(self, count: &Count) {
        if let Some(t) = count.figures() {
            let wall = self.started.elapsed().as_secs_f64();
            let now = dsv4_client::clock::unix_now();
            let resources = self.telemetry.resources(now - wall, now);
            // (A body dropped as the runtime shuts down has no runtime to check on.)
            if let (Some(check), Ok(rt)) = (self.check, tokio::runtime::Handle::try_current()) {
                rt.spawn(check.run(self.profile.clone(), self.path.clone(), t.cache_n));
            }
            self.stats
                .record(self.profile, self.path, &t, wall * 1000.0, Some(resources));
        }
    }
}

/// What checks a KV restore by the request (see [`crate::kv::verify`]): its body, the
/// engine that makes its tokens, and where the engine's output stood when it was sent.
pub struct CheckRestore {
    pub(crate) lifecycle: crate::lifecycle::Handle,
    pub(crate) engine: std::sync::Arc<crate::lifecycle::EngineRef>,
    pub(crate) body: Bytes,
    pub(crate) mark: u64,
}

/// Why llama-server's restores may reuse nothing, for the warning of a miss.
const SLOTS_MISS: &str = "llama-server's slot restore is known to do this on SWA and hybrid \
    models (llama.cpp #25913, #28194) and on some dense ones (#26676)";

impl CheckRestore {
    /// The request to `path` of `profile`'s engine had `cache_n` tokens from the cache: the
    /// restore's check, when the request can say.
    async fn run(self, profile: String, path: String, cache_n: u64) {
        use crate::kv::{verify, Expected};
        let book = self.lifecycle.kv();
        let message = match book.expected(&profile) {
            None => return,
            Some(Expected::Own) => self.own(&profile),
            Some(Expected::Slots(slots)) => {
                let tokens = match verify::request_tokens(&*self.engine, &path, &self.body).await {
                    Ok(tokens) => tokens,
                    Err(e) => {
                        tracing::debug!("this request cannot check the KV restore: {e}");
                        return;
                    }
                };
                let Some((shared, missed)) = verify::judge(&slots, &tokens, cache_n) else {
                    return;
                };
                book.checked(&profile, cache_n, shared, missed.then_some(SLOTS_MISS))
            }
        };
        if let Some(message) = message {
            self.lifecycle
                .alerts()
                .raise(dsv4_client::AlertKind::Kv, message);
        }
    }

    /// An engine that loads its own checkpoints: what it said of a load while it served the
    /// request, made the profile's restore and its check; nothing when it tried none.
    fn own(&self, profile: &str) -> Option<String> {
        use dsv4_engine::OwnLoad;
        let own = self.engine.kind.own_kv()?;
        let (_, lines) = self.engine.output.since(self.mark, 256);
        let (line, load) = lines
            .iter()
            .find_map(|l| (own.loaded)(l).map(|load| (l.trim().to_string(), load)))?;
        let book = self.lifecycle.kv();
        let program = self.engine.kind.program;
        let (step, reused, missed) = match load {
            OwnLoad::Loaded { tokens, seconds } => {
                book.credit(tokens);
                let step = dsv4_client::kv::KvStep {
                    seconds,
                    tokens,
                    result: format!("loaded by {program} for a request"),
                    ok: true,
                    ..Default::default()
                };
                (step, tokens, None)
            }
            OwnLoad::Failed { why, file } => {
                let step = dsv4_client::kv::KvStep {
                    result: format!("{program} could not load it: {why}"),
                    tokens: (own.tokens_in)(std::path::Path::new(&file)).unwrap_or(0),
                    ..Default::default()
                };
                let missed = format!(
                    "{program} matched the request to one of its checkpoints \
                    and could not load it: {why}"
                );
                (step, 0, Some(missed))
            }
        };
        let step = dsv4_client::kv::KvStep {
            at: dsv4_client::clock::unix_now(),
            engine_said: Some(line),
            ..step
        };
        let shared = step.tokens;
        book.restored(profile, step);
        book.checked(profile, reused, shared, missed.as_deref())
    }
}

/// An error and its causes on one line: a wrapper's message is often terse, its source says
/// what happened underneath.
pub(crate) fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text = format!("{text}: {c_text}");
        }
        cause = c.source();
    }
    text
}

/// The event that tells a streaming client why its answer broke off, in its protocol's
/// error shape (each protocol's SDK raises it with this message).
pub(crate) fn error_event(protocol: ApiProtocol, err: &io::Error, tail: &[String]) -> Bytes {
    api_error_event(
        protocol,
        format!("the engine broke off the answer: {}", describe(err)),
        tail,
    )
}

pub(crate) fn api_error_event(protocol: ApiProtocol, what: String, tail: &[String]) -> Bytes {
    let message = with_tail(what, tail);
    protocol.error_event(&Failure {
        message: &message,
        kind: ErrorType::Server.as_str(),
        code: Value::String(ErrorCode::EngineFailed.as_str().into()),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::upstream::UpstreamError;

    #[test]
    fn an_error_is_described_with_its_causes_once() {
        let io = io::Error::new(io::ErrorKind::ConnectionReset, "reset by peer");
        let e = UpstreamError::Connect {
            addr: ([127, 0, 0, 1], 9).into(),
            source: io,
        };
        assert_eq!(
            describe(&e),
            "cannot connect to the engine at 127.0.0.1:9: reset by peer"
        );
    }
}
