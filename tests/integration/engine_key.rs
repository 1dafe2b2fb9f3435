//! The engine's own key, against the fake engine playing llama-server: the engine's loopback
//! port, which every local user can see and connect to, answers 401 to anyone without the
//! secret dsv4d made for that engine generation; the secret sits in a private file, never on
//! the command line; a new engine gets a new one; and whatever credential a client sends stays
//! with dsv4d. (`real_engine.rs` checks the same against the real llama-server.)

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::State;
use serde_json::json;

/// The user the issue tested with: a local user who is not dsv4d's.
const NOBODY: u32 = 65534;
const CLIENT_KEY: &str = "sk-client-0123456789";

/// llama-server's refusal, as the real one writes it (the fake's keys are in another order).
pub fn assert_invalid_api_key(what: &str, got: &(u16, hyper::HeaderMap, serde_json::Value)) {
    let (status, _, v) = got;
    assert_eq!(*status, 401, "{what}: {v}");
    assert_eq!(
        *v,
        json!({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}),
        "{what}"
    );
}

/// Every way to ask the engine without its secret gets llama-server's 401; its health check
/// stays open, and the secret opens the rest.
pub async fn assert_only_the_secret_opens(e: &EngineSeen) {
    let secret = e.secret.as_deref().expect("a secret");
    let wrong = format!("Bearer {}", "0".repeat(secret.len()));
    for (what, headers) in [
        ("no credential", vec![]),
        ("a wrong key", vec![("authorization", wrong.as_str())]),
        ("a wrong x-api-key", vec![("x-api-key", wrong.as_str())]),
        (
            "a client's key",
            vec![("authorization", "Bearer sk-client")],
        ),
    ] {
        let got = e
            .send(
                "POST",
                "/v1/chat/completions",
                &headers,
                Some(chat(2, false)),
            )
            .await;
        assert_invalid_api_key(&format!("chat, {what}"), &got);
    }
    for path in ["/v1/models", "/props", "/slots", "/completion"] {
        assert_invalid_api_key(path, &e.send("GET", path, &[], None).await);
    }
    let (status, _, v) = e.send("GET", "/health", &[], None).await;
    assert_eq!(status, 200, "/health: {v}");
    let bearer = e.bearer();
    let (status, _, v) = e
        .send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", &bearer)],
            Some(chat(2, false)),
        )
        .await;
    assert_eq!(status, 200, "with the secret: {v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
}

/// The key file is 0600 and its folder 0700, both the daemon's (this test's) user's; the
/// secret has at least 128 bits, and shows nowhere a local user can look: not in the engine's
/// command line, not in dsv4d's log.
pub fn assert_kept_private(e: &EngineSeen, log: &str) {
    let file = e
        .key_file
        .as_deref()
        .expect("--api-key-file in the engine's argv");
    let secret = e.secret.as_deref().expect("a secret");
    let folder = file.parent().unwrap();
    let me = nix::unistd::geteuid().as_raw();
    let f = std::fs::symlink_metadata(file).unwrap();
    assert!(f.file_type().is_file(), "{}", file.display());
    assert_eq!(f.mode() & 0o7777, 0o600, "{}", file.display());
    assert_eq!(f.uid(), me);
    let d = std::fs::symlink_metadata(folder).unwrap();
    assert!(d.file_type().is_dir());
    assert_eq!(d.mode() & 0o7777, 0o700, "{}", folder.display());
    assert_eq!(d.uid(), me);
    assert!(
        secret.len() >= 32 && secret.bytes().all(|b| b.is_ascii_hexdigit()),
        "not 128 random bits in hex: {secret:?}"
    );
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", e.pid)).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(secret),
        "the secret is in the engine's command line: {:?}",
        e.argv
    );
    assert!(
        !e.argv.iter().any(|a| a == "--api-key"),
        "a key on the command line: {:?}",
        e.argv
    );
    assert!(!log.contains(secret), "the secret is in dsv4d's log");
}

/// Runs `program args` as uid/gid 65534; its exit status and what it printed.
fn as_nobody(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(program)
        .args(args)
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program} as uid {NOBODY}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Lets every user through `dir` and its parents up to the system temp folder, so that only
/// the key folder's own mode keeps another user out of it.
fn open_the_way_to(dir: &Path) {
    let tmp = std::env::temp_dir();
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| p.starts_with(&tmp) && *p != tmp) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        d = p.parent();
    }
}

