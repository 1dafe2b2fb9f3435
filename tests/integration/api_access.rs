//! Access to the HTTP front, end to end against the fake engine: API keys
//! (`api.api_keys_file`) and the request body limit (`api.max_body`).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

const SEC: Duration = Duration::from_secs(1);
const KEY: &str = "sk-dsv4-test-0123456789abcdef";
const SECOND_KEY: &str = "sk-second-key";

/// A `dsv4d` whose `api:` block the test writes (the harness's `Daemon` writes supervisor.yaml
/// as it starts), listening on `--listen 127.0.0.1:0`.
struct ApiDaemon {
    child: Child,
    addr: String,
    dir: TempDir,
    fake_log: PathBuf,
    log: Arc<Mutex<String>>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A key file in the config folder with `text` and `mode`.
struct KeyFile {
    text: &'static str,
    mode: u32,
}

impl ApiDaemon {
    /// Starts `dsv4d` with `api_lines` (indented YAML) added to the `api:` block and, when
    /// given, a key file `api-keys` beside supervisor.yaml.
    fn start(api_lines: &str, keys: Option<KeyFile>) -> ApiDaemon {
        let dir = temp_dir("api");
        let fake_log = dir.path().join("fake-engine.log");
        let config = Setup::default().write(dir.path(), &fake_log);
        if let Some(k) = keys {
            let path = dir.path().join("api-keys");
            std::fs::write(&path, k.text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(k.mode)).unwrap();
        }
        let yaml = std::fs::read_to_string(&config).unwrap();
        let head = "api:\n  listen: 127.0.0.1:0\n";
        assert!(
            yaml.starts_with(head),
            "unexpected supervisor.yaml:\n{yaml}"
        );
        std::fs::write(
            &config,
            yaml.replacen(head, &format!("{head}{api_lines}"), 1),
        )
        .unwrap();

        let mut child = Command::new(DSV4D)
            .args(["--config", config.to_str().unwrap()])
            .args(["--bus", "none", "--listen", "127.0.0.1:0"])
            .env(
                "DSV4_LOG",
                std::env::var("DSV4_LOG").unwrap_or_else(|_| "debug".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dsv4d");
        let log = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    let _ = addr_tx.send(a.trim().to_string());
                }
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let addr = match addr_rx.recv_timeout(10 * SEC) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("dsv4d did not listen:\n{}", log.lock().unwrap());
            }
        };
        ApiDaemon {
            child,
            addr,
            dir,
            fake_log,
            log,
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    fn key_file(&self) -> PathBuf {
        self.dir.path().join("api-keys")
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn fake_log(&self) -> String {
        std::fs::read_to_string(&self.fake_log).unwrap_or_default()
    }

    fn spawns(&self) -> usize {
        self.fake_log()
            .lines()
            .filter(|l| l.starts_with("start pid="))
            .count()
    }

    /// Sends a request with `headers` (and a JSON body when given); returns status, headers
    /// and the body as JSON (or as a JSON string when it is not JSON).
    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<serde_json::Value>,
    ) -> (u16, hyper::HeaderMap, serde_json::Value) {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::default(),
        };
        let resp = self
            .client
            .request(req.body(body).unwrap())
            .await
            .expect("request");
        body_json(resp).await
    }

