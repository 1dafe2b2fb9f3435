//! `power.prefill`: the real power-profiles-daemon on a private system bus, driving a
//! fixture ACPI platform profile (as on a mini PC that has one), and the real llama-server on
//! the tiny model with a 16K context, one thread. A streamed request's 14,000-token prompt
//! is read for seconds (5 s here); its answer of 2,000 tokens (`ignore_eos`) goes on for
//! seconds more (about 300 tokens a second at that context here).

use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::power::{wait_power, SystemBus};
use crate::support::*;

const PROMPT_TOKENS: usize = 14_000;
const ANSWER_TOKENS: u32 = 2_000;
const PREFILL_AFTER: &str = "1s";

/// A daemon on `bus`'s power-profiles-daemon in front of the real llama-server (16K
/// context), with `power.prefill` when given; its engine started, power-saver held.
async fn daemon(bus: &SystemBus, prefill: Option<&str>) -> Daemon {
    let dir = temp_dir("daemon");
    let model = crate::validate::tiny_16k(dir.path());
    let prefill = prefill.map_or(String::new(), |p| format!(", prefill: {p}"));
    let mut s = Setup::default()
        .top_level(
            "power",
            &format!(
                "{{ method: ppd, cpu: power-saver{prefill}, prefill_after: {PREFILL_AFTER} }}"
            ),
        )
        .daemon_env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .engine("idle_timeout", "10m")
        // No sample wakes the power policy: only the requests' prefills do.
        .top_level("monitor", "{ interval: 1h, idle_interval: 1h }");
    s.custom_profiles
        .insert("16k".into(), real::profile(&model, 16_384, ""));
    s.default_profile = "16k".into();
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    bus.wait_active("power-saver", PATIENCE).await;
    assert_eq!(bus.platform_profile(), "low-power");
    d
}

/// A streamed chat with a long prompt (`tag` first: no cache holds it), read by a task of
/// its own: each event that carries answer text, with when it came. The channel closes at
/// the answer's end.
fn long_stream(d: &Daemon, tag: &str) -> mpsc::UnboundedReceiver<Instant> {
    let body = json!({
        "messages": [{"role": "user", "content": format!("{tag} {}", "word ".repeat(PROMPT_TOKENS / 5))}],
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": true,
        "temperature": 0,
        "stream": true,
    });
    let url = d.url("/v1/chat/completions");
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<Bytes>>();
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let body = client.request(req).await.unwrap().into_body();
        each_sse_data(body, |v| {
            if carries_text(v) {
                let _ = tx.send(Instant::now());
            }
        })
        .await;
    });
    rx
}

/// Whether a `data:` event is a chunk with answer text.
fn carries_text(v: &Value) -> bool {
    v["choices"][0]["delta"]["content"]
        .as_str()
        .is_some_and(|c| !c.is_empty())
}

