//! The answers' bodies: a small body of dsv4d's own, or the engine's stream, which holds the
//! request's lease until it ends or is dropped, records the request's timings, and turns an
//! engine that breaks off into an error event the client can read.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use dsv4_engine::OutputTail;
use http_body::{Body, Frame, SizeHint};
use memchr::memmem;
use serde_json::Value;
use tokio::time::Instant;

use crate::http::body::{End, OnEnd, Settle};
use crate::http::http_error::{with_tail, ErrorCode, ErrorType};
use crate::http::keepalive::Keepalive;
use crate::http::progress::{count_events, Progress};
use crate::http::protocol::{Failure, LastEvent, Protocol};
use crate::lifecycle::upstream::UpstreamBody;
use crate::lifecycle::{Lease, ERROR_TAIL_LINES};
use crate::observe::flights::Ticket;
use crate::observe::monitor::Telemetry;
use crate::observe::stats::{Stats, Tap};

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

/// The engine's body on its way to the client: its bytes shown to the statistics tap, and a
/// break in an event stream told as an error event first.
pub struct EngineStream {
    pub(crate) inner: UpstreamBody,
    /// Reads the engine's `timings` off the response's end, for the statistics.
    pub(crate) tap: Option<Box<Tapped>>,
    /// An event stream: the engine's output, to quote in the error event of a break.
    pub(crate) sse: Option<OutputTail>,
    /// The break, held back while its error event goes out.
    pub(crate) broken: Option<Broken>,
    /// The protocol the client speaks: its error event tells a break.
    pub(crate) protocol: Protocol,
    /// An event stream the engine ends by closing its connection (ds4-server: no chunked
    /// framing, so its end and a cut look alike), whose protocol has a last event: the head
    /// of its last event, to tell whether it ended with it. `None` once told, or where a cut
    /// shows as one.
    pub(crate) unframed: Option<LastEvent>,
    /// The request's place among those in flight, moved along as its answer comes.
    pub(crate) flight: Option<Ticket>,
    /// The engine's own progress events, read (and taken out when dsv4d asked for them).
    /// Boxed: the body is moved whole several times on its way out, and most have none.
    pub(crate) progress: Option<Box<Progress>>,
    /// The engine's body has ended (what the progress reader held goes out first).
    pub(crate) drained: bool,
    /// What went wrong, as the error event told the client.
    pub(crate) failed: Option<Box<str>>,
    /// The bytes so far end a line (or there are none): a `data:` at the next chunk's start
    /// begins a line.
    pub(crate) line_start: bool,
    /// The protocol's last event has gone out: the answer is complete, even if the client
    /// closes before the body's last chunk (Codex does, at `response.completed`).
    pub(crate) ended: bool,
}

/// A stream the engine broke off, between its error event and the failure after it.
pub enum Broken {
    Unflushed(hyper::Error),
    Flushed(hyper::Error),
}

/// The request's hold on the engine, let go when its body ends however it ends (the last byte,
/// a break, a client that left); the figures of a complete answer go to the statistics.
pub struct Release {
    pub(crate) lease: Lease,
}

impl Settle<EngineStream> for Release {
    fn settle(mut self, how: End, body: &mut EngineStream) {
        // A client that leaves once the last event is out leaves a complete answer.
        let how = match (how, body.ended) {
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
            t.finish();
        }
    }
}

