//! An engine that leaves its process group still ends with it.
//!
//! The profile's `command` is a wrapper that starts the engine in a session of its own and
//! waits for it (`setsid engine "$@" & wait`), as a user's launch script may: signals to the
//! engine's process group reach the wrapper only. Every process of the engine carries the
//! engine's mark, and dsv4d ends them all: at the idle stop, at a profile switch, at a
//! shutdown, and at its next start after it was SIGKILLed.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::State;
use nix::sys::signal::Signal;

/// The setup, with every profile's engine behind a `setsid` wrapper in `dir`.
fn setsid_setup(dir: &std::path::Path) -> Setup {
    let wrapper = dir.join("setsid-wrapper");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nsetsid {FAKE_ENGINE} \"$@\" &\nwait\n"),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let command = wrapper.display().to_string();
    Setup::default()
        .engine("idle_timeout", "1s")
        .profile_key("320k", "command", &command)
        .profile_key("64k", "command", &command)
}

/// The pid of the `n`th engine started (the fake engine logs `start pid=N`), once it is.
async fn nth_engine(d: &Daemon, n: usize) -> i64 {
    let t = Instant::now();
    loop {
        if let Some(pid) = d.starts().get(n).and_then(|l| {
            l.strip_prefix("start pid=")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        }) {
            return pid;
        }
        assert!(t.elapsed() < PATIENCE, "no engine {n}: {:?}", d.starts());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The engine is out of its wrapper's process group (else the test tests nothing).
fn assert_left_the_group(engine: i64, wrapper: i64) {
    let stat = std::fs::read_to_string(format!("/proc/{engine}/stat")).unwrap();
    let pgrp: i64 = stat[stat.rfind(')').unwrap() + 1..]
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(
        pgrp, wrapper,
        "engine {engine} is still in the wrapper's group"
    );
}

async fn wait_gone(pid: i64, what: &str, d: &Daemon) {
    let t = Instant::now();
    while alive(pid) {
        assert!(
            t.elapsed() < PATIENCE,
            "engine {pid} outlived {what}:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn serve(d: &Daemon) {
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_out_of_its_group_ends_at_the_idle_stop_a_switch_and_a_shutdown() {
    let bus = PrivateBus::start();
    let dir = temp_dir("setsid");
    let setup = setsid_setup(dir.path()).session_bus(&bus);
    let mut d = Daemon::start_in(&setup, dir);
    let proxy = live_proxy(&bus, &d).await;

    // The idle stop: by the time the state says stopped, the engine has gone.
    serve(&d).await;
    let wrapper = d.status().await["engine_pid"].as_i64().unwrap();
    let first = nth_engine(&d, 0).await;
    assert_left_the_group(first, wrapper);
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(!alive(first), "engine {first} outlived the idle stop");

    // A profile switch drains and restarts: the old engine goes.
    serve(&d).await;
    let second = nth_engine(&d, 1).await;
    proxy.set_profile("64k").await.unwrap();
    wait_gone(second, "a switch to another profile", &d).await;

    // A shutdown.
    serve(&d).await;
    let third = nth_engine(&d, 2).await;
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(
        !alive(third),
        "engine {third} outlived the daemon's shutdown"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_out_of_its_group_left_by_a_killed_daemon_is_ended_at_the_next_start() {
    let dir = temp_dir("setsid-kill");
    let setup = setsid_setup(dir.path()).engine("idle_timeout", "10m");
    let d = Daemon::start_in(&setup, dir);
    serve(&d).await;
    let wrapper = d.status().await["engine_pid"].as_i64().unwrap();
    let engine = nth_engine(&d, 0).await;
    assert_left_the_group(engine, wrapper);
    let dir = d.kill_and_keep_dir().await;
    // The death signal reaches the wrapper only: the engine is still there.
    let t = Instant::now();
    while alive(wrapper) {
        assert!(t.elapsed() < PATIENCE, "the wrapper survived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        alive(engine),
        "the engine went with its wrapper; nothing to test"
    );

    let mut d = Daemon::start_in(&setup, dir);
    wait_gone(engine, "the next dsv4d's start", &d).await;
    d.log_with(&["ending an engine process a previous dsv4d left running"])
        .await;
    serve(&d).await;
    // Its own engine, out of its group too, goes with its shutdown, not left behind.
    let own = nth_engine(&d, 0).await;
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(!alive(own), "engine {own} outlived the daemon's shutdown");
}