/// The request lines in the fake engine's log that are not its readiness probe.
fn proxied_requests(d: &Daemon) -> Vec<String> {
    d.fake_log()
        .lines()
        .filter(|l| l.starts_with("request ") && !l.starts_with("request GET /health "))
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_port_answers_401_without_the_generation_secret() {
    let d = Daemon::start(&Setup::default());
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    let e = EngineSeen::of(&d).await;
    assert!(e.secret.is_some(), "no --api-key-file in {:?}", e.argv);
    assert_only_the_secret_opens(&e).await;
    assert_kept_private(&e, &d.log());
    assert_eq!(
        e.key_file.as_deref().unwrap(),
        d.dir().join("state/engine-keys/engine-1.key")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_local_user_can_neither_read_the_secret_nor_use_the_port() {
    let d = Daemon::start(&Setup::default());
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    let e = EngineSeen::of(&d).await;
    let file = e.key_file.clone().unwrap();
    let folder = file.parent().unwrap();
    // Every folder on the way is open; only the key folder's own mode is left.
    open_the_way_to(folder.parent().unwrap());
    let (listed, text) = as_nobody("ls", &[folder.parent().unwrap().to_str().unwrap()]);
    assert!(
        listed,
        "uid {NOBODY} cannot even list the state folder: {text}"
    );
    assert!(text.contains("engine-keys"), "{text}");
    let (read, text) = as_nobody("cat", &[file.to_str().unwrap()]);
    assert!(!read, "uid {NOBODY} read the engine's key: {text}");
    assert!(text.contains("Permission denied"), "{text}");
    let (listed, text) = as_nobody("ls", &[folder.to_str().unwrap()]);
    assert!(!listed, "uid {NOBODY} listed the key folder: {text}");
    // What it can read, the engine's command line, names the file but holds no key.
    let (read, cmdline) = as_nobody("cat", &[&format!("/proc/{}/cmdline", e.pid)]);
    assert!(read, "{cmdline}");
    assert!(cmdline.contains(file.to_str().unwrap()), "{cmdline}");
    assert!(!cmdline.contains(e.secret.as_deref().unwrap()), "{cmdline}");
    // And the port, which it can see, turns it away.
    let url = format!("http://{}/v1/models", e.addr);
    let (_, answer) = as_nobody("curl", &["-sS", "-w", "\n%{http_code}", &url]);
    assert!(answer.ends_with("\n401"), "uid {NOBODY} got: {answer}");
    assert!(answer.contains("Invalid API Key"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_engine_gets_a_new_secret_and_the_old_file_goes_with_the_old_engine() {
    let setup = Setup::default().engine("idle_timeout", "1s");
    let d = Daemon::start(&setup);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    let first = EngineSeen::of(&d).await;
    let old_file = first.key_file.clone().unwrap();
    assert!(old_file.exists());
    d.wait_state(State::Stopped, PATIENCE).await;
    // The daemon runs on; the stopped engine's key is gone with it.
    let t = Instant::now();
    while old_file.exists() {
        assert!(
            t.elapsed() < PATIENCE,
            "{} outlived its engine",
            old_file.display()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let folder = old_file.parent().unwrap();
    assert_eq!(std::fs::read_dir(folder).unwrap().count(), 0);

    // The second engine stays while it is tried directly (those requests are not leases).
    d.reconfigure(&setup.engine("idle_timeout", "1h")).await;
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    let second = EngineSeen::of(&d).await;
    assert_eq!(d.status().await["generation"], 2);
    assert_ne!(second.pid, first.pid);
    assert_ne!(second.key_file, first.key_file);
    assert_ne!(second.secret, first.secret);
    assert_kept_private(&second, &d.log());
    // The first engine's secret opens nothing now.
    let got = second
        .send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", &first.bearer())],
            Some(chat(1, false)),
        )
        .await;
    assert_invalid_api_key("the old generation's secret", &got);
    assert_only_the_secret_opens(&second).await;
    // The daemon's own exit takes the last key with it.
    let file = second.key_file.clone().unwrap();
    let dir = d.stop().await;
    assert!(!file.exists(), "{} outlived the daemon", file.display());
    drop(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_gets_its_secret_and_never_a_client_credential() {
    let secret_carried = |d: &Daemon, e: &EngineSeen| {
        let requests = proxied_requests(d);
        assert!(!requests.is_empty());
        let want = format!("authorization={:?} x-api-key=-", e.bearer());
        for line in &requests {
            assert!(line.ends_with(&want), "{line}\nwanted {want}");
        }
        let log = d.fake_log();
        assert!(
            !log.contains(CLIENT_KEY),
            "a client key reached the engine:\n{log}"
        );
        requests.len()
    };

    // With API keys: the client's key is checked, then replaced.
    let d = Daemon::start(&Setup::default().api_keys_file(&format!("{CLIENT_KEY}\n"), 0o600));
    let bearer = format!("Bearer {CLIENT_KEY}");
    for headers in [
        vec![("authorization", bearer.as_str())],
        vec![("x-api-key", CLIENT_KEY)],
    ] {
        let (status, _, v) = d
            .send(
                "POST",
                "/v1/chat/completions",
                &headers,
                Some(chat(3, false)),
            )
            .await;
        assert_eq!(status, 200, "{headers:?}: {v}");
    }
    let (_, _, status) = d
        .send("GET", "/status", &[("x-api-key", CLIENT_KEY)], None)
        .await;
    let e = EngineSeen::of_pid(status["engine_pid"].as_i64().expect("engine_pid"));
    assert_eq!(secret_carried(&d, &e), 2);

    // Without: whatever a client sends is dropped all the same, on every kind of request,
    // streams and requests on a connection the engine closed included (sent again).
    let d = Daemon::start(&Setup::default());
    let client_bearer = format!("Bearer {CLIENT_KEY}");
    let credentials = [
        ("authorization", client_bearer.as_str()),
        ("x-api-key", CLIENT_KEY),
    ];
    let mut conn = one_connection(d.addr).await;
    for i in 0..6 {
        let mut req = hyper::Request::post("/v1/chat/completions")
            .header("host", d.addr.to_string())
            .header("content-type", "application/json");
        for (k, v) in credentials {
            req = req.header(k, v);
        }
        let body = chat(3, i % 2 == 0).to_string();
        let req = req
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        conn.ready()
            .await
            .expect("the connection to dsv4d stays open");
        let (status, _, v) = body_json(conn.send_request(req).await.expect("answer")).await;
        assert_eq!(status, 200, "request {i}: {v}");
    }
    for (method, path) in [("GET", "/v1/models"), ("GET", "/slots"), ("GET", "/props")] {
        // `/v1/models` is dsv4d's own; the others reach the engine.
        let (status, _, v) = d.send(method, path, &credentials, None).await;
        assert_eq!(status, 200, "{path}: {v}");
    }
    let e = EngineSeen::of(&d).await;
    assert_eq!(secret_carried(&d, &e), 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_names_the_protection_and_ds4_gets_no_key() {
    let d = Daemon::start(&Setup::default());
    assert_eq!(d.status().await["engine_key"], "per-generation secret");
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(d.status().await["engine_key"], "per-generation secret");

    // ds4-server has no key option: it gets none, status says so, and still no client
    // credential reaches it.
    let d = Daemon::start(&Setup::default().ds4());
    assert_eq!(
        d.status().await["engine_key"],
        "none (ds4-server has no key option)"
    );
    let (status, _, v) = d
        .send(
            "POST",
            "/v1/chat/completions",
            &[
                ("authorization", "Bearer sk-client"),
                ("x-api-key", "sk-client"),
            ],
            Some(chat(2, false)),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let e = EngineSeen::of(&d).await;
    assert_eq!(e.key_file, None, "{:?}", e.argv);
    assert_eq!(
        d.status().await["engine_key"],
        "none (ds4-server has no key option)"
    );
    let requests = proxied_requests(&d);
    assert!(!requests.is_empty());
    for line in requests {
        assert!(line.ends_with(" authorization=- x-api-key=-"), "{line}");
    }
    let folder = d.dir().join("state/engine-keys");
    assert_eq!(std::fs::read_dir(folder).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_systemds_runtime_directory_the_keys_go_there() {
    let run = temp_dir("runtime");
    let d = Daemon::start(
        &Setup::default().daemon_env("RUNTIME_DIRECTORY", run.path().to_str().unwrap()),
    );
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    let e = EngineSeen::of(&d).await;
    assert_eq!(
        e.key_file.as_deref().unwrap(),
        run.path().join("engine-keys/engine-1.key")
    );
    assert_kept_private(&e, &d.log());
    assert!(!d.dir().join("state/engine-keys").exists());
}

/// Runs dsv4d on `dir`'s configuration until it exits (at most 10 s); its exit code and
/// stderr.
fn dsv4d_exit(dir: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(DSV4D)
        .arg("--config")
        .arg(dir.join("supervisor.yaml"))
        .args(["--listen", "127.0.0.1:0", "--bus", "none"])
        .env("DSV4_LOG", "off")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dsv4d");
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > PATIENCE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("dsv4d kept running with the key folder it should refuse");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    (status.code(), err)
}

#[test]
fn a_key_folder_that_is_not_private_stops_the_daemon_with_the_reason() {
    let dir = temp_dir("keys-open");
    let setup = Setup::default();
    setup.write(dir.path(), &dir.path().join("fake.log"));
    let folder = dir.path().join("state/engine-keys");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (code, err) = dsv4d_exit(dir.path());
    assert_eq!(code, Some(1), "{err}");
    let f = folder.display();
    assert!(
        err.contains(&format!(
            "dsv4d: refusing the engine key folder {f}: group or others may use it (mode \
             0755); run chmod 700 {f}"
        )),
        "{err}"
    );
    // Its mode is the owner's business: dsv4d leaves it as it found it.
    let mode = std::fs::metadata(&folder).unwrap().mode();
    assert_eq!(mode & 0o7777, 0o755);

    // Private, but another user's.
    std::fs::set_permissions(&folder, std::fs::Permissions::from_mode(0o700)).unwrap();
    nix::unistd::chown(
        &folder,
        Some(nix::unistd::Uid::from_raw(NOBODY)),
        Some(nix::unistd::Gid::from_raw(NOBODY)),
    )
    .expect("chown (the tests run as root)");
    let (code, err) = dsv4d_exit(dir.path());
    assert_eq!(code, Some(1), "{err}");
    let me = nix::unistd::geteuid().as_raw();
    assert!(
        err.contains(&format!(
            "dsv4d: refusing the engine key folder {f}: it is owned by uid {NOBODY}, not by \
             the user dsv4d runs as (uid {me})"
        )),
        "{err}"
    );
}