impl From<Bytes> for ProxyBody {
    fn from(b: Bytes) -> Self {
        ProxyBody::Full(Some(b))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
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
        let mut polled = Pin::new(&mut this.inner).poll_frame(cx);
        // The progress events the reader takes out leave nothing to send: the next frame.
        while let Poll::Ready(Some(Ok(frame))) = &polled {
            let Some(d) = frame.data_ref() else { break };
            if let Some(t) = this.tap.as_mut() {
                t.tap.push(d);
            }
            if let Some(last) = this.unframed.as_mut() {
                last.push(d);
            }
            // The protocol's last event: the answer is complete, on its way out.
            if this.sse.is_some() && ends_here(d, this.protocol.spec().ends) {
                this.ended = true;
                if let Some(f) = &this.flight {
                    f.ending();
                }
            }
            let Some(progress) = this.progress.as_mut() else {
                if let (Some(f), true) = (&this.flight, this.sse.is_some()) {
                    let events = count_events(d, this.line_start);
                    if events > 0 {
                        f.tokens(events);
                    }
                }
                this.line_start = d.last().is_none_or(|b| matches!(b, b'\n' | b'\r'));
                break;
            };
            let fed = progress.feed(d.clone());
            if let Some(f) = &this.flight {
                if let Some(p) = fed.latest {
                    f.prefill(p);
                }
                if fed.events > 0 {
                    f.tokens(fed.events);
                }
            }
            match fed.out {
                Some(out) => {
                    polled = Poll::Ready(Some(Ok(Frame::data(out))));
                    break;
                }
                None => polled = Pin::new(&mut this.inner).poll_frame(cx),
            }
        }
        if let (Poll::Ready(None), Some(progress)) = (&polled, this.progress.as_mut()) {
            if let Some(rest) = progress.rest() {
                this.drained = true;
                return Poll::Ready(Some(Ok(Frame::data(rest))));
            }
        }
        match &polled {
            Poll::Ready(Some(Ok(_))) => {}
            Poll::Ready(None)
                if this
                    .unframed
                    .as_ref()
                    .is_some_and(|l| !l.ended(this.protocol.spec().ends)) =>
            {
                // Stopped (or crashed) mid-answer: told as llama-server's breaks are, then the
                // end. (There is no failure to break the connection with: the engine's close
                // was the end of its body.)
                this.unframed = None;
                this.tap = None;
                let tail = this.sse.as_ref().map(|o| o.last(ERROR_TAIL_LINES));
                let what = format!(
                    "the engine ended the answer before its end ({}): it was stopped or failed",
                    this.protocol.spec().end_name
                );
                let event = api_error_event(
                    this.protocol,
                    what.clone(),
                    tail.as_deref().unwrap_or_default(),
                );
                this.failed = Some(what.into());
                return Poll::Ready(Some(Ok(Frame::data(event))));
            }
            Poll::Ready(Some(Err(e))) => {
                this.tap = None;
                if let Some(output) = &this.sse {
                    // Clients show an error event's message; a stream that merely stops looks
                    // like a complete, cut-off answer. The connection still breaks after it,
                    // so nothing mistakes it for an end.
                    this.failed =
                        Some(format!("the engine broke off the answer: {}", describe(e)).into());
                    let event = error_event(this.protocol, e, &output.last(ERROR_TAIL_LINES));
                    if let Poll::Ready(Some(Err(e))) = polled {
                        this.broken = Some(Broken::Unflushed(e));
                    }
                    return Poll::Ready(Some(Ok(Frame::data(event))));
                }
            }
            Poll::Ready(None) | Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        // A break held back behind its error event is still to come, and so is what the
        // progress reader holds.
        self.drained
            || (self.broken.is_none() && self.progress.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether `chunk` holds a line that begins one of `ends` (at its start, or after a line
/// end: never within an event's JSON, where a line end cannot be).
fn ends_here(chunk: &[u8], ends: &[&[u8]]) -> bool {
    ends.iter().any(|e| {
        memmem::find_iter(chunk, e).any(|at| at == 0 || matches!(chunk[at - 1], b'\n' | b'\r'))
    })
}

/// A response being watched for its `timings`.
pub struct Tapped {
    pub(crate) tap: Tap,
    pub(crate) stats: Stats,
    pub(crate) telemetry: Telemetry,
    pub(crate) profile: String,
    pub(crate) path: String,
    pub(crate) started: Instant,
}

impl Tapped {
    fn finish(self) {
        if let Some(t) = self.tap.timings() {
            let wall = self.started.elapsed().as_secs_f64();
            let now = dsv4_client::clock::unix_now();
            let resources = self.telemetry.resources(now - wall, now);
            self.stats
                .record(self.profile, self.path, &t, wall * 1000.0, Some(resources));
        }
    }
}

/// An error and its causes on one line: hyper's own message is terse ("connection closed
/// before message completed"), its source says what happened underneath.
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
pub(crate) fn error_event(protocol: Protocol, err: &hyper::Error, tail: &[String]) -> Bytes {
    api_error_event(
        protocol,
        format!("the engine broke off the answer: {}", describe(err)),
        tail,
    )
}

pub(crate) fn api_error_event(protocol: Protocol, what: String, tail: &[String]) -> Bytes {
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
    fn an_end_counts_only_at_a_line_start() {
        let ends: &[&[u8]] = &[b"event: message_stop", b"data: [DONE]"];
        for (chunk, ended) in [
            (&b"event: message_stop\ndata: {}\n\n"[..], true),
            (b"data: {\"a\":1}\n\ndata: [DONE]\n\n", true),
            (b"data: {\"text\":\"say data: [DONE] now\"}\n\n", false),
            (b"data: {\"text\":\"event: message_stop\"}\r\n\r\n", false),
            (b"\r\ndata: [DONE]", true),
        ] {
            assert_eq!(
                ends_here(chunk, ends),
                ended,
                "{}",
                String::from_utf8_lossy(chunk)
            );
        }
    }

    #[test]
    fn an_error_is_described_with_its_causes_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
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
