//! Another local user takes the engine's port: only the engine is the engine.
//!
//! dsv4d hands the engine its loopback port by number, on a command line every local user can
//! read. The impostor (`tests/fixtures/impostor.py`, run as uid 65534) watches `/proc` for it
//! and binds the port first, then answers every request itself and writes down what it got.
//! So that no test races it, the engine runs through a wrapper that waits for the impostor's
//! move on each port before it starts the real engine (the real attack wins that race anyway:
//! 20 of 20 starts of llama-server, and ds4-server leaves a whole load's time).
//!
//! What must hold: no request but the readiness probe's reaches the impostor, no secret
//! either; the start goes on with another port, so the client gets the real engine's answer
//! from the same start; and a start whose every port is taken fails with words that name the
//! port, the other process and its uid.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::support::real::{ds4_engine, ds4_setup, engine, setup};
use crate::support::*;
use dsv4_client::State;

/// The user the impostor runs as: a local user who is not dsv4d's.
const NOBODY: u32 = 65534;
/// The wrapper's name; the impostor finds it by its folder, which is this test's own.
const WRAPPER: &str = "port-wrapper";

/// The impostor, running as [`NOBODY`] until dropped.
struct Impostor {
    child: Child,
    dir: TempDir,
}

impl Impostor {
    /// Takes the first `take` engine ports it sees (`all`: every one).
    fn start(take: &str) -> Impostor {
        let dir = temp_dir("impostor");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/impostor.py");
        let child = Command::new("/usr/bin/python3")
            .arg(&script)
            .arg(dir.path())
            .arg(dir.path().join(WRAPPER))
            .arg(take)
            .uid(NOBODY)
            .gid(NOBODY)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect(
                "Debian's python3 runs the impostor (the test needs root to run it as uid 65534)",
            );
        Impostor { child, dir }
    }

    /// What it was sent: one line per request.
    fn seen(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("impostor.log")).unwrap_or_default()
    }

    /// The ports it took.
    fn taken(&self) -> Vec<u16> {
        let mut ports: Vec<u16> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let port = name.strip_prefix("seen-")?.parse().ok()?;
                let text = std::fs::read_to_string(e.path()).ok()?;
                (text.trim() == "taken").then_some(port)
            })
            .collect();
        ports.sort_unstable();
        ports
    }

    /// A wrapper for `engine` that waits until the impostor has made its move on the port it
    /// is given, then runs the engine in its place.
    fn wrapper(&self, engine: &Path) -> PathBuf {
        let path = self.dir.path().join(WRAPPER);
        let script = format!(
            "#!/bin/sh\n\
             # Runs the engine once the impostor has seen its port.\n\
             port=; prev=\n\
             for a in \"$@\"; do [ \"$prev\" = --port ] && port=$a; prev=$a; done\n\
             i=0\n\
             while [ ! -e '{dir}/seen-'\"$port\" ]; do\n\
             \x20 i=$((i + 1))\n\
             \x20 if [ $i -gt 3000 ]; then echo \"{WRAPPER}: the impostor never saw port $port\" >&2; exit 3; fi\n\
             \x20 sleep 0.01\n\
             done\n\
             exec '{engine}' \"$@\"\n",
            dir = self.dir.path().display(),
            engine = engine.display(),
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `s` with its only profile's `command` run through `wrapper`.
fn through(mut s: Setup, engine: &Path, wrapper: &Path) -> Setup {
    for yaml in s.custom_profiles.values_mut() {
        let from = format!("command: {}\n", engine.display());
        assert!(yaml.contains(&from), "{yaml}");
        *yaml = yaml.replace(&from, &format!("command: {}\n", wrapper.display()));
    }
    s
}

/// Nothing but the readiness probe reached the impostor: no client request, no secret.
fn assert_nothing_reached(impostor: &Impostor) {
    let seen = impostor.seen();
    // An empty line: a connection closed before it sent anything.
    for line in seen.lines().filter(|l| !l.is_empty()) {
        assert!(
            line.starts_with("GET /health ") || line.starts_with("GET /v1/models "),
            "the impostor got more than the readiness probe: {line:?}\n{seen}"
        );
        assert!(
            !line.to_ascii_lowercase().contains("authorization"),
            "the impostor got a credential: {line:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_on_the_real_engines_port_gets_nothing_and_the_engine_moves() {
    let impostor = Impostor::start("1");
    let (server, _) = engine();
    let wrapper = impostor.wrapper(&server);
    let d = Daemon::start(&through(setup(), &server, &wrapper));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    assert_eq!(
        v["choices"][0]["message"]["content"], "abc",
        "the real engine answers, not the impostor: {v}"
    );
    let taken = impostor.taken();
    assert_eq!(taken.len(), 1, "the impostor took one port: {taken:?}");
    let words = format!("port {} was taken by another process", taken[0]);
    let log = d.log_with(&[&words]).await;
    assert!(log.contains("uid 65534"), "{log}");
    let status = d.status().await;
    assert_eq!(status["state"], State::Ready.as_str());
    assert_eq!(status["generation"], 1, "the same start, on another port");
    assert_nothing_reached(&impostor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_whose_every_port_is_taken_fails_naming_the_stranger() {
    let impostor = Impostor::start("all");
    let (server, _) = engine();
    let wrapper = impostor.wrapper(&server);
    let d = Daemon::start(&through(setup(), &server, &wrapper));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 503, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("could not have its port, 3 times in a row")
            && message.contains("was taken by another process")
            && message.contains("uid 65534"),
        "{message}"
    );
    assert_eq!(impostor.taken().len(), 3, "three ports tried");
    assert_nothing_reached(&impostor);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_on_the_real_ds4_servers_port_gets_nothing_and_the_engine_moves() {
    let test = "a_stranger_on_the_real_ds4_servers_port_gets_nothing_and_the_engine_moves";
    let Some((server, model)) = ds4_engine(test) else {
        return;
    };
    let impostor = Impostor::start("1");
    let wrapper = impostor.wrapper(&server);
    let dir = temp_dir("ds4-port");
    let s = through(
        ds4_setup(&server, &model, dir.path(), "10m"),
        &server,
        &wrapper,
    );
    let d = Daemon::start_in(&s, dir);
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 16,
    });
    let (status, _, v) = body_json(d.post("/v1/chat/completions", body).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    assert_eq!(
        v["choices"][0]["message"]["content"], "Hi!",
        "the real ds4-server answers, not the impostor: {v}"
    );
    let taken = impostor.taken();
    assert_eq!(taken.len(), 1, "{taken:?}");
    let words = format!("port {} was taken by another process", taken[0]);
    let log = d.log_with(&[&words]).await;
    assert!(log.contains("uid 65534"), "{log}");
    assert_eq!(d.status().await["generation"], 1);
    assert_nothing_reached(&impostor);
}
