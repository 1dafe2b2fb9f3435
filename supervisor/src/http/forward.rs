//! Forwarding to the engine. Must not: buffer responses, time out a response that has not
//! started (a 256K-token prefill takes two hours), or touch the engine process (it asks the
//! lifecycle actor for a lease).
//!
//! A request's body is read whole first ([`crate::http::intake`]), and only then does the request
//! take a lease and go to the engine. Responses stream frame by frame. A client that goes
//! away is noticed whenever it does: hyper sees the connection close once the request's
//! body has been read (while the request waits for a lease, or for the engine's first byte
//! through a prefill of hours), and drops the request's future, its lease and its upstream
//! request, whose connection closes, so the engine stops work; later, it drops the
//! response body, to the same effect.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::config::Config;
use crate::http::answer::{describe, CheckRestore, EngineStream, ProxyBody, Release, Tapped};
use crate::http::body::OnEnd;
use crate::http::connections;
use crate::http::ctx::Ctx;
use crate::http::http_error::{with_tail, ApiError, ErrorCode, ErrorType};
use crate::http::intake::{self, IntakeError};
use crate::http::keepalive;
use crate::http::progress::{self, Progress};
use crate::http::protocol::{Api, ApiProtocol, Route, Streams};
use crate::http::sse;
use crate::http::watch::Watch;
use crate::lifecycle::upstream::{UpstreamBody, UpstreamError};
use crate::lifecycle::Lease;
use crate::lifecycle::ERROR_TAIL_LINES;
use crate::observe::flights::Ticket;
use crate::observe::stats::Count;
use dsv4_engine::PrefillReport;

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
/// (No protocol's path: its refusal is in OpenAI's shape.)
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

pub(crate) async fn proxy(
    ctx: &Arc<Ctx>,
    config: &Arc<Config>,
    req: Request<Incoming>,
    on: &connections::Slot,
    route: Option<Route>,
) -> Response<ProxyBody> {
    let api = &config.supervisor.api;
    let protocol = route.map(|r| r.protocol);
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
    let held = match read_body(ctx, config, &parts, body, on).await {
        Ok(held) => held,
        Err(e) => return intake_refusal(&e, protocol),
    };
    let streamed = match (parts.method == Method::POST, route) {
        (true, Some(r)) if r.streams != Streams::No && sse::wants_stream(&held.bytes) => {
            Some(r.protocol)
        }
        _ => None,
    };
    let flight = ctx.parts.flights.enter(
        &parts.uri,
        streamed.is_some(),
        config.supervisor.notify.long_request,
        started,
    );
    // A streamed answer is kept from going silent (see `crate::http::keepalive`); any other
    // request goes on as it is.
    let keepalive = api.stream_keepalive.zip(streamed);
    // With `api.loading_reasoning`, a chat stream's loading words go out as reasoning too;
    // only such a request's body is read for its model.
    let reasoning =
        (keepalive.is_some() && api.loading_reasoning && sse::is_chat(parts.uri.path()))
            .then(|| keepalive::Reasoning::new(sse::model_of(&held.bytes)));
    // The APIs whose clients count events get events of their own API as keep-alives.
    let opening = keepalive.and_then(|(_, protocol)| keepalive::opening(protocol, &held.bytes));
    let answer = forward(
        ctx.clone(),
        config.clone(),
        Request::from_parts(parts, held),
        started,
        slot_action,
        (flight, streamed, route),
    );
    match keepalive {
        None => answer.await,
        Some((period, protocol)) => {
            let wrap = |k| ProxyBody::Streamed(Box::new(k));
            let lifecycle = ctx.parts.lifecycle.clone();
            let answer = Box::pin(answer);
            let extra = keepalive::Extra { reasoning, opening };
            keepalive::respond(answer, period, protocol, lifecycle, started, wrap, extra).await
        }
    }
}

/// The request's whole body, read first: a client that is slow to send it holds no lease
/// and no engine connection meanwhile, and never starts the engine. Until it is whole, its
/// connection may be chosen to make room at the cap.
async fn read_body(
    ctx: &Ctx,
    config: &Config,
    parts: &http::request::Parts,
    body: Incoming,
    on: &connections::Slot,
) -> Result<intake::Held, IntakeError> {
    let api = &config.supervisor.api;
    let limits = intake::Limits {
        max_body: api.max_body,
        timeout: api.body_timeout,
        max_buffered: api.max_buffered,
        min_rate: api.min_body_rate,
    };
    // A Content-Length beside Transfer-Encoding is not the body's length: hyper reads such a
    // body as chunked (RFC 9112 6.3), and so does the intake.
    let declared = match parts.headers.contains_key(header::TRANSFER_ENCODING) {
        true => None,
        false => content_length(&parts.headers),
    };
    let reading = on.intake();
    let (got, stop) = (reading.got(), reading.evicted());
    intake::read(body, declared, limits, &ctx.bodies, got, stop).await
}

