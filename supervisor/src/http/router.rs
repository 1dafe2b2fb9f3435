//! The router: a request, past the front door ([`crate::http::front`]: Host, browsers,
//! preflights), is judged on its method, its path and its key ([`crate::http::auth`]), then
//! answered by dsv4d itself (`/status`, `/v1/models`, `/metrics`, the dashboard and its
//! actions) or forwarded to the engine ([`crate::http::forward`]).

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use hyper::body::Incoming;
use serde_json::json;

use crate::config::Config;
use crate::http::answer::ProxyBody;
use crate::http::auth::KeyFile;
use crate::http::connections;
use crate::http::ctx::Ctx;
use crate::http::forward::proxy;
use crate::http::front;
use crate::http::http_error::{ApiError, ErrorCode, ErrorType};
use crate::http::protocol::{Api, ApiProtocol, Route};
use crate::http::ui_actions;

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
pub(crate) async fn handle(
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
        // Before the path is judged: that of the request as sent.
        Err(refused) => return refused.into_response_in(ApiProtocol::of(req.uri().path())),
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
    // Each request as it comes (`DSV4_LOG=dsv4::http=debug`): which agent probes what, how
    // often a client resends. The path only: a query may hold what is not the log's.
    tracing::debug!("request: {} {}", req.method(), req.uri().path());
    if let Some(refused) = refuse_method(&req) {
        return refused;
    }
    // From here on the path is the one the engine will route: decoded as it decodes it,
    // and sent to it so that it decodes to exactly that (see `crate::http::path`).
    if let Err(refused) = judge_path(&mut req) {
        // The target is as sent (a refused one is left unchanged).
        return refused.into_response_in(ApiProtocol::of(req.uri().path()));
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
        let body = ctx
            .parts
            .lifecycle
            .with_status(|s| json!({ "status": "ok", "engine": s.state, "profile": s.profile }));
        return json_response(StatusCode::OK, body);
    }
    // The path's protocol, once: its errors are told in its shape.
    let route = Route::of(req.uri().path());
    let protocol = route.map(|r| r.protocol);
    if let Some(refused) = api_key(ctx, config, &mut req, on, protocol) {
        return refused;
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
        (true, "/metrics") => metrics(ctx).await,
        // A probe never starts the engine: `GET /` and every `HEAD` of a path the engine
        // serves (an agent's look before it asks anything, a browser's first visit) are the
        // engine's only while it serves.
        (true, path)
            if (req.method() == Method::HEAD || path == "/")
                && ctx.parts.lifecycle.state() != dsv4_client::State::Ready =>
        {
            probed(ctx, req.method(), path)
        }
        _ => proxy(ctx, config, req, on, route).await,
    }
}

/// The API key `req` shows, when keys are required: its refusal (401 with
/// `WWW-Authenticate`, in the path's protocol), or none, its connection marked keyed (kept
/// alive as long as any other).
fn api_key(
    ctx: &Ctx,
    config: &Arc<Config>,
    req: &mut Request<Incoming>,
    on: &connections::Slot,
    protocol: Option<ApiProtocol>,
) -> Option<Response<ProxyBody>> {
    let keys = ctx.api_keys.get(config);
    let keyed = matches!(keys, Some(Ok(_)));
    if let Err(refused) = crate::http::auth::require(KeyFile::Api, keys, req.headers_mut()) {
        let unauthorized = refused.status == StatusCode::UNAUTHORIZED;
        let mut r: Response<ProxyBody> = refused.into_response_in(protocol);
        if unauthorized {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        return Some(r);
    }
    if keyed {
        on.keyed();
    }
    None
}

/// CONNECT, TRACE and the like: nothing here or in the engine serves them, so they are
/// answered here and never start the engine.
fn refuse_method(req: &Request<Incoming>) -> Option<Response<ProxyBody>> {
    if ALLOWED_METHODS.contains(req.method()) {
        return None;
    }
    let mut r: Response<ProxyBody> = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorType::InvalidRequest,
        ErrorCode::MethodNotAllowed,
        format!("method {} is not supported; use {ALLOW}", req.method()),
    )
    .into_response_in(ApiProtocol::of(req.uri().path()));
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(ALLOW));
    Some(r)
}

/// `GET /metrics`: OpenMetrics text of the latest figures.
async fn metrics(ctx: &Ctx) -> Response<ProxyBody> {
    let sample = ctx.parts.telemetry.latest();
    let kv = ctx.parts.lifecycle.kv().status().await;
    let status = ctx.parts.lifecycle.status();
    let in_progress = ctx.parts.in_progress(status.state);
    let (workers, holds) = (ctx.parts.lifecycle.workers(), ctx.parts.holders.list());
    let live = crate::observe::metrics::Live {
        in_progress: &in_progress,
        workers: &workers,
        holds: &holds,
    };
    let text = crate::observe::metrics::render(
        &status,
        &ctx.parts.stats.report(0),
        sample.as_deref(),
        &ctx.parts.power.status(),
        &ctx.parts.thermal.status(),
        &kv,
        live,
    );
    let mut r = Response::new(ProxyBody::from(Bytes::from(text)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::observe::metrics::CONTENT_TYPE),
    );
    r
}

/// dsv4d's answer to a probe while the engine does not serve: for `/`, 200 and a line that
/// says where things are; for any other path, 404 (as llama-server answers a `HEAD` of a path
/// it does not serve). A `HEAD` gets the head alone.
fn probed(ctx: &Ctx, method: &Method, path: &str) -> Response<ProxyBody> {
    let (status, text) = match path {
        "/" => (
            StatusCode::OK,
            ctx.parts.lifecycle.with_status(|s| {
                format!(
                    "dsv4d: the engine is {} (profile {}); it starts at the first request to \
                     the APIs under /v1. Status: /status; dashboard: /ui\n",
                    s.state, s.profile
                )
            }),
        ),
        _ => (StatusCode::NOT_FOUND, String::new()),
    };
    let body = match *method == Method::HEAD {
        true => Bytes::new(),
        false => Bytes::from(text),
    };
    let mut r = Response::new(ProxyBody::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

pub(crate) fn json_response(status: StatusCode, v: serde_json::Value) -> Response<ProxyBody> {
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
    let active = ctx.parts.lifecycle.profile();
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
fn judge_path(req: &mut Request<Incoming>) -> Result<(), ApiError> {
    let bad = |why: String| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequest,
            ErrorCode::BadPath,
            why,
        )
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::auth::ApiKeys;
    use http::header::{HeaderMap, HeaderValue};

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
}
