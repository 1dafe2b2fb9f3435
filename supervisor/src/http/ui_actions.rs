//! The dashboard's actions: `POST /ui/actions/NAME`, with a small JSON body where the action
//! takes an argument.
//!
//! | NAME | body | does |
//! |---|---|---|
//! | `start` | | starts the engine of the active profile |
//! | `stop` | | stops it once the requests in flight are done |
//! | `stop-now` | | stops it at once |
//! | `profile` | `{"profile": "320k"}` | switches the profile (drain and restart) |
//! | `drop-checkpoint` | `{"what": "320k"}` | removes KV checkpoints (`all`, a profile, an id) |
//! | `validate` | `{"profile": "64k", "runs": 1}` | starts a validation run |
//! | `cancel-validation` | | ends the running validation |
//!
//! Owns: who may act from a browser. An action needs `api.admin_keys_file` set (else the
//! page only looks), one of its keys (`Authorization: Bearer` or `x-api-key`; the admin key
//! stands in for an API key here), and a request from dsv4d's own page (its `Origin`, and
//! `Sec-Fetch-Site: same-origin` where a browser sends it). Must not: act by any other path
//! than [`crate::actions`], which the D-Bus methods call too.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::actions::ActionError;
use crate::config::Config;
use crate::http::auth::{self, KeyFile};
use crate::http::ctx::Ctx;
use crate::http::front;
use crate::http::http_error::{ApiError, ErrorCode, ErrorType};
use crate::http::intake::{self, IntakeError};
use crate::lifecycle::ControlError;

/// Where the actions are.
pub const PREFIX: &str = "/ui/actions/";

/// The largest body an action takes: a profile name and a few numbers.
const MAX_BODY: u64 = 4096;

/// Who the log says asked.
const BY: &str = "the dashboard (admin key)";

/// `POST /ui/actions/NAME`: checks who asks, then acts; the answer is JSON either way.
pub async fn act(
    ctx: &Arc<Ctx>,
    config: &Arc<Config>,
    name: &str,
    mut req: Request<Incoming>,
) -> Result<Value, ApiError> {
    if req.method() != Method::POST {
        return Err(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorType::InvalidRequest,
            ErrorCode::MethodNotAllowed,
            format!("the dashboard's actions take POST, not {}", req.method()),
        ));
    }
    let Some(keys) = ctx.admin_keys.get(config) else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorType::InvalidRequest,
            ErrorCode::ActionsOff,
            "the dashboard's actions are off: set api.admin_keys_file to a file of admin keys \
             to allow them; dsv4ctl does each of them over D-Bus",
        ));
    };
    front::same_origin(&config.supervisor.api, &req)?;
    auth::require(KeyFile::Admin, Some(keys), req.headers_mut())?;
    let body = read_body(ctx, config, req.into_body()).await?;
    let actions = &ctx.parts.actions;
    let done = match name {
        "start" => {
            args(&body, &[], &[])?;
            actions.start(BY).await.map(|()| json!({}))
        }
        "stop" => {
            args(&body, &[], &[])?;
            actions.stop(false, BY).await.map(|()| json!({}))
        }
        "stop-now" => {
            args(&body, &[], &[])?;
            actions.stop(true, BY).await.map(|()| json!({}))
        }
        "profile" => {
            let Args { profile, .. } = args(&body, &["profile"], &["profile"])?;
            let profile = profile.unwrap_or_default();
            actions
                .set_profile(&profile, BY)
                .await
                .map(|()| json!({ "profile": profile }))
        }
        "drop-checkpoint" => {
            let Args { what, .. } = args(&body, &["what"], &["what"])?;
            actions
                .drop_kv(&what.unwrap_or_default(), BY)
                .await
                .map(|dropped| json!({ "dropped": dropped }))
        }
        "validate" => {
            let Args {
                profile,
                runs,
                long,
                prefill,
                ..
            } = args(&body, &[], &["profile", "runs", "long", "prefill"])?;
            let req = dsv4_client::validate::ValidateRequest {
                profile,
                runs: runs.unwrap_or(1),
                long,
                prefill,
                ..Default::default()
            };
            actions
                .validate(req, BY)
                .map(|profile| json!({ "profile": profile }))
        }
        "cancel-validation" => {
            args(&body, &[], &[])?;
            Ok(json!({ "cancelled": actions.cancel_validation(BY) }))
        }
        _ => return Err(not_found(&format!("{PREFIX}{name}"))),
    };
    match done {
        Ok(mut v) => {
            v["action"] = json!(name);
            Ok(v)
        }
        Err(e) => Err(refusal(e)),
    }
}

