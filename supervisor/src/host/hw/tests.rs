//! Every reader against the fixture trees (`tests/fixtures/sysfs/`): a Strix Halo machine and
//! a bare one with nothing, as snapshots of what is found and of one whole sample.

use std::path::PathBuf;

use serde::Serialize;

use super::*;

fn fixture(name: &str) -> SysRoot {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/sysfs")
        .join(name);
    SysRoot::new(dir).unwrap()
}

/// What the readers make of a tree: the devices found, and one sample.
#[derive(Serialize)]
struct Reading {
    card: Option<amdgpu::Card>,
    k10temp: Option<hwmon::K10temp>,
    sample: Sample,
}

fn reading(root: SysRoot) -> Reading {
    let mut sampler = Sampler::new(root);
    let sample = sampler.sample(None, 1_000.0);
    Reading {
        card: sampler.card.clone(),
        k10temp: sampler.k10temp.clone(),
        sample,
    }
}

#[test]
fn strix_halo() {
    insta::assert_json_snapshot!(reading(fixture("strix-halo")));
}

#[test]
fn a_bare_machine_has_everything_absent() {
    let r = reading(fixture("bare"));
    assert!(r.card.is_none() && r.k10temp.is_none());
    assert_eq!(
        r.sample,
        Sample {
            at: 1_000.0,
            ..Sample::default()
        }
    );
    insta::assert_json_snapshot!(r);
}

/// A copy of the Strix Halo tree to change.
fn changeable() -> (tempfile::TempDir, SysRoot) {
    let dir = tempfile::tempdir().unwrap();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sysfs/strix-halo");
    copy_tree(&src, dir.path());
    let root = SysRoot::new(dir.path()).unwrap();
    (dir, root)
}

/// `cp -a`: the tree with its symbolic links as links.
fn copy_tree(src: &std::path::Path, dst: &std::path::Path) {
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(src.join("."))
        .arg(dst)
        .status()
        .unwrap();
    assert!(status.success());
}

const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

#[test]
fn odd_and_missing_files_are_absent_figures_not_errors() {
    let (dir, root) = changeable();
    let dev = dir.path().join(DEVICE);
    std::fs::write(dev.join("mem_info_gtt_used"), "lots\n").unwrap();
    std::fs::remove_file(dev.join("mem_info_gtt_total")).unwrap();
    std::fs::write(dev.join("gpu_busy_percent"), "250\n").unwrap();
    std::fs::write(dev.join("hwmon/hwmon3/temp1_input"), "").unwrap();
    std::fs::remove_file(dev.join("hwmon/hwmon3/power1_average")).unwrap();
    std::fs::write(dev.join("hwmon/hwmon3/power1_input"), "61000000\n").unwrap();
    std::fs::write(dev.join("gpu_metrics"), [0xFFu8; 7]).unwrap();
    std::fs::write(dir.path().join("proc/pressure/memory"), "\u{0}\u{1}").unwrap();
    let mut s = Sampler::new(root);
    let sample = s.sample(None, 5.0);
    let gpu = sample.gpu.unwrap();
    assert_eq!((gpu.memory.gtt_used, gpu.memory.gtt_total), (None, None));
    assert_eq!(gpu.busy_percent, None);
    assert_eq!(gpu.memory.vram_total, Some(536_870_912));
    assert_eq!(sample.temperatures.get(Sensor::Edge), None);
    // power1_input when there is no power1_average.
    assert_eq!(sample.power.soc, Some(61.0));
    assert_eq!(
        sample.power.soc_source,
        Some(dsv4_client::telemetry::PowerSource::Input)
    );
    // A table that does not decode: its figures are absent, the rest stand.
    assert_eq!(
        (sample.power.socket, sample.temperatures.get(Sensor::Gfx)),
        (None, None)
    );
    assert!(!sample.throttle.supported);
    assert_eq!(sample.pressure, None);
    assert_eq!(sample.temperatures.get(Sensor::Tctl), Some(74.25));
    assert!(sample.memory.is_some());
}

#[test]
fn a_rising_residency_counter_between_samples_is_throttling() {
    let (dir, root) = changeable();
    let metrics = dir.path().join(DEVICE).join("gpu_metrics");
    let mut s = Sampler::new(root);
    assert!(!s.sample(None, 10.0).throttle.active);
    assert!(!s.sample(None, 11.0).throttle.active);
    // throttle_residency_thm_gfx, at offset 248, goes from 3 to 5.
    let mut blob = std::fs::read(&metrics).unwrap();
    blob[248..252].copy_from_slice(&5u32.to_le_bytes());
    std::fs::write(&metrics, &blob).unwrap();
    let t = s.sample(None, 12.0).throttle;
    assert!(t.active && t.supported);
    assert_eq!(t.kinds, [dsv4_client::telemetry::ThrottleKind::Thermal]);
    assert_eq!((t.since, t.seconds.thermal), (Some(11.0), 1.0));
    let t = s.sample(None, 13.0).throttle;
    assert!(!t.active);
    assert_eq!(t.seconds.thermal, 1.0);
}

#[test]
fn a_card_that_appears_later_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let root = SysRoot::new(dir.path()).unwrap();
    let mut s = Sampler::new(root);
    assert!(s.sample(None, 1.0).gpu.is_none());
    copy_tree(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sysfs/strix-halo"),
        dir.path(),
    );
    // Looked for again only after a while, not on every sample.
    assert!(s.sample(None, 2.0).gpu.is_none());
    s.looked_at = None;
    assert_eq!(s.sample(None, 3.0).gpu.unwrap().card, "card1");
}

#[test]
fn the_engine_process_is_read_from_the_real_proc() {
    let mut s = Sampler::new(fixture("bare"));
    let sample = s.sample(Some(std::process::id()), 1.0);
    let e = sample.engine.unwrap();
    assert_eq!(e.pid, std::process::id());
    assert!(e.rss_bytes > 0);
    assert!(s.sample(None, 2.0).engine.is_none());
}
