//! A real-client soak through dsv4d in front of the real llama-server and the tiny model
//! (`support::real`): hundreds of requests of every kind a client sends, over the connection
//! patterns clients use, then real clients: the official `openai` Python package
//! (`tests/clients/openai_soak.py`) and curl. Every answer must be complete and exact, and come
//! within a second; the engine's connections must stay few.
//!
//! It guards against a proxy that reuses an engine connection llama-server has closed (it
//! closes the connection right after a streamed response): the request sent on it then hangs
//! or gets a 502. Every request is bounded to 5 s, so such a failure shows in seconds, and the
//! report names each failed request: its number, kind, and connection pattern.
//!
//! Needs, besides the real engine (`tests/engine/prepare`), curl and a python with the openai
//! package (`tests/clients/prepare`, which `.ci/run` runs and passes on as `DSV4_PYTHON`).
//! Without them the tests fail with the command that installs them: they never pass by
//! skipping.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::support::real::{self, LlamaServer};
use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

/// Bound on each request, from sending it to the last byte of its answer.
const PER_REQUEST: Duration = Duration::from_secs(5);
/// The tiny model answers in milliseconds; anything this slow is a stall (what a loaded
/// machine may add to the second, and no more: a lost connection's retry or an engine's idle
/// close takes 5 s).
const SLOW: Duration = Duration::from_secs(1).checked_add(LOAD_MARGIN).unwrap();
/// A pattern stops sending after this many failures (each may cost `PER_REQUEST`): enough to
/// show what goes wrong, and the whole soak still fails within about a minute.
const MAX_FAILURES: usize = 6;
/// Requests per pattern: (a) one keep-alive connection, (b) a fresh connection each,
/// (c) `CONCURRENCY` keep-alive connections at once.
const ONE_CONNECTION: usize = 120;
const FRESH_CONNECTIONS: usize = 80;
const CONCURRENT: usize = 160;
const CONCURRENCY: usize = 8;
/// Established connections to the engine's port, at most, at any moment of the run. The soak
/// never has more than `CONCURRENCY` (8) requests in flight, so a proxy that reuses its
/// connections needs 8 at once; the bound leaves as many again for connections the engine
/// has not yet closed, and is still far below the hundreds that a proxy holding on to one
/// connection per request would reach.
const MAX_ENGINE_CONNECTIONS: usize = 16;
/// openai_soak.py iterations (4 requests each), and requests in the one curl process.
const OPENAI_ITERATIONS: usize = 30;
const CURL_REQUESTS: usize = 40;

/// The tiny model's answers (see `tests/engine/make_tiny_gguf.py`).
const CHAT: &str = "abcdefgh";
/// `/completion` and `/v1/completions` with the prompt "count 5": the digits after 5, then stop.
const COUNT_PROMPT: &str = "count 5";
const COUNTED: &str = "6789";

const OPENAI_SOAK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/openai_soak.py");

/// The engine computes on one thread: ggml's threads wait for each other spinning, and on a
/// busy machine one that is not scheduled stalls a token for many milliseconds. What the soak
/// measures is the proxy, not that.
const ENGINE_ARGS: [&str; 4] = ["-t", "1", "-tb", "1"];

/// The two tests start engines of their own; run one at a time, so that neither slows the
/// other's requests.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    ChatStream,
    Chat,
    Completions,
    Completion,
    Models,
    Tokenize,
}

use Kind::*;

/// The mix, repeated: every other request is a stream, since what follows a stream is what a
/// proxy gets wrong.
const MIX: [Kind; 10] = [
    ChatStream,
    Chat,
    ChatStream,
    Completions,
    ChatStream,
    Completion,
    ChatStream,
    Models,
    ChatStream,
    Tokenize,
];

impl Kind {
    fn of(n: usize) -> Kind {
        MIX[n % MIX.len()]
    }

