//! The HTTP front: the supervisor's own endpoints and the streaming proxy to the engine.
//!
//! Owns: client connections, routing, who may call (browsers: [`crate::http::front`], API keys:
//! [`crate::http::auth`]), hop-by-hop header handling, and the lease that each proxied request
//! holds until its response body ends or is dropped. Must not: buffer responses, time out a
//! response that has not started (a 256K-token prefill takes two hours), or touch the engine
//! process (it asks the lifecycle actor for a lease).
//!
//! A request's body is read whole first ([`crate::http::intake`]), and only then does the request
//! take a lease and go to the engine. Responses stream frame by frame. A client that goes
//! away is noticed whenever it does: hyper sees the connection close once the request's
//! body has been read (while the request waits for a lease, or for the engine's first byte
//! through a prefill of hours), and drops the request's future, its lease and its upstream
//! request, whose connection closes, so the engine stops work; later, it drops the
//! response body, to the same effect.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dsv4_engine::OutputTail;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::config::Config;
use crate::http::auth::KeyFile;
use crate::http::body::{End, OnEnd, Settle};
use crate::http::connections;
pub use crate::http::ctx::Ctx;
use crate::http::front;
use crate::http::http_error::{with_tail, ApiError, ErrorCode, ErrorType};
use crate::http::intake::{self, IntakeError};
use crate::http::keepalive::{self, Keepalive};
use crate::http::sse::{self, Protocol};
use crate::http::ui_actions;
use crate::lifecycle::upstream::{UpstreamBody, UpstreamError};
use crate::lifecycle::{Lease, ERROR_TAIL_LINES};
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
    inner: UpstreamBody,
    /// Reads the engine's `timings` off the response's end, for the statistics.
    tap: Option<Box<Tapped>>,
    /// An event stream: the engine's output, to quote in the error event of a break.
    sse: Option<OutputTail>,
    /// The break, held back while its error event goes out.
    broken: Option<Broken>,
    /// An OpenAI event stream the engine ends by closing its connection (ds4-server: no
    /// chunked framing, so its end and a cut look alike): the last bytes seen, to tell
    /// whether it ended with `data: [DONE]`. `None` once told, or where a cut shows as one.
    unframed: Option<LastBytes>,
}

/// The last few bytes of a stream.
#[derive(Default)]
pub struct LastBytes(Vec<u8>);

impl LastBytes {
    const KEEP: usize = 32;

    fn push(&mut self, data: &[u8]) {
        self.0
            .extend_from_slice(&data[data.len().saturating_sub(Self::KEEP)..]);
        let extra = self.0.len().saturating_sub(Self::KEEP);
        self.0.drain(..extra);
    }

    /// Whether the stream ended with its `[DONE]` event.
    fn done(&self) -> bool {
        self.0.trim_ascii_end().ends_with(b"data: [DONE]")
    }
}

/// A stream the engine broke off, between its error event and the failure after it.
pub enum Broken {
    Unflushed(hyper::Error),
    Flushed(hyper::Error),
}

/// The request's hold on the engine, let go when its body ends however it ends (the last byte,
/// a break, a client that left); the figures of a complete answer go to the statistics.
pub struct Release {
    lease: Lease,
}

