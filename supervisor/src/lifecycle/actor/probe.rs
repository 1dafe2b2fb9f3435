//! The readiness probe: polls the engine until it answers, looking again when it speaks.

use super::*;

/// Polls the engine until it answers its readiness check, then tells the actor. Also looks
/// again whenever the engine writes a line of output (it usually logs when it gets ready).
///
/// A line that names the probe's path is the engine logging the probe itself and does not
/// count, or every probe would trigger the next; [`PROBE_MIN_GAP`] bounds the rest.
pub(super) async fn probe_ready(
    readiness: Readiness,
    engine: Arc<EngineRef>,
    internal: mpsc::UnboundedSender<Internal>,
) {
    let mut interval = PROBE_FIRST;
    let mut conn = None;
    loop {
        if engine.exit.borrow().is_some() {
            return;
        }
        let attempt = tokio::time::timeout(
            PROBE_ATTEMPT,
            probe_once(&mut conn, engine.upstream, readiness.path()),
        );
        if matches!(attempt.await, Ok(true)) {
            let _ = internal.send(Internal::Ready { gen: engine.gen });
            return;
        }
        let probed = tokio::time::Instant::now();
        let next = probed + interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                _ = engine.output.next_line() => {
                    let about_probe = engine.output.last(1).first().is_some_and(|l| l.contains(readiness.path()));
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

/// One readiness check, on the connection of the previous check when the engine kept it open
/// (a load of a minute is hundreds of checks; one connection each would be wasteful).
pub(super) async fn probe_once(conn: &mut Option<ProbeConn>, addr: SocketAddr, path: &str) -> bool {
    use http_body_util::Empty;
    if conn.as_ref().is_none_or(|c| c.is_closed()) {
        *conn = None;
        let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
            return false;
        };
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
