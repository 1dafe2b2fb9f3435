//! The second engine for real: dsv4d in front of a real ds4-server (antirez's DwarfStar 4 on
//! its CPU path, `support::real::ds4_engine`) and its tiny model, as a user runs it, and the
//! fake engine's ds4 mode checked against the real one in everything dsv4d can see.
//!
//! The tier needs the ds4-server that `../shared/rigs/ds4/build.sh` builds; without one each
//! test says that it was skipped and why, and returns. Nothing else in the suite skips.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::control::{ctl, wait_bus_name};
use crate::kv::wait_saved;
use crate::soak::{need_curl, openai_soak_with, python, run_client};
use crate::support::real::{ds4_engine, ds4_env, ds4_setup};
use crate::support::*;
use dsv4_client::State;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

/// What the tiny ds4 model answers every chat.
const ANSWER: &str = "Hi!";

/// A prompt of about `n` tokens (the tiny model reads one byte as one token).
fn prompt(n: usize) -> String {
    "word ".repeat(n / 5 + 1)
}

fn chat_of(prompt: &str, stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 16,
        "stream": stream,
    })
}

/// One chat through `d`: 200 and the model's answer; the response.
async fn answered(d: &Daemon, prompt: &str) -> Value {
    let (status, _, v) =
        body_json(d.post("/v1/chat/completions", chat_of(prompt, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER, "{v}");
    v
}

/// A chat sent to `d` on a connection of its own, by a task of its own.
fn post_in_background(
    d: &Daemon,
    body: Value,
) -> tokio::task::JoinHandle<hyper::Response<hyper::body::Incoming>> {
    let addr = d.addr;
    tokio::spawn(async move {
        let mut sender = one_connection(addr).await;
        let req = hyper::Request::post("/v1/chat/completions")
            .header("host", addr.to_string())
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap();
        sender.send_request(req).await.unwrap()
    })
}

/// How many engines the daemon has started.
async fn generation(d: &Daemon) -> u64 {
    d.status().await["generation"].as_u64().unwrap_or(0)
}

/// A daemon in front of the real ds4-server; `None` (the tier skipped) without one.
fn daemon(test: &str, idle: &str, bus: Option<&PrivateBus>) -> Option<Daemon> {
    let (server, model) = ds4_engine(test)?;
    let dir = temp_dir("ds4-real");
    let mut s = ds4_setup(&server, &model, dir.path(), idle);
    if let Some(bus) = bus {
        s = s.session_bus(bus);
    }
    Some(Daemon::start_in(&s, dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_serves_the_openai_package_and_curl_200_times_in_a_row() {
    let Some(d) = daemon("real_ds4_serves_the_openai_package_and_curl", "10m", None) else {
        return;
    };
    // Readiness: the first request starts it; ds4 has no /health, so dsv4d waits for its port
    // and then for GET /v1/models.
    answered(&d, "hello").await;
    assert_eq!(d.status().await["state"], State::Ready.as_str());
    assert_eq!(generation(&d).await, 1);

    // The official client: 34 x (models.list, chat, streamed chat) on one connection pool.
    let base = d.url("");
    let base = base.trim_end_matches('/');
    if let Err(e) = openai_soak_with(&python(), base, 34, &["ds4"], Duration::from_secs(300)).await
    {
        panic!("openai_soak.py ds4: {e}");
    }

    // curl: 100 chats in one process, plain and streamed in turn, every one complete.
    need_curl();
    let url = format!("{base}/v1/chat/completions");
    let mut cmd = tokio::process::Command::new("curl");
    for i in 0..100 {
        if i > 0 {
            cmd.arg("--next");
        }
        cmd.args([
            "-sS",
            "--max-time",
            "20",
            "-H",
            "content-type: application/json",
        ])
        .arg("-d")
        .arg(chat_of("hello", i % 2 == 1).to_string())
        .arg("-w")
        .arg("\n@@ds4 %{http_code}\n")
        .arg(&url);
    }
    let run = run_client(cmd, Duration::from_secs(300)).await.unwrap();
    assert!(run.status.success(), "curl: {}", run.explain());
    // Each answer is followed by its mark and code: body, "\n@@ds4 CODE\n", body, ...
    let segments: Vec<&str> = run.stdout.split("\n@@ds4 ").collect();
    assert_eq!(segments.len(), 101, "{}", run.explain());
    for i in 0..100 {
        let body = match i {
            0 => segments[0],
            _ => segments[i].split_once('\n').map_or("", |(_, b)| b),
        };
        let code = segments[i + 1].lines().next().unwrap_or_default();
        assert_eq!(code, "200", "request {i}\n{body}");
        let got = if i % 2 == 1 {
            let (content, done) = sse_content(body);
            assert!(done, "request {i}: no [DONE]\n{body}");
            content
        } else {
            let v: Value =
                serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {body}"));
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(got, ANSWER, "request {i}\n{body}");
    }
    // One engine did all of it.
    assert_eq!(generation(&d).await, 1, "{}", d.log());
}

/// The `delta.content` of an event stream's text, and whether it ended with `[DONE]`.
fn sse_content(text: &str) -> (String, bool) {
    let mut content = String::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
        } else if let Ok(v) = serde_json::from_str::<Value>(data) {
            content.push_str(
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap_or_default(),
            );
        }
    }
    (content, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_clients_that_leave_mid_answer_free_the_engine() {
    let Some(d) = daemon("real_ds4_clients_that_leave_mid_answer", "10m", None) else {
        return;
    };
    answered(&d, "hello").await;
    // One leaves after the first event of its stream, one during its (silent) prefill.
    let resp = d
        .post("/v1/chat/completions", chat_of("hello there", true))
        .await;
    assert_eq!(resp.status(), 200);
    let mut s = Stream::new(resp.into_body());
    assert!(s.next_event().await.is_some());
    drop(s);
    let leaver = post_in_background(&d, chat_of(&prompt(40), true));
    tokio::time::sleep(Duration::from_millis(500)).await;
    leaver.abort();
    // The engine serves the next one, and nothing stays in flight.
    answered(&d, "hello again").await;
    let t = Instant::now();
    while d.status().await["in_flight"] != 0 {
        assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(generation(&d).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_idle_stop_reports_its_save_and_the_next_start_resumes_from_it() {
    let Some(d) = daemon("real_ds4_idle_stop_reports_its_save", "1s", None) else {
        return;
    };
    let p = prompt(40);
    let first = answered(&d, &p).await;
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The idle stop: ds4-server saves on SIGTERM and says so; dsv4d reports what it said.
    let kv = wait_saved(&d, "ds4", PATIENCE).await;
    let save = &kv["last_save"];
    assert_eq!(save["ok"], true, "{kv}\n{}", d.log());
    assert_eq!(save["result"], "saved", "{save}");
    assert_eq!(save["reason"], "shutdown", "{save}");
    assert!(save["tokens"].as_u64().unwrap() >= prompt_tokens, "{save}");
    assert!(save["bytes"].as_u64().unwrap() > 0, "{save}");
    assert!(save["seconds"].as_f64().unwrap() > 0.0, "{save}");
    assert!(
        save["engine_said"]
            .as_str()
            .unwrap()
            .contains("kv cache stored"),
        "{save}"
    );
    assert!(kv["dir_bytes"].as_u64().unwrap() > 0, "{kv}");
    // The next start finds it in --kv-disk-dir by itself: the old prompt comes from it.
    let second = answered(&d, &p).await;
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert!(
        cached.is_some_and(|c| c > 0),
        "no cached tokens after the restart: {second}\n{}",
        d.log()
    );
    assert_eq!(generation(&d).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_dsv4ctl_stop_lets_the_stream_end_and_stop_now_answers_with_an_error() {
    let bus = PrivateBus::start();
    let Some(d) = daemon("real_ds4_dsv4ctl_stop", "10m", Some(&bus)) else {
        return;
    };
    wait_bus_name(&d, &bus).await;
    answered(&d, "hello").await;
    for now in [false, true] {
        // A stream whose prompt takes a few seconds to read, in flight when the stop comes:
        // a text of its own each round, so that no cache of ds4's shortens its prefill.
        let text = if now { "alpha " } else { "beta " }.repeat(12);
        let task = post_in_background(&d, chat_of(&text, true));
        let t = Instant::now();
        while d.status().await["in_flight"] != 1 {
            assert!(t.elapsed() < PATIENCE, "{}", d.status().await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let address = bus.address.clone();
        let args: &[&str] = if now { &["stop", "--now"] } else { &["stop"] };
        let out = tokio::task::spawn_blocking(move || ctl(&address, args, None))
            .await
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let resp = tokio::time::timeout(PATIENCE, task).await.unwrap().unwrap();
        if now {
            // Cut: ds4-server writes nothing more. During its prefill no head has come, and
            // the client gets an error answer; once its answer began, the stream ends with
            // dsv4d's error event. Never a hang, never what looks like a whole answer.
            let status = resp.status().as_u16();
            let (_, _, v) = body_json(resp).await;
            match status {
                200 => {
                    let text = v.as_str().unwrap_or_default();
                    assert!(!text.contains("data: [DONE]"), "{text}");
                    assert!(text.contains("before its end ([DONE])"), "{text}");
                }
                _ => {
                    assert!(status >= 500, "{status} {v}");
                    assert!(v["error"]["message"].is_string(), "{v}");
                }
            }
        } else {
            // Drained: the answer is whole.
            assert_eq!(resp.status(), 200);
            let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
            assert_eq!((content.as_str(), done), (ANSWER, true));
        }
        d.wait_state(State::Stopped, PATIENCE).await;
        if !now {
            // Started again for the next round.
            answered(&d, "hello").await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_a_sigtermed_daemon_lets_it_save_and_leaves_nothing_running() {
    let Some(mut d) = daemon("real_ds4_a_sigtermed_daemon", "10m", None) else {
        return;
    };
    answered(&d, &prompt(40)).await;
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(!alive(pid), "ds4-server {pid} outlived the daemon");
    let log = d.log_with(&["kv cache stored"]).await;
    assert!(log.contains("after SIGTERM; it said:"), "{log}");
    assert!(!log.contains("SIGKILL"), "{log}");
}

/// ds4-server loads its own checkpoints when a prompt's text begins with one: after a stop,
/// its word on the first load it tries is the restore's check, a load as a good one and a
/// checkpoint it matched and could not load as a miss, told in the status, the journal and
/// an Alert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_a_load_of_its_own_checkpoint_is_checked_and_a_failed_one_told() {
    let bus = PrivateBus::start();
    let Some(d) = daemon("real_ds4_a_load_of_its_own_checkpoint", "1s", Some(&bus)) else {
        return;
    };
    wait_bus_name(&d, &bus).await;
    let mut alerts = alert_stream(&bus, &d).await;
    let asked = prompt(40);
    answered(&d, &asked).await;
    // Its identity: ds4-server has no --version; its log names its backend.
    let id = shown_identity(&d).await["identity"].clone();
    assert_eq!(id["engine"], "ds4-server", "{id}");
    assert_eq!(id["backend"], "CPU", "{id}\n{}", d.log());
    assert!(id["version"].is_null(), "{id}");
    assert_eq!(id["program"]["sha256"].as_str().unwrap().len(), 64, "{id}");
    wait_saved(&d, "ds4", PATIENCE).await;

    // The same prompt after the stop: ds4-server finds it on the disk and loads it.
    let v = answered(&d, &asked).await;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let good = crate::kv::wait_check_of(&d, "ds4", 0.0).await;
    assert_eq!(
        good["result"], "loaded by ds4-server for a request",
        "{good}"
    );
    let tokens = good["tokens"].as_u64().unwrap();
    assert!(tokens >= 16 && tokens <= cached, "{good}, {cached} cached");
    assert_eq!(good["check"]["reused"], tokens, "{good}");
    assert_eq!(good["check"]["missed"], false, "{good}");
    assert!(
        good["engine_said"]
            .as_str()
            .unwrap()
            .contains("kv cache hit"),
        "{good}"
    );

    // Stopped again; each checkpoint's text damaged, so that the one the prompt matches by
    // its name cannot be loaded.
    d.wait_state(State::Stopped, PATIENCE).await;
    let kv = d.dir().join("profiles/kv");
    for f in std::fs::read_dir(&kv).unwrap().flatten() {
        let mut bytes = std::fs::read(f.path()).unwrap();
        // After the 48-byte header and the text's length, the text.
        bytes[52] ^= 0x20;
        std::fs::write(f.path(), bytes).unwrap();
    }
    answered(&d, &asked).await;
    let at = good["check"]["at"].as_f64().unwrap();
    let miss = crate::kv::wait_check_of(&d, "ds4", at).await;
    assert_eq!(miss["check"]["missed"], true, "{miss}");
    assert_eq!(miss["check"]["reused"], 0, "{miss}");
    assert!(miss["check"]["shared"].as_u64().unwrap() >= 16, "{miss}");
    let result = miss["result"].as_str().unwrap();
    assert!(result.contains("cached text hash mismatch"), "{miss}");
    d.log_with(&["the KV checkpoint restore did nothing"]).await;
    let args = next_alert(&mut alerts, &d).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Kv);
    assert!(
        args.message
            .contains("could not load it: cached text hash mismatch"),
        "{}",
        args.message
    );
}

/// An engine process started directly (no dsv4d), killed by its pid on drop.
struct Engine {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    _dir: TempDir,
}

impl Engine {
    /// The real ds4-server, or the fake engine in ds4 mode, on the same arguments.
    fn start(program: &Path, model: &Path, fake: bool, more_env: &[(&str, &str)]) -> Engine {
        let dir = temp_dir("ds4-direct");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = dir.path().join("engine.log");
        let out = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(program);
        cmd.arg("-m")
            .arg(model)
            .args(["--ctx", "4096", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--kv-disk-dir")
            .arg(dir.path().join("kv"))
            .args(["--kv-cache-min-tokens", "16"])
            .envs(ds4_env(dir.path()))
            .envs(more_env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if fake {
            cmd.env("FAKE_ENGINE_MODE", "ds4");
        }
        let child = cmd.spawn().unwrap();
        let mut e = Engine {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            log,
            _dir: dir,
        };
        let t = Instant::now();
        while TcpStream::connect(e.addr).is_err() {
            assert!(
                e.child.try_wait().unwrap().is_none(),
                "{} exited: {}",
                program.display(),
                e.log()
            );
            assert!(t.elapsed() < PATIENCE, "no port: {}", e.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        e
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `raw` on a fresh connection and reads to the end (bounded).
    fn exchange(&self, raw: &str) -> String {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        s.write_all(raw.as_bytes()).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    fn get(&self, path: &str) -> String {
        self.exchange(&format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\n\r\n",
            self.addr
        ))
    }

    fn post_raw(&self, path: &str, body: &str) -> String {
        format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        )
    }

    fn signal(&self, sig: Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig);
    }

    fn wait(&mut self) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(t.elapsed() < PATIENCE, "still running: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What dsv4d can see of a ds4-server, checked the same way on the real one and on the fake
/// engine's ds4 mode; the differences are listed by name.
fn what_dsv4d_sees(program: &Path, model: &Path, fake: bool) -> Vec<String> {
    let mut seen = Vec::new();
    let mut note = |what: &str, ok: bool, detail: String| {
        if !ok {
            seen.push(format!("{what}: {detail}"));
        }
    };
    // The fake reads a prompt as long as the real one does, so that a stop can come mid-way.
    let e = Engine::start(program, model, fake, &[("FAKE_ENGINE_PREFILL_MS", "3000")]);
    let health = e.get("/health");
    note(
        "no /health",
        health.starts_with("HTTP/1.1 404"),
        health.clone(),
    );
    let models = e.get("/v1/models");
    note(
        "models answer",
        models.starts_with("HTTP/1.1 200"),
        models.clone(),
    );
    note(
        "Connection: close",
        models
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        models.clone(),
    );
    let encoded = e.get("/v1/%6Dodels");
    note(
        "paths not decoded",
        encoded.starts_with("HTTP/1.1 404"),
        encoded,
    );
    let queried = e.get("/v1/models?x=1");
    note(
        "query cut off",
        queried.starts_with("HTTP/1.1 200"),
        queried,
    );
    // Two requests in one write: one answer, then the connection ends.
    let two = e.get_two();
    note(
        "one request per connection",
        two.matches("HTTP/1.").count() == 1,
        two,
    );
    // A chunked body is not read.
    let chunked = e.exchange(&format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{{}}\r\n0\r\n\r\n",
        e.addr
    ));
    note("chunked body refused", chunked.contains(" 400 "), chunked);
    // A short streamed chat: framed by the connection's end, no `: prefill`, ends [DONE].
    let stream =
        e.exchange(&e.post_raw("/v1/chat/completions", &chat_of("hello", true).to_string()));
    let (head, body) = stream.split_once("\r\n\r\n").unwrap_or((&stream, ""));
    let head = head.to_ascii_lowercase();
    note(
        "stream close-delimited",
        !head.contains("transfer-encoding") && !head.contains("content-length"),
        head.clone(),
    );
    note("stream ends [DONE]", sse_content(body).1, body.to_string());
    note(
        "no prefill comment",
        !body.contains(": prefill"),
        body.to_string(),
    );
    // Progress redrawn with carriage returns, never a line end.
    let log = e.log();
    note(
        "progress without newlines",
        log.contains("ds4: prefill layer 1/4\rds4: prefill layer 2/4\r"),
        log.clone(),
    );
    drop(e);

    // SIGTERM during a stream's prefill: the port closes at once, nothing more is written
    // (no [DONE]), then it exits 0 and says what it saved.
    let mut e = Engine::start(program, model, fake, &[("FAKE_ENGINE_PREFILL_MS", "3000")]);
    let addr = e.addr;
    let raw = e.post_raw(
        "/v1/chat/completions",
        &chat_of(&prompt(60), true).to_string(),
    );
    let reader = send_in_background(addr, raw);
    e.wait_prefilling();
    e.signal(Signal::SIGTERM);
    let t = Instant::now();
    while TcpStream::connect(addr).is_ok() {
        if t.elapsed() > Duration::from_secs(5) {
            note(
                "listener closed at once",
                false,
                "still accepting 5 s after SIGTERM".into(),
            );
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let cut = reader.join().unwrap();
    // Stopped in its prefill: not even the head went out.
    note("a prefill cut answers nothing", cut.is_empty(), cut);
    let st = e.wait();
    note(
        "exit 0 after SIGTERM",
        st.code() == Some(0),
        format!("{st}: {}", e.log()),
    );
    drop(e);

    // A second signal while the first one's prefill still runs (about 10 s of it): exit 130.
    let mut e = Engine::start(program, model, fake, &[("FAKE_ENGINE_PREFILL_MS", "10000")]);
    let raw = e.post_raw(
        "/v1/chat/completions",
        &chat_of(&prompt(200), false).to_string(),
    );
    let _reader = send_in_background(e.addr, raw);
    e.wait_prefilling();
    e.signal(Signal::SIGTERM);
    e.wait_log("shutdown requested");
    e.signal(Signal::SIGTERM);
    let st = e.wait();
    note(
        "second signal exits 130",
        st.code() == Some(130),
        format!("{st}"),
    );
    seen
}

/// Sends `raw` to `addr` from a thread of its own; what came back, up to the connection's end.
fn send_in_background(addr: SocketAddr, raw: String) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut out = Vec::new();
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.set_read_timeout(Some(PATIENCE));
            let _ = s.write_all(raw.as_bytes());
            let _ = s.read_to_end(&mut out);
        }
        String::from_utf8_lossy(&out).into_owned()
    })
}

impl Engine {
    /// Waits until the engine's output has `needle`.
    fn wait_log(&self, needle: &str) {
        let t = Instant::now();
        while !self.log().contains(needle) {
            assert!(t.elapsed() < PATIENCE, "no {needle:?} in: {}", self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until a chat's prompt is being read: ds4-server logs `prompt start`, the fake
    /// engine the request.
    fn wait_prefilling(&self) {
        let t = Instant::now();
        loop {
            let log = self.log();
            if log.contains("prompt start") || log.contains("request POST /v1/chat/completions") {
                return;
            }
            assert!(t.elapsed() < PATIENCE, "no prefill began: {log}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn get_two(&self) -> String {
        let one = format!("GET /v1/models HTTP/1.1\r\nHost: {}\r\n\r\n", self.addr);
        self.exchange(&format!("{one}{one}"))
    }
}

#[test]
fn the_fake_ds4_mode_matches_the_real_ds4_server_where_dsv4d_looks() {
    let Some((server, model)) = ds4_engine("the_fake_ds4_mode_matches_the_real_ds4_server") else {
        return;
    };
    let real = what_dsv4d_sees(&server, &model, false);
    assert!(
        real.is_empty(),
        "the real ds4-server is not as the checks expect: {real:#?}"
    );
    let fake = what_dsv4d_sees(Path::new(FAKE_ENGINE), &model, true);
    assert!(
        fake.is_empty(),
        "the fake's ds4 mode differs from the real one: {fake:#?}"
    );
}

/// `dsv4ctl validate` on the real ds4-server: its figures come from streamed completions
/// (it has no timings and no tokenizer), and they are real ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_ds4_is_validated_from_its_stream() {
    let bus = PrivateBus::start();
    let Some(d) = daemon("real_ds4_is_validated", "10m", Some(&bus)) else {
        return;
    };
    wait_bus_name(&d, &bus).await;
    let address = bus.address.clone();
    // A short prefill: the tiny model on the CPU reads a few dozen tokens a second.
    let args = [
        "--json",
        "validate",
        "--profile",
        "ds4",
        "--runs",
        "1",
        "--prefill",
        "160",
    ];
    let out = tokio::task::spawn_blocking(move || ctl(&address, &args, None))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let r: dsv4_client::validate::ValidationResult = serde_json::from_slice(&out.stdout).unwrap();
    let names: Vec<&str> = r.tests.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["decode", "prefill"]);
    let decode = &r.tests[0].details[0];
    assert!(decode.predicted_n >= 2 && decode.value > 0.0, "{decode:?}");
    let prefill = &r.tests[1].details[0];
    assert!(
        prefill.prompt_n.abs_diff(160) <= 3 && prefill.value > 0.0,
        "{prefill:?}"
    );
    // Cold: nothing of the earlier prompts served it but the chat template's opening, which
    // ds4-server renders every prompt in (and which is not counted in the rate).
    assert!(prefill.cache_n < 40, "{prefill:?}");
    println!(
        "real ds4: decode {:.1} tok/s ({} tokens), prefill {:.1} tok/s ({} tokens)",
        decode.value, decode.predicted_n, prefill.value, prefill.prompt_n
    );
}
