//! The returning conversation: what the user waits for when they come back to a long
//! conversation, by what happened to the engine meanwhile.
//!
//! dsv4d runs the real llama-server, one thread, `--load-mode none` (no mmap), on the tiny
//! model with a 16K context, padded to `BENCH_PAD_MIB` MiB (default 384): the load reads the
//! whole file into the engine's memory, as a GPU engine copies its model into GTT, so a load
//! from the disk and one from the page cache differ, and the page cache's copy can be
//! evicted while the engine runs. A conversation's first turn is a 14,000-token message
//! (each round's its own: no cache holds it); its next turn adds the answer and a message of
//! a fourteenth of that (1,000 tokens). Timed: the next turn's first token as the client sees
//! it (its request sent to its first streamed token, a start included), and its prefill as
//! dsv4d records it (the engine's `prompt_ms`), with its prompt's tokens and those the
//! engine took from its cache, for:
//!
//! - (a) the engine never stopped;
//! - (b) dsv4d's idle stop in between, with `kv_checkpoint` (saved at the stop, restored at
//!   the start);
//! - (c) a stop without a checkpoint: what a supervisor that only stops and starts does;
//! - (d) (b) with the model's pages evicted from the page cache while the engine ran,
//!   without `engine.prewarm`, and (e) with it (read back after the stop).
//!
//! Then (a) to (c) on the real ds4-server with its tiny model (when the ds4 rig has built
//! them: `DSV4_DS4_SERVER`, `DSV4_DS4_MODEL`), a conversation of `BENCH_DS4_TOKENS` (500)
//! tokens, (b) with its disk KV (`kv_disk_dir`, saved by ds4-server at the stop, found by it
//! at the next start). ds4-server tells no `timings`: its prefill is dsv4d's clock, from the
//! request's sending to the engine to its first event.
//!
//! Prints each case's medians over `BENCH_ROUNDS` rounds (default 3) side by side, and
//! whether (b)'s prefill is within 10% of (a)'s and at least 5x shorter than (c)'s.
//!
//! Run: `cargo bench -p dsv4-tests --bench returning` (`tests/engine/prepare` first);
//! `BENCH_ONLY=llama` or `BENCH_ONLY=ds4` for one engine's part.

#[path = "../integration/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dsv4_client::State;
use serde_json::{json, Value};
use support::{env_or, Daemon, Setup};

/// One turn as timed: its first token as the client saw it, and the engine's prefill.
#[derive(Debug, Clone, Copy, Default)]
struct Turn {
    first_token_ms: f64,
    prompt_ms: f64,
    /// Its prompt's tokens, and those the engine took from its cache.
    prompt_n: u64,
    cache_n: u64,
}