    fn describe(self) -> &'static str {
        match self {
            ChatStream => "streamed POST /v1/chat/completions",
            Chat => "POST /v1/chat/completions",
            Completions => "POST /v1/completions",
            Completion => "POST /completion",
            Models => "GET /v1/models",
            Tokenize => "POST /tokenize",
        }
    }

    fn path(self) -> &'static str {
        match self {
            ChatStream | Chat => "/v1/chat/completions",
            Completions => "/v1/completions",
            Completion => "/completion",
            Models => "/v1/models",
            Tokenize => "/tokenize",
        }
    }

    fn body(self) -> Option<Value> {
        let chat = |stream| {
            json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                   "temperature": 0, "stream": stream})
        };
        match self {
            ChatStream => Some(chat(true)),
            Chat => Some(chat(false)),
            Completions => Some(json!({"prompt": COUNT_PROMPT, "max_tokens": 8, "temperature": 0})),
            Completion => Some(json!({"prompt": COUNT_PROMPT, "n_predict": 8, "temperature": 0})),
            Models => None,
            Tokenize => Some(json!({"content": "hello world"})),
        }
    }

    fn request(self, host: &str) -> hyper::Request<Full<Bytes>> {
        let b = hyper::Request::builder()
            .uri(self.path())
            .header("host", host);
        match self.body() {
            None => b.method("GET").body(Full::default()),
            Some(body) => b
                .method("POST")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body.to_string()))),
        }
        .unwrap()
    }

    /// Checks a complete 200 answer; `tokens` holds the first `/tokenize` answer, which every
    /// later one must repeat.
    fn check(self, body: &str, tokens: &OnceLock<Value>) -> Result<(), String> {
        if self == ChatStream {
            return check_chat_stream(body);
        }
        let v: Value = serde_json::from_str(body).map_err(|e| format!("not JSON ({e})"))?;
        let (got, want) = match self {
            ChatStream => unreachable!(),
            Chat => (&v["choices"][0]["message"]["content"], CHAT),
            Completions => (&v["choices"][0]["text"], COUNTED),
            Completion => {
                if v["stop"] != true {
                    return Err("\"stop\" is not true".into());
                }
                (&v["content"], COUNTED)
            }
            Models => {
                let ids: Vec<_> = v["data"].as_array().into_iter().flatten().collect();
                return match ids.iter().any(|m| m["id"] == "tiny") {
                    true => Ok(()),
                    false => Err("no model \"tiny\" in \"data\"".into()),
                };
            }
            Tokenize => {
                let t = &v["tokens"];
                if t.as_array().is_none_or(|a| a.is_empty()) {
                    return Err("\"tokens\" is not a non-empty list".into());
                }
                let first = tokens.get_or_init(|| t.clone());
                return match first == t {
                    true => Ok(()),
                    false => Err(format!("tokens {t}, the first answer said {first}")),
                };
            }
        };
        match got.as_str() == Some(want) {
            true => Ok(()),
            false => Err(format!("text {got}, expected {want:?}")),
        }
    }
}

/// An OpenAI chat stream: `data:` events whose deltas make `CHAT`, then `data: [DONE]` last.
fn check_chat_stream(body: &str) -> Result<(), String> {
    let mut content = String::new();
    let mut done = false;
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let Some(data) = event.strip_prefix("data: ") else {
            return Err(format!("not a data event: {event:?}"));
        };
        if done {
            return Err("an event after [DONE]".into());
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("event not JSON ({e})"))?;
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
    }
    if content != CHAT {
        return Err(format!("streamed content {content:?}, expected {CHAT:?}"));
    }
    if !done {
        return Err("the stream ended without data: [DONE]".into());
    }
    Ok(())
}

/// At most `n` characters of `s`, for messages.
fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}... ({} bytes)", &s[..i], s.len()),
        None => s.to_string(),
    }
}

/// One request's fate.
struct Outcome {
    /// The request's number in the whole soak (which also gives its kind).
    n: usize,
    kind: Kind,
    /// The connection pattern, and which connection of it.
    pattern: String,
    took: Duration,
    error: Option<String>,
}

impl Outcome {
    fn line(&self) -> String {
        format!(
            "request #{} ({}, {}) after {:.3} s: {}",
            self.n,
            self.kind.describe(),
            self.pattern,
            self.took.as_secs_f64(),
            self.error.as_deref().unwrap_or("ok")
        )
    }
}

/// One client connection to dsv4d, driven by a task of its own.
struct Conn {
    send: SendRequest<Full<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn connect(addr: SocketAddr) -> Result<Conn, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("cannot connect to dsv4d: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (send, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake failed: {e}"))?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(Conn { send, task })
}

