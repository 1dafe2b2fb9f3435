//! The correctness canary (issue 58.2) on the real engines: recorded at a profile's first
//! validation, the same engine and model again pass, and a model with other weights (the
//! same shape and file name) drifts, failing the validation with where, until the new
//! reference is recorded.

use std::path::Path;

use crate::control::wait_bus_name;
use crate::support::real::{engine, tiny_with_seed};
use crate::support::*;
use crate::validate::{ctl, kept, text};
use dsv4_client::validate::CanaryResult;

/// `dsv4ctl validate --canary ARGS`: its exit code, its stderr, and the canary kept.
fn canary(d: &Daemon, bus: &PrivateBus, more: &[&str]) -> (Option<i32>, String, CanaryResult) {
    let mut args = vec!["validate", "--canary"];
    args.extend(more);
    let out = ctl(bus, &args);
    let stderr = text(&out.stderr);
    let r = kept(d).pop().expect("no validation kept");
    let c = r
        .canary
        .unwrap_or_else(|| panic!("no canary: {stderr}\n{}", d.log()));
    (
        out.status.code(),
        format!("{}{stderr}", text(&out.stdout)),
        c,
    )
}

/// The daemon with the service profile `svc` on the tiny model and the validation profile
/// `64k` on `model`.
async fn daemon(bus: &PrivateBus, model: &Path) -> Daemon {
    let (_, tiny) = engine();
    let mut s = Setup::default()
        .engine("idle_timeout", "10m")
        .session_bus(bus);
    s.custom_profiles
        .insert("svc".into(), crate::support::real::profile(&tiny, 1024, ""));
    s.custom_profiles
        .insert("64k".into(), crate::support::real::profile(model, 1024, ""));
    s.default_profile = "svc".into();
    let d = Daemon::start(&s);
    wait_bus_name(&d, bus).await;
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_canary_is_recorded_passes_on_the_same_engine_and_drifts_on_other_weights() {
    let bus = PrivateBus::start();
    let dir = temp_dir("canary");
    let model = dir.path().join("64k.gguf");
    tiny_with_seed(&model, 0);
    let d = daemon(&bus, &model).await;

    let (code, said, first) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(first.recorded, "{first:?}");
    assert!(
        said.contains("recorded as the profile's reference"),
        "{said}"
    );
    let prompts = &first.run.prompts;
    assert_eq!(prompts.len(), 3, "{first:?}");
    // llama-server's greedy tokens (16, or fewer to the end of the answer), each with its
    // top 5.
    let counts: Vec<usize> = prompts.iter().map(|p| p.tokens.len()).collect();
    assert!(counts.iter().all(|n| (1..=16).contains(n)), "{counts:?}");
    assert!(
        prompts[0].tokens.iter().all(|t| t.top.len() == 5),
        "{first:?}"
    );
    assert!(d.dir().join("state/canary/64k.json").is_file());

    let (code, said, again) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(!again.recorded && again.drift.is_none(), "{again:?}");
    assert_eq!(again.run.prompts, first.run.prompts);
    assert!(
        again.reference_engine.starts_with("llama-server "),
        "{again:?}"
    );

    // The same shape and name, other weights: the greedy picks of the tiny model stay, its
    // log-probabilities do not.
    tiny_with_seed(&model, 1);
    let (code, said, drifted) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(1), "{said}");
    let drift = drifted.drift.clone().expect("no drift");
    eprintln!("{drift}");
    assert_eq!((drift.prompt, drift.position), (1, 0), "{drift:?}");
    assert!(said.contains("canary drift at prompt 1"), "{said}");
    assert!(said.contains("--canary --record"), "{said}");

    // The doctor says so, with the fix.
    let c = doctor_check(&d, "canary", "64k");
    assert_eq!(c["verdict"], "fail", "{c}");
    assert!(
        c["fix"]
            .as_str()
            .unwrap()
            .contains("--profile 64k --canary --record"),
        "{c}"
    );

    // Recorded again, it is the reference.
    let (code, said, recorded) = canary(&d, &bus, &["--record"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(recorded.recorded, "{recorded:?}");
    let (code, said, after) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(after.drift.is_none() && !after.recorded, "{after:?}");
    let c = doctor_check(&d, "canary", "64k");
    assert_eq!(c["verdict"], "ok", "{c}");
    assert!(
        c["found"]
            .as_str()
            .unwrap()
            .contains("matched its reference"),
        "{c}"
    );
}

/// ds4-server gives no log-probabilities: its canary is its greedy text, recorded then
/// matched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_ds4_servers_canary_is_its_greedy_text() {
    let Some((server, model)) = crate::support::real::ds4_engine("the_real_ds4_servers_canary")
    else {
        return;
    };
    let bus = PrivateBus::start();
    let dir = temp_dir("ds4-canary");
    let mut s =
        crate::support::real::ds4_setup(&server, &model, dir.path(), "10m").session_bus(&bus);
    let ds4 = s.custom_profiles.remove("ds4").unwrap();
    s.custom_profiles.insert("64k".into(), ds4.clone());
    s.custom_profiles.insert("svc".into(), ds4);
    s.default_profile = "svc".into();
    let d = Daemon::start_in(&s, dir);
    wait_bus_name(&d, &bus).await;
    let (code, said, first) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(0), "{said}\n{}", d.log());
    assert!(first.recorded, "{first:?}");
    assert!(first
        .run
        .prompts
        .iter()
        .all(|p| p.tokens.is_empty() && !p.text.is_empty()));
    let (code, said, again) = canary(&d, &bus, &[]);
    assert_eq!(code, Some(0), "{said}");
    assert!(!again.recorded && again.drift.is_none(), "{again:?}");
}
