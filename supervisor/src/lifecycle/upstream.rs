//! The connections to one engine generation: a small keep-alive pool of HTTP/1.1 connections,
//! each read and written inside the request's own task.
//!
//! Owns: the TCP connections to the engine, the credential every request to it carries (the
//! engine generation's key, in place of whatever the client sent), the request on its way
//! there, and the response body that reads from them. Must not: time out anything (a
//! prefill may keep a response silent for hours), or outlive the engine generation it belongs
//! to (the pool goes with the last lease).
//!
//! Engines close connections whenever they like: llama-server right after the last chunk of
//! every streamed answer and after 5 s of keep-alive, any server after `max` requests or
//! when overloaded. Nothing tells the proxy beforehand, so a pooled connection may be dead,
//! or die while a request is on its way. Two rules keep that from ever reaching a client:
//! 1. A connection is looked at before it is reused, so a close that has already arrived is
//!    seen, and one idle past [`IDLE_EXPIRY`] is not reused at all (well inside
//!    llama-server's 5 s, so its keep-alive timeout never races a request).
//! 2. A request goes on a pooled connection when there is one; if that connection breaks
//!    before any byte of an answer, the request goes again, once, on a fresh connection (its
//!    body was read whole beforehand, and the bytes are shared, not copied). A connection the
//!    engine had already closed has not seen the request, so nothing is done twice.
//!
//! Why not hyper-util's pooled client: it runs every connection as a task of its own, so each
//! request and each SSE event crosses two tasks and leaves as a write of its own, and it
//! retries only requests it never wrote. Measured side by side (`cargo bench -p dsv4-tests
//! --bench proxy`, same build, 2 cores): streaming 96% of direct here against 71% with the
//! pooled client, added p50 at concurrency 1 118 us against 135 us (wrk: 112 against 116),
//! and at 64 clients 0.66 against 0.71 of direct throughput, within that run's noise. Why not
//! hyper's connection driven in this task either: see [`crate::lifecycle::engine_wire`]. A
//! response body hands on every event the socket already holds in one frame (nothing waits
//! for more; a lone event goes out at once).

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::lifecycle::engine_wire::{self, Decoded, Decoder, Head, Parsed};

/// The header that carries a key without the `Bearer` scheme (as Anthropic-style clients send it).
/// (A header name made once: looked up by text, it is parsed and hashed at every use.)
pub const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// Idle connections kept for reuse: as many as clients are likely to keep busy at once, so
/// that a steady load reuses connections instead of opening and closing one per request
/// (measured: at 64 concurrent clients, a pool of 16 spent a fifth of dsv4d's time in
/// connect and close). [`IDLE_EXPIRY`] gives them back to the engine soon after the load
/// is gone, which matters to engines that serve each connection with a thread of its own.
const MAX_IDLE: usize = 128;
/// An idle connection older than this is closed rather than reused: engines close idle
/// connections on their own (llama-server after 5 s), and a request sent just as they do
/// would be lost to the race.
pub const IDLE_EXPIRY: Duration = Duration::from_secs(2);
/// Largest frame made by joining events that are already there.
const MAX_JOINED: usize = 64 * 1024;
/// Room made in a connection's buffer for each read.
const READ_SIZE: usize = 16 * 1024;
/// A request body up to this size is sent in one write with its head.
const ONE_WRITE: usize = 64 * 1024;

/// One HTTP/1.1 connection and what has been read from it but not yet taken.
struct Conn {
    io: TcpStream,
    buf: BytesMut,
    /// When it last went back to the pool.
    idle_since: Instant,
}

/// What one read of the socket gave.
struct Filled {
    /// Bytes read; 0: the socket is closed.
    n: usize,
    /// They were all the socket held: another read now would find nothing.
    drained: bool,
}

