//! A running engine as the rest of the daemon holds it: what a lease carries, and what the
//! KV steps and validation runs work with, with the calls of dsv4d's own they make to it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dsv4_engine::{ExitReport, OutputTail};
use http_body_util::BodyExt;
use tokio::sync::watch;

use super::state::Gen;
use super::upstream::Upstream;

/// A running engine, as a granted request sees it.
#[derive(Debug)]
pub struct EngineRef {
    pub gen: Gen,
    /// The profile this engine runs.
    pub profile: String,
    pub pid: u32,
    pub upstream: SocketAddr,
    /// The connections to this engine (a fresh pool per generation).
    pub connections: Arc<Upstream>,
    pub output: OutputTail,
    pub exit: watch::Receiver<Option<ExitReport>>,
    /// What dsv4 knows of its kind (how it tells its prefill, among others).
    pub kind: &'static dsv4_engine::Kind,
}

impl EngineRef {
    /// Whether the engine has exited, or does within `within` (its exit is seen a moment
    /// after its connections break).
    pub async fn gone_within(&self, within: Duration) -> bool {
        let mut exit = self.exit.clone();
        tokio::time::timeout(within, exit.wait_for(Option::is_some))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Sends one request of dsv4d's own to the engine (with its key, a JSON body when given) and
    /// returns its response, the body still coming.
    pub async fn send(
        &self,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<http::Response<super::upstream::UpstreamBody>, String> {
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, self.connections.host().clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(())
            .map_err(|e| e.to_string())?;
        let (parts, ()) = req.into_parts();
        let bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        self.connections
            .request(parts, bytes)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends one request to the engine (with its key) and returns the status and body.
    pub async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(http::StatusCode, Bytes), String> {
        let work = async {
            let resp = self.send(method, path, body).await?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("the engine's answer broke off: {e}"))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(CALL_TIMEOUT, work)
            .await
            .map_err(|_| "the engine did not answer".to_string())?
    }
}

impl crate::kv::engine::Engine for EngineRef {
    async fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(http::StatusCode, Bytes), String> {
        EngineRef::call(self, method, path, body).await
    }

    async fn gone_within(&self, within: Duration) -> bool {
        EngineRef::gone_within(self, within).await
    }

    fn exited(&self) -> bool {
        self.exit.borrow().is_some()
    }
}

/// One answer of the engine to dsv4d's own calls is awaited this long at most (a slot of a
/// 320K context is tens of GiB to write; the KV step's own timeout bounds the whole anyway).
const CALL_TIMEOUT: Duration = Duration::from_secs(3600);
