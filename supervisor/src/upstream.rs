//! The connection to one engine generation: a small keep-alive pool of HTTP/1.1 connections
//! whose driving happens inside the request's own task.
//!
//! Owns: the TCP connections to the engine, and the response body that reads from them.
//! Must not: time out anything (a prefill may keep a response silent for hours), or outlive
//! the engine generation it belongs to (the pool goes with the last lease).
//!
//! Why not hyper-util's pooled client: it runs every connection as a task of its own, so each
//! SSE event crosses two tasks and leaves as one write of its own. Here the request's task
//! polls the connection itself: a response body hands on every event the socket already
//! holds in one frame (nothing waits for more; a lone event goes out at once), which keeps
//! a fast stream from costing one system call per event, and a request needs no hop through
//! a connection task.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{Connection, SendRequest};
use hyper_util::rt::TokioIo;

/// Idle connections kept for reuse.
const MAX_IDLE: usize = 16;
/// Largest frame made by joining events that are already there.
const MAX_JOINED: usize = 64 * 1024;

/// The client's request body on its way to the engine, cut off past `api.max_body` (the
/// proxy sets the limit and turns the cut into a 413).
pub type RequestBody = http_body_util::Limited<Incoming>;

type Driver = Connection<TokioIo<tokio::net::TcpStream>, RequestBody>;

/// One HTTP/1.1 connection: the handle to send on and the state machine that drives it.
struct Conn {
    send: SendRequest<RequestBody>,
    driver: Pin<Box<Driver>>,
}

impl Conn {
    /// Polls the connection; `true` once it has ended (closed, or broken).
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        self.driver.as_mut().poll(cx).is_ready()
    }
}

/// Why the engine did not answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to the engine at {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    #[error("the engine at {addr} broke the exchange: {source}")]
    Http {
        addr: SocketAddr,
        source: hyper::Error,
    },
}

/// The engine's address and its idle connections.
#[derive(Debug)]
pub struct Upstream {
    addr: SocketAddr,
    idle: Mutex<Vec<ConnSlot>>,
}

/// `Conn` without its `Debug`-less parts in the way.
struct ConnSlot(Conn);

impl std::fmt::Debug for ConnSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Conn")
    }
}

impl Upstream {
    pub fn new(addr: SocketAddr) -> Arc<Upstream> {
        Arc::new(Upstream {
            addr,
            idle: Mutex::new(Vec::new()),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn take_idle(&self) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(ConnSlot(c)) = idle.pop() {
            if !c.send.is_closed() {
                return Some(c);
            }
        }
        None
    }

    fn put_idle(&self, c: Conn) {
        if c.send.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(ConnSlot(c));
        }
    }

    async fn connect(&self) -> Result<Conn, UpstreamError> {
        let addr = self.addr;
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| UpstreamError::Connect { addr, source })?;
        // systemd-socket-proxyd leaves Nagle on and streamed responses stall 40 ms on a
        // delayed ACK; here both sides of the proxy send at once.
        let _ = stream.set_nodelay(true);
        let (send, driver) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|source| UpstreamError::Http { addr, source })?;
        Ok(Conn {
            send,
            driver: Box::pin(driver),
        })
    }

    /// Sends `req` to the engine and returns its response, whose body streams from the
    /// connection (which goes back to the pool once the body has ended).
    pub async fn request(
        self: &Arc<Self>,
        req: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let addr = self.addr;
        let mut req = req;
        loop {
            let (mut conn, reused) = match self.take_idle() {
                Some(c) => (c, true),
                None => (self.connect().await?, false),
            };
            // Wait until the connection can take a request, driving it meanwhile.
            let ready = std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = conn.send.poll_ready(cx) {
                    return Poll::Ready(r.is_ok());
                }
                if conn.drive(cx) {
                    return Poll::Ready(false);
                }
                Poll::Pending
            })
            .await;
            if !ready {
                if reused {
                    continue; // the engine closed it while it was idle
                }
                return Err(UpstreamError::Connect {
                    addr,
                    source: io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "closed before the first request",
                    ),
                });
            }
            let mut sent = std::pin::pin!(conn.send.try_send_request(req));
            let mut live = true;
            let outcome = std::future::poll_fn(|cx| {
                if let Poll::Ready(r) = sent.as_mut().poll(cx) {
                    return Poll::Ready(r);
                }
                if live && conn.driver.as_mut().poll(cx).is_ready() {
                    live = false;
                    // The send future resolves with the connection's error next.
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            })
            .await;
            match outcome {
                Ok(resp) => {
                    let conn = live.then_some(conn);
                    return Ok(resp.map(|body| UpstreamBody::new(body, conn, self.clone())));
                }
                Err(mut e) => match e.take_message() {
                    // Not sent at all (a stale connection): another connection may take it.
                    Some(back) if reused => req = back,
                    _ => {
                        return Err(UpstreamError::Http {
                            addr,
                            source: e.into_error(),
                        })
                    }
                },
            }
        }
    }
}