impl Conn {
    /// Reads what the socket holds into the buffer: how many bytes (0: closed), and whether
    /// that was all it held.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Filled>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        let (n, room) = {
            let mut room = ReadBuf::uninit(self.buf.spare_capacity_mut());
            ready!(Pin::new(&mut self.io).poll_read(cx, &mut room))?;
            (room.filled().len(), room.capacity())
        };
        // SAFETY: `poll_read` initialised the first `n` bytes of the spare capacity.
        unsafe { self.buf.set_len(self.buf.len() + n) };
        // A read that did not fill the room took all the socket held (as the runtime,
        // which then waits for the socket's next readiness, reads it too).
        Poll::Ready(Ok(Filled {
            n,
            drained: n < room,
        }))
    }

    /// Whether it can take a request now: open, with nothing unread. A close (or bytes
    /// nobody asked for) that has already arrived is seen.
    fn usable(&mut self, cx: &mut Context<'_>) -> bool {
        self.buf.is_empty() && self.poll_fill(cx).is_pending()
    }

    /// Writes the request: its head and body in one write when the body is small, else as
    /// they go.
    async fn send(&mut self, head: &[u8], body: &[u8]) -> io::Result<()> {
        let (mut head, mut body) = (head, body);
        while !head.is_empty() {
            let parts = [IoSlice::new(head), IoSlice::new(body)];
            let n = match body.len() <= ONE_WRITE {
                true => self.io.write_vectored(&parts).await?,
                false => self.io.write(head).await?,
            };
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let from_body = n.saturating_sub(head.len());
            head = &head[n.min(head.len())..];
            body = &body[from_body..];
        }
        self.io.write_all(body).await
    }
}

/// Why the engine did not answer.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to the engine at {addr}: {source}")]
    Connect { addr: SocketAddr, source: io::Error },
    #[error(
        "the engine at {addr} closed the connection after the request was sent, before any \
         byte of an answer"
    )]
    Closed { addr: SocketAddr, source: io::Error },
    #[error("the engine at {addr} broke the exchange: {source}")]
    Http { addr: SocketAddr, source: io::Error },
}

/// How an exchange on one connection failed.
enum Failed {
    /// The connection went away before any byte of an answer: the engine cannot have
    /// acted on a request on a connection it had closed, so it may go again.
    Unanswered(io::Error),
    /// Anything else: sending again would not help, and the engine may have acted on it.
    Broken(io::Error),
}

impl Failed {
    fn of(e: io::Error, answered: bool) -> Failed {
        let gone = matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe
                | io::ErrorKind::UnexpectedEof
        );
        match gone && !answered {
            true => Failed::Unanswered(e),
            false => Failed::Broken(e),
        }
    }

    fn error(self, addr: SocketAddr) -> UpstreamError {
        match self {
            Failed::Unanswered(source) => UpstreamError::Closed { addr, source },
            Failed::Broken(source) => UpstreamError::Http { addr, source },
        }
    }
}

