//! The daemon's own files, in `state_dir` and the KV folder: whatever sits at their names (a
//! FIFO, which would block an open until a writer came) neither hangs dsv4d nor stops it; it
//! is named in the log and passed over, as a damaged file is.

use std::path::Path;

use crate::support::*;
use serde_json::Value;

fn fifo(path: &Path) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    nix::unistd::mkfifo(
        path,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
}

async fn within<T>(what: &str, d: &Daemon, f: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(PATIENCE, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} got no answer within {PATIENCE:?}:\n{}", d.log()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifos_in_the_state_and_kv_folders_hang_nothing() {
    let dir = temp_dir("fifos");
    let state = dir.path().join("state");
    for name in [
        "engine-group",
        "power-restore.json",
        "profile",
        "validation-running",
    ] {
        fifo(&state.join(name));
    }
    // Named as a checkpoint's manifest is, in the profile's KV folder.
    fifo(&dir.path().join("profiles/kv/0123456789abcdef.json"));
    let mut s = Setup::default().profile_key("320k", "kv_checkpoint", "{ dir: kv }");
    s.default_profile = "320k".into();
    let d = Daemon::start_in(&s, dir);

    let (status, v) = within("GET /status", &d, d.get("/status")).await;
    assert_eq!(status, 200, "{v}");
    // A start reads the engine group record and looks for a checkpoint to restore.
    let answer = within("a chat", &d, async {
        body_json(d.post("/v1/chat/completions", chat(4, false)).await).await
    })
    .await;
    assert_eq!(answer.0, 200, "{:?}", answer.2);
    let (status, v): (u16, Value) = within("GET /status", &d, d.get("/status")).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["kv"].is_object(), "{v}");
    let log = d.log();
    for name in ["engine-group", "profile"] {
        let said = format!(
            "{} is a FIFO (named pipe), not a regular file",
            state.join(name).display()
        );
        assert!(log.contains(&said), "{said}\n{log}");
    }
    assert!(
        log.contains("0123456789abcdef.json is a FIFO (named pipe), not a regular file"),
        "{log}"
    );
    // The stop saves a checkpoint beside it, and the daemon exits as always.
    let dir = d.stop().await;
    let manifests = files_with_extension(&dir.path().join("profiles/kv"), "json");
    assert!(!manifests.is_empty(), "{manifests:?}");
}
