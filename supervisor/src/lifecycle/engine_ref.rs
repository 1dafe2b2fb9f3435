//! A running engine as the rest of the daemon holds it: what a lease carries, and what the
//! KV steps and validation runs work with.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dsv4_engine::{ExitReport, OutputTail};
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
}
