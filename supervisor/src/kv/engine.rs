//! A running engine as the KV steps reach it (the lifecycle's `EngineRef`): through its own
//! API, with its key. Its own file, so that the steps that use it import it from here and
//! not from each other.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

/// A running engine as the KV steps reach it.
pub trait Engine: Send + Sync {
    /// One request of dsv4d's own to the engine (a JSON body when given): the status and the
    /// whole answer.
    fn call(
        &self,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> impl Future<Output = Result<(http::StatusCode, Bytes), String>> + Send;

    /// Whether the engine has exited, or does within `within` (its exit is seen a moment
    /// after its connections break).
    fn gone_within(&self, within: Duration) -> impl Future<Output = bool> + Send;

    /// Whether the engine has exited.
    fn exited(&self) -> bool;

    /// [`Engine::call`], expecting 200 and JSON of type `T`; an error answer says the
    /// engine's message.
    fn call_json<T: serde::de::DeserializeOwned>(
        &self,
        method: http::Method,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> impl Future<Output = Result<T, String>> + Send {
        async move {
            let (status, bytes) = self.call(method, path, body).await?;
            if status != http::StatusCode::OK {
                let text = String::from_utf8_lossy(&bytes);
                let message = serde_json::from_slice::<serde_json::Value>(&bytes)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(String::from))
                    .unwrap_or_else(|| text.chars().take(200).collect());
                return Err(format!("{path}: {status}: {message}"));
            }
            serde_json::from_slice(&bytes).map_err(|e| format!("{path}: unexpected answer: {e}"))
        }
    }
}
