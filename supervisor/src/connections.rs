//! Client connections against the open-file limit.
//!
//! Owns: raising the soft `RLIMIT_NOFILE` at start, the count of open client connections, the
//! cap (`api.max_connections`, lowered to what the open-file limit covers), and the answer
//! to a connection over it: a complete 503, written at once, and the connection closed.
//!
//! Every client connection is a file descriptor, and so is the engine connection a request
//! it carries holds while the engine answers: a client connection may cost two. The daemon's
//! own files (the listener, the runtime's, the engine's pipes, the bus, the config watcher)
//! need [`RESERVE`] more. Past the open-file limit `accept` fails and clients wait in the
//! kernel's backlog, unanswered; the cap keeps the daemon short of it and answers them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::http_error::ApiError;

/// File descriptors kept for the daemon itself, beyond what the client connections use.
pub const RESERVE: u64 = 64;

/// A connection must send a complete request head within this long, from its start or from
/// the end of its previous exchange (keep-alive), or it is closed. hyper's default, written
/// out: slow or idle clients give their slot back.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Refused connections whose requests are read (and dropped) for a moment after the 503, so
/// that closing them does not reset the answer away; past this many they close at once.
const LINGERING: usize = 16;

/// How long a refused connection may linger.
const LINGER: Duration = Duration::from_secs(1);

/// Raises the soft open-file limit to the hard one, and logs both values. A failure is
/// logged and otherwise ignored: the cap then follows the lower limit.
pub fn raise_nofile_limit() {
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(limits) => limits,
        Err(e) => {
            tracing::warn!("cannot read the open-file limit: {e}");
            return;
        }
    };
    if soft >= hard {
        tracing::info!("open-file limit: {} (the hard limit)", shown(soft));
        return;
    }
    match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
        Ok(()) => tracing::info!(
            "open-file limit raised from {} to {} (the hard limit)",
            shown(soft),
            shown(hard)
        ),
        Err(e) => tracing::warn!(
            "open-file limit stays {} (raising it to the hard limit {} failed: {e})",
            shown(soft),
            shown(hard)
        ),
    }
}

fn shown(limit: u64) -> String {
    match limit {
        RLIM_INFINITY => "unlimited".into(),
        n => n.to_string(),
    }
}

/// The open-file limits in force, for the status.
pub fn limits() -> dsv4_client::Limits {
    let finite = |n: u64| (n != RLIM_INFINITY).then_some(n);
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) => dsv4_client::Limits {
            open_files: finite(soft),
            open_files_hard: finite(hard),
        },
        Err(_) => dsv4_client::Limits::default(),
    }
}

/// The client connections the current soft open-file limit covers: two descriptors each
/// (the client's and the engine connection its request holds), after [`RESERVE`].
pub fn fd_cap() -> usize {
    let soft = getrlimit(Resource::RLIMIT_NOFILE).map_or(1024, |(soft, _)| soft);
    let cap = soft.saturating_sub(RESERVE) / 2;
    usize::try_from(cap).unwrap_or(usize::MAX).max(1)
}

/// The open client connections.
#[derive(Debug, Default, Clone)]
pub struct Connections {
    open: Arc<AtomicUsize>,
    lingering: Arc<AtomicUsize>,
}

/// One open client connection; dropping it (when its task ends) frees the slot.
#[derive(Debug)]
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Connections {
    /// How many client connections are open.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A slot for one more connection, when fewer than `cap` are open.
    pub fn admit(&self, cap: usize) -> Option<Slot> {
        let admitted = self
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < cap).then_some(n + 1)
            })
            .is_ok();
        admitted.then(|| Slot(self.open.clone()))
    }

    /// Answers `stream` with a 503 (`too_many_connections`) without reading its request, and
    /// closes it. The answer fits in the empty send buffer of a new connection, so it is
    /// written without waiting; what the client may have sent is then read and dropped for
    /// a moment, so that closing does not reset the connection before the answer is read.
    pub fn refuse(&self, stream: TcpStream, max_connections: usize, cap: usize) {
        let answer = refusal(max_connections, cap);
        if stream.try_write(&answer).is_err() {
            return;
        }
        let lingering = self.lingering.clone();
        let count = |n: usize| (n < LINGERING).then_some(n + 1);
        if lingering
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, count)
            .is_err()
        {
            return;
        }
        tokio::spawn(async move {
            let mut stream = stream;
            let mut sink = [0u8; 4096];
            let drain = async {
                let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                let mut left = 64usize << 10;
                while left > 0 {
                    match stream.read(&mut sink).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => left = left.saturating_sub(n),
                    }
                }
            };
            let _ = tokio::time::timeout(LINGER, drain).await;
            lingering.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// The complete response to a connection over the cap.
fn refusal(max_connections: usize, cap: usize) -> Vec<u8> {
    let message = if cap < max_connections {
        format!(
            "too many open connections: {cap}, the most the open-file limit allows \
             (api.max_connections is {max_connections}); retry shortly"
        )
    } else {
        format!("too many open connections: api.max_connections is {cap}; retry shortly")
    };
    let body = ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "unavailable_error",
        "too_many_connections",
        message,
    )
    .body();
    let mut out = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_counted_and_freed() {
        let c = Connections::default();
        let a = c.admit(2).unwrap();
        let _b = c.admit(2).unwrap();
        assert!(c.admit(2).is_none());
        assert_eq!(c.open(), 2);
        drop(a);
        assert_eq!(c.open(), 1);
        assert!(c.admit(2).is_some());
    }

    #[test]
    fn the_refusal_is_a_complete_response() {
        let text = String::from_utf8(refusal(50, 50)).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(head.contains(&format!("content-length: {}\r\n", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("api.max_connections"));
    }
}