impl Settle<EngineStream> for Release {
    fn settle(mut self, how: End, body: &mut EngineStream) {
        if how == End::Completed {
            self.lease.served();
        }
        drop(self.lease);
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
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(t), Some(d)) = (this.tap.as_mut(), frame.data_ref()) {
                    t.tap.push(d);
                }
                if let (Some(last), Some(d)) = (this.unframed.as_mut(), frame.data_ref()) {
                    last.push(d);
                }
            }
            Poll::Ready(None) if this.unframed.as_ref().is_some_and(|l| !l.done()) => {
                // Stopped (or crashed) mid-answer: told as llama-server's breaks are, then the
                // end. (There is no failure to break the connection with: the engine's close
                // was the end of its body.)
                this.unframed = None;
                this.tap = None;
                let tail = this.sse.as_ref().map(|o| o.last(ERROR_TAIL_LINES));
                let event = api_error_event(
                    "the engine ended the answer before its end ([DONE]): it was stopped or \
                     failed"
                        .to_string(),
                    tail.as_deref().unwrap_or_default(),
                );
                return Poll::Ready(Some(Ok(Frame::data(event))));
            }
            Poll::Ready(Some(Err(e))) => {
                this.tap = None;
                if let Some(output) = &this.sse {
                    // Clients show an error event's message; a stream that merely stops looks
                    // like a complete, cut-off answer. The connection still breaks after it,
                    // so nothing mistakes it for an end.
                    let event = error_event(e, &output.last(ERROR_TAIL_LINES));
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
        // A break held back behind its error event is still to come.
        self.broken.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response being watched for its `timings`.
pub struct Tapped {
    tap: Tap,
    stats: Stats,
    telemetry: Telemetry,
    profile: String,
    path: String,
    started: Instant,
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

/// Serves connections from `listener` until `shutdown` resolves, then stops accepting and
/// asks open connections to close once their current exchange is done. Returns a future that
/// resolves when every connection has closed.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<Ctx>,
    shutdown: impl Future<Output = ()>,
) -> impl Future<Output = ()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // A connection that has not sent a complete request head within 30 s, whether
    // new or kept alive between requests, is closed: idle and slow clients free their slot.
    http.timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(connections::HEADER_TIMEOUT)
        // What one connection may hold of a request head it has not finished: hyper's
        // default (about 400 KB) let 60 slow heads take 23 MB (api.max_buffered bounds
        // bodies only). A longer head gets 431.
        .max_buf_size(connections::HEAD_BUFFER);
    let connections = ctx.connections.clone();
    // The open-file limit was raised (or not) before the runtime started.
    let fd_cap = connections::fd_cap();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of fds and the like: keep serving the connections we have.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        ctx.activity.touch();
        let (max_connections, min_body_rate) = {
            let config = ctx.parts.config.borrow();
            let api = &config.supervisor.api;
            (api.max_connections, api.min_body_rate)
        };
        let cap = max_connections.min(fd_cap);
        let Some(slot) = connections.admit(cap, min_body_rate) else {
            tracing::debug!(%peer, "refused: {cap} client connections open");
            connections.refuse(stream, max_connections, cap);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let slot = Arc::new(slot);
        let service = {
            let (ctx, slot) = (ctx.clone(), slot.clone());
            hyper::service::service_fn(move |req| {
                let (ctx, slot) = (ctx.clone(), slot.clone());
                async move {
                    // In flight until its response body ends.
                    let busy = slot.busy();
                    let resp = handle(&ctx, req, &slot).await;
                    Ok::<_, Infallible>(resp.map(|b| OnEnd::new(b, move |_: End| drop(busy))))
                }
            })
        };
        let io = TokioIo::new(stream);
        let conn = http.serve_connection(io, service);
        let ctx = ctx.clone();
        tokio::spawn(async move {
            tokio::pin!(conn);
            let changed = slot.changed();
            let mut closing = false;
            loop {
                // Keys configured: a connection without one is kept alive briefly. (Only
                // whether they are: the keys themselves are read where a request shows one.)
                let keys = ctx
                    .parts
                    .config
                    .borrow()
                    .supervisor
                    .api
                    .api_keys_file
                    .is_some();
                let unkeyed = keys.then_some(connections::UNKEYED_KEEP_ALIVE);
                let until = match slot.next(unkeyed, tokio::time::Instant::now()) {
                    connections::Next::Serve(until) => until,
                    connections::Next::Evicted => {
                        tracing::debug!(%peer, "closed, idle the longest, to make room");
                        break;
                    }
                    connections::Next::Unkeyed => {
                        tracing::debug!(%peer, "closed: idle, and no API key shown");
                        break;
                    }
                    // An idle connection ends at once, a busy one after its answer.
                    connections::Next::Closing => {
                        if !std::mem::replace(&mut closing, true) {
                            conn.as_mut().graceful_shutdown();
                        }
                        None
                    }
                };
                tokio::select! {
                    ended = &mut conn => {
                        if let Err(e) = ended {
                            tracing::debug!(%peer, "connection ended: {e}");
                        }
                        break;
                    }
                    _ = changed.heard() => {}
                    _ = tokio::time::sleep_until(until.unwrap_or_else(tokio::time::Instant::now)),
                        if until.is_some() => {}
                }
            }
        });
    }
    drop(listener);
    ctx.closing.send_replace(true);
    connections.close();
    async move { connections.closed().await }
}

/// The methods served (by dsv4d or the engine); any other gets 405.
const ALLOWED_METHODS: [Method; 7] = [
    Method::GET,
    Method::HEAD,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
    Method::OPTIONS,
];
const ALLOW: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// `req`, which came on the connection `on` (the front door notes there what it showed).
async fn handle(
    ctx: &Arc<Ctx>,
    req: Request<Incoming>,
    on: &connections::Slot,
) -> Response<ProxyBody> {
    ctx.activity.touch();
    let config = ctx.parts.config.borrow().clone();
    // Browsers first, on every path: a request for a host that is not ours (DNS rebinding)
    // or from a web page not listed gets no further, and a preflight is answered here.
    let caller = match front::admit(&config.supervisor.api, &req) {
        Ok(caller) => caller,
        Err(refused) => return refused.into_response(),
    };
    if front::is_preflight(&req) {
        return front::preflight(&caller, req.headers());
    }
    let mut response = route(ctx, &config, req, on).await;
    front::finish(&caller, response.headers_mut());
    response
}

async fn route(
    ctx: &Arc<Ctx>,
    config: &Arc<Config>,
    mut req: Request<Incoming>,
    on: &connections::Slot,
) -> Response<ProxyBody> {
    if !ALLOWED_METHODS.contains(req.method()) {
        // CONNECT, TRACE and the like: nothing here or in the engine serves them, so they
        // are answered here and never start the engine.
        let mut r: Response<ProxyBody> = ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::InvalidRequest,
            ErrorCode::MethodNotAllowed,
            format!("method {} is not supported; use {ALLOW}", req.method()),
        )
        .into_response();
        r.headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(ALLOW));
        return r;
    }
    // From here on the path is the one the engine will route: decoded as it decodes it,
    // and sent to it so that it decodes to exactly that (see `crate::http::path`).
    if let Err(refused) = judge_path(&mut req) {
        return refused;
    }
    let own = matches!(*req.method(), Method::GET | Method::HEAD);
    if own {
        // The dashboard's files hold no data: open like /health.
        if let Some(page) = crate::http::dashboard::asset(req.uri().path()) {
            return page;
        }
    }
    // The rest of /ui is the dashboard's too, never the engine's: its actions (with their
    // own keys and checks), and nothing else.
    if let Some(action) = req.uri().path().strip_prefix(ui_actions::PREFIX) {
        let action = action.to_string();
        let done = ui_actions::act(ctx, config, &action, req).await;
        if done.is_ok() {
            // It showed an admin key: kept alive as long as any other.
            on.keyed();
        }
        return ui_actions::answer(done);
    }
    if req.uri().path() == "/ui" || req.uri().path().starts_with("/ui/") {
        return ui_actions::not_found(req.uri().path()).into_response();
    }
    if own && req.uri().path() == "/health" {
        // Open to every caller the front admits: it is what a load balancer or a watchdog
        // polls.
        let s = ctx.parts.lifecycle.status();
        return json_response(
            StatusCode::OK,
            json!({ "status": "ok", "engine": s.state, "profile": s.profile }),
        );
    }
    let keys = ctx.api_keys.get(config);
    let keyed = matches!(keys, Some(Ok(_)));
    if let Err(refused) = crate::http::auth::require(KeyFile::Api, keys, req.headers_mut()) {
        let unauthorized = refused.status == StatusCode::UNAUTHORIZED;
        let mut r: Response<ProxyBody> = refused.into_response();
        if unauthorized {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        return r;
    }
    if keyed {
        // Its connection is kept alive as long as any other.
        on.keyed();
    }
    match (own, req.uri().path()) {
        (true, "/status") => match serde_json::to_value(ctx.parts.status_document().await) {
            Ok(v) => json_response(StatusCode::OK, v),
            Err(e) => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                ErrorType::Server,
                ErrorCode::Internal,
                e.to_string(),
            )
            .into_response(),
        },
        (true, "/v1/models") => json_response(StatusCode::OK, models(ctx)),
        (true, "/events") => match crate::http::dashboard::events(ctx) {
            Ok(r) => r.map(ProxyBody::Events),
            Err(e) => e.into_response(),
        },
        (true, "/metrics") => {
            let sample = ctx.parts.telemetry.latest();
            let kv = ctx.parts.lifecycle.kv().status().await;
            let text = crate::observe::metrics::render(
                &ctx.parts.lifecycle.status(),
                &ctx.parts.stats.report(0),
                sample.as_deref(),
                &ctx.parts.power.status(),
                &ctx.parts.thermal.status(),
                &kv,
            );
            let mut r = Response::new(ProxyBody::from(Bytes::from(text)));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(crate::observe::metrics::CONTENT_TYPE),
            );
            r
        }
        _ => proxy(ctx, config, req, on).await,
    }
}