/// The engine's response body. Reading it drives its connection; events already received
/// are joined into one frame.
pub struct UpstreamBody {
    body: Incoming,
    conn: Option<Conn>,
    pool: Arc<Upstream>,
    trailers: Option<HeaderMap>,
    ended: bool,
}

impl UpstreamBody {
    fn new(body: Incoming, conn: Option<Conn>, pool: Arc<Upstream>) -> Self {
        UpstreamBody {
            body,
            conn,
            pool,
            trailers: None,
            ended: false,
        }
    }

    fn finish(&mut self) {
        self.ended = true;
        if let Some(c) = self.conn.take() {
            self.pool.put_idle(c);
        }
    }
}

/// Data gathered for one outgoing frame: the first piece as it came, more joined behind it.
#[derive(Default)]
struct Joined {
    first: Option<Bytes>,
    more: Option<BytesMut>,
}

impl Joined {
    fn push(&mut self, b: Bytes) {
        match (&mut self.first, &mut self.more) {
            (None, _) => self.first = Some(b),
            (Some(f), None) => {
                let mut m = BytesMut::with_capacity((f.len() + b.len()).max(4096));
                m.extend_from_slice(f);
                m.extend_from_slice(&b);
                self.more = Some(m);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&b),
        }
    }
    fn len(&self) -> usize {
        self.more
            .as_ref()
            .map(|m| m.len())
            .or(self.first.as_ref().map(|f| f.len()))
            .unwrap_or(0)
    }
    fn take(&mut self) -> Option<Bytes> {
        match (self.first.take(), self.more.take()) {
            (_, Some(m)) => Some(m.freeze()),
            (f, None) => f,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(t) = this.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let mut data = Joined::default();
        // Whether the body made progress since the connection was last driven: if not,
        // driving it again cannot help and the frame goes out with what it has.
        let mut fresh = true;
        loop {
            match Pin::new(&mut this.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(d) => {
                        data.push(d);
                        fresh = true;
                        if this.body.is_end_stream() {
                            // A known length reached: no `None` will follow.
                            this.finish();
                            break;
                        }
                        if data.len() >= MAX_JOINED {
                            break;
                        }
                    }
                    Err(frame) => {
                        if let Ok(t) = frame.into_trailers() {
                            this.trailers = Some(t);
                        }
                        break;
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    this.conn = None;
                    this.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.finish();
                    break;
                }
                Poll::Pending => {
                    let Some(conn) = this.conn.as_mut() else {
                        break;
                    };
                    if !fresh {
                        break;
                    }
                    fresh = false;
                    if conn.drive(cx) {
                        // The connection ended; the body reports how next time round.
                        this.conn = None;
                    }
                }
            }
        }
        match data.take() {
            Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
            None => match this.trailers.take() {
                Some(t) => Poll::Ready(Some(Ok(Frame::trailers(t)))),
                None if this.ended => Poll::Ready(None),
                None => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
