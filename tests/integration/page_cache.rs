//! Warm or cold: before each start dsv4d reads how much of the model's file the page cache
//! holds (mincore), shows it in the status, and records the load with its class. The real
//! llama-server on the tiny model padded to 40 MiB, on the disk (not a tmpfs, whose pages
//! never leave), its pages evicted before one load and read through before the next.

use std::path::Path;

use dsv4_client::State;

use crate::support::*;

/// Drops `path`'s pages from the page cache, as `dsv4d` never does for a user's load.
fn evict(path: &Path) {
    let file = std::fs::File::open(path).unwrap();
    nix::fcntl::posix_fadvise(
        &file,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
}

/// MiB of padding of this test's model.
const PAD_MIB: u32 = 40;

async fn chat(d: &Daemon) {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    });
    let resp = d.post("/v1/chat/completions", body).await;
    assert_eq!(resp.status(), 200, "{}", d.log());
    let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_start_says_how_much_of_the_model_was_cached_and_keeps_it_with_its_load() {
    let (_, model) = real::engine();
    // Large enough that what dsv4d reads of its header before the start (a readahead of a
    // few hundred KiB) is under 1% of it; its own file, which no other test evicts.
    let copy = crate::validate::padded_model(PAD_MIB);
    let mut s = real::setup();
    let profile = s.custom_profiles.get_mut("tiny").unwrap();
    *profile = profile.replace(&model.display().to_string(), &copy.display().to_string());
    let d = Daemon::start(&s);

    // Cold: nothing of it cached.
    evict(&copy);
    chat(&d).await;
    let cache = d.status().await["model_cache"].clone();
    assert_eq!(cache["class"], "cold", "{cache}");
    let size = std::fs::metadata(&copy).unwrap().len();
    assert_eq!(cache["total_bytes"], size, "{cache}");
    assert!(
        cache["resident_bytes"].as_u64().unwrap() < size / 10,
        "{cache}"
    );

    // Read through meanwhile (as the engine may not touch every page): the next start after
    // the idle stop is warm.
    d.wait_state(State::Stopped, PATIENCE).await;
    crate::validate::read_through(&copy);
    chat(&d).await;
    let cache = d.status().await["model_cache"].clone();
    assert_eq!(cache["class"], "warm", "{cache}");
    assert!(
        cache["resident_bytes"].as_u64().unwrap() * 10 >= size * 9,
        "{cache}"
    );
    // The dashboard says it, in a real browser.
    let dom = crate::dashboard::page_once(
        &format!("http://{}/ui", d.addr),
        "document.getElementById('model-cache').textContent.includes('warm load')",
    );
    assert!(dom.contains("model in page cache: 100% of"), "{dom}");
    let log = d.log();
    assert!(
        log.contains("model in the page cache: 100% of") && log.contains("(warm load)"),
        "{log}"
    );

    // Each load is kept with its class, for the estimate of the next of its class.
    d.wait_state(State::Stopped, PATIENCE).await;
    let book = std::fs::read_to_string(d.dir().join("state/load-times.json")).unwrap();
    let book: serde_json::Value = serde_json::from_str(&book).unwrap();
    let classes: Vec<&str> = book["tiny"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["class"].as_str().unwrap_or("-"))
        .collect();
    assert_eq!(classes, ["cold", "warm"], "{book}");
}