/// Why an exchange failed, and whether its connection can carry another request.
struct Failed {
    why: String,
    conn_usable: bool,
}

/// One request and its whole answer on `conn`.
async fn exchange(
    conn: &mut Conn,
    kind: Kind,
    host: &str,
    tokens: &OnceLock<Value>,
) -> Result<(), Failed> {
    let broken = |why: String| Failed {
        why,
        conn_usable: false,
    };
    conn.send
        .ready()
        .await
        .map_err(|e| broken(format!("the keep-alive connection to dsv4d is closed: {e}")))?;
    let resp = conn
        .send
        .send_request(kind.request(host))
        .await
        .map_err(|e| broken(format!("no response: {e}")))?;
    let status = resp.status();
    let ctype = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| broken(format!("status {status}, then the body broke off: {e}")))?
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    let failed = |why: String| Failed {
        why: format!("{why}; body: {}", clip(&body, 300)),
        conn_usable: true,
    };
    if status != 200 {
        return Err(failed(format!("status {status}")));
    }
    if kind == ChatStream && !ctype.starts_with("text/event-stream") {
        return Err(failed(format!("content-type {ctype:?}")));
    }
    kind.check(&body, tokens).map_err(failed)
}

/// What the patterns share.
struct Soak {
    addr: SocketAddr,
    host: String,
    tokens: OnceLock<Value>,
}

/// Sends requests `numbers` one after another: all on one keep-alive connection
/// (`fresh: false`), or each on a connection of its own. A keep-alive connection that breaks
/// is replaced, and the request that found it broken counts as failed. Stops after
/// `MAX_FAILURES` failures of its pattern (`failures`).
async fn sequence(
    soak: &Soak,
    pattern: &str,
    numbers: Vec<usize>,
    fresh: bool,
    failures: &AtomicUsize,
) -> Vec<Outcome> {
    let mut out = Vec::new();
    let mut conn: Option<Conn> = None;
    let mut opened = 0;
    for n in numbers {
        if failures.load(Ordering::Relaxed) >= MAX_FAILURES {
            break;
        }
        let kind = Kind::of(n);
        let t = Instant::now();
        let result = tokio::time::timeout(PER_REQUEST, async {
            if conn.is_none() {
                let c = connect(soak.addr).await.map_err(|why| Failed {
                    why,
                    conn_usable: false,
                })?;
                conn = Some(c);
                opened += 1;
            }
            exchange(conn.as_mut().unwrap(), kind, &soak.host, &soak.tokens).await
        })
        .await;
        let took = t.elapsed();
        let label = if fresh {
            pattern.to_string()
        } else {
            format!("{pattern}, connection {opened}")
        };
        let error = match result {
            Ok(Ok(())) => None,
            Ok(Err(f)) => {
                if !f.conn_usable {
                    conn = None;
                }
                Some(f.why)
            }
            Err(_) => {
                conn = None;
                Some(format!(
                    "no complete answer within {} s",
                    PER_REQUEST.as_secs()
                ))
            }
        };
        if error.is_some() {
            failures.fetch_add(1, Ordering::Relaxed);
        }
        if fresh {
            conn = None;
        }
        out.push(Outcome {
            n,
            kind,
            pattern: label,
            took,
            error,
        });
    }
    out
}

/// Samples, until stopped, the established TCP connections on the engine's port: the
/// engine's ends (local port = the engine's) and dsv4d's ends (remote port = the engine's,
/// in any state but TIME_WAIT and CLOSE: what dsv4d still holds).
struct Sampler {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(usize, usize, usize)>,
}

