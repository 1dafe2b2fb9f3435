//! Access to the HTTP front, end to end against the fake engine: API keys
//! (`api.api_keys_file`) and the request body limit (`api.max_body`).

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::*;
use bytes::Bytes;
use dsv4_client::State;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;

const KEY: &str = "sk-dsv4-test-0123456789abcdef";
const SECOND_KEY: &str = "sk-second-key";

/// `dsv4d` with `setup`'s `api:` keys, listening on `--listen 127.0.0.1:0`.
fn api_daemon(setup: Setup) -> Daemon {
    Daemon::start(&setup.listen_flag())
}

fn keys_setup() -> Setup {
    Setup::default().api_keys_file(
        "# keys for the tests\n\n  sk-dsv4-test-0123456789abcdef  \nsk-second-key\n",
        0o600,
    )
}

fn keys_config() -> Daemon {
    api_daemon(keys_setup())
}

/// A daemon that has read its keys at its start; `change` is then done to its key file, and
/// a reload (of a setting unrelated to the keys) reads them again. (The keys are read once
/// per configuration: at the start, and at each reload.)
async fn keys_changed_then_reloaded(change: impl FnOnce(&Path)) -> Daemon {
    let d = keys_config();
    // The reload comes from the configuration's watcher: it must be watching first.
    d.log_with(&[
        "API keys required: 2 key(s)",
        "watching for configuration changes",
    ])
    .await;
    change(&key_file(&d));
    d.reconfigure(&keys_setup().engine("max_waiting", "255"))
        .await;
    d
}

fn key_file(d: &Daemon) -> PathBuf {
    d.dir().join(API_KEYS_FILE)
}

/// A chat completion with `headers`; status, headers and the body as JSON.
async fn chat_with(
    d: &Daemon,
    headers: &[(&str, &str)],
) -> (u16, hyper::HeaderMap, serde_json::Value) {
    d.send(
        "POST",
        "/v1/chat/completions",
        headers,
        Some(chat(3, false)),
    )
    .await
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
    assert_401("no key", &chat_with(&d, &[]).await, MISSING);
    for headers in [
        [("authorization", "Bearer sk-wrong-key")],
        [("x-api-key", "sk-wrong-key")],
        // A prefix of a right key is not the key.
        [("authorization", "Bearer sk-dsv4-test")],
        [("x-api-key", "sk-dsv4-test-0123456789abcdef0")],
    ] {
        let got = chat_with(&d, &headers).await;
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
        &chat_with(&d, &[("authorization", "Basic c2stZHN2NA==")]).await,
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
    assert_eq!(v["engine"], State::Stopped.as_str());
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
        let (status, _, v) = chat_with(&d, &headers).await;
        assert_eq!(status, 200, "{headers:?}: {v}");
        assert_eq!(v["choices"][0]["message"]["content"], "abc");
    }
    assert_eq!(d.spawns(), 1);
    let bearer = format!("Bearer {KEY}");
    let (status, _, v) = d
        .send("GET", "/status", &[("authorization", &bearer)], None)
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["state"], State::Ready.as_str());
    let (status, _, v) = d
        .send("GET", "/v1/models", &[("x-api-key", SECOND_KEY)], None)
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "list");
    // Keys are never logged.
    let log = d.log_with(&["API keys required: 2 key(s)"]).await;
    assert!(!log.contains(KEY) && !log.contains(SECOND_KEY), "{log}");
}

