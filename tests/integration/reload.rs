//! Configuration reload while the daemon runs: file edits (including an editor's
//! write-then-rename) and SIGHUP; a valid change applies without restarting the engine, an
//! invalid one is rejected whole with an `Alert`, and the daemon keeps serving.

use std::time::{Duration, Instant};

use crate::support::*;
use dsv4_client::State;
use nix::sys::signal::Signal;

async fn wait_log(d: &Daemon, needle: &str, within: Duration) {
    let t = Instant::now();
    while !d.log().contains(needle) {
        assert!(
            t.elapsed() < within,
            "daemon never logged {needle:?}:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A daemon with `idle_timeout: 1h` on a private bus; a proxy that reads properties from the
/// daemon itself (not from a cache that follows PropertiesChanged), and its alerts.
async fn on_a_bus() -> (
    Setup,
    PrivateBus,
    Daemon,
    dsv4_client::Supervisor1Proxy<'static>,
    dsv4_client::AlertStream,
) {
    let bus = PrivateBus::start();
    let setup = Setup::default()
        .engine("idle_timeout", "1h")
        .session_bus(&bus);
    let d = Daemon::start(&setup);
    let proxy = live_proxy(&bus, &d).await;
    let alerts = proxy.receive_alert().await.unwrap();
    (setup, bus, d, proxy, alerts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_idle_timeout_applies_to_the_running_engine() {
    let setup = Setup::default().engine("idle_timeout", "1h");
    let d = Daemon::start(&setup);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let s = d.status().await;
    let deadline_before = s["idle_deadline"].as_f64().unwrap();
    let new = setup.engine("idle_timeout", "1s");
    replace_file(
        &d.dir().join("supervisor.yaml"),
        &d.config_text(&new, "supervisor.yaml"),
    );
    // Picked up once, and the engine, idle, stops within the new timeout.
    d.wait_state(State::Stopped, PATIENCE).await;
    d.log_with(&["configuration reloaded"]).await;
    assert_eq!(
        d.log().matches("configuration reloaded").count(),
        1,
        "{}",
        d.log()
    );
    assert_eq!(d.spawns(), 1, "the reload restarted the engine");
    assert!(deadline_before > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_edit_is_rejected_whole_with_an_alert() {
    let (setup, _bus, d, proxy, mut alerts) = on_a_bus().await;

    // Two mistakes: the whole change is refused, including the valid-looking part.
    let bad = setup
        .engine("idle_timeout", "banana")
        .engine("stop_timeout", "5s")
        .engine("max_wating", "3");
    replace_file(
        &d.dir().join("supervisor.yaml"),
        &d.config_text(&bad, "supervisor.yaml"),
    );
    let args = next_alert(&mut alerts, &d).await;
    let (kind, message) = (args.kind, args.message.to_string());
    assert_eq!(kind, dsv4_client::AlertKind::Config);
    assert!(message.contains("supervisor.yaml:"), "{message}");
    assert!(
        message.contains("idle_timeout") || message.contains("max_wating"),
        "{message}"
    );
    wait_log(&d, "the last good one stays", PATIENCE).await;
    // Still serving, with the old settings.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let s = d.status().await;
    assert!(
        s["idle_deadline"].as_f64().unwrap() - s["ready_since"].as_f64().unwrap() > 3000.0,
        "{s}"
    );
    assert_eq!(proxy.state().await.unwrap(), State::Ready.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_in_folder_made_while_running_is_watched_and_its_mistakes_placed() {
    let (_setup, _bus, d, _proxy, mut alerts) = on_a_bus().await;
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);

    // The folder is made after the start: once it is watched, a file saved in it counts.
    let dropins = d.dir().join("supervisor.yaml.d");
    std::fs::create_dir(&dropins).unwrap();
    wait_log(&d, "supervisor.yaml.d", PATIENCE).await;

    // A mistake is named in the drop-in's own file; the last good configuration stays.
    replace_file(
        &dropins.join("10-local.yaml"),
        "engine:\n  idle_timeout: 1s\n  max_waiting: lots\n",
    );
    let message = next_alert(&mut alerts, &d).await.message;
    assert!(
        message.contains("supervisor.yaml.d/10-local.yaml:3:16: engine.max_waiting:"),
        "{message}"
    );
    assert_eq!(d.status().await["state"], State::Ready.as_str());

    // Fixed, it is laid over supervisor.yaml: the idle engine stops within the new timeout.
    replace_file(
        &dropins.join("10-local.yaml"),
        "engine:\n  idle_timeout: 1s\n",
    );
    d.wait_state(State::Stopped, PATIENCE).await;
    d.log_with(&["configuration reloaded"]).await;
    assert_eq!(d.spawns(), 1, "the reload restarted the engine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_active_profile_applies_at_the_next_start() {
    // An engine that stays until the test says: the checks below take what they take.
    let setup = Setup::default().engine("idle_timeout", "1h");
    let d = Daemon::start(&setup);
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(d.status().await["restart_pending"], false);
    let new = setup.clone().profile_key("320k", "context", "200000");
    let file = "profiles/320k.yaml";
    replace_file(&d.dir().join(file), &d.config_text(&new, file));
    let t = Instant::now();
    while d.status().await["restart_pending"] != true {
        assert!(t.elapsed() < PATIENCE, "restart never pending\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The running engine is left alone...
    assert_eq!(d.spawns(), 1);
    assert_eq!(d.status().await["state"], State::Ready.as_str());
    // ...and once it has stopped (idle: a second, from another edit), the next one gets
    // the new context.
    let short = new.engine("idle_timeout", "1s");
    let file = "supervisor.yaml";
    replace_file(&d.dir().join(file), &d.config_text(&short, file));
    d.wait_state(State::Stopped, PATIENCE).await;
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let starts = d.starts();
    assert_eq!(starts.len(), 2);
    assert!(starts[0].contains(" -c 327680 "), "{}", starts[0]);
    assert!(starts[1].contains(" -c 200000 "), "{}", starts[1]);
    assert_eq!(d.status().await["restart_pending"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads() {
    let setup = Setup::default();
    let d = Daemon::start(&setup);
    d.wait_state(State::Stopped, PATIENCE).await;
    // Written in place while the daemon is told to reload: SIGHUP (the write may also be seen).
    let new = setup.top_level("exit_when_idle", "null");
    std::fs::write(
        d.dir().join("supervisor.yaml"),
        d.config_text(&new, "supervisor.yaml"),
    )
    .unwrap();
    d.signal(Signal::SIGHUP);
    wait_log(&d, "SIGHUP: configuration reloaded", PATIENCE).await;
    let (status, _) = d.get("/health").await;
    assert_eq!(status, 200);
}

/// At `DSV4_LOG=trace`, writes to files in the watched folders that are not configuration (a
/// log file kept there) must not be logged one by one: each such line was itself a write,
/// and the daemon logged its own log in a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_to_other_files_in_the_config_folder_are_not_traced() {
    let d = Daemon::start(&Setup::default().log_level("trace"));
    let other = d.dir().join("dsv4d.log");
    for n in 0..200 {
        std::fs::write(&other, format!("line {n}\n")).unwrap();
    }
    // A configuration change still gets through (and is logged) after them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    d.signal(Signal::SIGHUP);
    wait_log(&d, "SIGHUP", PATIENCE).await;
    let log = d.log();
    let traced = log.lines().filter(|l| l.contains("dsv4d.log")).count();
    assert_eq!(traced, 0, "{traced} lines about the other file:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_active_profile_falls_back_to_the_default_with_an_alert() {
    let bus = PrivateBus::start();
    let setup = Setup::default().session_bus(&bus);
    // 64k, not the default 320k, was chosen earlier and is remembered.
    let dir = temp_dir("daemon");
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    std::fs::write(dir.path().join("state/profile"), "64k\n").unwrap();
    let d = Daemon::start_in(&setup, dir);
    let mut alerts = alert_stream(&bus, &d).await;
    assert_eq!(d.status().await["profile"], "64k");

    std::fs::remove_file(d.dir().join("profiles/64k.yaml")).unwrap();
    let args = next_alert(&mut alerts, &d).await;
    assert_eq!(args.kind, dsv4_client::AlertKind::Config);
    assert!(
        args.message.contains("64k") && args.message.contains("320k"),
        "{}",
        args.message
    );
    let s = d.status().await;
    assert_eq!(s["profile"], "320k", "{s}");
    assert_eq!(s["state"], State::Stopped.as_str(), "{s}");
    // Remembered, as a switch is: a restart keeps it.
    let remembered = std::fs::read_to_string(d.dir().join("state/profile")).unwrap();
    assert_eq!(remembered.trim(), "320k");
    // The next request starts the default profile's engine.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let starts = d.starts();
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert!(starts[0].contains(" -c 327680 "), "{}", starts[0]);
    assert_eq!(d.status().await["engine_profile"], "320k");
}

/// Files that would make the loader take minutes and gigabytes (aliases of aliases, deep
/// nesting, a huge file) arrive by reload: each is refused at once with what is wrong, the
/// last good configuration stays, and the daemon lives and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_a_file_that_would_exhaust_the_loader_keeps_the_last_good_config() {
    let d = Daemon::start(&Setup::default().engine("idle_timeout", "1h"));
    // Serving (and handling SIGHUP) first.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    let profile = d.dir().join("profiles/320k.yaml");
    let good = std::fs::read_to_string(&profile).unwrap();
    let mut laughs = format!("{good}x0: &a0 [\"ha\"]\n");
    for i in 1..10 {
        let prev = format!("*a{}", i - 1);
        laughs.push_str(&format!(
            "x{i}: &a{i} [{}]\n",
            [prev.as_str(); 10].join(", ")
        ));
    }
    let deep = format!("{good}x: {}1{}\n", "[".repeat(100_000), "]".repeat(100_000));
    let huge = format!("{good}description: {}\n", "x".repeat(4 << 20));
    for (text, why) in [
        (laughs, "its aliases expand to more than 100000 values"),
        (deep, "nested more than 32 deep"),
        (huge, "the file is larger than 256 KiB"),
    ] {
        replace_file(&profile, &text);
        d.signal(Signal::SIGHUP);
        // Refused, with what is wrong (the watcher may see the write too: then twice).
        wait_log(&d, why, PATIENCE).await;
        let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
        assert_eq!(status, 200, "{v}");
    }
    let s = d.status().await;
    assert!(
        s["idle_deadline"].as_f64().unwrap() - s["ready_since"].as_f64().unwrap() > 3000.0,
        "{s}"
    );
}