impl Sampler {
    fn start(port: u16) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut engine_max, mut held_max, mut samples) = (0, 0, 0);
            while !flag.load(Ordering::Relaxed) {
                let t = Instant::now();
                let (engine, held) = tcp_on_port(port);
                engine_max = engine_max.max(engine);
                held_max = held_max.max(held);
                samples += 1;
                // The tables list every socket of the machine, TIME_WAIT ones too, and may be
                // long: reading them takes at most a fifth of one core from the soak.
                std::thread::sleep((t.elapsed() * 4).max(Duration::from_millis(2)));
            }
            (engine_max, held_max, samples)
        });
        Sampler { stop, thread }
    }

    /// (most engine-side connections, most dsv4d-side ones, samples taken)
    fn finish(self) -> (usize, usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// From /proc/net/tcp{,6}: (established sockets on local port `port`, sockets to remote port
/// `port` that are not yet closed).
fn tcp_on_port(port: u16) -> (usize, usize) {
    const ESTABLISHED: &str = "01";
    const TIME_WAIT: &str = "06";
    const CLOSE: &str = "07";
    let port_of = |addr: &str| {
        addr.rsplit(':')
            .next()
            .and_then(|p| u16::from_str_radix(p, 16).ok())
    };
    let (mut engine, mut held) = (0, 0);
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 4 {
                continue;
            }
            if port_of(f[1]) == Some(port) && f[3] == ESTABLISHED {
                engine += 1;
            }
            if port_of(f[2]) == Some(port) && f[3] != TIME_WAIT && f[3] != CLOSE {
                held += 1;
            }
        }
    }
    (engine, held)
}

/// The port dsv4d gave the engine: `--port N` in its argv.
fn engine_port(pid: i64) -> u16 {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    args.iter()
        .position(|a| a == "--port")
        .and_then(|i| args.get(i + 1))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no --port N in engine {pid}'s argv: {args:?}"))
}

/// The python that runs openai_soak.py: `DSV4_PYTHON`, or the venv `tests/clients/prepare`
/// makes. Fails, with how to get one, when it has no openai package.
pub fn python() -> PathBuf {
    let python = std::env::var_os("DSV4_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| real::cache_dir_of("clients").join("venv/bin/python"));
    let ok = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .stdin(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "no python with the openai package at {}: run tests/clients/prepare (it makes that \
         venv and prints python=PATH; .ci/run passes it on as DSV4_PYTHON)",
        python.display()
    );
    python
}

/// Fails, with how to install it, when there is no curl.
pub fn need_curl() {
    let ok = std::process::Command::new("curl")
        .arg("--version")
        .stdout(Stdio::null())
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "curl not found: install it (apt-get install -y curl; .ci/run does)"
    );
}

