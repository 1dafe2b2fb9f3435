//! KV checkpoint benchmark: what a stop costs the next request of a long conversation,
//! with checkpoints and without.
//!
//! dsv4d runs the real llama-server on the tiny model (context 4096) with `kv_checkpoint`,
//! and an idle engine stops after 1 s. Each round: with no checkpoint on disk, a prompt of
//! about 2,800 tokens (a cold start and a cold prefill); the idle stop saves the cache; then
//! the same prompt plus a few tokens (a start that restores the cache and prefills only the
//! new tokens). Prints, over `BENCH_ROUNDS` rounds (default 5), the median and the range of:
//! the cold prefill (the engine's `prompt_ms`), the save and the restore (dsv4d's own
//! measure of each step), the prefill after the restore, and each request's whole time as
//! the client sees it, engine start included.
//!
//! Run: `cargo bench -p dsv4-tests --bench kv` (needs `tests/engine/prepare` first).

#[path = "../integration/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use dsv4_client::State;
use serde_json::{json, Value};
use support::{body_json, env_or, Daemon, Setup};

/// The request's timings and its whole time in ms.
async fn complete(d: &Daemon, prompt: &str) -> (Value, f64) {
    let t = Instant::now();
    let body = json!({"prompt": prompt, "n_predict": 4, "cache_prompt": true});
    let (status, _, v) = body_json(d.post("/completion", body).await).await;
    assert_eq!(status, 200, "{v}");
    (v["timings"].clone(), t.elapsed().as_secs_f64() * 1000.0)
}

async fn kv_status(d: &Daemon) -> Value {
    d.status().await["kv"]["profiles"][0].clone()
}

async fn wait_stopped(d: &Daemon) {
    d.wait_state(State::Stopped, Duration::from_secs(30)).await;
}

fn row(name: &str, unit: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    let median = v[v.len() / 2];
    println!(
        "{name:<44} {median:>10.2} {unit:<3} (min {:.2}, max {:.2})",
        v[0],
        v[v.len() - 1]
    );
}

fn main() {
    let rounds = env_or::<u64>("BENCH_ROUNDS", 5).max(1) as usize;
    let (_, model) = support::real::engine();
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .engine("stop_timeout", "5s");
    s.custom_profiles.insert(
        "tiny".into(),
        support::real::profile(&model, 4096, "kv_checkpoint: { dir: kv }\n"),
    );
    s.default_profile = "tiny".into();
    let rt = support::bench_runtime();
    rt.block_on(async {
        let d = Daemon::start(&s);
        let prompt = "abc ".repeat(700);
        let longer = format!("{prompt}xyz");
        let mut cold_prefill = Vec::new();
        let mut cold_wall = Vec::new();
        let mut save = Vec::new();
        let mut restore = Vec::new();
        let mut warm_prefill = Vec::new();
        let mut warm_wall = Vec::new();
        let mut tokens = (0, 0, 0);
        for _ in 0..rounds {
            // No checkpoint: the request pays the whole prefill.
            let _ = std::fs::remove_dir_all(d.dir().join("profiles/kv"));
            let (t, wall) = complete(&d, &prompt).await;
            assert_eq!(t["cache_n"], 0, "{t}");
            cold_prefill.push(t["prompt_ms"].as_f64().unwrap());
            cold_wall.push(wall);
            wait_stopped(&d).await;
            let kv = kv_status(&d).await;
            assert_eq!(kv["last_save"]["result"], "saved", "{kv}");
            save.push(kv["last_save"]["seconds"].as_f64().unwrap() * 1000.0);
            // Restored: only the new tokens are prefilled.
            let (t, wall) = complete(&d, &longer).await;
            let kv = kv_status(&d).await;
            assert_eq!(kv["last_restore"]["result"], "restored", "{kv}");
            restore.push(kv["last_restore"]["seconds"].as_f64().unwrap() * 1000.0);
            warm_prefill.push(t["prompt_ms"].as_f64().unwrap());
            warm_wall.push(wall);
            tokens = (
                t["cache_n"].as_u64().unwrap(),
                t["prompt_n"].as_u64().unwrap(),
                kv["last_save"]["bytes"].as_u64().unwrap(),
            );
            wait_stopped(&d).await;
        }
        println!(
            "tiny model, context 4096, {rounds} rounds: a {}-token prompt, then {} more tokens \
             after an idle stop; checkpoint {} bytes",
            tokens.0, tokens.1, tokens.2
        );
        row("cold prefill (engine prompt_ms)", "ms", cold_prefill);
        row("save at the idle stop (dsv4d)", "ms", save);
        row("restore at the next start (dsv4d)", "ms", restore);
        row(
            "prefill after the restore (engine prompt_ms)",
            "ms",
            warm_prefill,
        );
        row("request, cold start + cold prefill", "ms", cold_wall);
        row("request, start + restore + new tokens", "ms", warm_wall);
    });
}