fn json_response(status: StatusCode, v: serde_json::Value) -> Response<ProxyBody> {
    let mut r = Response::new(ProxyBody::from(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// `GET /v1/models`: the profiles, from the configuration; needs no engine. OpenAI's list
/// shape, with what `ListProfiles()` tells about each.
fn models(ctx: &Ctx) -> serde_json::Value {
    let active = ctx.parts.lifecycle.status().profile;
    let data: Vec<_> = crate::config::profiles::list(&ctx.parts.config.borrow(), &active)
        .into_iter()
        .map(|p| {
            json!({
                "id": p.name,
                "object": "model",
                "created": 0,
                "owned_by": "dsv4",
                "engine": p.engine,
                "context": p.context,
                "description": p.description,
                "active": p.active,
            })
        })
        .collect();
    json!({ "object": "list", "data": data })
}

/// Replaces the request's target by its origin form with the path decoded and encoded
/// canonically; a path that cannot be decoded cleanly is refused with a 400.
#[allow(clippy::result_large_err)]
fn judge_path(req: &mut Request<Incoming>) -> Result<(), Response<ProxyBody>> {
    let bad = |why: String| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequest,
            ErrorCode::BadPath,
            why,
        )
        .into_response()
    };
    let canonical =
        crate::http::path::canonical(req.uri().path()).map_err(|e| bad(e.to_string()))?;
    let std::borrow::Cow::Owned(mut target) = canonical else {
        // Written as the engine will read it already: only an absolute form changes.
        if req.uri().scheme().is_none() {
            return Ok(());
        }
        let origin_form = req.uri().path_and_query().map_or("/", |p| p.as_str());
        *req.uri_mut() = Uri::try_from(origin_form).map_err(|e| bad(e.to_string()))?;
        return Ok(());
    };
    if let Some(q) = req.uri().query() {
        target.push('?');
        target.push_str(q);
    }
    *req.uri_mut() = Uri::try_from(target).map_err(|e| bad(e.to_string()))?;
    Ok(())
}

/// Whether `req` is a slot action (`POST /slots/N?action=...`, or anything but a read of
/// `/slots`), judged on the path the engine routes (see `judge_path`).
fn is_slot_action(req: &Request<Incoming>) -> bool {
    let path = req.uri().path();
    req.method() != Method::GET && (path == "/slots" || path.starts_with("/slots/"))
}

/// With KV checkpoints on, the engine's slot files are dsv4d's: a client's `POST
/// /slots/N?action=save|restore|erase` would write files no bound counts, read back another
/// conversation's cache, or throw away another client's slot. `GET /slots` still passes.
/// Judged for `profile`: before the lease, each of the running engine's and the active one
/// (a switch may be draining toward it); with the lease, the engine that will serve it.
fn slots_kept_by_dsv4d(config: &Config, profile: &str) -> Option<Response<ProxyBody>> {
    config.profile(profile)?.kv_checkpoint.as_ref()?;
    Some(
        ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorType::InvalidRequest,
            ErrorCode::SlotsManaged,
            format!(
                "profile {profile} keeps KV checkpoints (kv_checkpoint): dsv4d saves and \
                 restores the engine's slots itself, so slot actions are not forwarded; see \
                 dsv4ctl kv"
            ),
        )
        .into_response(),
    )
}

