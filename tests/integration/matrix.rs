//! `dsv4ctl validate --matrix` on the real llama-server with the tiny model, the real
//! power-profiles-daemon on a private system bus, and a fixture sysroot whose GPU level file
//! and SoC power the daemon reads and writes.
//!
//! A watcher stands in for the hardware: it looks at what is in force (PPD's active profile,
//! the level file, the `-ub` on the validation engine's command line, read from /proc) and
//! writes the SoC power those settings would draw to `power1_average`. A cell whose decode
//! test saw the watts of its own settings therefore ran with its settings in force.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsv4_client::validate::{CellSettings, ValidationResult};
use dsv4_client::State;

use crate::control::wait_bus_name;
use crate::power::{wait_level, SystemBus};
use crate::support::real::engine;
use crate::support::*;
use crate::validate::{ctl, kept, padded_model, text, validate_in_background, wait_log, PAD_MIB};

const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

/// What the watcher saw in force: PPD's active profile, the GPU level, the validation
/// engine's `-ub` (none when it does not run).
type Seen = (String, String, Option<String>);

/// The SoC power the fixture shows for those settings: each setting adds its own power of
/// two, so every cell draws its own figure.
fn watts(active: &str, level: &str, ub: Option<&str>) -> f64 {
    let Some(ub) = ub else {
        return 10.0;
    };
    let mut w = 20.0;
    if active == "balanced" {
        w += 80.0;
    }
    if level == "low" {
        w += 40.0;
    }
    if ub == "512" {
        w += 20.0;
    }
    w
}

fn expected_watts(c: &CellSettings) -> f64 {
    let ub = c
        .args
        .iter()
        .find(|a| a.axis == "ub")
        .map(|a| a.args[1].as_str());
    watts(c.cpu.as_deref().unwrap(), c.gpu.as_deref().unwrap(), ub)
}

/// The `-ub` value of the running process whose command line names `model`.
fn engine_ub(model: &Path) -> Option<String> {
    let model = model.to_str()?;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.iter().any(|a| a == model) {
            continue;
        }
        let at = args.iter().rposition(|a| a == "-ub")?;
        return args.get(at + 1).cloned();
    }
    None
}