/// The engine's address, its key and its idle connections.
pub struct Upstream {
    addr: SocketAddr,
    /// `Host` for requests to it, made once.
    host: http::HeaderValue,
    /// `Authorization` for requests to it: the engine generation's key; `None` for an engine
    /// that takes no key.
    key: Option<http::HeaderValue>,
    idle: Mutex<VecDeque<Conn>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// A request as it goes on the wire.
struct Wire {
    head: BytesMut,
    body: Bytes,
    method: http::Method,
}

impl Upstream {
    /// The engine at `addr`, which requires `key` (`Authorization: Bearer ...`) if given.
    pub fn new(addr: SocketAddr, key: Option<http::HeaderValue>) -> Arc<Upstream> {
        // Digits, dots and a colon: always a valid value.
        let host = http::HeaderValue::from_str(&addr.to_string())
            .unwrap_or_else(|_| http::HeaderValue::from_static("localhost"));
        Arc::new(Upstream {
            addr,
            host,
            key,
            idle: Mutex::new(VecDeque::new()),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The `Host` header for requests to the engine.
    pub fn host(&self) -> &http::HeaderValue {
        &self.host
    }

    /// The `Authorization` header the engine requires, if it takes a key.
    pub fn key(&self) -> Option<&http::HeaderValue> {
        self.key.as_ref()
    }

    /// Puts the engine's own credential in place of any the client sent: a client's key is
    /// dsv4d's business and never reaches the engine, whether dsv4d checks keys or not.
    fn authorize(&self, headers: &mut HeaderMap) {
        headers.remove(http::header::AUTHORIZATION);
        headers.remove(X_API_KEY);
        if let Some(key) = &self.key {
            headers.insert(http::header::AUTHORIZATION, key.clone());
        }
    }

    /// The most recently used idle connection that is still open, if any.
    async fn take_idle(&self) -> Option<Conn> {
        loop {
            let mut c = {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.pop_back()?
            };
            if c.idle_since.elapsed() >= IDLE_EXPIRY {
                // The rest are older still.
                self.idle.lock().unwrap_or_else(|p| p.into_inner()).clear();
                return None;
            }
            if std::future::poll_fn(|cx| Poll::Ready(c.usable(cx))).await {
                return Some(c);
            }
        }
    }

    /// Gives a connection whose exchange has ended back to the pool, unless something
    /// nobody asked for is left in it.
    fn put_idle(&self, mut c: Conn) {
        if !c.buf.is_empty() {
            return;
        }
        let now = Instant::now();
        c.idle_since = now;
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        while idle
            .front()
            .is_some_and(|o| now.duration_since(o.idle_since) >= IDLE_EXPIRY)
        {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back(c);
        }
    }

    async fn connect(&self) -> Result<Conn, UpstreamError> {
        let addr = self.addr;
        let io = TcpStream::connect(addr)
            .await
            .map_err(|source| UpstreamError::Connect { addr, source })?;
        // systemd-socket-proxyd leaves Nagle on and streamed responses stall 40 ms on a
        // delayed ACK; here both sides of the proxy send at once.
        let _ = io.set_nodelay(true);
        Ok(Conn {
            io,
            buf: BytesMut::new(),
            idle_since: Instant::now(),
        })
    }

    /// Sends the request, with its body read whole, to the engine and returns its response,
    /// whose body streams from the connection (which goes back to the pool once the body has
    /// ended).
    pub async fn request(
        self: &Arc<Self>,
        mut parts: http::request::Parts,
        body: Bytes,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        self.authorize(&mut parts.headers);
        let mut head = BytesMut::new();
        engine_wire::encode_request(&parts, body.len(), &mut head);
        let wire = Wire {
            head,
            body,
            method: parts.method,
        };
        // A pooled connection first; if it turns out dead before answering, a fresh one.
        if let Some(conn) = self.take_idle().await {
            match self.exchange(conn, &wire).await {
                Ok(r) => return Ok(r),
                Err(Failed::Unanswered(e)) => {
                    tracing::debug!(
                        "pooled engine connection closed before an answer, sending again: {e}"
                    );
                }
                Err(broken) => return Err(broken.error(self.addr)),
            }
        }
        let conn = self.connect().await?;
        self.exchange(conn, &wire)
            .await
            .map_err(|f| f.error(self.addr))
    }

    /// Sends on one connection and reads until the answer's head has arrived.
    async fn exchange(
        self: &Arc<Self>,
        mut conn: Conn,
        wire: &Wire,
    ) -> Result<Response<UpstreamBody>, Failed> {
        conn.send(&wire.head, &wire.body)
            .await
            .map_err(|e| Failed::of(e, false))?;
        let mut answered = false;
        let Head {
            parts,
            framing,
            reusable,
        } = loop {
            match engine_wire::parse_head(&conn.buf, &wire.method) {
                Ok(Parsed::Head(head, n)) => {
                    conn.buf.advance(n);
                    break head;
                }
                Ok(Parsed::Informational(n)) => {
                    conn.buf.advance(n);
                    continue;
                }
                Ok(Parsed::Partial) => {}
                Err(e) => return Err(Failed::Broken(e.into())),
            }
            match std::future::poll_fn(|cx| conn.poll_fill(cx)).await {
                Ok(Filled { n: 0, .. }) => {
                    let what = match answered {
                        false => "the engine closed the connection before any byte of an answer",
                        true => {
                            "the engine closed the connection in the middle of its answer's head"
                        }
                    };
                    let e = io::Error::new(io::ErrorKind::UnexpectedEof, what);
                    return Err(Failed::of(e, answered));
                }
                Ok(_) => answered = true,
                Err(e) => return Err(Failed::of(e, answered)),
            }
        };
        let body = UpstreamBody::new(conn, Decoder::new(framing), reusable, self.clone());
        Ok(Response::from_parts(parts, body))
    }
}

/// The engine's response body. Reading it reads its connection; events already received
/// are joined into one frame.
pub struct UpstreamBody {
    /// `None` once the body has ended or broken.
    conn: Option<Conn>,
    decoder: Decoder,
    /// Whether the connection may go back to the pool at the body's end.
    reusable: bool,
    pool: Arc<Upstream>,
    /// The connection broke after data that has yet to go out: the error comes next.
    broken: Option<io::Error>,
    ended: bool,
}

impl UpstreamBody {
    fn new(conn: Conn, decoder: Decoder, reusable: bool, pool: Arc<Upstream>) -> Self {
        let mut body = UpstreamBody {
            conn: Some(conn),
            decoder,
            reusable,
            pool,
            broken: None,
            ended: false,
        };
        if body.decoder.done() {
            body.finish();
        }
        body
    }

    fn finish(&mut self) {
        self.ended = true;
        if let Some(c) = self.conn.take().filter(|_| self.reusable) {
            self.pool.put_idle(c);
        }
    }

    /// The connection broke with `e`: what arrived before still goes out first.
    fn fail(&mut self, e: io::Error, data: &mut Joined) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        self.conn = None;
        if let Some(d) = data.take() {
            self.broken = Some(e);
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        self.ended = true;
        Poll::Ready(Some(Err(e)))
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
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Frame<Bytes>>>> {
        let this = &mut *self;
        if let Some(e) = this.broken.take() {
            this.ended = true;
            return Poll::Ready(Some(Err(e)));
        }
        let mut data = Joined::default();
        let mut drained = false;
        while let Some(conn) = this.conn.as_mut() {
            match this.decoder.decode(&mut conn.buf) {
                Ok(Decoded::Data(d)) => {
                    data.push(d);
                    if data.len() >= MAX_JOINED {
                        break;
                    }
                }
                Ok(Decoded::Done) => this.finish(),
                Err(e) => return this.fail(e.into(), &mut data),
                // What came goes now; the next poll waits for more (an event a read).
                Ok(Decoded::More) if drained && data.len() > 0 => break,
                Ok(Decoded::More) => match conn.poll_fill(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Ok(Filled { n: 0, .. })) => match this.decoder.closed() {
                        Ok(()) => {
                            this.ended = true;
                            this.conn = None;
                        }
                        Err(e) => return this.fail(e, &mut data),
                    },
                    Poll::Ready(Ok(filled)) => drained = filled.drained,
                    Poll::Ready(Err(e)) => return this.fail(e, &mut data),
                },
            }
        }
        match data.take() {
            Some(d) => Poll::Ready(Some(Ok(Frame::data(d)))),
            None if this.ended => Poll::Ready(None),
            None => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.broken.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};

    fn client_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.append(AUTHORIZATION, HeaderValue::from_static("Bearer sk-client"));
        h.append(
            AUTHORIZATION,
            HeaderValue::from_static("Basic c2stY2xpZW50"),
        );
        h.append("x-api-key", HeaderValue::from_static("sk-client"));
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h
    }

    #[test]
    fn the_engine_gets_its_own_key_and_never_the_clients() {
        let key = HeaderValue::from_static("Bearer engine-secret");
        let up = Upstream::new(([127, 0, 0, 1], 9).into(), Some(key.clone()));
        let mut h = client_headers();
        up.authorize(&mut h);
        assert_eq!(h.get_all(AUTHORIZATION).iter().collect::<Vec<_>>(), [&key]);
        assert!(h.get("x-api-key").is_none());
        assert_eq!(h[CONTENT_TYPE], "application/json");
        assert_eq!(up.key(), Some(&key));
    }

    #[test]
    fn an_engine_without_a_key_gets_no_credential_at_all() {
        let up = Upstream::new(([127, 0, 0, 1], 9).into(), None);
        let mut h = client_headers();
        up.authorize(&mut h);
        let left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["content-type"]);
    }
}