/// Waits until dsv4d alone holds `profile` in power-profiles-daemon (the hold it replaced
/// is released just after the new one is taken) and the fixture's platform profile is
/// `platform` (power-profiles-daemon writes it as the profile changes); asserts both.
async fn held_by_dsv4d_alone(bus: &SystemBus, profile: &str, platform: &str) {
    let want = [("dsv4d".to_string(), profile.to_string())];
    let t = Instant::now();
    while bus.holds().await != want || bus.platform_profile() != platform {
        assert!(t.elapsed() < PATIENCE, "{:?}", bus.holds().await);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(bus.holds().await, want);
    assert_eq!(bus.platform_profile(), platform);
}

async fn power(d: &Daemon) -> Value {
    d.status().await["power"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_holds_performance_and_its_first_token_gives_power_saver_back() {
    let bus = SystemBus::with_platform_profile().await;
    let d = daemon(&bus, Some("performance")).await;
    let mut events = long_stream(&d, "1");

    // In the prefill, past prefill_after: performance, held by dsv4d alone.
    bus.wait_active("performance", PATIENCE).await;
    assert!(events.is_empty(), "performance came after the first token");
    held_by_dsv4d_alone(&bus, "performance", "performance").await;
    // The status says so once the hold it replaced is released.
    wait_power(&d, "on power.prefill", |p| p["prefill"] == true).await;
    let p = power(&d).await;
    assert_eq!(p["prefill"], true, "{p}");
    assert_eq!(
        p["cpu"], "performance held through net.hadess.PowerProfiles",
        "{p}"
    );

    // The first token: power-saver again, while the answer goes on.
    let first = tokio::time::timeout(PATIENCE * 4, events.recv())
        .await
        .expect("no answer within the patience")
        .expect("the answer ended without text");
    bus.wait_active("power-saver", PATIENCE).await;
    let back = Instant::now();
    let mut after = 0;
    while let Some(at) = events.recv().await {
        after += usize::from(at > back);
    }
    assert!(
        after > 0,
        "power-saver came back only at the answer's end ({:?} after its first token)",
        back - first
    );
    held_by_dsv4d_alone(&bus, "power-saver", "low-power").await;
    wait_power(&d, "back on power.cpu", |p| p["prefill"] == false).await;
    assert_eq!(power(&d).await["prefill"], false);
    d.log_with(&[
        "power: a request has been in its prefill for 1s: the CPU on performance",
        "power: no request is long in its prefill: the CPU on power-saver",
    ])
    .await;
}

/// Without `power.prefill`, the same prefill (longer than `prefill_after`) stays on
/// power-saver throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_power_prefill_a_long_prefill_stays_on_power_saver() {
    let bus = SystemBus::with_platform_profile().await;
    let d = daemon(&bus, None).await;
    let sent = Instant::now();
    let mut events = long_stream(&d, "2");
    let mut looked = 0;
    let prefill = loop {
        tokio::select! {
            first = events.recv() => {
                assert!(first.is_some(), "the answer ended without text");
                break sent.elapsed();
            }
            () = tokio::time::sleep(Duration::from_millis(50)) => {
                assert_eq!(bus.active().await, "power-saver");
                assert_eq!(bus.platform_profile(), "low-power");
                looked += 1;
            }
        }
        assert!(
            sent.elapsed() < PATIENCE * 4,
            "no answer within the patience"
        );
    };
    // The prefill outlasted prefill_after: with the key, it would have switched.
    assert!(prefill > Duration::from_secs(2), "{prefill:?}");
    assert!(looked > 10, "{looked}");
    assert_eq!(power(&d).await["prefill"], false);
    assert!(!d.log().contains("in its prefill for"), "{}", d.log());
}

/// With cpufreq (no power-profiles-daemon; a fixture's policies), a long prefill of the fake
/// engine puts the policies dsv4d set on performance's governor and EPP, its answer puts
/// them back on power-saver's, and the stop gives the user's own settings back byte for
/// byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_cpufreq_a_long_prefill_sets_performance_and_the_stop_gives_all_back() {
    use crate::power::{cpufreq_files, read, POLICIES};
    let tree = fixture_copy("strix-halo");
    let before = cpufreq_files(tree.path());
    let setup = |idle: &str| {
        Setup::default()
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level(
                "power",
                &format!(
                    "{{ method: cpufreq, prefill: performance, prefill_after: {PREFILL_AFTER} }}"
                ),
            )
            .top_level("monitor", "{ interval: 1h, idle_interval: 1h }")
            .engine("idle_timeout", idle)
            .knob("prefill_ms", "4000")
    };
    let d = Daemon::start(&setup("10m"));
    let governor = |i: u32| {
        read(
            tree.path(),
            &format!("{POLICIES}/policy{i}/scaling_governor"),
        )
    };
    let epp = |i: u32| {
        read(
            tree.path(),
            &format!("{POLICIES}/policy{i}/energy_performance_preference"),
        )
    };
    // Until the three policies dsv4d sets have `want`'s governor and EPP (written one file
    // after another) and the status says `prefill` (once they are written).
    let wait = |want: (&'static str, &'static str), prefill: bool| {
        let d = &d;
        async move {
            let t = Instant::now();
            loop {
                let files = (0..3).all(|i| (governor(i), epp(i)) == (want.0.into(), want.1.into()));
                if files && power(d).await["prefill"] == prefill {
                    return;
                }
                assert!(t.elapsed() < PATIENCE, "not {want:?} and prefill {prefill}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    let url = d.url("/v1/chat/completions");
    let request = tokio::spawn(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<Bytes>>();
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(
                chat(3, false).to_string(),
            )))
            .unwrap();
        client.request(req).await.unwrap().status()
    });
    wait(("performance", "performance"), true).await;
    assert!(!request.is_finished(), "performance came after the answer");
    for i in 0..3 {
        assert_eq!(
            (governor(i), epp(i)),
            ("performance".into(), "performance".into())
        );
    }
    // policy3 (acpi-cpufreq) is not dsv4d's to set.
    assert_eq!(governor(3), "schedutil");
    assert_eq!(power(&d).await["prefill"], true);
    assert_eq!(request.await.unwrap(), 200);
    wait(("powersave", "power"), false).await;
    for i in 0..3 {
        assert_eq!((governor(i), epp(i)), ("powersave".into(), "power".into()));
    }
    assert_eq!(power(&d).await["prefill"], false);
    d.reconfigure(&setup("1s")).await;
    d.wait_state(dsv4_client::State::Stopped, PATIENCE).await;
    let t = Instant::now();
    while cpufreq_files(tree.path()) != before {
        assert!(t.elapsed() < PATIENCE, "the settings were not given back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
