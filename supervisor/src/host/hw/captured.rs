//! The readers against sysfs captured from real machines (`tests/fixtures/captured/`, where
//! each capture's source is cited). The expected figures below were read off the captured
//! bytes by hand, with the kernel's structures, not with the decoder under test.

use std::path::PathBuf;

use super::gpu_metrics::{decode, DecodeError, ThrottleReading};
use super::*;

fn capture(gpu: &str) -> SysRoot {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/captured/lact")
        .join(gpu);
    SysRoot::new(dir).unwrap()
}

fn table(root: &SysRoot) -> Vec<u8> {
    let card = amdgpu::Card::find(root).expect("an AMD card");
    root.read_bytes(&format!("{}/gpu_metrics", card.device))
        .unwrap()
}

#[test]
fn strix_point_v3_0() {
    let root = capture("strixpoint");
    let m = decode(&table(&root)).unwrap();
    assert_eq!((m.revision, m.layout), ((3, 0), "3.0"));
    assert_eq!(m.gfx_celsius, Some(38.12));
    assert_eq!(m.soc_celsius, Some(40.62));
    assert_eq!(m.core_max_celsius, Some(50.0));
    // Percent on v3.0: the same figure as the driver's gpu_busy_percent in this capture.
    assert_eq!(m.gfx_busy_percent, Some(3.0));
    assert_eq!(m.socket_watts, Some(9.839));
    assert_eq!(m.apu_watts, Some(9.839));
    assert_eq!(m.gfx_watts, Some(1.536));
    assert_eq!(
        m.throttle,
        Some(ThrottleReading::Residency([
            28, 1868, 92382, 257, 1795, 0, 0
        ]))
    );

    let sample = Sampler::new(root).sample(None, 1.0);
    let gpu = sample.gpu.unwrap();
    assert_eq!(gpu.card, "card1");
    assert_eq!(gpu.busy_percent, Some(3.0));
    assert_eq!(gpu.memory.vram_total, Some(536_870_912));
    assert_eq!(
        (gpu.memory.gtt_used, gpu.memory.gtt_total),
        (Some(3_946_811_392), Some(16_441_004_032))
    );
    assert_eq!(
        gpu.performance_level,
        Some(dsv4_client::words::GpuLevel::Auto)
    );
    assert_eq!(sample.temperatures.get(Sensor::Edge), Some(38.0));
    assert_eq!(sample.power.soc, Some(9.087));
    assert_eq!(sample.power.socket, Some(9.839));
}

#[test]
fn phoenix_v2_1_in_centi_percent() {
    let root = capture("phoenix");
    let m = decode(&table(&root)).unwrap();
    assert_eq!((m.revision, m.layout), ((2, 1), "2.1"));
    assert_eq!(m.gfx_celsius, Some(25.0));
    assert_eq!(m.soc_celsius, Some(27.37));
    assert_eq!(m.core_max_celsius, Some(25.87));
    // The table holds 79: 0.79 %, which the driver's integer gpu_busy_percent shows as 0.
    assert_eq!(m.gfx_busy_percent, Some(0.79));
    let busy: u32 = root
        .value("/sys/class/drm/card1/device/gpu_busy_percent")
        .unwrap();
    assert_eq!(m.gfx_busy_percent.map(|p| p.floor() as u32), Some(busy));
    assert_eq!(m.socket_watts, Some(3.401));
    assert_eq!(m.gfx_watts, Some(0.585));
    assert_eq!(m.apu_watts, None);
    assert_eq!(m.throttle, None);

    let sample = Sampler::new(root).sample(None, 1.0);
    let gpu = sample.gpu.unwrap();
    assert_eq!(gpu.memory.vram_total, Some(4_294_967_296));
    assert_eq!(gpu.memory.gtt_used, Some(211_398_656));
    assert_eq!(sample.temperatures.get(Sensor::Edge), Some(25.0));
    assert_eq!(sample.temperatures.get(Sensor::Gfx), Some(25.0));
    assert_eq!(sample.power.soc, Some(3.103));
}

/// Discrete cards write v1.3, which dsv4 does not decode: it says so, and reads the rest.
#[test]
fn discrete_cards_v1_3() {
    for (gpu, card, edge, busy) in [
        ("rx7800xt", "card1", 24.0, 2.0),
        ("rx9070", "card1", 48.0, 25.0),
        ("rx7600s", "card1", 53.0, 0.0),
        // This capture's files are padded with NUL bytes to 4096.
        ("rx6900xt", "card0", 56.0, 3.0),
    ] {
        let root = capture(gpu);
        assert_eq!(
            decode(&table(&root)),
            Err(DecodeError::Unknown {
                format: 1,
                content: 3,
                size: 120
            }),
            "{gpu}"
        );
        let sample = Sampler::new(root).sample(None, 1.0);
        let g = sample.gpu.unwrap();
        assert_eq!(g.card, card, "{gpu}");
        assert_eq!(g.busy_percent, Some(busy), "{gpu}");
        assert_eq!(sample.temperatures.get(Sensor::Edge), Some(edge), "{gpu}");
        assert_eq!(sample.temperatures.get(Sensor::Gfx), None, "{gpu}");
        assert!(!sample.throttle.supported, "{gpu}");
    }
    let g = Sampler::new(capture("rx6900xt"))
        .sample(None, 1.0)
        .gpu
        .unwrap();
    assert_eq!(g.memory.vram_total, Some(17_163_091_968));
    assert_eq!(
        g.performance_level,
        Some(dsv4_client::words::GpuLevel::Auto)
    );
}
