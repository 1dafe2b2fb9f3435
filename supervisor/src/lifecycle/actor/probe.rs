//! The readiness probe: polls the engine until it answers, looking again when it speaks, and
//! makes sure that what answers is the engine.

use std::net::SocketAddr;
use std::sync::Arc;

use dsv4_engine::procs::{self, PortHolder};
use dsv4_engine::Readiness;
use tokio::sync::mpsc;

use super::messages::Internal;
use super::{PROBE_ATTEMPT, PROBE_FIRST, PROBE_MAX, PROBE_MIN_GAP};
use crate::lifecycle::EngineRef;

/// Polls the engine until it answers its readiness check, then tells the actor. Also looks
/// again whenever the engine writes a line of output (it usually logs when it gets ready).
///
/// A line that names the probe's path is the engine logging the probe itself and does not
/// count, or every probe would trigger the next; [`PROBE_MIN_GAP`] bounds the rest.
///
/// The port was handed to the engine by number, and another local user can bind it first.
/// So each new connection, and the answer that would make the engine ready, is checked to
/// reach a listener that one of the engine's own processes (those with its `mark`) holds;
/// a stranger's is reported (`PortTaken`), and nothing is ever sent to it but this probe.
pub(super) async fn probe_ready(
    readiness: Readiness,
    engine: Arc<EngineRef>,
    mark: Arc<str>,
    internal: mpsc::UnboundedSender<Internal>,
) {
    let mut interval = PROBE_FIRST;
    let mut conn = None;
    loop {
        if engine.exit.borrow().is_some() {
            return;
        }
        let mut fresh = false;
        let attempt = tokio::time::timeout(
            PROBE_ATTEMPT,
            probe_once(&mut conn, &mut fresh, engine.upstream, readiness.path()),
        );
        let ok = matches!(attempt.await, Ok(true));
        if ok || fresh {
            match holder(engine.upstream.port(), mark.clone()).await {
                PortHolder::Other(stranger) => {
                    let _ = internal.send(Internal::PortTaken {
                        gen: engine.gen,
                        pid: engine.pid,
                        stranger,
                    });
                    return;
                }
                PortHolder::Engine if ok => {
                    let _ = internal.send(Internal::Ready { gen: engine.gen });
                    return;
                }
                // Nobody listens any more (the engine closed it, or is going): look again.
                PortHolder::Engine | PortHolder::Nobody => {}
            }
        }
        let probed = tokio::time::Instant::now();
        let next = probed + interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                _ = engine.output.next_line() => {
                    let about_probe = readiness.path().is_some_and(|path| {
                        engine.output.last(1).first().is_some_and(|l| l.contains(path))
                    });
                    if !about_probe {
                        tokio::time::sleep_until(probed + PROBE_MIN_GAP).await;
                        break;
                    }
                }
            }
        }
        interval = (interval * 2).min(PROBE_MAX);
    }
}

pub(super) type ProbeConn =
    hyper::client::conn::http1::SendRequest<http_body_util::Empty<bytes::Bytes>>;

/// Who listens on the engine's port (see [`procs::port_holder`]), read off the async threads.
/// A `/proc` that cannot be read counts as nobody: the probe looks again.
pub(super) async fn holder(port: u16, mark: Arc<str>) -> PortHolder {
    let found = tokio::task::spawn_blocking(move || {
        procs::port_holder(std::path::Path::new("/proc"), port, &mark)
    })
    .await;
    match found {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            tracing::warn!("cannot tell who listens on the engine's port {port}: {e}");
            PortHolder::Nobody
        }
        Err(_) => PortHolder::Nobody,
    }
}

/// One readiness check, on the connection of the previous check when the engine kept it open
/// (a load of a minute is hundreds of checks; one connection each would be wasteful).
/// `fresh` is set when this check opened a new connection. Without a `path`, the check is
/// that the port takes a connection (closed again at once).
pub(super) async fn probe_once(
    conn: &mut Option<ProbeConn>,
    fresh: &mut bool,
    addr: SocketAddr,
    path: Option<&str>,
) -> bool {
    use http_body_util::Empty;
    let Some(path) = path else {
        let connected = tokio::net::TcpStream::connect(addr).await.is_ok();
        *fresh = connected;
        return connected;
    };
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = None;
        let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
            return false;
        };
        *fresh = true;
        let _ = stream.set_nodelay(true);
        let io = hyper_util::rt::TokioIo::new(stream);
        let Ok((sender, driver)) = hyper::client::conn::http1::handshake(io).await else {
            return false;
        };
        // The driver ends with the connection; it does not outlive the engine.
        tokio::spawn(driver);
        *conn = Some(sender);
    }
    let Some(sender) = conn.as_mut() else {
        return false;
    };
    if sender.ready().await.is_err() {
        *conn = None;
        return false;
    }
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, addr.to_string())
        .body(Empty::new());
    let Ok(req) = req else { return false };
    match sender.send_request(req).await {
        Ok(resp) => {
            let ok = resp.status() == hyper::StatusCode::OK;
            // Read the body so the connection can carry the next check.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            ok
        }
        Err(_) => {
            *conn = None;
            false
        }
    }
}