/// What a client process did.
pub struct ClientRun {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl ClientRun {
    pub fn explain(&self) -> String {
        format!(
            "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status,
            clip(&self.stdout, 4000),
            clip(&self.stderr, 4000)
        )
    }
}

/// Runs a client process to its end, killing it after `within`.
pub async fn run_client(
    mut cmd: tokio::process::Command,
    within: Duration,
) -> Result<ClientRun, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| format!("cannot start: {e}"))?;
    let out = tokio::time::timeout(within, child.wait_with_output())
        .await
        .map_err(|_| format!("still running after {} s (killed)", within.as_secs()))?
        .map_err(|e| format!("cannot wait for it: {e}"))?;
    Ok(ClientRun {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// openai_soak.py against `base` (`http://HOST:PORT`): its summary line, or why it failed.
async fn openai_soak(python: &Path, base: &str) -> Result<String, String> {
    openai_soak_with(
        python,
        base,
        OPENAI_ITERATIONS,
        &[],
        Duration::from_secs(120),
    )
    .await
}

/// openai_soak.py against `base` for `iterations`, with `more` arguments (`ds4`), killed
/// after `within`: its summary line, or why it failed.
pub async fn openai_soak_with(
    python: &Path,
    base: &str,
    iterations: usize,
    more: &[&str],
    within: Duration,
) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg("-B")
        .arg(OPENAI_SOAK)
        .arg(format!("{base}/v1"))
        .arg(iterations.to_string())
        .args(more);
    // Every request is bounded to 5 s and the script stops at the first failure.
    let run = run_client(cmd, within).await?;
    match run.status.success() {
        true => Ok(run.stdout.trim().to_string()),
        false => Err(run.explain()),
    }
}

/// What the one curl process did.
struct CurlRun {
    outcomes: Vec<Outcome>,
    /// Connections curl opened for all its requests.
    connects: usize,
}

const CURL_MARK: &str = "\n@@dsv4-soak ";

/// One curl process sending `CURL_REQUESTS` chat requests to `base`, alternately streamed and
/// plain, separated by `--next`, so that curl sends them one after another on the connection
/// it keeps; each bounded by `--max-time 5`. `--fail-early` stops it at the first transfer
/// that fails (a timeout, a broken connection).
async fn curl_soak(base: &str) -> Result<CurlRun, String> {
    need_curl();
    let url = format!("{base}/v1/chat/completions");
    let write_out = format!(
        "{CURL_MARK}code=%{{http_code}} connects=%{{num_connects}} time=%{{time_total}} \
         exit=%{{exitcode}} error=%{{errormsg}}\n"
    );
    let mut cmd = tokio::process::Command::new("curl");
    cmd.arg("--fail-early");
    for i in 0..CURL_REQUESTS {
        if i > 0 {
            cmd.arg("--next");
        }
        let body = if i % 2 == 0 { ChatStream } else { Chat }.body().unwrap();
        cmd.args(["-sS", "--max-time", &PER_REQUEST.as_secs().to_string()])
            .args(["-H", "Content-Type: application/json"])
            .args(["--data-binary", &body.to_string()])
            .args(["-w", &write_out, &url]);
    }
    let within = PER_REQUEST * CURL_REQUESTS as u32 + Duration::from_secs(10);
    // A failed transfer makes curl exit non-zero; its write-out line says which.
    let run = run_client(cmd, within).await?;
    let (stdout, stderr) = (run.stdout.as_str(), run.stderr.as_str());
    let mut outcomes = Vec::new();
    let mut connects = 0;
    let mut rest = stdout;
    for i in 0..CURL_REQUESTS {
        let kind = if i % 2 == 0 { ChatStream } else { Chat };
        let pattern = "one curl process, requests separated by --next".to_string();
        let Some((body, after)) = rest.split_once(CURL_MARK) else {
            outcomes.push(Outcome {
                n: i,
                kind,
                pattern,
                took: Duration::ZERO,
                error: Some(format!(
                    "curl never got to it; curl: {}",
                    clip(stderr, 2000)
                )),
            });
            break;
        };
        let (stats, after) = after.split_once('\n').unwrap_or((after, ""));
        rest = after;
        let field = |name: &str| {
            stats
                .split_whitespace()
                .find_map(|f| f.strip_prefix(&format!("{name}=")))
                .unwrap_or("")
                .to_string()
        };
        connects += field("connects").parse::<usize>().unwrap_or(0);
        let took = Duration::from_secs_f64(field("time").parse().unwrap_or(0.0));
        let error = if field("exit") != "0" {
            Some(format!(
                "curl failed: exit {}: {}",
                field("exit"),
                stats.split_once("error=").map_or("", |s| s.1)
            ))
        } else if field("code") != "200" {
            Some(format!(
                "status {}; body: {}",
                field("code"),
                clip(body, 300)
            ))
        } else {
            kind.check(body, &OnceLock::new())
                .err()
                .map(|e| format!("{e}; body: {}", clip(body, 300)))
        };
        outcomes.push(Outcome {
            n: i,
            kind,
            pattern,
            took,
            error,
        });
    }
    Ok(CurlRun { outcomes, connects })
}

/// The requests that failed and those slower than `SLOW`, one line each.
fn problems(outcomes: &[Outcome]) -> (Vec<String>, Vec<String>) {
    let failed = outcomes
        .iter()
        .filter(|o| o.error.is_some())
        .map(Outcome::line)
        .collect();
    let slow = outcomes
        .iter()
        .filter(|o| o.error.is_none() && o.took > SLOW)
        .map(Outcome::line)
        .collect();
    (failed, slow)
}

fn summary(name: &str, outcomes: &[Outcome]) -> String {
    let failed = outcomes.iter().filter(|o| o.error.is_some()).count();
    let slowest = outcomes.iter().map(|o| o.took).max().unwrap_or_default();
    format!(
        "{name}: {} requests, {failed} failed, slowest {:.3} s",
        outcomes.len(),
        slowest.as_secs_f64()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_request_kind_over_every_connection_pattern_and_real_clients_through_dsv4d() {
    let _one = ONE_AT_A_TIME.lock().await;
    need_curl();
    let python = python();
    // Long enough that the engine is never stopped for idleness during the soak.
    let d = Daemon::start(&real::setup_with_args(&ENGINE_ARGS).engine("idle_timeout", "1h"));

    // The first request starts the engine: it has more than a second, and is not counted.
    let warm = tokio::time::timeout(
        Duration::from_secs(30),
        d.post("/v1/chat/completions", chat(8, false)),
    )
    .await
    .unwrap_or_else(|_| panic!("the engine did not answer within 30 s:\n{}", d.log()));
    let (status, _, v) = body_json(warm).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    assert_eq!(v["choices"][0]["message"]["content"], CHAT, "{v}");
    let before = d.status().await;
    let pid = before["engine_pid"].as_i64().expect("engine_pid");
    let port = engine_port(pid);
    // The engine takes its generation's secret and nothing else, so every request below
    // passes through dsv4d's credential handling, and the openai package's own key
    // (`sk-unused`) must not reach it.
    let seen = EngineSeen::of_pid(pid);
    assert!(
        seen.secret.is_some(),
        "no --api-key-file in {:?}",
        seen.argv
    );
    let direct = seen.send("GET", "/v1/models", &[], None).await;
    assert_eq!(direct.0, 401, "straight to the engine: {}", direct.2);
    let sampler = Sampler::start(port);

    let soak = Arc::new(Soak {
        addr: d.addr,
        host: d.addr.to_string(),
        tokens: OnceLock::new(),
    });
    let started = Instant::now();
    let mut report = String::new();
    let mut all = Vec::new();

    // (a) one after another on one keep-alive connection.
    let failures = AtomicUsize::new(0);
    let a = sequence(
        &soak,
        "pattern a: one keep-alive connection",
        (0..ONE_CONNECTION).collect(),
        false,
        &failures,
    )
    .await;
    writeln!(report, "{}", summary("a: one keep-alive connection", &a)).unwrap();
    all.extend(a);

    // (b) one after another, each on a fresh connection.
    let first = ONE_CONNECTION;
    let failures = AtomicUsize::new(0);
    let b = sequence(
        &soak,
        "pattern b: a fresh connection each",
        (first..first + FRESH_CONNECTIONS).collect(),
        true,
        &failures,
    )
    .await;
    writeln!(report, "{}", summary("b: a fresh connection each", &b)).unwrap();
    all.extend(b);

    // (c) CONCURRENCY at a time, each task on a keep-alive connection of its own, sending a
    // run of consecutive numbers, so that each gets the whole mix.
    let first = ONE_CONNECTION + FRESH_CONNECTIONS;
    let per_task = CONCURRENT / CONCURRENCY;
    let failures = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|t| {
            let soak = soak.clone();
            let failures = failures.clone();
            let numbers = (first + t * per_task..first + (t + 1) * per_task).collect();
            tokio::spawn(async move {
                let pattern =
                    format!("pattern c: {CONCURRENCY} concurrent keep-alive connections, task {t}");
                sequence(&soak, &pattern, numbers, false, &failures).await
            })
        })
        .collect();
    let mut c = Vec::new();
    for t in tasks {
        c.extend(t.await.unwrap());
    }
    c.sort_by_key(|o| o.n);
    writeln!(
        report,
        "{}",
        summary(
            &format!("c: {CONCURRENCY} concurrent keep-alive connections"),
            &c
        )
    )
    .unwrap();
    all.extend(c);
    let patterns_took = started.elapsed();

    // Real clients.
    let base = format!("http://{}", d.addr);
    let t = Instant::now();
    let openai = openai_soak(&python, &base).await;
    let openai_took = t.elapsed();
    let t = Instant::now();
    let curl = curl_soak(&base).await;
    let curl_took = t.elapsed();

    let (engine_max, held_max, samples) = sampler.finish();
    let after = d.status().await;

    let (failed, slow) = problems(&all);
    let mut errors = Vec::new();
    if !failed.is_empty() {
        errors.push(format!(
            "{} of {} requests failed:\n  {}",
            failed.len(),
            all.len(),
            failed.join("\n  ")
        ));
    }
    if !slow.is_empty() {
        errors.push(format!(
            "{} requests took more than {} s:\n  {}",
            slow.len(),
            SLOW.as_secs(),
            slow.join("\n  ")
        ));
    }
    let planned = ONE_CONNECTION + FRESH_CONNECTIONS + CONCURRENT;
    if all.len() < planned {
        errors.push(format!(
            "only {} of {planned} requests were sent: a pattern stops after {MAX_FAILURES} \
             failures",
            all.len()
        ));
    }
    match &openai {
        Ok(line) => writeln!(
            report,
            "openai ({:.3} s): {line}",
            openai_took.as_secs_f64()
        )
        .unwrap(),
        Err(e) => errors.push(format!(
            "the openai client (openai_soak.py {base}/v1 {OPENAI_ITERATIONS}) failed: {e}"
        )),
    }
    match &curl {
        Ok(run) => {
            writeln!(
                report,
                "{} ({:.3} s), {} connections opened",
                summary("curl --next", &run.outcomes),
                curl_took.as_secs_f64(),
                run.connects
            )
            .unwrap();
            let (failed, slow) = problems(&run.outcomes);
            if !failed.is_empty() || run.outcomes.len() < CURL_REQUESTS {
                errors.push(format!(
                    "curl: {} of {CURL_REQUESTS} requests failed or were not sent \
                     (--fail-early stops at a failed transfer):\n  {}",
                    CURL_REQUESTS - (run.outcomes.len() - failed.len()),
                    failed.join("\n  ")
                ));
            }
            if !slow.is_empty() {
                errors.push(format!(
                    "curl: {} requests took more than {} s:\n  {}",
                    slow.len(),
                    SLOW.as_secs(),
                    slow.join("\n  ")
                ));
            }
        }
        Err(e) => errors.push(format!("curl failed: {e}")),
    }
    writeln!(
        report,
        "engine port {port}: at most {engine_max} established connections \
         (dsv4d held at most {held_max}), {samples} samples; patterns took {:.3} s",
        patterns_took.as_secs_f64()
    )
    .unwrap();
    if engine_max > MAX_ENGINE_CONNECTIONS {
        errors.push(format!(
            "the engine had {engine_max} established connections at once, more than \
             {MAX_ENGINE_CONNECTIONS}"
        ));
    }
    if after["engine_pid"] != before["engine_pid"] || after["generation"] != before["generation"] {
        errors.push(format!(
            "the engine was restarted during the soak: pid {} generation {} -> pid {} \
             generation {}; last error: {}",
            before["engine_pid"],
            before["generation"],
            after["engine_pid"],
            after["generation"],
            after["last_error"]
        ));
    }
    if errors.is_empty() {
        println!("{report}");
    }
    assert!(
        errors.is_empty(),
        "soak through dsv4d failed:\n{report}\n{}\n\n--- dsv4d's own log (without the engine's \
         output and the requests done), last 40 lines ---\n{}",
        errors.join("\n\n"),
        own_log_tail(&d.log(), 40)
    );
}

/// The last `n` lines dsv4d logged itself, without the engine output it passes on and the
/// line for each request done.
fn own_log_tail(log: &str, n: usize) -> String {
    let own: Vec<&str> = log
        .lines()
        .filter(|l| !l.contains(" stream=\"") && !l.contains(" request done "))
        .collect();
    own[own.len().saturating_sub(n)..].join("\n")
}

/// The clients and their checks against llama-server itself, no dsv4d in between: proof that
/// what the soak expects is what the engine answers, so a soak failure is dsv4d's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_clients_pass_against_llama_server_alone() {
    let _one = ONE_AT_A_TIME.lock().await;
    need_curl();
    let python = python();
    let engine = LlamaServer::start_with_args(&ENGINE_ARGS);
    // Not dsv4d: it lists the model file, not the profile "tiny"; the script takes what it lists.
    let line = openai_soak(&python, &engine.url)
        .await
        .unwrap_or_else(|e| panic!("openai_soak.py against llama-server: {e}\n{}", engine.log()));
    println!("openai: {line}");
    let run = curl_soak(&engine.url)
        .await
        .unwrap_or_else(|e| panic!("curl against llama-server: {e}"));
    let (failed, slow) = problems(&run.outcomes);
    println!(
        "{}, {} connections opened",
        summary("curl --next", &run.outcomes),
        run.connects
    );
    assert!(
        failed.is_empty() && slow.is_empty() && run.outcomes.len() == CURL_REQUESTS,
        "curl against llama-server:\n  {}\n  {}",
        failed.join("\n  "),
        slow.join("\n  ")
    );
}