async fn proxy(
    ctx: &Arc<Ctx>,
    config: &Arc<Config>,
    req: Request<Incoming>,
    on: &connections::Slot,
) -> Response<ProxyBody> {
    let api = &config.supervisor.api;
    let limits = intake::Limits {
        max_body: api.max_body,
        timeout: api.body_timeout,
        max_buffered: api.max_buffered,
        min_rate: api.min_body_rate,
    };
    let started = Instant::now();
    let slot_action = is_slot_action(&req);
    if slot_action {
        let status = ctx.parts.lifecycle.status();
        let running = status.engine_profile.as_deref();
        let refused = [running, Some(status.profile.as_str())]
            .into_iter()
            .flatten()
            .find_map(|p| slots_kept_by_dsv4d(config, p));
        if let Some(refused) = refused {
            return refused;
        }
    }
    let (parts, body) = req.into_parts();
    // The whole body first: a client that is slow to send it holds no lease and no engine
    // connection meanwhile, and never starts the engine.
    // A Content-Length beside Transfer-Encoding is not the body's length: hyper reads such a
    // body as chunked (RFC 9112 6.3), and so does the intake.
    let declared = match parts.headers.contains_key(header::TRANSFER_ENCODING) {
        true => None,
        false => content_length(&parts.headers),
    };
    // Until it is whole, its connection may be chosen to make room at the cap.
    let reading = on.intake();
    let (got, stop) = (reading.got(), reading.evicted());
    let held = match intake::read(body, declared, limits, &ctx.bodies, got, stop).await {
        Ok(held) => held,
        Err(e) => return intake_refusal(&e),
    };
    drop(reading);
    // A streamed answer is kept from going silent (see `crate::http::keepalive`); any other
    // request goes on as it is.
    let keepalive = match api.stream_keepalive {
        Some(period) if parts.method == Method::POST => Protocol::of(parts.uri.path())
            .filter(|_| sse::wants_stream(&held.bytes))
            .map(|protocol| (period, protocol)),
        _ => None,
    };
    let answer = forward(
        ctx.clone(),
        config.clone(),
        parts,
        held,
        started,
        slot_action,
    );
    match keepalive {
        None => answer.await,
        Some((period, protocol)) => {
            let wrap = |k| ProxyBody::Streamed(Box::new(k));
            let lifecycle = ctx.parts.lifecycle.clone();
            keepalive::respond(Box::pin(answer), period, protocol, lifecycle, started, wrap).await
        }
    }
}