/// The rest of a request's way, its body read: its turn (a lease on the engine, started if
/// need be), the engine's answer.
async fn forward(
    ctx: Arc<Ctx>,
    config: Arc<Config>,
    req: Request<intake::Held>,
    started: Instant,
    slot_action: bool,
    (flight, streamed, route): (Ticket, Option<ApiProtocol>, Option<Route>),
) -> Response<ProxyBody> {
    let protocol = route.map(|r| r.protocol);
    let (mut parts, held) = req.into_parts();
    let lease = match turn(&ctx, &config, protocol).await {
        Ok(lease) => lease,
        Err(refused) => return refused,
    };
    if slot_action {
        // The engine that will serve it, which a switch may have changed meanwhile.
        if let Some(refused) = slots_kept_by_dsv4d(&config, &lease.engine.profile) {
            return refused;
        }
    }
    let tap_path = (parts.method == Method::POST).then(|| parts.uri.path().to_string());
    // The target is in origin form already (`judge_path`), as an HTTP/1.1 client sends it to
    // a server it talks to directly.
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    // The body is here already: nothing for the engine to agree to first, and its length is
    // what was read (the request's head is written with it: lifecycle/engine_wire.rs), not
    // what the client said.
    parts.headers.remove(header::EXPECT);
    parts.headers.remove(header::CONTENT_LENGTH);
    parts
        .headers
        .insert(header::HOST, lease.engine.connections.host().clone());
    let engine = lease.engine.clone();
    let sent = flight.sent(&engine);
    // An engine that tells a prefill's progress in its stream when asked is asked, for a
    // streamed OpenAI request; its progress events are taken out again unless the client
    // asked for them itself.
    let mut progress = None;
    let mut body = held.bytes;
    if let (PrefillReport::Stream { ask, field, read }, Some(ApiProtocol::OpenAi)) =
        (engine.kind.prefill, streamed)
    {
        let asked = progress::ask(&body, ask);
        progress = Some(Progress::new(field, read, asked.is_some()));
        if let Some(asked) = asked {
            body = asked;
        }
    }
    // Where the engine's output stands: what it says of this request comes after.
    let mark = engine.output.written();
    let sent_answer = engine.connections.request(parts, body.clone()).await;
    // Sent: the bytes have left (the upstream kept them only for a second try).
    drop(held.charge);
    match sent_answer {
        Ok(resp) => {
            let asked = Asked {
                tap_path,
                protocol,
                route,
                sent,
                started,
                body,
                mark,
            };
            answer(&ctx, resp, lease, (flight, progress), asked)
        }
        Err(e) => {
            drop(lease);
            let error = engine_error(&engine, &e).await;
            flight.ended(Some(&error.message));
            error.into_response_in(protocol)
        }
    }
}

/// A request's turn at the engine: a lease (the engine started if need be), never while a
/// validation holds the engine; else the answer that refuses it.
async fn turn(
    ctx: &Ctx,
    config: &Config,
    protocol: Option<ApiProtocol>,
) -> Result<Lease, Response<ProxyBody>> {
    // A validation that began while this request waited for an engine holds that engine:
    // never a client's. Then back to the validation's gate, to wait for the profile it
    // restores (or 503 past max_waiting, as any request during a validation).
    let active = ctx.parts.lifecycle.profile();
    if let Some(refused) = lends(
        config.profile(&active).map(|p| p.engine.describe()),
        &active,
    )
    .or_else(|| held(ctx, config, &active))
    {
        return Err(refused.into_response_in(protocol));
    }
    loop {
        if let Err(max_waiting) = ctx
            .parts
            .validator
            .admit(config.supervisor.engine.max_waiting)
            .await
        {
            return Err(validation_queue_full(max_waiting, protocol));
        }
        let lease = match ctx.parts.lifecycle.acquire().await {
            Ok(lease) => lease,
            Err(refusal) => return Err(ApiError::from(refusal).into_response_in(protocol)),
        };
        if let Some(refused) = lends(Some(lease.engine.kind), &lease.engine.profile)
            .or_else(|| held(ctx, config, &lease.engine.profile))
        {
            return Err(refused.into_response_in(protocol));
        }
        if !ctx.parts.validator.running() {
            return Ok(lease);
        }
        drop(lease);
    }
}

