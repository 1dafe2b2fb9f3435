//! The engine's identity at every start (issue 58.1), on the real llama-server: what it is
//! (its program's hash and `--version`, its backend from `--list-devices`), its model files
//! and the kernel, recorded in `state_dir` and shown in the status; the same engine again is
//! unchanged, and another build or another model file is said ("engine changed: ...").

use crate::support::real::engine;
use crate::support::*;
use dsv4_client::State;
use serde_json::{json, Value};
use std::path::Path;

/// A program that runs the real llama-server, with `more` arguments after the caller's;
/// with `version`, it answers `--version` so.
pub(crate) fn wrapper(path: &Path, server: &Path, version: Option<&str>, more: &str) {
    let answer = match version {
        Some(v) => format!("if [ \"$1\" = --version ]; then echo \"version: {v}\"; exit 0; fi\n"),
        None => String::new(),
    };
    let text = format!(
        "#!/bin/sh\n{answer}exec {} \"$@\" {more}\n",
        server.display()
    );
    // Written beside and renamed: a program being run cannot be written in place.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Serves one chat (starting the engine), and returns the identity of the engine that served
/// it, once read; then waits for that engine's idle stop.
async fn served_identity(d: &Daemon) -> Value {
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let (status, _, v) = body_json(d.post("/v1/chat/completions", body).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    // The engine that served was spawned after the last one's identity was shown, which
    // the spawn took away: the identity shown now is this engine's.
    let identity = shown_identity(d).await;
    d.wait_state(State::Stopped, PATIENCE).await;
    identity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_start_records_the_engines_identity_and_a_change_is_said() {
    let (server, _) = engine();
    let dir = temp_dir("identity");
    let program = dir.path().join("llama-server");
    let model = dir.path().join("tiny.gguf");
    wrapper(&program, &server, None, "");
    crate::support::real::tiny_with_seed(&model, 0);
    let profile = crate::support::real::profile(&model, 1024, "").replace(
        &format!("command: {}", server.display()),
        &format!("command: {}", program.display()),
    );
    let bus = PrivateBus::start();
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .session_bus(&bus);
    s.custom_profiles.insert("tiny".into(), profile);
    s.default_profile = "tiny".into();
    let d = Daemon::start(&s);
    crate::control::wait_bus_name(&d, &bus).await;

    let first = served_identity(&d).await;
    assert_eq!(first["profile"], "tiny", "{first}");
    assert_eq!(first["first"], true, "{first}");
    let id = &first["identity"];
    assert_eq!(id["engine"], "llama-server", "{id}");
    assert_eq!(id["program"]["path"], program.display().to_string(), "{id}");
    assert_eq!(id["program"]["sha256"].as_str().unwrap().len(), 64, "{id}");
    // What the real build says of itself, and the backend it lists (none: the CPU).
    let version = id["version"].as_str().unwrap();
    assert!(version.contains("commit"), "{id}");
    assert_eq!(id["backend"], "CPU", "{id}");
    assert_eq!(id["models"][0]["path"], model.display().to_string(), "{id}");
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(id["kernel"], kernel.trim(), "{id}");
    let kept: Value =
        serde_json::from_slice(&std::fs::read(d.dir().join("state/identity.json")).unwrap())
            .unwrap();
    assert_eq!(kept["tiny"], *id, "{kept}");

    // The same engine and model again: unchanged, and nothing said.
    let again = served_identity(&d).await;
    assert_eq!(again["first"], false, "{again}");
    assert_eq!(again["changed"], json!([]), "{again}");
    assert_eq!(again["identity"], *id);
    assert!(!d.log().contains("engine changed"), "{}", d.log());

    // Another build: the program says another version.
    wrapper(&program, &server, Some("9999 (other)"), "");
    let built = served_identity(&d).await;
    let said = format!("llama-server {version} (CPU) -> llama-server 9999 (other) (CPU)");
    assert_eq!(built["changed"], json!([said]), "{built}");
    d.log_with(&[&format!("engine changed: {said}")]).await;

    // Another model file of the same name and shape: other weights, written since.
    crate::support::real::tiny_with_seed(&model, 1);
    let remade = served_identity(&d).await;
    let changed = remade["changed"].as_array().unwrap();
    assert_eq!(changed.len(), 1, "{remade}");
    let line = changed[0].as_str().unwrap();
    assert!(
        line.starts_with(&format!("model {}: written since", model.display())),
        "{remade}"
    );
    d.log_with(&["engine changed: model"]).await;
    // dsv4ctl status shows it.
    let out = crate::control::ctl(&bus.address, &["status"], None);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("changed since the last start:"), "{table}");
    assert!(table.contains("llama-server 9999 (other) (CPU)"), "{table}");
}