    async fn chat_with(
        &self,
        headers: &[(&str, &str)],
    ) -> (u16, hyper::HeaderMap, serde_json::Value) {
        self.send(
            "POST",
            "/v1/chat/completions",
            headers,
            Some(chat(3, false)),
        )
        .await
    }
}

impl Drop for ApiDaemon {
    fn drop(&mut self) {
        // Its engine goes with it (PR_SET_PDEATHSIG).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keys_config() -> ApiDaemon {
    ApiDaemon::start(
        "  api_keys_file: api-keys\n",
        Some(KeyFile {
            text: "# keys for the tests\n\n  sk-dsv4-test-0123456789abcdef  \nsk-second-key\n",
            mode: 0o600,
        }),
    )
}

/// Asserts a 401 in the OpenAI shape, with `message`.
fn assert_401(what: &str, got: &(u16, hyper::HeaderMap, serde_json::Value), message: &str) {
    let (status, headers, v) = got;
    assert_eq!(*status, 401, "{what}: {v}");
    assert_eq!(
        headers.get("www-authenticate").map(|h| h.to_str().unwrap()),
        Some("Bearer"),
        "{what}"
    );
    assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
    assert_eq!(v["error"]["code"], "invalid_api_key", "{what}: {v}");
    assert_eq!(v["error"]["message"], message, "{what}: {v}");
}

const MISSING: &str = "missing API key: send Authorization: Bearer <key> or x-api-key";
const INVALID: &str = "invalid API key";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_the_right_key_get_401_and_never_start_the_engine() {
    let d = keys_config();
    assert_401("no key", &d.chat_with(&[]).await, MISSING);
    for headers in [
        [("authorization", "Bearer sk-wrong-key")],
        [("x-api-key", "sk-wrong-key")],
        // A prefix of a right key is not the key.
        [("authorization", "Bearer sk-dsv4-test")],
        [("x-api-key", "sk-dsv4-test-0123456789abcdef0")],
    ] {
        let got = d.chat_with(&headers).await;
        assert_401(&format!("{headers:?}"), &got, INVALID);
        assert!(
            !got.2.to_string().contains("sk-wrong-key"),
            "the key was echoed: {}",
            got.2
        );
    }
    // Another auth scheme is not a key.
    assert_401(
        "basic",
        &d.chat_with(&[("authorization", "Basic c2stZHN2NA==")])
            .await,
        MISSING,
    );
    // The supervisor's own endpoints and everything proxied follow the key.
    for (method, path) in [
        ("GET", "/status"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/slots"),
        ("POST", "/health"),
    ] {
        assert_401(path, &d.send(method, path, &[], None).await, MISSING);
    }
    // /health stays open.
    let (status, _, v) = d.send("GET", "/health", &[], None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["engine"], "stopped");
    let (status, _, _) = d.send("HEAD", "/health", &[], None).await;
    assert_eq!(status, 200);

    assert_eq!(d.spawns(), 0, "a rejected request started the engine");
    assert!(!d.fake_log().contains("start pid="), "{}", d.fake_log());
    assert!(!d.fake_log().contains("request "), "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_key_in_either_header_is_let_through() {
    let d = keys_config();
    for headers in [
        [("authorization", "Bearer sk-dsv4-test-0123456789abcdef")],
        [("authorization", "bearer sk-second-key")],
        [("x-api-key", KEY)],
        [("x-api-key", SECOND_KEY)],
    ] {
        let (status, _, v) = d.chat_with(&headers).await;
        assert_eq!(status, 200, "{headers:?}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], "abc");
    }
    assert_eq!(d.spawns(), 1);
    let bearer = format!("Bearer {KEY}");
    let (status, _, v) = d
        .send("GET", "/status", &[("authorization", &bearer)], None)
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], "ready");
    let (status, _, v) = d
        .send("GET", "/v1/models", &[("x-api-key", SECOND_KEY)], None)
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    // Keys are never logged.
    let log = d.log();
    assert!(log.contains("API keys required: 2 key(s)"), "{log}");
    assert!(!log.contains(KEY) && !log.contains(SECOND_KEY), "{log}");
}

/// Asserts that the protected endpoints answer 503 with `why` in the message, that `/health`
/// stays open and that the daemon logged the problem once.
async fn assert_keys_unavailable(d: &ApiDaemon, why: &str) {
    let bearer = format!("Bearer {KEY}");
    for (method, path, body) in [
        ("POST", "/v1/chat/completions", Some(chat(3, false))),
        ("GET", "/status", None),
        ("GET", "/v1/models", None),
    ] {
        for headers in [vec![], vec![("authorization", bearer.as_str())]] {
            let (status, _, v) = d.send(method, path, &headers, body.clone()).await;
            assert_eq!(status, 503, "{path}: {v}");
            assert_eq!(v["error"]["code"], "api_keys_unavailable", "{v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(why), "{msg}");
        }
    }
    // The daemon stays up, and said so once.
    let (status, _, _) = d.send("GET", "/health", &[], None).await;
    assert_eq!(status, 200);
    assert_eq!(d.spawns(), 0);
    let log = d.log();
    assert_eq!(log.matches(why).count(), 1, "{log}");
    assert!(!log.contains(KEY), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_made_world_readable_refuses_every_request_with_503() {
    let d = keys_config();
    // The config loader checks the file at start; the keys are read at the first request.
    std::fs::set_permissions(d.key_file(), std::fs::Permissions::from_mode(0o644)).unwrap();
    let fix = format!("chmod 600 {}", d.key_file().display());
    assert_keys_unavailable(&d, &fix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_gone_after_start_refuses_every_request_with_503() {
    let d = keys_config();
    std::fs::remove_file(d.key_file()).unwrap();
    let why = format!("cannot open the API key file {}", d.key_file().display());
    assert_keys_unavailable(&d, &why).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_max_body_with_a_length_gets_413_before_the_engine() {
    let d = ApiDaemon::start("  max_body: 1KiB\n", None);
    let mut body = chat(3, false);
    body["messages"][0]["content"] = "x".repeat(4096).into();
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(body))
        .await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_large");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("api.max_body (1024 bytes)"), "{msg}");
    assert_eq!(d.spawns(), 0);
    let fake = d.fake_log();
    assert!(
        !fake.contains("request POST") && !fake.contains("start pid="),
        "{fake}"
    );
    // A body within the limit goes through.
    let (status, _, v) = d.chat_with(&[]).await;
    assert_eq!(status, 200, "{v}");
}

/// A raw HTTP/1.1 connection sending a POST whose body goes out frame by frame, with no
/// Content-Length (chunked). Returns the response future's task and the frame sender.
async fn chunked_post(
    addr: &str,
    path: &str,
) -> (
    tokio::task::JoinHandle<hyper::Result<hyper::Response<hyper::body::Incoming>>>,
    tokio::sync::mpsc::Sender<Result<Frame<Bytes>, std::convert::Infallible>>,
) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let req = hyper::Request::post(path)
        .header("host", addr)
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let resp = tokio::spawn(async move { sender.send_request(req).await });
    (resp, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_over_max_body_gets_413() {
    let d = ApiDaemon::start("  max_body: 1KiB\n", None);
    let (resp, tx) = chunked_post(&d.addr, "/v1/chat/completions").await;
    // 1000 bytes, then 100 more: over 1024. The body stays open, so that the daemon has read
    // all the client sent when it answers.
    let pad = "x".repeat(1000);
    let start = format!(r#"{{"max_tokens":3,"messages":[{{"role":"user","content":"{pad}"#);
    tx.send(Ok(Frame::data(Bytes::from(start[..1000].to_string()))))
        .await
        .unwrap();
    tx.send(Ok(Frame::data(Bytes::from("x".repeat(100)))))
        .await
        .unwrap();
    let resp = tokio::time::timeout(10 * SEC, resp)
        .await
        .expect("an answer while the body is still open")
        .unwrap()
        .expect("a response");
    let (status, _, v) = body_json(resp).await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_large");
    assert_eq!(
        v["error"]["message"],
        "request body larger than api.max_body (1024 bytes)"
    );
    drop(tx);
    // The daemon goes on serving.
    let (status, _, v) = d.chat_with(&[]).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_within_max_body_streams_through() {
    let d = ApiDaemon::start("  max_body: 1KiB\n", None);
    let (resp, tx) = chunked_post(&d.addr, "/echo").await;
    for _ in 0..4 {
        tx.send(Ok(Frame::data(Bytes::from("y".repeat(256)))))
            .await
            .unwrap();
    }
    drop(tx);
    let resp = tokio::time::timeout(10 * SEC, resp)
        .await
        .expect("an answer")
        .unwrap()
        .expect("a response");
    assert_eq!(resp.status(), 200);
    let echoed = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(echoed.len(), 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_before_the_body_limit() {
    let d = ApiDaemon::start(
        "  api_keys_file: api-keys\n  max_body: 1KiB\n",
        Some(KeyFile {
            text: "sk-dsv4-test-0123456789abcdef\n",
            mode: 0o600,
        }),
    );
    let mut body = chat(3, false);
    body["messages"][0]["content"] = "x".repeat(4096).into();
    let got = d
        .send("POST", "/v1/chat/completions", &[], Some(body.clone()))
        .await;
    assert_401("no key, big body", &got, MISSING);
    let (status, _, v) = d
        .send(
            "POST",
            "/v1/chat/completions",
            &[("x-api-key", KEY)],
            Some(body),
        )
        .await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(d.spawns(), 0);
}