/// The refusal of a request to `profile` while its canary drifted and `canary.hold` is on.
fn held(ctx: &Ctx, config: &Config, profile: &str) -> Option<ApiError> {
    let hold = config.supervisor.canary.hold;
    let why = ctx.parts.validator.checks().held(profile, hold)?;
    Some(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Server,
        ErrorCode::CanaryDrift,
        why,
    ))
}

/// The refusal of a request to `profile` when its engine serves no API (`kind` lends the
/// box's devices to a coordinator on another box): it would read the request as commands.
fn lends(kind: Option<&dsv4_engine::Kind>, profile: &str) -> Option<ApiError> {
    let kind = kind.filter(|k| matches!(k.validation, dsv4_engine::ValidationApi::Lends))?;
    Some(ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Server,
        ErrorCode::EngineLends,
        format!(
            "this box's active profile `{profile}` runs {}, which serves no API: it lends the \
             box's devices to a coordinator on another box (peers:); switch to a profile that \
             serves (dsv4ctl profile NAME)",
            kind.name
        ),
    ))
}

/// What the request was, for its answer's body.
struct Asked {
    /// A POST's path, whose answer's figures are counted.
    tap_path: Option<String>,
    protocol: Option<ApiProtocol>,
    route: Option<Route>,
    /// When it was sent to the engine, and when it came.
    sent: Instant,
    started: Instant,
    /// Its body as sent, and the engine's output line it was sent at, for the check of a KV
    /// restore it may make.
    body: bytes::Bytes,
    mark: u64,
}

/// The engine's answer `resp`, on its way to the client with the request's lease, read by
/// its watch ([`crate::http::watch`]).
fn answer(
    ctx: &Ctx,
    resp: Response<UpstreamBody>,
    lease: Lease,
    (flight, progress): (Ticket, Option<Progress>),
    asked: Asked,
) -> Response<ProxyBody> {
    let engine = lease.engine.clone();
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
    // Where the answer's token counts are, by the protocol table.
    let protocol = asked.protocol.unwrap_or(ApiProtocol::OpenAi);
    let count = match asked.tap_path.is_some() && parts.status.is_success() {
        true => Count::new(protocol, content_type, asked.sent),
        false => None,
    };
    let lifecycle = &ctx.parts.lifecycle;
    let check = lifecycle
        .kv()
        .expected(&engine.profile)
        .map(|_| CheckRestore {
            lifecycle: lifecycle.clone(),
            engine: engine.clone(),
            body: asked.body,
            mark: asked.mark,
        });
    let tap = match (asked.tap_path, &count) {
        (Some(path), Some(_)) => Some(Box::new(Tapped {
            stats: ctx.parts.stats.clone(),
            telemetry: ctx.parts.telemetry.clone(),
            profile: engine.profile.clone(),
            path,
            started: asked.started,
            check,
        })),
        _ => None,
    };
    if !sse {
        // The whole answer is ready; its body is on its way.
        flight.ending();
    }
    let watch = (sse || count.is_some())
        .then(|| Box::new(Watch::new(protocol.spec(), sse, count, progress)));
    let stream = EngineStream {
        inner,
        watch,
        tap,
        sse: sse.then(|| engine.output.clone()),
        broken: None,
        protocol,
        unframed: sse && unframed && asked.route.is_some_and(Route::ends_marked),
        flight: Some(flight),
        drained: false,
        failed: None,
    };
    Response::from_parts(
        parts,
        ProxyBody::Upstream(OnEnd::new(stream, Release { lease })),
    )
}

/// The 503 for a request over `max_waiting` while a validation holds the engine.
fn validation_queue_full(max_waiting: usize, protocol: Option<ApiProtocol>) -> Response<ProxyBody> {
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
    .into_response_in(protocol)
}

/// The answer to a request whose body was not read whole.
fn intake_refusal(e: &IntakeError, protocol: Option<ApiProtocol>) -> Response<ProxyBody> {
    tracing::debug!("refused a request: {e}");
    let mut r: Response<ProxyBody> = ApiError::from(e).into_response_in(protocol);
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
    fn content_length_parses_or_is_absent() {
        let mut h = HeaderMap::new();
        assert_eq!(content_length(&h), None);
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("42"));
        assert_eq!(content_length(&h), Some(42));
    }
}
