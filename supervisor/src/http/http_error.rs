//! Errors the supervisor itself answers over HTTP, in the error shape of the protocol the
//! request's path speaks ([`crate::http::protocol`]): OpenAI's
//! `{"error":{"message":..., "type":..., "code":...}}` on every path but Anthropic's, whose
//! SDKs read `{"type":"error","error":{"type":..., "message":...}}`.
//!
//! Owns: the mapping from a refusal or a proxy failure to a status code, `Retry-After`, and a
//! message that names the cause (with the tail of the engine's output where there is one).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::Value;

pub use dsv4_client::words::{ErrorCode, ErrorType};

use crate::http::intake::IntakeError;
use crate::http::protocol::{Api, ApiProtocol, Failure};
use crate::lifecycle::state::Refusal;

/// An error response about to be sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    pub code: ErrorCode,
    pub message: String,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: ErrorType,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// The body, in `protocol`'s shape (OpenAI's where there is none).
    pub fn body(&self, protocol: Option<ApiProtocol>) -> Bytes {
        protocol
            .unwrap_or(ApiProtocol::OpenAi)
            .error_body(&Failure {
                message: &self.message,
                kind: self.kind.as_str(),
                code: Value::String(self.code.as_str().into()),
                status: Some(self.status.as_u16()),
            })
    }

    /// The response, in OpenAI's shape, with a body of any type that can be made from
    /// bytes: for the paths of no protocol (dsv4d's own, the dashboard's).
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        self.into_response_in(None)
    }

    /// The response to a request at a path of `protocol`, in that protocol's shape.
    pub fn into_response_in<B: From<Bytes>>(self, protocol: Option<ApiProtocol>) -> Response<B> {
        let mut r = Response::new(B::from(self.body(protocol)));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(d) = self.retry_after {
            // Whole seconds, rounded up, at least 1.
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        r
    }
}

pub use crate::lifecycle::refusal::with_tail;

impl From<&IntakeError> for ApiError {
    /// A request body that was not read whole.
    fn from(e: &IntakeError) -> Self {
        let (status, kind, code) = match e {
            IntakeError::TooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorType::InvalidRequest,
                ErrorCode::BodyTooLarge,
            ),
            IntakeError::TimedOut { .. } => (
                StatusCode::REQUEST_TIMEOUT,
                ErrorType::InvalidRequest,
                ErrorCode::BodyTimeout,
            ),
            IntakeError::TooSlow { .. } => (
                StatusCode::REQUEST_TIMEOUT,
                ErrorType::InvalidRequest,
                ErrorCode::BodyTooSlow,
            ),
            IntakeError::Evicted { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorType::Unavailable,
                ErrorCode::TooManyConnections,
            ),
            IntakeError::OverBudget { .. } => (
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorType::Unavailable,
                ErrorCode::BodiesOverBudget,
            ),
            IntakeError::Client(_) => (
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequest,
                ErrorCode::BadBody,
            ),
        };
        let error = ApiError::new(status, kind, code, e.to_string());
        match status {
            StatusCode::SERVICE_UNAVAILABLE => error.retry_after(Duration::from_secs(1)),
            _ => error,
        }
    }
}

impl From<Refusal> for ApiError {
    fn from(r: Refusal) -> Self {
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        let message = r.message();
        let (status, kind, code, retry) = match r {
            Refusal::QueueFull { .. } => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::QueueFull,
                Some(Duration::from_secs(5)),
            ),
            Refusal::StartFailed(_) => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::EngineStartFailed,
                Some(Duration::from_secs(1)),
            ),
            Refusal::StartTimeout { .. } => (
                StatusCode::GATEWAY_TIMEOUT,
                ErrorType::Timeout,
                ErrorCode::EngineStartTimeout,
                None,
            ),
            Refusal::Backoff { retry_after, .. } => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::EngineBackoff,
                Some(retry_after),
            ),
            Refusal::StartCancelled => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::EngineStopped,
                Some(Duration::from_secs(1)),
            ),
            Refusal::NotEnoughMemory { .. } => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::InsufficientMemory,
                Some(Duration::from_secs(10)),
            ),
            Refusal::TooHot { .. } => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::TooHot,
                Some(Duration::from_secs(60)),
            ),
            Refusal::ShuttingDown => (
                unavailable,
                ErrorType::Unavailable,
                ErrorCode::ShuttingDown,
                Some(Duration::from_secs(5)),
            ),
        };
        let e = ApiError::new(status, kind, code, message);
        match retry {
            Some(d) => e.retry_after(d),
            None => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lifecycle::state::EngineFailure;
    use http_body_util::{BodyExt, Full};

    /// Every error code dsv4d can answer has its row in docs/http-api.md (status, code,
    /// when), so the reference cannot drift from the words.
    #[test]
    fn every_error_code_is_documented() {
        let doc = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/http-api.md");
        let doc = std::fs::read_to_string(doc).unwrap();
        let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| ")).collect();
        for code in ErrorCode::ALL {
            let cell = format!("| `{code}` |");
            assert!(
                rows.iter().any(|r| r.contains(&cell)),
                "docs/http-api.md has no row for the error code {code}"
            );
        }
    }

    async fn parts(e: ApiError) -> (StatusCode, Option<String>, serde_json::Value) {
        let r: Response<Full<Bytes>> = e.into_response();
        let status = r.status();
        let ra = r
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        let body = r.into_body().collect().await.unwrap().to_bytes();
        (status, ra, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn start_failure_carries_the_engine_tail_in_openai_shape() {
        let f = EngineFailure {
            summary: "the engine exited before it was ready (exit code 1)".into(),
            tail: vec!["error: failed to load model".into()],
        };
        let (status, ra, v) = parts(Refusal::StartFailed(f).into()).await;
        assert_eq!(status, 503);
        assert_eq!(ra.as_deref(), Some("1"));
        assert_eq!(v["error"]["type"], "unavailable_error");
        assert_eq!(v["error"]["code"], "engine_start_failed");
        assert_eq!(
            v["error"]["message"],
            "engine failed to start: the engine exited before it was ready (exit code 1); \
             engine output (last 1 lines):\nerror: failed to load model"
        );
    }

    #[tokio::test]
    async fn timeout_is_504_and_names_the_setting() {
        let r = Refusal::StartTimeout {
            timeout: Duration::from_secs(600),
            tail: vec![],
        };
        let (status, ra, v) = parts(r.into()).await;
        assert_eq!(status, 504);
        assert_eq!(ra, None);
        assert_eq!(
            v["error"]["message"],
            "engine was not ready within engine.start_timeout (10m)"
        );
    }

    #[tokio::test]
    async fn backoff_rounds_retry_after_up() {
        let r = Refusal::Backoff {
            retry_after: Duration::from_millis(1500),
            last: None,
        };
        let (status, ra, _) = parts(r.into()).await;
        assert_eq!(status, 503);
        assert_eq!(ra.as_deref(), Some("2"));
    }
}