/// The rest of a request's way, its body read: its turn (a lease on the engine, started if
/// need be), the engine's answer.
async fn forward(
    ctx: Arc<Ctx>,
    config: Arc<Config>,
    mut parts: http::request::Parts,
    held: intake::Held,
    started: Instant,
    slot_action: bool,
) -> Response<ProxyBody> {
    if let Err(max_waiting) = ctx
        .parts
        .validator
        .admit(config.supervisor.engine.max_waiting)
        .await
    {
        return validation_queue_full(max_waiting);
    }
    let lease = loop {
        let lease = match ctx.parts.lifecycle.acquire().await {
            Ok(lease) => lease,
            Err(refusal) => return ApiError::from(refusal).into_response(),
        };
        if !ctx.parts.validator.running() {
            break lease;
        }
        // A validation began while this request waited for an engine: that engine is the
        // validation's, never a client's. Back to the gate, then wait for the profile it
        // restores (or 503 past max_waiting, as any request during a validation).
        drop(lease);
        if let Err(max_waiting) = ctx
            .parts
            .validator
            .admit(config.supervisor.engine.max_waiting)
            .await
        {
            return validation_queue_full(max_waiting);
        }
    };
    if slot_action {
        // The engine that will serve it, which a switch may have changed meanwhile.
        if let Some(refused) = slots_kept_by_dsv4d(&config, &lease.engine.profile) {
            return refused;
        }
    }
    let tap_path = (parts.method == Method::POST).then(|| parts.uri.path().to_string());
    let ends_with_done = ends_with_done(parts.uri.path());
    // The target is in origin form already (`judge_path`), as an HTTP/1.1 client sends it to
    // a server it talks to directly.
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    // The body is here already: nothing for the engine to agree to first, and its length is
    // what was read (hyper's client sets Content-Length from it), not what the client said.
    parts.headers.remove(header::EXPECT);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::HOST, lease.engine.connections.host().clone());
    let engine = lease.engine.clone();
    let answer = engine.connections.request(parts, held.bytes).await;
    // Sent: the bytes have left (the upstream kept them only for a second try).
    drop(held.charge);
    match answer {
        Ok(resp) => {
            let (mut parts, inner) = resp.into_parts();
            // A body that only the connection's close ends.
            let unframed = !parts.headers.contains_key(header::CONTENT_LENGTH)
                && !parts.headers.contains_key(header::TRANSFER_ENCODING);
            strip_hop_by_hop(&mut parts.headers);
            let content_type = parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok());
            let sse = content_type.is_some_and(|t| t.starts_with("text/event-stream"));
            let tap = match tap_path {
                Some(path) if parts.status.is_success() => {
                    Tap::for_content_type(content_type).map(|tap| {
                        Box::new(Tapped {
                            tap,
                            stats: ctx.parts.stats.clone(),
                            telemetry: ctx.parts.telemetry.clone(),
                            profile: engine.profile.clone(),
                            path,
                            started,
                        })
                    })
                }
                _ => None,
            };
            let stream = EngineStream {
                inner,
                tap,
                sse: sse.then(|| engine.output.clone()),
                broken: None,
                unframed: (sse && unframed && ends_with_done).then(LastBytes::default),
            };
            Response::from_parts(
                parts,
                ProxyBody::Upstream(OnEnd::new(stream, Release { lease })),
            )
        }
        Err(e) => {
            drop(lease);
            engine_error(&engine, &e).await.into_response()
        }
    }
}