/// Asserts that the protected endpoints answer 503 with `why` in the message, that `/health`
/// stays open and that the daemon logged the problem once.
async fn assert_keys_unavailable(d: &Daemon, why: &str, said: usize) {
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
    // The daemon stays up, and said so `said` times whatever the requests (the reload's
    // check, and the keys' reader once).
    let (status, _, _) = d.send("GET", "/health", &[], None).await;
    assert_eq!(status, 200);
    assert_eq!(d.spawns(), 0);
    let log = d.log_with_count(why, said).await;
    assert_eq!(log.matches(why).count(), said, "{log}");
    assert!(!log.contains(KEY), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_made_world_readable_refuses_every_request_with_503() {
    let d = keys_changed_then_reloaded(|file| {
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap()
    })
    .await;
    let fix = format!("chmod 600 {}", key_file(&d).display());
    assert_keys_unavailable(&d, &fix, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_of_another_user_refuses_every_request_with_503() {
    // Mode 600, but another user's (nobody's): that user could change the keys.
    let d = keys_changed_then_reloaded(|file| {
        std::os::unix::fs::chown(file, Some(65534), None)
            .expect("chown the key file (the tests run as root)")
    })
    .await;
    let why = format!(
        "the API key file {} is owned by uid 65534, not by dsv4d's user",
        key_file(&d).display()
    );
    assert_keys_unavailable(&d, &why, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_than_one_credential_gets_400_even_with_the_right_key_among_them() {
    let d = keys_config();
    let bearer = format!("Bearer {KEY}");
    let guesses: Vec<(&str, &str)> = (0..96).map(|_| ("x-api-key", "sk-guess")).collect();
    for headers in [
        vec![
            ("authorization", bearer.as_str()),
            ("x-api-key", "sk-guess"),
        ],
        vec![("x-api-key", "sk-guess"), ("x-api-key", KEY)],
        [guesses.clone(), vec![("x-api-key", KEY)]].concat(),
    ] {
        let (status, _, v) = chat_with(&d, &headers).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "several_credentials", "{v}");
    }
    assert_eq!(d.spawns(), 0);
    // A short key is accepted, and warned about at load, by line.
    let (status, _, v) = chat_with(&d, &[("x-api-key", SECOND_KEY)]).await;
    assert_eq!(status, 200, "{v}");
    d.log_with(&[
        "the API key on line(s) 4 of",
        "is shorter than 16 characters",
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_gone_after_start_refuses_every_request_with_503() {
    let d = keys_changed_then_reloaded(|file| std::fs::remove_file(file).unwrap()).await;
    let why = format!("cannot open the API key file {}", key_file(&d).display());
    assert_keys_unavailable(&d, &why, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_max_body_with_a_length_gets_413_before_the_engine() {
    let d = api_daemon(Setup::default().api("max_body", "1KiB"));
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
    let (status, _, v) = chat_with(&d, &[]).await;
    assert_eq!(status, 200, "{v}");
}

/// A raw HTTP/1.1 connection sending a POST whose body goes out frame by frame, with no
/// Content-Length (chunked). Returns the response future's task and the frame sender.
async fn chunked_post(
    addr: SocketAddr,
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
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let resp = tokio::spawn(async move { sender.send_request(req).await });
    (resp, tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_over_max_body_gets_413() {
    let d = api_daemon(Setup::default().api("max_body", "1KiB"));
    let (resp, tx) = chunked_post(d.addr, "/v1/chat/completions").await;
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
    let resp = tokio::time::timeout(PATIENCE, resp)
        .await
        .expect("an answer while the body is still open")
        .unwrap()
        .expect("a response");
    let (status, _, v) = body_json(resp).await;
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_large");
    assert_eq!(
        v["error"]["message"],
        "the request body is larger than api.max_body (1024 bytes)"
    );
    drop(tx);
    // The daemon goes on serving.
    let (status, _, v) = chat_with(&d, &[]).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_within_max_body_goes_through() {
    let d = api_daemon(Setup::default().api("max_body", "1KiB"));
    let (resp, tx) = chunked_post(d.addr, "/echo").await;
    for _ in 0..4 {
        tx.send(Ok(Frame::data(Bytes::from("y".repeat(256)))))
            .await
            .unwrap();
    }
    drop(tx);
    let resp = tokio::time::timeout(PATIENCE, resp)
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
    let d = api_daemon(
        Setup::default()
            .api_keys_file("sk-dsv4-test-0123456789abcdef\n", 0o600)
            .api("max_body", "1KiB"),
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

/// Asks `/v1/models` with the right key until the answer has `status` (a reload is picked up
/// in the background); the last answer.
async fn models_until(d: &Daemon, status: u16) -> (u16, hyper::HeaderMap, serde_json::Value) {
    let t = std::time::Instant::now();
    loop {
        let got = d
            .send("GET", "/v1/models", &[("x-api-key", KEY)], None)
            .await;
        if got.0 == status || t.elapsed() > PATIENCE {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_file_made_unusable_then_a_reload_revokes_every_key_with_an_alert() {
    let bus = PrivateBus::start();
    let d = api_daemon(
        Setup::default()
            .api_keys_file(&format!("{KEY}\n"), 0o600)
            .session_bus(&bus),
    );
    let mut alerts = alert_stream(&bus, &d).await;
    let file = key_file(&d);
    let shown = file.display().to_string();
    let (status, _, v) = models_until(&d, 200).await;
    assert_eq!(status, 200, "{v}");

    let private = |mode| std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode));
    let write_keys = |text: &str| {
        std::fs::write(&file, text).unwrap();
        private(0o600).unwrap();
    };
    for what in ["mode 644", "deleted", "no key left"] {
        let why = match what {
            "mode 644" => {
                private(0o644).unwrap();
                format!("chmod 600 {shown}")
            }
            "deleted" => {
                std::fs::remove_file(&file).unwrap();
                format!("cannot open the API key file {shown}")
            }
            _ => {
                write_keys("# revoked\n");
                "holds no key".to_string()
            }
        };
        d.signal(nix::sys::signal::Signal::SIGHUP);
        // The key that worked a moment ago is refused, and not with the old keys' 200.
        let (status, headers, v) = models_until(&d, 503).await;
        assert_eq!(status, 503, "{what}: {v}");
        assert_eq!(v["error"]["code"], "api_keys_unavailable", "{what}: {v}");
        assert_eq!(v["error"]["type"], "unavailable_error", "{what}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(&why), "{what}: {message}");
        assert!(message.contains(&shown), "{what}: {message}");
        assert!(headers.contains_key("retry-after"), "{what}: {headers:?}");
        let args = next_alert(&mut alerts, &d).await;
        assert_eq!(args.kind, dsv4_client::AlertKind::Config, "{what}");
        assert!(args.message.contains(&why), "{what}: {}", args.message);
        // A good file back and a reload: the key works again.
        write_keys(&format!("{KEY}\n"));
        d.signal(nix::sys::signal::Signal::SIGHUP);
        let (status, _, v) = models_until(&d, 200).await;
        assert_eq!(status, 200, "{what}, fixed: {v}");
    }
    assert_eq!(d.spawns(), 0);
    assert!(!d.log().contains(KEY), "{}", d.log());
}

/// Sends `head` (a request without a body) on a fresh connection; the response's status
/// line and headers, as text.
async fn raw_request(addr: SocketAddr, head: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(PATIENCE, stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_and_trace_get_405_and_never_start_the_engine() {
    let d = api_daemon(Setup::default());
    let host = d.addr.to_string();
    for head in [
        format!("CONNECT {host} HTTP/1.1\r\nHost: {host}\r\n\r\n"),
        format!("TRACE /v1/models HTTP/1.1\r\nHost: {host}\r\n\r\n"),
    ] {
        let got = raw_request(d.addr, &head).await;
        assert!(got.starts_with("HTTP/1.1 405 "), "{head}: {got}");
        let allow = got
            .lines()
            .find_map(|l| l.strip_prefix("allow: "))
            .unwrap_or_else(|| panic!("no Allow: {got}"));
        assert!(
            allow.contains("POST") && !allow.contains("CONNECT"),
            "{got}"
        );
    }
    // The OpenAI error shape, for a method a client library could send.
    let (status, _, v) = d.send("TRACE", "/v1/chat/completions", &[], None).await;
    assert_eq!(status, 405, "{v}");
    assert_eq!(v["error"]["code"], "method_not_allowed", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(d.status().await["state"], State::Stopped.as_str());
    assert_eq!(d.spawns(), 0);
    assert!(!d.fake_log().contains("start pid="), "{}", d.fake_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_from_a_systemd_credential() {
    const KEY: &str = "sk-dsv4-credential-0123456789abcdef";
    // The folder as systemd hands it to the service ($CREDENTIALS_DIRECTORY): the service's
    // own, read-only, the file 0440 (systemd 254 and later show an ACL mask as group bits).
    let creds = temp_dir("credentials");
    let file = creds.path().join("api-keys");
    std::fs::write(&file, format!("{KEY}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o440)).unwrap();
    std::fs::set_permissions(creds.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
    let setup = Setup::default().api("api_keys_file", "credential:api-keys");
    let d = api_daemon(
        setup
            .clone()
            .daemon_env("CREDENTIALS_DIRECTORY", creds.path().to_str().unwrap()),
    );
    let (status, _, _) = chat_with(&d, &[]).await;
    assert_eq!(status, 401);
    let bearer = format!("Bearer {KEY}");
    let (status, _, body) = chat_with(&d, &[("authorization", &bearer)]).await;
    assert_eq!(status, 200, "{body}");

    // Without the credentials, dsv4d refuses to start and says what the unit needs...
    let config = d.dir().join("supervisor.yaml");
    let out = run_dsv4d(["--config", config.to_str().unwrap(), "--bus", "none"]);
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("api.api_keys_file: names the systemd credential \"api-keys\"")
            && err.contains("LoadCredential=api-keys:/etc/dsv4/api-keys"),
        "{err}"
    );
    // ...while a check by hand leaves the credential to the service's own check.
    let out = run_dsv4d(["--check-config", "--config", config.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("api.api_keys_file: the systemd credential \"api-keys\""),
        "{said}"
    );
    std::fs::set_permissions(creds.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
}

/// Keyless `GET /v1/models` for `within`: every status answered.
async fn keyless_for(d: &Daemon, within: Duration) -> Vec<u16> {
    let t = std::time::Instant::now();
    let mut out = Vec::new();
    while t.elapsed() < within {
        out.push(d.send("GET", "/v1/models", &[], None).await.0);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    out
}

/// The probe's two ways of losing the keys: the drop-in that sets `api.api_keys_file` moved
/// out of its folder, and rewritten slowly (read while half-written). Neither turns keys off:
/// keyless requests get 401 throughout, the refusal is logged and alerted, and the drop-in
/// back in place is taken again. Only a restart without the setting turns keys off, and that
/// start says so at warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_never_turns_keys_off() {
    let bus = PrivateBus::start();
    let keyed = Setup::default()
        .api_keys_file(&format!("{KEY}\n"), 0o600)
        .session_bus(&bus);
    let d = api_daemon(keyed);
    let mut alerts = alert_stream(&bus, &d).await;
    // The setting moves into a drop-in of its own, as `credential:` setups keep it.
    let folder = d.dir().join("supervisor.yaml.d");
    std::fs::create_dir(&folder).unwrap();
    let dropin = folder.join("10-keys.yaml");
    let text = format!("api:\n  api_keys_file: {API_KEYS_FILE}\n");
    replace_file(&dropin, &text);
    let plain = Setup::default().session_bus(&bus).listen_flag();
    replace_file(
        &d.dir().join("supervisor.yaml"),
        &d.config_text(&plain, "supervisor.yaml"),
    );
    let mut statuses = keyless_for(&d, Duration::from_secs(2)).await;
    let (status, _, v) = models_until(&d, 200).await;
    assert_eq!(status, 200, "{v}");

    // Moved out of the folder.
    let aside = d.dir().join("10-keys.yaml.aside");
    std::fs::rename(&dropin, &aside).unwrap();
    statuses.extend(keyless_for(&d, Duration::from_secs(2)).await);
    let refused = "it has no api.api_keys_file where the configuration in force has";
    d.log_with(&[refused, "keys are turned off only by a restart"])
        .await;
    let args = next_alert(&mut alerts, &d).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Config);
    assert!(args.message.contains(refused), "{}", args.message);
    std::fs::rename(&aside, &dropin).unwrap();
    statuses.extend(keyless_for(&d, Duration::from_secs(1)).await);

    // Rewritten slowly: half of it, a pause longer than the debounce, then the rest.
    let before = d.log().matches(refused).count();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&dropin).unwrap();
        f.write_all(b"api:\n").unwrap();
        f.sync_all().unwrap();
        statuses.extend(keyless_for(&d, Duration::from_millis(1500)).await);
        f.write_all(&text.as_bytes()["api:\n".len()..]).unwrap();
    }
    statuses.extend(keyless_for(&d, Duration::from_secs(2)).await);
    d.log_with_count(refused, before + 1).await;
    let let_through = statuses.iter().filter(|s| **s != 401).count();
    assert_eq!(let_through, 0, "{statuses:?}\n{}", d.log());
    let (status, _, v) = models_until(&d, 200).await;
    assert_eq!(status, 200, "{v}");

    // A restart without the setting: keys are off, and the start says so.
    std::fs::remove_file(&dropin).unwrap();
    let dir = d.stop().await;
    let d = Daemon::start_in(&plain, dir);
    d.log_with(&["api.api_keys_file is not set, where the configuration dsv4d ran with before"])
        .await;
    assert_eq!(d.send("GET", "/v1/models", &[], None).await.0, 200);
}
