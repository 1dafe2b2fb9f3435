//! Warm or cold: before each start dsv4d reads how much of the model's file the page cache
//! holds (mincore), shows it in the status, and records the load with its class. The real
//! llama-server on the tiny model padded to 40 MiB, on the disk (not a tmpfs, whose pages
//! never leave), its pages evicted before one load and read through before the next.

use std::path::PathBuf;

use dsv4_client::State;

use crate::support::*;

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

/// The fake engine's model file of profile 320k made `mib` MiB on the disk, out of the page
/// cache (the fake engine never reads it: only dsv4d's prewarm can bring it back).
fn evicted_model(d: &Daemon, mib: usize) -> std::path::PathBuf {
    use std::io::Write;
    let model = d.dir().join("profiles/models/320k.gguf");
    let mut file = std::fs::File::create(&model).unwrap();
    let mut mib_of_zeros = vec![0u8; 1 << 20];
    mib_of_zeros[..4].copy_from_slice(b"GGUF");
    file.write_all(&mib_of_zeros).unwrap();
    mib_of_zeros[..4].fill(0);
    for _ in 1..mib {
        file.write_all(&mib_of_zeros).unwrap();
    }
    file.sync_all().unwrap();
    evict(&model);
    model
}

/// The first line of the daemon's log with `needle`, once there is one.
async fn log_line(d: &Daemon, needle: &str) -> String {
    let log = d.log_with(&[needle]).await;
    log.lines()
        .find(|l| l.contains(needle))
        .unwrap()
        .to_string()
}

/// A daemon with `engine.prewarm` and the idle timeout `idle`.
fn prewarm_setup(idle: &str) -> Setup {
    Setup::default()
        .engine("idle_timeout", idle)
        .engine("prewarm", "true")
}

/// A daemon of `setup(idle)` whose engine served a request, its model made `mib` MiB and
/// evicted while the engine runs; with an idle timeout of an hour, so that nothing stops
/// before the test says (by a reload to `setup("1s")`).
async fn served_then_evicted(setup: impl Fn(&str) -> Setup, mib: usize) -> (Daemon, PathBuf) {
    let d = Daemon::start(&setup("1h"));
    let model = evicted_model(&d, mib);
    chat(&d).await;
    evict(&model);
    (d, model)
}

/// With `engine.prewarm`, after the idle stop the model evicted while the engine ran is read
/// back into the page cache, as fincore sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_idle_stop_prewarm_reads_an_evicted_model_back() {
    let (d, model) = served_then_evicted(prewarm_setup, 32).await;
    assert!(fincore(&model) < 1 << 20, "{}", fincore(&model));
    // Only then the idle stop: a timeout of a second, taken at once by a reload.
    d.reconfigure(&prewarm_setup("1s")).await;
    let said = log_line(&d, "prewarm: read ").await;
    // (Of 32 MiB: read, or found there after the kernel read ahead of a chunk.)
    assert!(
        said.contains(" of 32.0 MiB") && said.contains(": done"),
        "{said}"
    );
    let size = std::fs::metadata(&model).unwrap().len();
    assert_eq!(fincore(&model), size, "{said}");
    assert_eq!(d.status().await["state"], State::Stopped.as_str());
}

/// It reads no more than the memory available beyond `memory.reserve` (a fixture meminfo
/// with 12 MiB beyond it): one chunk of 8 MiB, and it says why it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_stops_at_the_memory_limit() {
    let tree = fixture_copy("strix-halo");
    let setup = |idle: &str| {
        prewarm_setup(idle)
            .args(&["--sysroot", tree.path().to_str().unwrap()])
            .top_level("memory", "{ reserve: 1GiB, return_timeout: 1s }")
    };
    let (d, model) = served_then_evicted(setup, 64).await;
    // While the engine runs, the box's memory runs short: 1 GiB and 12 MiB available.
    let meminfo = tree.path().join("proc/meminfo");
    let text = std::fs::read_to_string(&meminfo).unwrap();
    let text = text.replace(
        "MemAvailable:   118012544 kB",
        "MemAvailable:    1060864 kB",
    );
    assert!(
        text.contains("1060864"),
        "the fixture's MemAvailable changed"
    );
    std::fs::write(&meminfo, text).unwrap();
    // Only then the idle stop: a timeout of a second, taken at once by a reload.
    d.reconfigure(&setup("1s")).await;
    let said = log_line(&d, "prewarm: read ").await;
    assert!(
        said.contains("read 8.0 MiB of 64.0 MiB")
            && said
                .contains("stopped at the memory limit: 12.0 MiB available beyond memory.reserve"),
        "{said}"
    );
    assert!(fincore(&model) < 32 << 20, "{}", fincore(&model));
}

/// Without `engine.prewarm` nothing is read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_prewarm_an_evicted_model_stays_out_of_the_page_cache() {
    let d = Daemon::start(&Setup::default().engine("idle_timeout", "1s"));
    let model = evicted_model(&d, 32);
    chat(&d).await;
    evict(&model);
    d.wait_state(State::Stopped, PATIENCE).await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert!(!d.log().contains("prewarm:"), "{}", d.log());
    assert!(fincore(&model) < 1 << 20, "{}", fincore(&model));
}

/// A start stops a prewarm under way before its next chunk: a model of 512 MiB, evicted,
/// is being read back when a request comes; the engine starts and the prewarm says why it
/// stopped, having read less than the whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_stops_a_prewarm_under_way() {
    let (d, model) = served_then_evicted(prewarm_setup, 512).await;
    d.reconfigure(&prewarm_setup("1s")).await;
    log_line(&d, "prewarm: reading the model's files back").await;
    chat(&d).await;
    let said = log_line(&d, "prewarm: read ").await;
    assert!(said.contains(": stopped: a start began"), "{said}");
    let size = std::fs::metadata(&model).unwrap().len();
    assert!(fincore(&model) < size, "{said}");
}