/// The 503 for a request over `max_waiting` while a validation holds the engine.
fn validation_queue_full(max_waiting: usize) -> Response<ProxyBody> {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Server,
        ErrorCode::QueueFull,
        format!(
            "a validation run holds the engine and {max_waiting} requests (engine.max_waiting) \
             already wait for its end; try again later"
        ),
    )
    .retry_after(Duration::from_secs(30))
    .into_response()
}

/// The answer to a request whose body was not read whole.
fn intake_refusal(e: &IntakeError) -> Response<ProxyBody> {
    tracing::debug!("refused a request: {e}");
    let mut r: Response<ProxyBody> = ApiError::from(e).into_response();
    // What is left of the body is unread (or unreadable), so the connection cannot carry
    // another request (RFC 9110 15.5.9 asks the same of a 408).
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A 502 that says why the engine did not answer: its exit, with its last output, when it died.
async fn engine_error(engine: &crate::lifecycle::EngineRef, err: &UpstreamError) -> ApiError {
    // The connection usually breaks a moment before the exit is noticed.
    let mut exit = engine.exit.clone();
    let exited =
        tokio::time::timeout(Duration::from_millis(250), exit.wait_for(Option::is_some)).await;
    let report = match exited {
        Ok(Ok(r)) => r.clone(),
        _ => None,
    };
    let message = match report {
        Some(report) => with_tail(
            format!("the engine exited while handling the request ({report})"),
            &engine.output.last(ERROR_TAIL_LINES),
        ),
        None => with_tail(describe(err), &engine.output.last(ERROR_TAIL_LINES)),
    };
    tracing::warn!("{message}");
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        ErrorType::Server,
        ErrorCode::EngineFailed,
        message,
    )
}

