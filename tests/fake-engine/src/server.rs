//! HTTP side of the fake engine: the accept loop, the API key check, request
//! routing, the handlers for each endpoint, token pacing (token delay, pause,
//! prefill, die-after-tokens), the streaming response body and the event log
//! that integration tests read (each request with the credentials it carried).
//! When connections close is `conn.rs`'s business; the handlers here report
//! each request and response to it, and carry out the random breaks that fall
//! inside an exchange (after-read, mid-response).

use std::convert::Infallible;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use dsv4::http::body::{End, OnEnd};
use http::header::{
    HeaderMap, HeaderName, HeaderValue, ACCESS_CONTROL_ALLOW_CREDENTIALS,
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    AUTHORIZATION, CACHE_CONTROL, CONNECTION, CONTENT_TYPE, EXPECT, ORIGIN,
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::conn::{self, ConnState, Reason, Rng};
use crate::gen::{self, Flavor, Meta, Plan, Timings};
use crate::{Config, Mode};

/// Largest request body the JSON endpoints accept.
const MAX_JSON_BODY: usize = 64 * 1024 * 1024;

/// Frames a streaming generator may run ahead of the socket.
const STREAM_CHANNEL_DEPTH: usize = 4;

/// Append-only event log for tests (`--log-file`). Each event is one whole
/// line written with a single `write` on an `O_APPEND` file, so lines never
/// interleave and are visible to readers as soon as they are written.
pub struct EventLog {
    file: Option<Mutex<File>>,
}

impl EventLog {
    pub fn open(path: Option<&Path>) -> std::io::Result<EventLog> {
        let file = match path {
            Some(p) => Some(Mutex::new(
                OpenOptions::new().create(true).append(true).open(p)?,
            )),
            None => None,
        };
        Ok(EventLog { file })
    }

    pub fn line(&self, text: &str) {
        let Some(file) = &self.file else { return };
        let mut line = String::with_capacity(text.len() + 1);
        line.push_str(text);
        line.push('\n');
        let mut f = file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = f.write_all(line.as_bytes()).and_then(|()| f.flush()) {
            say!("fake-engine: cannot write log file: {e}");
        }
    }
}

/// Shared state of the running engine.
pub struct Engine {
    pub cfg: Config,
    pub log: EventLog,
    /// Dice for `--connections random:…` (seeded by `--seed`).
    pub rng: Rng,
    ready: AtomicBool,
    tokens_total: AtomicU64,
    pub active: AtomicU64,
    next_id: AtomicU64,
    /// ds4 after its first signal: no more connections, no more bytes of any answer.
    stopping: AtomicBool,
    stop: tokio::sync::Notify,
}

impl Engine {
    pub fn new(cfg: Config, log: EventLog) -> Engine {
        Engine {
            rng: Rng::new(cfg.seed),
            cfg,
            log,
            ready: AtomicBool::new(false),
            tokens_total: AtomicU64::new(0),
            active: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            stop: tokio::sync::Notify::new(),
        }
    }

    /// ds4-server's shutdown: the listening socket closes at once, and the answers under way
    /// stop once their prefill is over.
    pub fn stop_serving(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.stop.notify_waiters();
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Tokens generated so far (what a ds4 checkpoint of this engine would hold).
    pub fn tokens_served(&self) -> u64 {
        self.tokens_total.load(Ordering::SeqCst)
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// Marks the model as loaded (logs `ready t_ns=<unix time in ns>` once, for benchmarks
    /// that measure how soon a supervisor notices). `FAKE_ENGINE_QUIET_READY=1` leaves out the
    /// `main: model loaded` stderr line, to measure readiness found by polling alone.
    pub fn set_ready(&self) {
        if !self.ready.swap(true, Ordering::SeqCst) {
            let t_ns = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            if std::env::var_os("FAKE_ENGINE_QUIET_READY").is_none_or(|v| v.is_empty()) {
                say!("main: model loaded");
            }
            self.log.line(&format!("ready t_ns={t_ns}"));
        }
    }

    fn meta(&self, flavor: Flavor) -> Meta {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Meta {
            id: format!("{}{n}", flavor.id_prefix()),
            created,
            model: self.cfg.model_name.clone(),
        }
    }

    /// Waits until token `i` is due (each token "takes" `--token-ms`, counted on `pace`);
    /// `--pause-after 0` pauses before the very first token.
    async fn before_token(&self, i: u64, pace: &mut Pace) {
        if i == 0 && self.cfg.pause_after == Some(0) {
            sleep_ms(self.cfg.pause_ms).await;
            pace.restart();
        }
        pace.next_token(self.cfg.token_ms).await;
    }

    /// Bookkeeping after token `i` went out: the process-wide counter for
    /// `--die-after-tokens`, and the one-off `--pause-after` pause.
    async fn after_token(&self, i: u64, pace: &mut Pace) {
        let total = self.tokens_total.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(limit) = self.cfg.die_after_tokens {
            if total >= limit {
                say!("fake-engine: dying on purpose after {limit} tokens");
                // Give the socket a moment to carry the last token out, so the
                // client sees a truncated stream rather than nothing at all.
                tokio::time::sleep(Duration::from_millis(50)).await;
                std::process::exit(3);
            }
        }
        if self.cfg.pause_after == Some(i + 1) {
            sleep_ms(self.cfg.pause_ms).await;
            pace.restart();
        }
    }
}

/// When the next token is due: `--token-ms` after the one before on a schedule that starts
/// with the answer, not after the last wake-up, so that a loaded machine's late wake-ups
/// do not slow the rate (a real engine's throughput does not drift with its scheduling). A
/// pause starts the schedule again.
pub struct Pace {
    due: tokio::time::Instant,
}

impl Pace {
    pub fn new() -> Pace {
        Pace {
            due: tokio::time::Instant::now(),
        }
    }

    fn restart(&mut self) {
        self.due = tokio::time::Instant::now();
    }

    async fn next_token(&mut self, token_ms: u64) {
        if token_ms > 0 {
            self.due += Duration::from_millis(token_ms);
            tokio::time::sleep_until(self.due).await;
        }
    }
}

async fn sleep_ms(ms: u64) {
    if ms > 0 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// Counts an in-flight generation for `/slots`.
struct Busy(Arc<Engine>);

impl Busy {
    fn new(engine: &Arc<Engine>) -> Busy {
        engine.active.fetch_add(1, Ordering::SeqCst);
        Busy(engine.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Tracks one response from request to its end. The response body reports
/// how it ended (`settle`): whole, it logs `done`; cut short, or dropped with
/// the handler before there was a body (the client went away), it logs
/// `client-closed`, unless the engine broke the connection on purpose. Either
/// way the connection's state hears of it.
struct ResponseGuard {
    engine: Arc<Engine>,
    conn: Arc<ConnState>,
    path: String,
    settled: bool,
}

impl ResponseGuard {
    fn new(engine: &Arc<Engine>, conn: &Arc<ConnState>, path: &str) -> ResponseGuard {
        conn.request_started();
        ResponseGuard {
            engine: engine.clone(),
            conn: conn.clone(),
            path: path.to_string(),
            settled: false,
        }
    }

    /// The response body ended as `end` says; `streamed`: it was chunked (no
    /// length known up front), what `close-after-stream` closes after.
    fn settle(mut self, end: End, streamed: bool) {
        self.settled = true;
        match end {
            End::Completed => {
                self.engine.log.line(&format!("done {}", self.path));
                self.conn.response_finished(streamed);
            }
            End::Errored | End::Dropped => self.abandon(),
        }
    }

    fn abandon(&self) {
        if !self.conn.closing() {
            say!("fake-engine: client closed {}", self.path);
            self.engine
                .log
                .line(&format!("client-closed {}", self.path));
        }
        self.conn.response_abandoned();
    }
}

impl Drop for ResponseGuard {
    fn drop(&mut self) {
        if !self.settled {
            self.abandon();
        }
    }
}

/// `random:…@mid-response`: the body stops after its first event (a stream),
/// its first frame (an echo) or half of it (a full body), and the connection
/// is dropped.
struct Cut {
    conn: Arc<ConnState>,
    /// Enough went out; the next poll breaks the connection.
    sent: bool,
    broken: bool,
}

enum Source {
    /// A complete body, handed out as one frame.
    Full(Option<Bytes>),
    /// Frames produced by a generator task; the channel closing ends the body.
    Channel(mpsc::Receiver<Bytes>),
    /// The request body of `/echo`, forwarded frame by frame.
    Echo(Incoming),
}

/// The one response body type: each item from the source becomes its own
/// frame (hyper writes and flushes frames individually). `handle` wraps it
/// in an `OnEnd` that settles the response's guard.
pub struct EngineBody {
    source: Source,
    cut: Option<Cut>,
    /// Length announced when a cut full body no longer has all of it.
    declared: Option<u64>,
}

impl EngineBody {
    fn new(source: Source) -> EngineBody {
        EngineBody {
            source,
            cut: None,
            declared: None,
        }
    }

    fn full(bytes: Bytes) -> EngineBody {
        EngineBody::new(Source::Full(Some(bytes)))
    }

    fn channel(rx: mpsc::Receiver<Bytes>) -> EngineBody {
        EngineBody::new(Source::Channel(rx))
    }

    fn echo(body: Incoming) -> EngineBody {
        EngineBody::new(Source::Echo(body))
    }

    /// Arms `random:…@mid-response` on a body that is not empty.
    fn cut(&mut self, conn: Arc<ConnState>) {
        if let Source::Full(Some(b)) = &mut self.source {
            self.declared = Some(b.len() as u64);
            b.truncate(b.len() / 2);
        }
        self.cut = Some(Cut {
            conn,
            sent: false,
            broken: false,
        });
    }
}

impl Body for EngineBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(cut) = this.cut.as_mut().filter(|c| c.sent) {
            if !cut.broken {
                cut.broken = true;
                cut.conn.break_now(Reason::MidResponse);
            }
            return Poll::Pending;
        }
        let polled = match &mut this.source {
            Source::Full(slot) => Poll::Ready(slot.take().map(|b| Ok(Frame::data(b)))),
            Source::Channel(rx) => rx.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b)))),
            Source::Echo(inc) => Pin::new(inc).poll_frame(cx),
        };
        if let (Some(cut), Poll::Ready(Some(Ok(frame)))) = (this.cut.as_mut(), &polled) {
            // A stream is cut after its first event, not after a `: prefill` comment.
            let event =
                |d: &Bytes| !matches!(this.source, Source::Channel(_)) || d.starts_with(b"data:");
            if frame.data_ref().is_some_and(event) {
                cut.sent = true;
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        if self.cut.is_some() {
            // A cut body never ends; it breaks.
            return false;
        }
        match &self.source {
            Source::Full(slot) => slot.is_none(),
            Source::Channel(_) => false,
            Source::Echo(inc) => inc.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        if let Some(n) = self.declared {
            return SizeHint::with_exact(n);
        }
        match &self.source {
            Source::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            Source::Full(None) => SizeHint::with_exact(0),
            Source::Channel(_) => SizeHint::default(),
            Source::Echo(inc) => inc.size_hint(),
        }
    }
}

type Resp = Response<EngineBody>;

fn json_response(status: StatusCode, v: &Value) -> Resp {
    let mut r = Response::new(EngineBody::full(Bytes::from(v.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/json; charset=utf-8"),
    );
    r
}

fn error_response(status: StatusCode, message: &str, kind: &str) -> Resp {
    json_response(status, &gen::error_body(status.as_u16(), message, kind))
}

/// llama-server's `/v1/messages/count_tokens`: the prompt's characters, one token each.
async fn count_tokens(req: Request<Incoming>) -> Resp {
    match read_json(req).await {
        Ok(body) => {
            let messages = body.get("messages").and_then(Value::as_array);
            let n = messages.map_or(0, |m| gen::chat_prompt_chars(m));
            json_response(StatusCode::OK, &json!({"input_tokens": n}))
        }
        Err(m) => bad_request(&m),
    }
}

fn not_found() -> Resp {
    error_response(StatusCode::NOT_FOUND, "File Not Found", "not_found_error")
}

fn loading() -> Resp {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "Loading model",
        "unavailable_error",
    )
}

fn bad_request(message: &str) -> Resp {
    error_response(StatusCode::BAD_REQUEST, message, "invalid_request_error")
}

fn sse_response(rx: mpsc::Receiver<Bytes>) -> Resp {
    let mut r = Response::new(EngineBody::channel(rx));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Accepts connections forever, serving each as HTTP/1.1 with keep-alive
/// (closed as `--connections` says, by `conn::run`).
pub async fn serve(engine: Arc<Engine>, listener: TcpListener) {
    loop {
        let stop = engine.stop.notified();
        if engine.stopping() {
            // Closed now: a client connecting from here on is refused.
            drop(listener);
            return;
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = stop => continue,
        };
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                say!("fake-engine: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        if let Err(e) = stream.set_nodelay(true) {
            say!("fake-engine: set_nodelay failed: {e}");
        }
        // One line per connection, so tests can see whether a client reuses them.
        engine.log.line(&format!("connection from {peer}"));
        let engine = engine.clone();
        let state = ConnState::new(engine.clone());
        let conn = state.clone();
        let svc = service_fn(move |req| {
            let engine = engine.clone();
            let conn = conn.clone();
            async move { Ok::<_, Infallible>(handle(engine, conn, req).await) }
        });
        tokio::spawn(conn::run(state, stream, svc));
    }
}

/// A header's value for the event log: quoted, or `-` when absent.
fn shown(headers: &HeaderMap, name: &str) -> String {
    let values: Vec<String> = headers
        .get_all(name)
        .iter()
        .map(|v| format!("{:?}", String::from_utf8_lossy(v.as_bytes())))
        .collect();
    if values.is_empty() {
        "-".to_string()
    } else {
        values.join(",")
    }
}

/// Paths llama-server serves without a key: its health check and the web UI's page
/// (`tools/server/server-http.cpp`, `get_public_endpoints`).
const PUBLIC_PATHS: [&str; 3] = ["/health", "/v1/health", "/"];

/// llama-server's key check (`--api-key`, `--api-key-file`): the key comes from
/// `Authorization`, with or without a `Bearer ` prefix (exactly so spelled), or from
/// `x-api-key` when there is no `Authorization`; CORS preflights and the public paths need
/// none, and while the model loads every request is told that first. A refusal is a 401
/// that closes the connection, as llama-server's does (it never reads the body).
fn refuse_key(engine: &Engine, method: &Method, path: &str, headers: &HeaderMap) -> Option<Resp> {
    let keys = &engine.cfg.api_keys;
    if keys.is_empty() || method == Method::OPTIONS || PUBLIC_PATHS.contains(&path) {
        return None;
    }
    if !engine.is_ready() && path != "/echo" {
        return None;
    }
    let presented = headers
        .get(AUTHORIZATION)
        .filter(|v| !v.is_empty())
        .or_else(|| headers.get("x-api-key"))
        .map(HeaderValue::as_bytes)
        .unwrap_or_default();
    let key = presented.strip_prefix(b"Bearer ").unwrap_or(presented);
    if keys.iter().any(|k| k.as_bytes() == key) {
        return None;
    }
    say!("srv    operator(): unauthorized: Invalid API Key");
    let mut r = error_response(
        StatusCode::UNAUTHORIZED,
        "Invalid API Key",
        "authentication_error",
    );
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    Some(r)
}

/// Entry point for every request: logs it (with the credentials it carried),
/// checks its key, routes it, and ties the response to a guard that logs
/// `done` / `client-closed` when its body ends. Random breaks inside the
/// exchange (`--connections random:…`) happen here, never to `GET /health`.
async fn handle(
    engine: Arc<Engine>,
    conn: Arc<ConnState>,
    req: Request<Incoming>,
) -> Response<OnEnd<EngineBody, impl FnOnce(End) + Send>> {
    let ds4 = engine.cfg.mode == Mode::Ds4;
    // Routed on the decoded path, as llama-server's HTTP library routes; ds4-server compares
    // the path as sent (its query cut off), with no decoding.
    let path = match ds4 {
        true => req.uri().path().to_string(),
        false => decode_path_component(req.uri().path()),
    };
    let method = req.method().clone();
    // Health checks are not logged: a supervisor polls them, and their lines would crowd
    // the start-up messages out of the output tail that tests read.
    if path != "/health" {
        say!("fake-engine: request {method} {path}");
    }
    // `Expect` only when sent, so that most lines end with the credentials.
    let expect = match req.headers().contains_key(EXPECT) {
        true => format!(" expect={}", shown(req.headers(), EXPECT.as_str())),
        false => String::new(),
    };
    // Anthropic's headers only when sent, as `Expect`.
    let anthropic: String = ["anthropic-version", "anthropic-beta"]
        .into_iter()
        .filter(|h| req.headers().contains_key(*h))
        .map(|h| format!(" {h}={}", shown(req.headers(), h)))
        .collect();
    engine.log.line(&format!(
        "request {method} {path} authorization={} x-api-key={}{expect}{anthropic}",
        shown(req.headers(), AUTHORIZATION.as_str()),
        shown(req.headers(), "x-api-key")
    ));
    let guard = ResponseGuard::new(&engine, &conn, &path);
    let dice = !(method == Method::GET && path == "/health");
    if dice && conn.roll_after_read() {
        // The whole request is read, then the connection goes without a byte of answer.
        let _ = Limited::new(req.into_body(), MAX_JSON_BODY).collect().await;
        conn.break_now(Reason::AfterRead);
        return std::future::pending().await;
    }
    let origin = req.headers().get(ORIGIN).cloned();
    let refused = refuse_key(&engine, &method, &path, req.headers());
    let answered = refused.is_none();
    let mut resp = match refused {
        Some(r) => r,
        None if ds4 => route_ds4(&engine, req, &method, &path).await,
        None => route(&engine, req, &method, &path).await,
    };
    if ds4 {
        // One request per connection, every answer says so; a stream's end is the end of
        // the connection (no chunked framing: hyper writes a body of unknown length
        // close-delimited only in an HTTP/1.0 answer, so such an answer says 1.0 here where
        // ds4-server says 1.1).
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
        if resp.body().size_hint().exact().is_none() {
            *resp.version_mut() = hyper::Version::HTTP_10;
        }
    }
    if engine.cfg.mode == Mode::Llama {
        // As llama-server does: every answer allows the origin that asked, and an empty one
        // when none did.
        resp.headers_mut().insert(
            ACCESS_CONTROL_ALLOW_ORIGIN,
            origin.unwrap_or(HeaderValue::from_static("")),
        );
    }
    if answered && conn.keep_alive_header() {
        resp.headers_mut().insert(
            HeaderName::from_static("keep-alive"),
            HeaderValue::from_static(conn::KEEP_ALIVE_VALUE),
        );
    }
    let body = resp.body_mut();
    let streamed = body.size_hint().exact().is_none();
    // An empty body is never polled: it completes when hyper drops it.
    if answered && !body.is_end_stream() && dice && conn.roll_mid_response() {
        body.cut(conn.clone());
    }
    resp.map(|body| OnEnd::new(body, move |end| guard.settle(end, streamed)))
}

async fn route(engine: &Arc<Engine>, req: Request<Incoming>, method: &Method, path: &str) -> Resp {
    let llama = engine.cfg.mode == Mode::Llama;
    match (method, path) {
        (&Method::GET, "/health" | "/v1/health") if llama => {
            if engine.is_ready() {
                json_response(StatusCode::OK, &json!({"status": "ok"}))
            } else {
                loading()
            }
        }
        (&Method::POST, "/echo") => echo(req),
        // llama-server answers every OPTIONS as a CORS preflight, loaded or not, allowing
        // the origin (added by `handle`) with credentials.
        (&Method::OPTIONS, _) if llama => {
            let mut r = Response::new(EngineBody::full(Bytes::new()));
            let h = r.headers_mut();
            h.insert(
                ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
            h.insert(
                ACCESS_CONTROL_ALLOW_METHODS,
                HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
            );
            h.insert(ACCESS_CONTROL_ALLOW_HEADERS, HeaderValue::from_static("*"));
            h.insert(CONTENT_TYPE, HeaderValue::from_static("text/html"));
            r
        }
        _ if !engine.is_ready() => loading(),
        (&Method::GET, "/v1/models" | "/models") => {
            json_response(StatusCode::OK, &gen::models_list(&engine.cfg.model_name))
        }
        (&Method::POST, "/v1/chat/completions" | "/chat/completions") => {
            generate(engine, req, Flavor::Chat).await
        }
        (&Method::POST, "/v1/completions" | "/completions") => {
            generate(engine, req, Flavor::Text).await
        }
        (&Method::POST, "/completion") => generate(engine, req, Flavor::Native).await,
        (&Method::POST, "/v1/messages") => generate(engine, req, Flavor::Anthropic).await,
        (&Method::POST, "/v1/responses" | "/responses") => {
            generate(engine, req, Flavor::Responses).await
        }
        (&Method::POST, "/v1/messages/count_tokens") => count_tokens(req).await,
        (&Method::GET, "/slots") => {
            let busy = engine.active.load(Ordering::SeqCst);
            let slots: Vec<Value> = (0..u64::from(engine.cfg.parallel.max(1)))
                .map(|i| json!({"id": i, "is_processing": i < busy}))
                .collect();
            json_response(StatusCode::OK, &Value::Array(slots))
        }
        (&Method::POST, p) if llama && p.starts_with("/slots/") => slot_action(engine, req).await,
        (&Method::POST, "/tokenize") if llama => {
            let body = match read_json(req).await {
                Ok(v) => v,
                Err(e) => return json_response(StatusCode::BAD_REQUEST, &json!({"error": e})),
            };
            let text = body["content"].as_str().unwrap_or_default();
            json_response(StatusCode::OK, &gen::tokenize(text))
        }
        (&Method::GET, "/props") => json_response(
            StatusCode::OK,
            &json!({
                "n_ctx": engine.cfg.n_ctx,
                "total_slots": engine.cfg.parallel,
                "model_path": engine.cfg.model_path,
                "model_alias": engine.cfg.model_name,
                "default_generation_settings": {"n_ctx": engine.cfg.n_ctx},
                "build_info": "fake-engine",
            }),
        ),
        _ => not_found(),
    }
}

/// ds4-server's routes (`client_main` in `ds4_server.c`): exact paths, anything else 404
/// `unknown endpoint`; a chunked request body is a bad request. `/echo` is the test hook.
async fn route_ds4(
    engine: &Arc<Engine>,
    req: Request<Incoming>,
    method: &Method,
    path: &str,
) -> Resp {
    let ds4_error = |status: StatusCode, message: &str| {
        json_response(
            status,
            &json!({"error": {"message": message, "type": "invalid_request_error"}}),
        )
    };
    if req.headers().contains_key(hyper::header::TRANSFER_ENCODING) {
        return ds4_error(StatusCode::BAD_REQUEST, "bad HTTP request");
    }
    match (method, path) {
        (&Method::OPTIONS, _) => {
            let mut r = Response::new(EngineBody::full(Bytes::new()));
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
        (&Method::GET, "/v1/models") => {
            json_response(StatusCode::OK, &gen::models_list(&engine.cfg.model_name))
        }
        (&Method::POST, "/v1/chat/completions") => generate(engine, req, Flavor::Chat).await,
        (&Method::POST, "/v1/completions") => generate(engine, req, Flavor::Text).await,
        (&Method::POST, "/v1/messages") => generate(engine, req, Flavor::Anthropic).await,
        (&Method::POST, "/v1/responses") => generate(engine, req, Flavor::Responses).await,
        (&Method::POST, "/echo") => echo(req),
        _ => ds4_error(StatusCode::NOT_FOUND, "unknown endpoint"),
    }
}

/// The path as cpp-httplib's `decode_path_component` decodes it before routing: `%XX` and
/// `%uXXXX` (as UTF-8) are decoded, and an escape that is not one of those is kept as it is.
fn decode_path_component(raw: &str) -> String {
    let b = raw.as_bytes();
    let hex = |at: usize, n: usize| -> Option<u32> {
        let digits = b.get(at..at + n)?;
        let text = std::str::from_utf8(digits).ok()?;
        u32::from_str_radix(text, 16)
            .ok()
            .filter(|_| digits.iter().all(u8::is_ascii_hexdigit))
    };
    let mut out: Vec<u8> = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 1 < b.len() {
            if b[i + 1] == b'u' {
                if let Some(v) = hex(i + 2, 4) {
                    if let Some(c) = char::from_u32(v) {
                        out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                    }
                    i += 6;
                    continue;
                }
            } else if let Some(v) = hex(i + 1, 2) {
                out.push(v as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `POST /slots/N?action=save|restore|erase` with `{"filename": NAME}`, as llama-server
/// answers it: the file lives in `--slot-save-path` (without one: 501), a name with a path
/// in it is refused, a save takes `--save-ms` first. A slot "holds" the tokens generated so
/// far; a restore reads the count back from the file.
async fn slot_action(engine: &Arc<Engine>, req: Request<Incoming>) -> Resp {
    let error = |status: StatusCode, message: &str| {
        json_response(
            status,
            &json!({"error": {"code": status.as_u16(), "message": message, "type": "invalid_request_error"}}),
        )
    };
    let path = decode_path_component(req.uri().path());
    let id: Option<u64> = path.strip_prefix("/slots/").and_then(|id| id.parse().ok());
    let action = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("action=")))
        .unwrap_or("")
        .to_string();
    let Some(id) = id.filter(|id| *id < u64::from(engine.cfg.parallel.max(1))) else {
        return error(StatusCode::BAD_REQUEST, "Invalid slot ID");
    };
    let Some(dir) = engine.cfg.slot_save_path.clone() else {
        return error(
            StatusCode::NOT_IMPLEMENTED,
            "This server does not support slots action.",
        );
    };
    let body = match Limited::new(req.into_body(), 1 << 20).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::BAD_REQUEST, "bad body"),
    };
    let name = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["filename"].as_str().map(String::from));
    let name = match (action.as_str(), name) {
        ("erase", _) => String::new(),
        (_, Some(n)) if !n.is_empty() && !n.contains('/') && n != ".." => n,
        _ => return error(StatusCode::BAD_REQUEST, "Invalid filename"),
    };
    let path = dir.join(&name);
    engine.log.line(&format!("slot {id} {action} {name}"));
    match action.as_str() {
        "save" if engine.cfg.save_abort => {
            say!("fake-engine: aborting in a slot save (--save-abort)");
            std::process::exit(134);
        }
        "save" => {
            tokio::time::sleep(Duration::from_millis(engine.cfg.save_ms)).await;
            let tokens = engine.tokens_served();
            let content = format!(
                "fake-engine slot tokens={tokens}
"
            );
            if engine.cfg.save_full {
                let _ = std::fs::write(&path, &content.as_bytes()[..4]);
            }
            if engine.cfg.save_full || std::fs::write(&path, &content).is_err() {
                return json_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    &json!({"error": {"code": 500, "message": "Unable to save slot", "type": "server_error"}}),
                );
            }
            json_response(
                StatusCode::OK,
                &json!({"id_slot": id, "filename": name, "n_saved": tokens, "n_written": content.len(), "timings": {"save_ms": engine.cfg.save_ms}}),
            )
        }
        "restore" if engine.cfg.restore_abort => {
            say!("llama_state_seq_load_file: GGML_ASSERT failed (fake-engine --restore-abort)");
            std::process::exit(134);
        }
        "restore" => {
            let tokens = std::fs::read_to_string(&path).ok().and_then(|t| {
                t.trim()
                    .strip_prefix("fake-engine slot tokens=")?
                    .parse::<u64>()
                    .ok()
            });
            match tokens {
                Some(n) => json_response(
                    StatusCode::OK,
                    &json!({"id_slot": id, "filename": name, "n_restored": n, "n_read": 0, "timings": {"restore_ms": 0}}),
                ),
                None => error(
                    StatusCode::BAD_REQUEST,
                    "Unable to restore slot: No available space in KV cache or invalid slot save file",
                ),
            }
        }
        "erase" => json_response(StatusCode::OK, &json!({"id_slot": id, "n_erased": 0})),
        _ => error(StatusCode::BAD_REQUEST, "Invalid action"),
    }
}

/// Streams the request body straight back, reporting selected request
/// headers as `x-echo-<name>` response headers.
fn echo(req: Request<Incoming>) -> Resp {
    const ECHOED: [&str; 8] = [
        "content-type",
        "connection",
        "te",
        "x-custom",
        "host",
        "transfer-encoding",
        "keep-alive",
        "upgrade",
    ];
    let (parts, body) = req.into_parts();
    let mut resp = Response::new(EngineBody::echo(body));
    for name in ECHOED {
        let values: Vec<&[u8]> = parts
            .headers
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        if values.is_empty() {
            continue;
        }
        let joined = values.join(&b", "[..]);
        let (Ok(hn), Ok(hv)) = (
            HeaderName::from_bytes(format!("x-echo-{name}").as_bytes()),
            HeaderValue::from_bytes(&joined),
        ) else {
            continue;
        };
        resp.headers_mut().insert(hn, hv);
    }
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    resp
}

/// Reads and parses a JSON object body, or says why it cannot (for a 400).
async fn read_json(req: Request<Incoming>) -> Result<Value, String> {
    let collected = match Limited::new(req.into_body(), MAX_JSON_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => return Err(format!("cannot read request body: {e}")),
    };
    match serde_json::from_slice::<Value>(&collected) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(_) => Err("request body must be a JSON object".to_string()),
        Err(e) => Err(format!("invalid JSON in request body: {e}")),
    }
}

/// What a generation request asked for, after validation.
struct Job {
    flavor: Flavor,
    plan: Plan,
    prompt_n: u64,
    stream: bool,
}

fn parse_job(flavor: Flavor, body: &Value) -> Result<Job, String> {
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let (plan, prompt_n) = match flavor {
        Flavor::Responses => {
            let input = match body.get("input") {
                Some(Value::String(s)) => s.chars().count() as u64,
                Some(Value::Array(items)) => gen::chat_prompt_chars(items),
                _ => return Err("'input' is required: a string or an array".to_string()),
            };
            let n = gen::max_tokens(body, &["max_output_tokens"]);
            let text = body.get("input").and_then(Value::as_str);
            (Plan::for_chat(text, n), input)
        }
        Flavor::Chat | Flavor::Anthropic => {
            let Some(messages) = body.get("messages").and_then(Value::as_array) else {
                return Err("'messages' is required and must be an array".to_string());
            };
            let n = gen::max_tokens(body, &["max_tokens", "max_completion_tokens", "n_predict"]);
            let last = messages.last().and_then(|m| m.get("content")?.as_str());
            (Plan::for_chat(last, n), gen::chat_prompt_chars(messages))
        }
        Flavor::Text | Flavor::Native => {
            let keys: &[&str] = if flavor == Flavor::Native {
                &["n_predict", "max_tokens"]
            } else {
                &["max_tokens", "n_predict"]
            };
            let Some(prompt) = body.get("prompt").and_then(gen::prompt_text) else {
                return Err("\"prompt\" must be a string or an array of strings".to_string());
            };
            // `cache_prompt` is accepted for compatibility; the fake keeps no cache.
            let _cache_prompt = body
                .get("cache_prompt")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            let n = gen::max_tokens(body, keys);
            (Plan::for_prompt(&prompt, n), prompt.chars().count() as u64)
        }
    };
    Ok(Job {
        flavor,
        plan,
        prompt_n,
        stream,
    })
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

async fn generate(engine: &Arc<Engine>, req: Request<Incoming>, flavor: Flavor) -> Resp {
    let t0 = Instant::now();
    let body = match read_json(req).await {
        Ok(v) => v,
        Err(m) => return bad_request(&m),
    };
    // As llama-server does with a grammar it cannot parse: the client's text goes to the
    // engine's output as it is, and the request gets 400.
    if let Some(grammar) = body.get("grammar").and_then(Value::as_str) {
        eprintln!("parse: error parsing grammar: expecting name at {grammar}");
        return bad_request("Failed to parse grammar");
    }
    let job = match parse_job(flavor, &body) {
        Ok(j) => j,
        Err(m) => return bad_request(&m),
    };
    let meta = engine.meta(flavor);
    if job.stream {
        if engine.cfg.mode == Mode::Ds4 {
            // ds4-server sends a stream's head at the first prefill progress callback, or
            // after the prefill when none fires (a short or a CPU-path prefill): until then
            // the client has nothing, not even the status.
            let every = engine.cfg.prefill_comment_ms;
            let head_after = match every {
                0 => engine.cfg.prefill_ms,
                every => every.min(engine.cfg.prefill_ms),
            };
            tokio::time::sleep_until((t0 + Duration::from_millis(head_after)).into()).await;
            if engine.stopping() {
                // Stopped before the head went: not a byte of answer; the process exits.
                return std::future::pending().await;
            }
        }
        let (tx, rx) = mpsc::channel(STREAM_CHANNEL_DEPTH);
        tokio::spawn(stream_job(engine.clone(), job, meta, tx, t0));
        return sse_response(rx);
    }

    let _busy = Busy::new(engine);
    sleep_ms(engine.cfg.prefill_ms).await;
    if engine.cfg.mode == Mode::Ds4 {
        crate::ds4_progress();
        if engine.stopping() {
            // Stopped during the prefill: not a byte of answer; the process exits.
            return std::future::pending().await;
        }
    }
    let prompt_ms = ms_since(t0);
    let t1 = Instant::now();
    let mut pace = Pace::new();
    let mut content = String::new();
    for i in 0..job.plan.len() {
        engine.before_token(i, &mut pace).await;
        content.push_str(&job.plan.token(i));
        engine.after_token(i, &mut pace).await;
    }
    let timings = Timings {
        cache_n: 0,
        prompt_n: job.prompt_n,
        prompt_ms,
        predicted_n: job.plan.len(),
        predicted_ms: ms_since(t1),
    };
    let mut answer = job
        .flavor
        .full(&meta, &content, job.plan.finish(), &timings);
    // As llama-server: `n_probs` asks each generated token's top log-probabilities.
    let n_probs = body.get("n_probs").and_then(Value::as_u64).unwrap_or(0);
    if job.flavor == Flavor::Native && n_probs > 0 {
        answer["completion_probabilities"] = probabilities(&job, n_probs);
    }
    json_response(StatusCode::OK, &answer)
}

/// llama-server's `completion_probabilities` for the tokens of `job`: each one's id, text,
/// bytes and log-probability, and the `n` most likely at its position, the pick first. The
/// figures are the same at every run, as a deterministic engine's are.
fn probabilities(job: &Job, n: u64) -> Value {
    let entry = |id: u64, text: &str, logprob: f64| json!({"id": id, "token": text, "bytes": text.as_bytes(), "logprob": logprob});
    let tokens: Vec<Value> = (0..job.plan.len())
        .map(|i| {
            let text = job.plan.token(i);
            let id = 100 + text.bytes().map(u64::from).sum::<u64>() % 900;
            let top: Vec<Value> = (0..n)
                .map(|k| match k {
                    0 => entry(id, &text, -0.01),
                    k => entry(id + k, &format!("alt{k}"), -2.0 * k as f64),
                })
                .collect();
            let mut e = entry(id, &text, -0.01);
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect();
    Value::Array(tokens)
}

/// Produces one streamed response into `tx`. Stops as soon as a send fails,
/// which means hyper dropped the body because the client went away.
async fn stream_job(
    engine: Arc<Engine>,
    job: Job,
    meta: Meta,
    tx: mpsc::Sender<Bytes>,
    t0: Instant,
) {
    let _busy = Busy::new(&engine);
    if !prefill(&engine, &tx, t0).await {
        return;
    }
    let ds4 = engine.cfg.mode == Mode::Ds4;
    if ds4 {
        crate::ds4_progress();
    }
    for v in job.flavor.opening(&meta) {
        if tx.send(job.flavor.sse(&v)).await.is_err() {
            return;
        }
    }
    let prompt_ms = ms_since(t0);
    let t1 = Instant::now();
    let mut pace = Pace::new();
    for i in 0..job.plan.len() {
        engine.before_token(i, &mut pace).await;
        if ds4 && engine.stopping() {
            // ds4-server writes nothing more once stopping: the stream ends, no [DONE].
            return;
        }
        let event = job.flavor.sse(&job.flavor.chunk(&meta, &job.plan.token(i)));
        if tx.send(event).await.is_err() {
            return;
        }
        engine.after_token(i, &mut pace).await;
    }
    let timings = Timings {
        cache_n: 0,
        prompt_n: job.prompt_n,
        prompt_ms,
        predicted_n: job.plan.len(),
        predicted_ms: ms_since(t1),
    };
    let content: String = (0..job.plan.len()).map(|i| job.plan.token(i)).collect();
    for v in job
        .flavor
        .closing(&meta, &content, job.plan.finish(), &timings)
    {
        if tx.send(job.flavor.sse(&v)).await.is_err() {
            return;
        }
    }
    if job.flavor.ends_with_done() {
        let _ = tx.send(gen::sse_done()).await;
    }
}

/// Waits out `--prefill-ms` (measured from the request's arrival). In ds4 mode
/// an SSE comment `: prefill` goes out every `--prefill-comment-ms` meanwhile.
/// Returns false if the client went away.
async fn prefill(engine: &Engine, tx: &mpsc::Sender<Bytes>, t0: Instant) -> bool {
    let total = Duration::from_millis(engine.cfg.prefill_ms);
    let every = Duration::from_millis(engine.cfg.prefill_comment_ms);
    let comments = engine.cfg.mode == Mode::Ds4 && !every.is_zero();
    loop {
        let elapsed = t0.elapsed();
        if elapsed >= total {
            return true;
        }
        let left = total - elapsed;
        if !comments {
            tokio::time::sleep(left).await;
            return true;
        }
        if left <= every {
            tokio::time::sleep(left).await;
            return true;
        }
        tokio::time::sleep(every).await;
        if tx.send(gen::sse_comment("prefill")).await.is_err() {
            return false;
        }
    }
}
