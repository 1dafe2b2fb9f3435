//! The thermal policy end to end: `dsv4d --sysroot` on a fixture copy whose temperatures a
//! test raises and lowers; the `ThermalEvent` signals, the status, the metric, and what
//! `thermal.on_critical` does to the engine and to requests.

use std::time::{Duration, Instant};

use dsv4_client::State;
use futures_util::StreamExt;

use crate::support::*;

const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

struct Hot {
    tree: TempDir,
    d: Daemon,
    events: dsv4_client::ThermalEventStream,
    _bus: PrivateBus,
}

impl Hot {
    async fn start(on_critical: &str, knobs: &[(&'static str, &str)]) -> Hot {
        let bus = PrivateBus::start();
        let tree = fixture_copy("strix-halo");
        let mut setup = Setup::default()
            .session_bus(&bus)
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("monitor", "{ interval: 100ms, idle_interval: 100ms }")
            .top_level(
                "thermal",
                &format!(
                    "{{ warn: 85C, critical: 95C, hysteresis: 5C, on_critical: {on_critical} }}"
                ),
            )
            .engine("idle_timeout", "10m");
        for (k, v) in knobs {
            setup = setup.knob(k, v);
        }
        let d = Daemon::start(&setup);
        let events = live_proxy(&bus, &d)
            .await
            .receive_thermal_event()
            .await
            .unwrap();
        Hot {
            tree,
            d,
            events,
            _bus: bus,
        }
    }

    fn edge(&self, celsius: f64) {
        let file = self
            .tree
            .path()
            .join(DEVICE)
            .join("hwmon/hwmon3/temp1_input");
        std::fs::write(file, format!("{}\n", (celsius * 1000.0) as i64)).unwrap();
    }

    /// The next event: (level, sensor, celsius, message).
    async fn next(&mut self) -> (String, String, f64, String) {
        let e = tokio::time::timeout(PATIENCE, self.events.next())
            .await
            .unwrap_or_else(|_| panic!("no ThermalEvent\n{}", self.d.log()))
            .unwrap();
        let a = e.args().unwrap();
        (
            a.level.to_string(),
            a.sensor.to_string(),
            a.celsius,
            a.message.to_string(),
        )
    }

    /// No event within `wait`.
    async fn quiet(&mut self, wait: Duration) {
        if let Ok(Some(e)) = tokio::time::timeout(wait, self.events.next()).await {
            panic!("an event: {:?}", e.args().unwrap().message);
        }
    }
}

async fn chat_status(d: &Daemon) -> (u16, serde_json::Value) {
    let (status, _, v) = d
        .send("POST", "/v1/chat/completions", &[], Some(chat(3, false)))
        .await;
    (status, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn levels_are_announced_once_each_and_on_critical_stop_refuses_with_the_temperature() {
    let mut h = Hot::start("stop", &[]).await;
    assert_eq!(chat_status(&h.d).await.0, 200);
    h.edge(86.0);
    let (level, sensor, celsius, message) = h.next().await;
    assert_eq!(
        (level.as_str(), sensor.as_str(), celsius),
        ("warn", "edge", 86.0)
    );
    assert_eq!(message, "edge temperature 86.0 C: hot (at or above 85 C)");
    // Noise around the threshold: nothing more.
    h.edge(84.5);
    h.quiet(Duration::from_millis(400)).await;
    h.edge(85.5);
    h.quiet(Duration::from_millis(400)).await;
    let (_, metrics) = {
        let (s, _, v) = h.d.send("GET", "/metrics", &[], None).await;
        (s, v.as_str().unwrap().to_string())
    };
    assert!(
        metrics.contains("dsv4_thermal_level{sensor=\"edge\"} 1\n"),
        "{metrics}"
    );

    h.edge(96.5);
    let (level, _, celsius, _) = h.next().await;
    assert_eq!((level.as_str(), celsius), ("critical", 96.5));
    h.d.wait_state(State::Stopped, PATIENCE).await;
    let (status, v) = chat_status(&h.d).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(v["error"]["code"], "too_hot", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("edge at 96.5 C, critical at 95 C"), "{m}");
    let s = h.d.status().await;
    assert_eq!(s["thermal"]["level"], "critical", "{s}");
    assert_eq!(s["thermal"]["sensors"][0]["peak"], 96.5, "{s}");
    assert!(
        s["thermal"]["action"]
            .as_str()
            .unwrap()
            .contains("requests refused"),
        "{s}"
    );
    assert_eq!(h.d.spawns(), 1);

    // Cooled below warn less the hysteresis: announced, and requests are served again.
    h.edge(79.0);
    let (level, _, _, message) = h.next().await;
    assert_eq!(level, "normal", "{message}");
    assert_eq!(
        message,
        "edge temperature 79.0 C: back to normal (below 80 C)"
    );
    let t = Instant::now();
    loop {
        let (status, v) = chat_status(&h.d).await;
        if status == 200 {
            break;
        }
        assert!(t.elapsed() < PATIENCE, "{v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(h.d.spawns(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_when_idle_lets_a_stream_finish_then_stops() {
    let mut h = Hot::start("stop-when-idle", &[("token_ms", "50")]).await;
    // 10 s of stream: it still runs when the checks below are done, however slow the
    // machine.
    let resp = h.d.post("/v1/chat/completions", chat(200, true)).await;
    let mut stream = Stream::new(resp.into_body());
    stream.next_event().await.unwrap();
    h.edge(97.0);
    let (level, ..) = h.next().await;
    assert_eq!(level, "critical");
    // The stream goes on to its end; a new request is refused meanwhile.
    let (status, v) = chat_status(&h.d).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(h.d.status().await["state"], State::Draining.as_str());
    let (content, done, _) = stream.collect_chat().await;
    assert!(done, "the stream was cut: {content:?}");
    assert_eq!(content.len(), 199);
    h.d.wait_state(State::Stopped, PATIENCE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rising_residency_counter_is_a_throttling_event_and_notify_leaves_the_engine() {
    let mut h = Hot::start("notify", &[]).await;
    assert_eq!(chat_status(&h.d).await.0, 200);
    let metrics_file = h.tree.path().join(DEVICE).join("gpu_metrics");
    let mut blob = std::fs::read(&metrics_file).unwrap();
    blob[248..252].copy_from_slice(&9u32.to_le_bytes());
    std::fs::write(&metrics_file, &blob).unwrap();
    let (level, sensor, celsius, message) = h.next().await;
    assert_eq!(
        (level.as_str(), sensor.as_str()),
        ("throttling", "throttle")
    );
    assert!(celsius.is_nan());
    assert_eq!(message, "the hardware is throttling (thermal)");
    let s = h.d.status().await;
    assert!(s["thermal"]["throttling_since"].is_f64(), "{s}");
    // Critical with notify only: announced, and the engine keeps serving.
    h.edge(99.0);
    let (level, ..) = h.next().await;
    assert_eq!(level, "critical");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(chat_status(&h.d).await.0, 200);
    assert_eq!(h.d.status().await["state"], State::Ready.as_str());
}