/// A streamed chat of `messages`: the turn's figures and its answer's text.
async fn turn(d: &Daemon, messages: &[Value]) -> (Turn, String) {
    let body = json!({
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": true,
        // The usage at the end, from which dsv4d records the request's tokens.
        "stream_options": {"include_usage": true},
        "cache_prompt": true,
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = hyper::Request::post(d.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let before = recorded(d).await;
    let sent = Instant::now();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200, "{}", d.log());
    let (mut answer, mut first) = (String::new(), None);
    support::each_sse_data(resp.into_body(), |v| {
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            first.get_or_insert_with(|| sent.elapsed());
            answer.push_str(c);
        }
    })
    .await;
    let first = first.unwrap_or_else(|| panic!("no token in the answer:\n{}", d.log()));
    let record = record_after(d, before).await;
    let figure = |k: &str| record[k].as_f64().unwrap_or(f64::NAN);
    let turn = Turn {
        first_token_ms: first.as_secs_f64() * 1000.0,
        prompt_ms: figure("prompt_ms"),
        prompt_n: record["prompt_tokens"].as_u64().unwrap_or(0),
        cache_n: record["cached_tokens"].as_u64().unwrap_or(0),
    };
    (turn, answer)
}

/// How many requests dsv4d has recorded.
async fn recorded(d: &Daemon) -> u64 {
    d.status().await["requests"]["requests"]
        .as_u64()
        .unwrap_or(0)
}

/// dsv4d's record of the request after the `before`th: its prefill time (the engine's
/// `timings`, or dsv4d's clock from the request's sending to its first event for an engine
/// without them), its prompt tokens and those the engine took from its cache.
async fn record_after(d: &Daemon, before: u64) -> Value {
    let t = Instant::now();
    while recorded(d).await <= before {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no record:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = d.status().await;
    let recent = status["requests"]["recent"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    recent.last().cloned().unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    NeverStopped,
    Restored,
    NoCheckpoint,
    Evicted,
    Prewarmed,
}

impl Case {
    const ALL: [Case; 5] = [
        Case::NeverStopped,
        Case::Restored,
        Case::NoCheckpoint,
        Case::Evicted,
        Case::Prewarmed,
    ];

    fn name(self) -> &'static str {
        match self {
            Case::NeverStopped => "(a) never stopped",
            Case::Restored => "(b) idle stop, KV restored",
            Case::NoCheckpoint => "(c) stop without a checkpoint",
            Case::Evicted => "(d) (b), model evicted",
            Case::Prewarmed => "(e) (d) with engine.prewarm",
        }
    }
}

/// The engine the cases run on.
enum Engine {
    /// llama-server, on this model (the 16K tiny one, padded).
    Llama(PathBuf),
    /// ds4-server and its tiny model, with its disk KV (`kv_disk_dir`).
    Ds4(PathBuf, PathBuf),
}

impl Engine {
    fn cases(&self) -> &'static [Case] {
        match self {
            Engine::Llama(_) => &Case::ALL,
            Engine::Ds4(..) => &Case::ALL[..3],
        }
    }

    /// The first turn's message, in tokens (one character is one token of either tiny
    /// model).
    fn tokens(&self) -> usize {
        match self {
            Engine::Llama(_) => 14_000,
            Engine::Ds4(..) => env_or("BENCH_DS4_TOKENS", 500),
        }
    }

    fn model(&self) -> &Path {
        match self {
            Engine::Llama(model) | Engine::Ds4(_, model) => model,
        }
    }

    /// `case`'s daemon, to be started in `dir`.
    fn setup(&self, case: Case, dir: &Path) -> Setup {
        let idle = match case {
            Case::NeverStopped => "1h",
            _ => "1s",
        };
        let kv = !matches!(case, Case::NoCheckpoint | Case::NeverStopped);
        let mut s = match self {
            Engine::Llama(model) => {
                let kv = if kv {
                    "kv_checkpoint: { dir: kv }\n"
                } else {
                    ""
                };
                let mut s = Setup::default().engine("stop_timeout", "10s");
                // Read into the engine's own memory, as a GPU engine copies the model into
                // its GTT: the page cache's copy is then the file's alone, which an eviction
                // drops while the engine runs (a mapped page would stay).
                let profile = support::real::profile(model, 16_384, kv)
                    .replace("extra_args: [", "extra_args: [\"--load-mode\", \"none\", ");
                s.custom_profiles.insert("16k".into(), profile);
                s.default_profile = "16k".into();
                s
            }
            Engine::Ds4(server, model) => {
                let mut s = support::real::ds4_setup(server, model, dir, idle);
                if !kv {
                    let p = s.custom_profiles.get_mut("ds4").unwrap();
                    *p = p.replace("kv_disk_dir: kv\n", "");
                }
                s
            }
        };
        s = s.engine("idle_timeout", idle);
        match case {
            Case::Prewarmed => s.engine("prewarm", "true"),
            _ => s,
        }
    }
}

/// One round of `case`: the first turn, what happens in between, the next turn.
async fn round(d: &Daemon, engine: &Engine, case: Case, n: usize) -> Turn {
    let opening = format!("{case:?} {n} {}", "word ".repeat(engine.tokens() / 5));
    let mut messages = vec![json!({"role": "user", "content": opening})];
    let (_, answer) = turn(d, &messages).await;
    messages.push(json!({"role": "assistant", "content": answer}));
    // The next turn's own text: a fourteenth of the first (1,000 tokens after 14,000), as
    // an agent's next turn brings a tool's output.
    let next = format!("And then? {}", "more ".repeat(engine.tokens() / 14 / 5));
    messages.push(json!({"role": "user", "content": next}));
    if matches!(case, Case::Evicted | Case::Prewarmed) {
        support::evict(engine.model());
    }
    let prewarms = d.log().matches("prewarm: read ").count();
    if case != Case::NeverStopped {
        d.wait_state(State::Stopped, Duration::from_secs(120)).await;
    }
    match case {
        Case::Restored | Case::Evicted | Case::Prewarmed => {
            let kv = d.status().await["kv"]["profiles"][0].clone();
            assert_eq!(kv["last_save"]["result"], "saved", "{kv}");
        }
        _ => {}
    }
    if case == Case::Prewarmed {
        d.log_with_count("prewarm: read ", prewarms + 1).await;
    }
    turn(d, &messages).await.0
}

/// The 16K tiny model padded to `mib` MiB, made once in the engine's cache folder.
fn model(mib: u32) -> PathBuf {
    let dir = support::real::cache_dir().join("models");
    let out = dir.join(format!("tiny-16k-pad-{mib}mib.gguf"));
    if out.is_file() {
        return out;
    }
    let part = out.with_extension("part");
    let st = std::process::Command::new(support::real::cache_dir().join("venv/bin/python"))
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/make_tiny_gguf.py"))
        .arg(&part)
        .args(["--ctx", "16384", "--pad-mib", &mib.to_string()])
        .status()
        .expect("the engine's python (tests/engine/prepare)");
    assert!(st.success());
    std::fs::rename(&part, &out).unwrap();
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Each case of `engine`, `rounds` times: its next turns.
async fn run(engine: &Engine, rounds: usize) -> Vec<(Case, Vec<Turn>)> {
    let mut rows = Vec::new();
    for &case in engine.cases() {
        let dir = support::temp_dir("returning");
        let d = Daemon::start_in(&engine.setup(case, dir.path()), dir);
        let mut turns = Vec::new();
        for n in 0..rounds {
            turns.push(round(&d, engine, case, n).await);
        }
        rows.push((case, turns));
    }
    rows
}

/// The table of `rows`; the goal, when (a), (b) and (c) are in it.
fn print(rows: &[(Case, Vec<Turn>)]) {
    println!(
        "{:<32} {:>22} {:>22} {:>14} {:>12}",
        "case", "first token ms", "prefill ms", "prompt tokens", "from cache"
    );
    let mut prefill = Vec::new();
    for (case, turns) in rows {
        let m = |f: fn(&Turn) -> f64| median(turns.iter().map(f).collect());
        // The median, and the range over the rounds.
        let spread = |f: fn(&Turn) -> f64| {
            let v: Vec<f64> = turns.iter().map(f).collect();
            let (lo, hi) = v
                .iter()
                .fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
            format!("{:.0} ({lo:.0}-{hi:.0})", median(v))
        };
        prefill.push(m(|t| t.prompt_ms));
        println!(
            "{:<32} {:>22} {:>22} {:>14.0} {:>12.0}",
            case.name(),
            spread(|t| t.first_token_ms),
            spread(|t| t.prompt_ms),
            m(|t| t.prompt_n as f64),
            m(|t| t.cache_n as f64)
        );
    }
    let [a, b, c, ..] = prefill[..] else {
        return;
    };
    println!(
        "goal: (b)'s prefill within 10% of (a)'s: {} ({b:.1} ms against {a:.1}); at least 5x \
         shorter than (c)'s: {} ({:.1}x)",
        if (b - a).abs() <= 0.10 * a {
            "met"
        } else {
            "MISSED"
        },
        if b * 5.0 <= c { "met" } else { "MISSED" },
        c / b
    );
}

fn main() {
    let rounds = env_or::<u64>("BENCH_ROUNDS", 3).max(1) as usize;
    let mib = env_or::<u32>("BENCH_PAD_MIB", 384);
    let llama = Engine::Llama(model(mib));
    let ds4 = support::real::ds4_engine("the returning conversation on ds4-server")
        .map(|(server, model)| Engine::Ds4(server, model));
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let rt = support::bench_runtime();
    if only != "ds4" {
        let rows = rt.block_on(run(&llama, rounds));
        println!(
            "the next turn of a {}-token conversation: real llama-server, one thread, the \
             tiny model (16K context, padded to {mib} MiB); medians of {rounds} rounds",
            llama.tokens()
        );
        print(&rows);
    }
    if let Some(engine) = ds4.as_ref().filter(|_| only != "llama") {
        let rows = rt.block_on(run(engine, rounds));
        println!(
            "\nthe next turn of a {}-token conversation: real ds4-server, its tiny model \
             (context 4096), its disk KV for (b); medians of {rounds} rounds",
            engine.tokens()
        );
        print(&rows);
    }
}