/// An error and its causes on one line: hyper's own message is terse ("connection closed
/// before message completed"), its source says what happened underneath.
fn describe(err: &dyn std::error::Error) -> String {
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

/// The SSE event that tells a streaming client why its answer broke off, in OpenAI's error
/// shape (the `openai` packages raise it as an `APIError` with this message).
fn error_event(err: &hyper::Error, tail: &[String]) -> Bytes {
    api_error_event(
        format!("the engine broke off the answer: {}", describe(err)),
        tail,
    )
}

/// The OpenAI paths whose event streams end with `data: [DONE]`.
fn ends_with_done(path: &str) -> bool {
    matches!(
        path,
        "/v1/chat/completions" | "/chat/completions" | "/v1/completions" | "/completions"
    )
}

fn api_error_event(what: String, tail: &[String]) -> Bytes {
    let message = with_tail(what, tail);
    let v = json!({
        "error": { "message": message, "type": ErrorType::Server, "code": ErrorCode::EngineFailed }
    });
    Bytes::from(format!("data: {v}\n\n"))
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Removes the headers that belong to one connection, not to the message (RFC 9110 7.6.1):
/// the fixed set and any named in `Connection`.
fn strip_hop_by_hop(h: &mut HeaderMap) {
    const FIXED: [HeaderName; 7] = [
        header::CONNECTION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ];
    // Most messages have none: one look at each name instead of nine hashed removals.
    let hop = |k: &HeaderName| {
        FIXED.contains(k) || k.as_str() == "keep-alive" || k.as_str() == "proxy-connection"
    };
    if !h.keys().any(hop) {
        return;
    }
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in FIXED {
        h.remove(n);
    }
    h.remove("keep-alive");
    h.remove("proxy-connection");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::auth::ApiKeys;

    #[test]
    fn hop_by_hop_headers_go_and_end_to_end_ones_stay() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str().to_string()).collect();
        left.sort();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn an_event_stream_ends_with_done_only_when_its_last_event_is_done() {
        let ended = |pieces: &[&str]| {
            let mut last = LastBytes::default();
            for p in pieces {
                last.push(p.as_bytes());
            }
            last.done()
        };
        let chunk = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
        assert!(ended(&[chunk, "data: [DONE]\n\n"]));
        // Split anywhere, in pieces of any size.
        assert!(ended(&[chunk, "data: [DO", "NE]", "\n", "\n"]));
        assert!(ended(&["data: [DONE]"]));
        assert!(!ended(&[chunk]));
        assert!(!ended(&[]));
        // A [DONE] somewhere before the end is not the end.
        assert!(!ended(&["data: [DONE]\n\n", chunk]));
    }

    #[test]
    fn content_length_parses_or_is_absent() {
        let mut h = HeaderMap::new();
        assert_eq!(content_length(&h), None);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("42"));
        assert_eq!(content_length(&h), Some(42));
    }

    fn keys() -> Option<Result<Arc<ApiKeys>, String>> {
        Some(Ok(Arc::new(ApiKeys::parse("sk-right\n").unwrap())))
    }

    fn check_key(
        keys: Option<Result<Arc<ApiKeys>, String>>,
        headers: &mut HeaderMap,
    ) -> Result<(), ApiError> {
        crate::http::auth::require(KeyFile::Api, keys, headers)
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_right_key_passes_and_no_credential_is_forwarded() {
        for pairs in [
            &[("authorization", "Bearer sk-right")][..],
            &[("x-api-key", "sk-right")],
        ] {
            let mut h = headers(pairs);
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            assert_eq!(check_key(keys(), &mut h), Ok(()), "{pairs:?}");
            let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
            assert_eq!(left, ["content-type"], "{pairs:?}");
        }
    }

    #[test]
    fn several_credentials_are_refused_with_400() {
        let mut h = headers(&[
            ("authorization", "Bearer sk-other"),
            ("x-api-key", "sk-also-sent"),
            ("x-api-key", "sk-right"),
        ]);
        let e = check_key(keys(), &mut h).unwrap_err();
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, ErrorCode::SeveralCredentials)
        );
    }

    #[test]
    fn without_keys_configured_credentials_pass_through() {
        let mut h = headers(&[("authorization", "Bearer x"), ("x-api-key", "y")]);
        assert_eq!(check_key(None, &mut h), Ok(()));
        assert_eq!(h.len(), 2);
    }

    #[test]
    fn a_missing_or_wrong_key_is_401_in_openai_shape() {
        for (pairs, message) in [
            (
                &[][..],
                "missing API key: send Authorization: Bearer <key> or x-api-key",
            ),
            (&[("authorization", "Bearer sk-wrong")], "invalid API key"),
            (&[("x-api-key", "sk-wrong")], "invalid API key"),
        ] {
            let mut h = headers(pairs);
            let e = check_key(keys(), &mut h).unwrap_err();
            assert_eq!(e.status, StatusCode::UNAUTHORIZED);
            assert_eq!(e.kind, ErrorType::InvalidRequest);
            assert_eq!(e.code, ErrorCode::InvalidApiKey);
            assert_eq!(e.message, message);
            // A refused request is not touched further.
            assert_eq!(h.len(), pairs.len());
        }
    }

    #[test]
    fn keys_that_cannot_be_read_refuse_with_503() {
        let why = "the API key file /k may be read or written by group or others (mode 0644); \
                   run chmod 600 /k";
        let mut h = headers(&[("authorization", "Bearer sk-right")]);
        let e = check_key(Some(Err(why.into())), &mut h).unwrap_err();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.code, ErrorCode::ApiKeysUnavailable);
        assert!(e.message.ends_with(why), "{}", e.message);
        assert!(e.retry_after.is_some());
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