/// Until `stop`: reads what is in force every 20 ms, writes its watts, records each new sight.
async fn watch(
    bus: &SystemBus,
    tree: &Path,
    model: &Path,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<Seen>>>,
) {
    let level_file = tree.join(DEVICE).join("power_dpm_force_performance_level");
    let power_file = tree.join(DEVICE).join("hwmon/hwmon3/power1_average");
    let mut written = None;
    while !stop.load(Ordering::SeqCst) {
        let active = bus.active().await;
        let level = std::fs::read_to_string(&level_file)
            .unwrap_or_default()
            .trim()
            .to_string();
        let ub = engine_ub(model);
        let w = watts(&active, &level, ub.as_deref());
        if written != Some(w) {
            std::fs::write(&power_file, format!("{}\n", (w * 1e6) as u64)).unwrap();
            written = Some(w);
        }
        let sight = (active, level, ub);
        {
            let mut seen = seen.lock().unwrap();
            if seen.last() != Some(&sight) {
                seen.push(sight);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The service profile `svc` (the tiny model) and the validation profile `64k` (`model`, at
/// its own path) with `matrix`, on `bus`'s PPD and the fixture `tree`.
fn setup(bus: &SystemBus, session: &PrivateBus, tree: &Path, model: &Path, matrix: &str) -> Setup {
    let (_, tiny) = engine();
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .top_level("power", "{ method: auto, cpu: power-saver, gpu: auto }")
        .top_level("monitor", "{ interval: 100ms, idle_interval: 100ms }")
        .daemon_env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .args(&["--sysroot", tree.to_str().unwrap()])
        .session_bus(session);
    s.custom_profiles
        .insert("svc".into(), crate::support::real::profile(&tiny, 4096, ""));
    s.custom_profiles.insert(
        "64k".into(),
        crate::support::real::profile(model, 4096, &format!("matrix:\n{matrix}")),
    );
    s.default_profile = "svc".into();
    s
}

const MATRIX: &str = "  cpu: [power-saver, balanced]\n  gpu: [auto, low]\n  \
                      ub: [[-ub, '256'], [-ub, '512']]\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cell_runs_with_its_settings_in_force_and_the_verdict_is_the_frugal_one() {
    let bus = SystemBus::start().await;
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    // The padded model: each load takes long enough (a few tenths of a second) that the
    // watcher has written the cell's watts well before its decode test begins.
    let model = padded_model(PAD_MIB);
    let d = Daemon::start(&setup(&bus, &session, tree.path(), &model, MATRIX));
    wait_bus_name(&d, &session).await;
    let before = bus.active().await;
    assert_eq!(before, "balanced");

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let out = {
        let watcher = watch(&bus, tree.path(), &model, stop.clone(), seen.clone());
        let run = async {
            let run =
                validate_in_background(&session, &["--matrix", "--runs", "2", "--prefill", "256"]);
            let out = tokio::task::spawn_blocking(move || run.join().unwrap())
                .await
                .unwrap();
            stop.store(true, Ordering::SeqCst);
            out
        };
        tokio::join!(watcher, run).1
    };
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}\n{}",
        text(&out.stderr),
        d.log()
    );
    let r: ValidationResult = kept(&d).pop().unwrap();
    let m = r.matrix.clone().expect("no matrix in the result");
    assert_eq!((m.planned, m.cells.len()), (8, 8), "{stdout}");
    let seen = seen.lock().unwrap().clone();
    for c in &m.cells {
        assert!(c.error.is_none(), "cell {}: {:?}", c.index, c.error);
        let (cpu, gpu) = (
            c.settings.cpu.as_deref().unwrap(),
            c.settings.gpu.as_deref().unwrap(),
        );
        let ub = c.settings.args[0].args[1].clone();
        // PPD showed the cell's profile, the level file its level, the engine its -ub...
        let sight = (cpu.to_string(), gpu.to_string(), Some(ub.clone()));
        assert!(
            seen.contains(&sight),
            "cell {}: {sight:?} never seen in {seen:?}",
            c.index
        );
        // ...and all through its decode test, which drew the watts of those settings.
        let decode = c.test("decode").unwrap();
        assert_eq!(
            decode.telemetry.soc_power_mean_w,
            Some(expected_watts(&c.settings)),
            "cell {} ({}): {:?}\n{seen:?}",
            c.index,
            c.settings.label(),
            decode.telemetry
        );
        assert_eq!(c.applied_gpu.as_deref(), Some(gpu), "cell {}", c.index);
        let applied = c.applied_cpu.clone().unwrap_or_default();
        match cpu {
            "power-saver" => assert!(applied.contains("power-saver held"), "{applied}"),
            _ => assert!(
                applied.contains("balanced profile is left as it is"),
                "{applied}"
            ),
        }
        let load = c.load.as_ref().unwrap();
        assert!(
            load.cold_seconds > 0.0 && load.warm_seconds > 0.0,
            "{load:?}"
        );
        assert!(
            stdout.contains(&format!("  {}: {}", c.index, c.settings.label())),
            "{stdout}"
        );
    }
    // The verdict: among the cells within the noise of the fastest decode, the fewest joules
    // per token. Cell 1 (power-saver, auto, -ub 256) draws a fraction of the others' power.
    let v = m.verdict.clone().unwrap();
    assert!(v.within_noise.contains(&v.fastest), "{v:?}");
    let energy = |i: u32| {
        let c = &m.cells[i as usize - 1];
        c.test("decode")
            .unwrap()
            .telemetry
            .joules_per_token
            .unwrap()
    };
    for other in &v.within_noise {
        assert!(energy(v.pick) <= energy(*other), "{v:?}");
    }
    if v.within_noise.contains(&1) {
        assert_eq!(v.pick, 1, "{v:?}");
    }
    assert!(
        stdout.contains(&format!("verdict: cell {}:", v.pick)),
        "{stdout}"
    );
    let snippet = m.snippet.clone().unwrap();
    let picked = &m.cells[v.pick as usize - 1].settings;
    assert!(
        snippet.contains(&format!(
            "power:\n  cpu: {}\n  gpu: {}\n",
            picked.cpu.as_deref().unwrap(),
            picked.gpu.as_deref().unwrap()
        )),
        "{snippet}"
    );
    assert!(
        snippet.contains(&format!(
            "\"--threads-batch\", \"1\", \"-ub\", \"{}\"]",
            picked.args[0].args[1]
        )),
        "{snippet}"
    );
    // Whether power.prefill pays, from the cells that differ from the pick by their CPU
    // profile alone: said, and in the snippet when it does.
    let p = v.prefill.clone().expect("no word on power.prefill");
    assert!(
        stdout.contains(&format!("long prefills: {}", p.reason)),
        "{stdout}"
    );
    match &p.cpu {
        Some(cpu) => assert!(
            snippet.contains(&format!("  prefill: {cpu}\n")),
            "{snippet}"
        ),
        None => assert!(!snippet.contains("prefill:"), "{snippet}"),
    }
    // The service profile is back, and its engine runs as configured (power-saver held, the
    // GPU on auto), not as the last cell said (balanced, low).
    let st = d.status().await;
    assert_eq!(st["profile"], "svc", "{st}");
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(d.status().await["engine_profile"], "svc");
    bus.wait_active("power-saver", PATIENCE).await;
    let level = tree
        .path()
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "auto\n");
    // Once it stops, the user's own profile is back.
    let out = ctl(&session, &["stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    bus.wait_active(&before, PATIENCE).await;
    assert!(bus.holds().await.is_empty());

    // Narrowed from the command line, and compared cell by cell with the run before.
    let out = ctl(
        &session,
        &[
            "validate",
            "--matrix",
            "--runs",
            "1",
            "--prefill",
            "256",
            "--only",
            "gpu=low",
            "--only",
            "ub=-ub 512",
            "--only",
            "cpu=balanced",
            "--compare",
            "last",
        ],
    );
    let stdout = text(&out.stdout);
    assert!(
        out.status.code() == Some(0) || out.status.code() == Some(1),
        "{stdout}"
    );
    assert!(
        stdout.contains("matrix of profile 64k: 1 of 1 cells"),
        "{stdout}"
    );
    assert!(
        stdout.contains("compared cell by cell with the matrix of 64k"),
        "{stdout}"
    );
    assert!(stdout.contains("1     decode"), "{stdout}");
    let r = kept(&d).pop().unwrap();
    let only = &r.matrix.unwrap().cells[0].settings;
    assert_eq!(only.label(), "cpu=balanced gpu=low ub=[-ub 512]");
}

/// The fake engine's profiles, with a matrix of two CPU profiles on the validation one.
fn fake_matrix(session: &PrivateBus, bus: &SystemBus, tree: &Path) -> Setup {
    let mut s = crate::validate::fake_setup(session, "5")
        .engine("idle_timeout", "2s")
        .top_level("power", "{ method: auto, cpu: power-saver, gpu: auto }")
        .daemon_env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .args(&["--sysroot", tree.to_str().unwrap()]);
    s.profile_keys.entry("64k".into()).or_default().insert(
        "matrix",
        "{ cpu: [power-saver, balanced], gpu: [low, auto] }".into(),
    );
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_during_a_cell_is_served_by_the_service_profile_before_the_matrix_goes_on() {
    let bus = SystemBus::start().await;
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(&fake_matrix(&session, &bus, tree.path()));
    wait_bus_name(&d, &session).await;
    let run = validate_in_background(&session, &["--matrix", "--runs", "3"]);
    wait_log(&d, "validation: decode run 1/3", PATIENCE).await;
    // During cell 1: the request waits for the cell's end, then the service engine answers.
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "320k.gguf", "{v}");
    let log = d.log();
    let served = log.find("the matrix pauses").expect("no pause in the log");
    assert!(
        log.find("validation: cell 2/4")
            .is_none_or(|next| next > served),
        "the next cell began before the client was served:\n{log}"
    );
    let out = tokio::task::spawn_blocking(move || run.join().unwrap())
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}\n{}",
        text(&out.stderr),
        d.log()
    );
    let log = d.log();
    let resumed = log.find("the matrix goes on").expect("never resumed");
    assert!(
        resumed > served && log[resumed..].contains("validation: cell 2/4"),
        "{log}"
    );
    let m = kept(&d).pop().unwrap().matrix.unwrap();
    assert_eq!((m.cells.len(), m.pauses), (4, 1), "{m:?}");
    assert!(text(&out.stdout).contains("paused 1 time(s) to serve client requests"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_in_a_cell_has_every_setting_given_back_at_its_next_start() {
    let bus = SystemBus::start().await;
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let level = tree
        .path()
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    let s = fake_matrix(&session, &bus, tree.path());
    let d = Daemon::start(&s);
    wait_bus_name(&d, &session).await;
    let run = validate_in_background(&session, &["--matrix", "--runs", "3"]);
    // Cell 1 (power-saver held, the GPU on low) is in force.
    wait_log(&d, "validation: decode run 1/3", PATIENCE).await;
    assert_eq!(
        std::fs::read_to_string(&level).unwrap(),
        "low\n",
        "{}",
        d.log()
    );
    bus.wait_active("power-saver", PATIENCE).await;
    let dir = d.kill_and_keep_dir().await;
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &session).await;
    let out = run.join().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    // The hold went with the killed daemon's bus connection; the level and the profile come
    // back at the start.
    bus.wait_active("balanced", PATIENCE).await;
    assert!(bus.holds().await.is_empty());
    wait_level(&level, "auto", "the level was not given back", &d).await;
    assert_eq!(d.status().await["profile"], "320k", "{}", d.log());
    // The next engine runs as configured, not as the cell said.
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    d.wait_state(State::Ready, PATIENCE).await;
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "auto\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_matrix_that_cannot_run_is_refused_with_the_reason_and_nothing_changes() {
    let bus = SystemBus::start().await;
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let d = Daemon::start(&fake_matrix(&session, &bus, tree.path()));
    wait_bus_name(&d, &session).await;
    for (args, said) in [
        (
            &["--only", "fan=on"][..],
            "the matrix has no axis `fan`; its axes: cpu, gpu",
        ),
        (
            &["--only", "gpu=high"],
            "axis `gpu` has no value `high`; its values: low, auto",
        ),
        (
            &["--profile", "320k"],
            "profile 320k has no matrix: add one to",
        ),
    ] {
        let out = ctl(&session, &[&["validate", "--matrix"][..], args].concat());
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(said), "{args:?}: {stderr}");
    }
    assert!(kept(&d).is_empty());
    assert_eq!(d.spawns(), 0);
    assert_eq!(d.status().await["profile"], "320k");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_matrix_and_a_restarted_daemon_leave_the_settings_as_they_were() {
    let bus = SystemBus::start().await;
    let session = PrivateBus::start();
    let tree = fixture_copy("strix-halo");
    let level = tree
        .path()
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    let s = fake_matrix(&session, &bus, tree.path());
    let d = Daemon::start(&s);
    wait_bus_name(&d, &session).await;

    // Cancelled in cell 1 (power-saver held, the GPU on low).
    let run = validate_in_background(&session, &["--matrix", "--runs", "3"]);
    wait_log(&d, "validation: decode run 1/3", PATIENCE).await;
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "low\n");
    let conn = zbus::connection::Builder::address(session.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    let control = dsv4_client::Supervisor1Proxy::new(&conn).await.unwrap();
    assert!(control.cancel_validation().await.unwrap());
    let out = tokio::task::spawn_blocking(move || run.join().unwrap())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("cancelled"),
        "{}",
        text(&out.stderr)
    );
    // The profile that was active, with the settings as configured (the GPU on auto), and
    // the user's own profile once its engine stops.
    assert_eq!(d.status().await["profile"], "320k");
    wait_level(&level, "auto", "the level stayed the cell's", &d).await;
    let out = ctl(&session, &["stop"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    bus.wait_active("balanced", PATIENCE).await;
    let kept_run = kept(&d).pop().unwrap();
    assert_eq!(
        kept_run.matrix.unwrap().cells.len(),
        0,
        "cell 1 never ended"
    );

    // A restart (SIGTERM, as systemctl restart) in cell 1: everything given back on the way
    // out, and the next start on the profile that was active.
    let run = validate_in_background(&session, &["--matrix", "--runs", "3"]);
    // This run's first decode: the second in the log.
    let t = Instant::now();
    while d.log().matches("validation: decode run 1/3").count() < 2 {
        assert!(t.elapsed() < PATIENCE, "{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bus.wait_active("power-saver", PATIENCE).await;
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "low\n");
    let dir = d.stop().await;
    assert_eq!(std::fs::read_to_string(&level).unwrap(), "auto\n");
    bus.wait_active("balanced", PATIENCE).await;
    assert!(bus.holds().await.is_empty());
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &session).await;
    let _ = tokio::task::spawn_blocking(move || run.join().unwrap())
        .await
        .unwrap();
    assert_eq!(d.status().await["profile"], "320k", "{}", d.log());
}