/// A path under `/ui/` that is neither a file of the page nor an action.
pub fn not_found(path: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorType::InvalidRequest,
        ErrorCode::NotFound,
        format!(
            "nothing at {path:?}: the dashboard is /ui, its actions are {PREFIX}start, stop, \
             stop-now, profile, drop-checkpoint, validate and cancel-validation"
        ),
    )
}

/// What an action's body may say.
#[derive(Debug, Default, Deserialize)]
struct Args {
    profile: Option<String>,
    what: Option<String>,
    runs: Option<u32>,
    long: Option<u64>,
    prefill: Option<u64>,
}

/// The body as [`Args`]: a JSON object (or nothing) with no field but the `allowed`, and the
/// `needed` ones there and not empty.
fn args(body: &Bytes, needed: &[&str], allowed: &[&str]) -> Result<Args, ApiError> {
    let bad = |why: String| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequest,
            ErrorCode::BadBody,
            why,
        )
    };
    let object: serde_json::Map<String, Value> = match body.is_empty() {
        true => Default::default(),
        false => serde_json::from_slice(body)
            .map_err(|e| bad(format!("the action's body is not a JSON object: {e}")))?,
    };
    if let Some(other) = object.keys().find(|k| !allowed.contains(&k.as_str())) {
        return Err(bad(match allowed.is_empty() {
            true => format!("the action takes no field, and the body has `{other}`"),
            false => format!(
                "the action takes {}, not `{other}`",
                allowed
                    .iter()
                    .map(|a| format!("`{a}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }));
    }
    let args: Args = serde_json::from_value(Value::Object(object))
        .map_err(|e| bad(format!("the action's body is not what it takes: {e}")))?;
    for field in needed {
        let given = match *field {
            "profile" => args.profile.as_deref(),
            "what" => args.what.as_deref(),
            _ => None,
        };
        if given.is_none_or(str::is_empty) {
            return Err(bad(format!(
                "the action needs {{\"{field}\": ...}} in its JSON body"
            )));
        }
    }
    Ok(args)
}

/// The whole body, at most [`MAX_BODY`] bytes, read as every request body is (within
/// `api.body_timeout` and `api.min_body_rate`, counted in `api.max_buffered`).
async fn read_body(ctx: &Ctx, config: &Config, body: Incoming) -> Result<Bytes, ApiError> {
    let api = &config.supervisor.api;
    let limits = intake::Limits {
        max_body: MAX_BODY,
        timeout: api.body_timeout,
        max_buffered: api.max_buffered,
        min_rate: api.min_body_rate,
    };
    // Sent with an admin key: not chosen to make room at the connection cap.
    let got = std::sync::atomic::AtomicU64::default();
    match intake::read(
        body,
        None,
        limits,
        &ctx.bodies,
        &got,
        std::future::pending(),
    )
    .await
    {
        Ok(held) => Ok(held.bytes),
        Err(IntakeError::TooLarge { .. }) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorType::InvalidRequest,
            ErrorCode::BodyTooLarge,
            format!("an action's body is at most {MAX_BODY} bytes"),
        )),
        Err(e) => Err(ApiError::from(&e)),
    }
}

/// An action that did not happen, as an HTTP error.
fn refusal(e: ActionError) -> ApiError {
    let message = e.to_string();
    let (status, kind, code) = match e {
        ActionError::Refused(r) => return ApiError::from(r),
        ActionError::Control(ControlError::UnknownProfile { .. }) => (
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequest,
            ErrorCode::UnknownProfile,
        ),
        ActionError::Control(ControlError::Gone) => {
            return ApiError::from(crate::lifecycle::state::Refusal::ShuttingDown)
        }
        ActionError::NotFound(_) => (
            StatusCode::NOT_FOUND,
            ErrorType::InvalidRequest,
            ErrorCode::NotFound,
        ),
        ActionError::Control(ControlError::NotSaved { .. }) | ActionError::Failed(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorType::Server,
            ErrorCode::ActionFailed,
        ),
        ActionError::Busy(_) => (
            StatusCode::CONFLICT,
            ErrorType::InvalidRequest,
            ErrorCode::Busy,
        ),
        ActionError::Invalid(_) => (
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequest,
            ErrorCode::BadBody,
        ),
    };
    ApiError::new(status, kind, code, message)
}

/// An action's answer: 200 with what was done.
pub fn answer<B: From<Bytes>>(done: Result<Value, ApiError>) -> Response<B> {
    match done {
        Ok(v) => {
            let mut r = Response::new(B::from(Bytes::from(v.to_string())));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => {
            let code = e.code;
            let mut r: Response<B> = e.into_response();
            let h = r.headers_mut();
            match code {
                ErrorCode::MethodNotAllowed => {
                    h.insert(header::ALLOW, HeaderValue::from_static("POST"));
                }
                ErrorCode::InvalidAdminKey => {
                    h.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                }
                _ => {}
            }
            r
        }
    }
}
