//! The accept loop: client connections taken from the listener within the connection cap,
//! each served by hyper until it closes, is evicted or the daemon stops (then the future
//! [`serve`] returns resolves once every connection has closed). A request on a connection
//! goes to the router ([`crate::http::router`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tracing::Instrument as _;

use crate::http::body::{End, OnEnd, Parked};
use crate::http::connections;
use crate::http::ctx::Ctx;
use crate::http::router::handle;

/// Serves connections from `listener` until `shutdown` resolves, then stops accepting and
/// asks open connections to close once their current exchange is done. Returns a future that
/// resolves when every connection has closed.
pub async fn serve(
    listener: TcpListener,
    ctx: Arc<Ctx>,
    shutdown: impl Future<Output = ()>,
) -> impl Future<Output = ()> {
    let mut http = hyper::server::conn::http1::Builder::new();
    // A connection that has not sent a complete request head within 30 s, whether
    // new or kept alive between requests, is closed: idle and slow clients free their slot.
    http.timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(connections::HEADER_TIMEOUT)
        // What one connection may hold of a request head it has not finished: hyper's
        // default (about 400 KB) let 60 slow heads take 23 MB (api.max_buffered bounds
        // bodies only). A longer head gets 431.
        .max_buf_size(connections::HEAD_BUFFER)
        .writev(false);
    let connections = ctx.connections.clone();
    // The open-file limit was raised (or not) before the runtime started.
    let fd_cap = connections::fd_cap();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of fds and the like: keep serving the connections we have.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        ctx.activity.touch();
        let (max_connections, min_body_rate) = {
            let config = ctx.parts.config.borrow();
            let api = &config.supervisor.api;
            (api.max_connections, api.min_body_rate)
        };
        let cap = max_connections.min(fd_cap);
        let Some(slot) = connections.admit(cap, min_body_rate) else {
            tracing::debug!(%peer, "refused: {cap} client connections open");
            connections.refuse(stream, max_connections, cap);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let slot = Arc::new(slot);
        let service = {
            let (ctx, slot) = (ctx.clone(), slot.clone());
            hyper::service::service_fn(move |req| {
                let (ctx, slot) = (ctx.clone(), slot.clone());
                let span = crate::log::journal::request_span();
                async move {
                    // In flight until its response body ends.
                    let busy = slot.busy();
                    let resp = handle(&ctx, req, &slot).await;
                    let end = move |_: End| drop(busy);
                    Ok::<_, Infallible>(resp.map(|b| Parked::new(OnEnd::new(b, end))))
                }
                .instrument(span)
            })
        };
        let io = TokioIo::new(stream);
        let conn = http.serve_connection(io, service);
        tokio::spawn(hold(conn, ctx.clone(), slot, peer));
    }
    drop(listener);
    ctx.closing.send_replace(true);
    connections.close();
    async move { connections.closed().await }
}

/// Serves connection `conn` (from `peer`, in `slot`) until it ends, or until its slot says
/// it goes: evicted for room, idle without a key, or closing with the daemon (an idle one at
/// once, a busy one after its answer).
async fn hold<C: Served>(conn: C, ctx: Arc<Ctx>, slot: Arc<connections::Slot>, peer: SocketAddr) {
    tokio::pin!(conn);
    let changed = slot.changed();
    let mut closing = false;
    loop {
        // Keys configured: a connection without one is kept alive briefly. (Only
        // whether they are: the keys themselves are read where a request shows one.)
        let keys = ctx
            .parts
            .config
            .borrow()
            .supervisor
            .api
            .api_keys_file
            .is_some();
        let unkeyed = keys.then_some(connections::UNKEYED_KEEP_ALIVE);
        let until = match slot.next(unkeyed, tokio::time::Instant::now()) {
            connections::Next::Serve(until) => until,
            connections::Next::Evicted => {
                tracing::debug!(%peer, "closed, idle the longest, to make room");
                break;
            }
            connections::Next::Unkeyed => {
                tracing::debug!(%peer, "closed: idle, and no API key shown");
                break;
            }
            // An idle connection ends at once, a busy one after its answer.
            connections::Next::Closing => {
                if !std::mem::replace(&mut closing, true) {
                    conn.as_mut().graceful_shutdown();
                }
                None
            }
        };
        tokio::select! {
            ended = &mut conn => {
                if let Err(e) = ended {
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                break;
            }
            _ = changed.heard() => {}
            _ = tokio::time::sleep_until(until.unwrap_or_else(tokio::time::Instant::now)),
                if until.is_some() => {}
        }
    }
}

/// A connection as [`hold`] drives it: a future of its end that can be asked to close once
/// its exchange is done.
trait Served: Future<Output = hyper::Result<()>> {
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<I, B, S> Served for hyper::server::conn::http1::Connection<I, S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn graceful_shutdown(self: Pin<&mut Self>) {
        hyper::server::conn::http1::Connection::graceful_shutdown(self);
    }
}
