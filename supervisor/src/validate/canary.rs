//! The correctness canary: a few fixed prompts, greedy, with the engine's top
//! log-probabilities where it gives them, compared with the profile's reference. Throughput is
//! not correctness: a backend that computes wrong logits does so at full speed.
//!
//! Owns: the prompts, one run on an engine, the comparison, and the reference, kept in
//! `state_dir/canary/<profile>.json`.

use std::path::{Path, PathBuf};

use dsv4_client::validate::{CanaryPrompt, CanaryRun, CanaryToken, Drift, TopLogprob};
use serde_json::{json, Value};

use super::measure::Api;
use crate::kv::engine::Engine;
use crate::lifecycle::engine_ref::EngineRef;

/// The prompts: text the tiny test models and the real one continue alike.
pub const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "0 1 2 3 4 5 6 7",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
];
/// Tokens generated per prompt.
pub const TOKENS: u64 = 16;
/// Alternatives asked for per position (llama-server's `n_probs`).
pub const TOP: u64 = 5;
/// The largest difference of a log-probability (nats) from the reference that is not a
/// drift. Measured here, llama-server on the CPU gave the same log-probabilities to the last
/// bit over 20 runs of the canary, and with 1 and 2 threads; GPU backends reduce in orders
/// that vary from run to run, by far less than this; a backend that computes wrong logits
/// (perplexity 727 against 7.0) moves them by nats.
pub const TOLERANCE: f64 = 0.1;

/// One canary run on `engine`, through `api`.
pub async fn run(api: Api, engine: &EngineRef) -> Result<Vec<CanaryPrompt>, String> {
    let mut out = Vec::new();
    for prompt in PROMPTS {
        out.push(self::prompt(api, engine, prompt).await?);
    }
    Ok(out)
}

/// One of the canary's prompts on `engine`, through `api`.
pub async fn prompt(api: Api, engine: &EngineRef, prompt: &str) -> Result<CanaryPrompt, String> {
    match api {
        Api::Native => native(engine, prompt).await,
        Api::Streamed => text_only(engine, prompt).await,
    }
}

/// llama-server's `/completion`, greedy, with the top log-probabilities of each position.
async fn native(engine: &EngineRef, prompt: &str) -> Result<CanaryPrompt, String> {
    let body = json!({
        "prompt": prompt, "n_predict": TOKENS, "temperature": 0.0, "n_probs": TOP,
        "cache_prompt": false,
    });
    let v: Value = engine
        .call_json(http::Method::POST, "/completion", Some(body))
        .await?;
    let probs = v["completion_probabilities"]
        .as_array()
        .ok_or("the engine's answer has no completion_probabilities")?;
    let token = |p: &Value| -> Option<TopLogprob> {
        Some(TopLogprob {
            id: p["id"].as_i64()?,
            text: p["token"].as_str()?.to_string(),
            logprob: p["logprob"].as_f64()?,
        })
    };
    let tokens = probs
        .iter()
        .map(|p| {
            let top: Option<Vec<TopLogprob>> = p["top_logprobs"]
                .as_array()
                .map(|t| t.iter().map(token).collect())
                .unwrap_or(Some(Vec::new()));
            Some(CanaryToken {
                text: p["token"].as_str()?.to_string(),
                top: top?,
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or("the engine's completion_probabilities are not as llama-server gives them")?;
    Ok(CanaryPrompt {
        prompt: prompt.to_string(),
        text: v["content"].as_str().unwrap_or_default().to_string(),
        tokens,
    })
}

/// An engine that gives no log-probabilities (ds4-server): the greedy text of
/// `/v1/completions`.
async fn text_only(engine: &EngineRef, prompt: &str) -> Result<CanaryPrompt, String> {
    let body = json!({
        "model": "canary", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
        "stream": false,
    });
    let v: Value = engine
        .call_json(http::Method::POST, "/v1/completions", Some(body))
        .await?;
    let text = v["choices"][0]["text"]
        .as_str()
        .ok_or("the engine's answer has no choices[0].text")?;
    Ok(CanaryPrompt {
        prompt: prompt.to_string(),
        text: text.to_string(),
        tokens: Vec::new(),
    })
}

/// Where `got` first leaves `reference`, beyond `tolerance` for a log-probability.
pub fn drift(reference: &CanaryRun, got: &CanaryRun, tolerance: f64) -> Option<Drift> {
    let n = reference.prompts.len().max(got.prompts.len());
    (0..n).find_map(|i| {
        let (r, g) = (reference.prompts.get(i), got.prompts.get(i));
        let at = |position, expected: String, got: String| Drift {
            prompt: i + 1,
            prompt_text: r.or(g).map(|p| p.prompt.clone()).unwrap_or_default(),
            position,
            expected,
            got,
        };
        let (r, g) = match (r, g) {
            (Some(r), Some(g)) if r.prompt == g.prompt => (r, g),
            (r, g) => {
                let shown = |p: Option<&CanaryPrompt>| {
                    p.map_or("no prompt".into(), |p| format!("the prompt {:?}", p.prompt))
                };
                return Some(at(0, shown(r), shown(g)));
            }
        };
        match r.tokens.is_empty() || g.tokens.is_empty() {
            true => text_drift(&r.text, &g.text).map(|(p, e, g)| at(p, e, g)),
            false => token_drift(&r.tokens, &g.tokens, tolerance).map(|(p, e, g)| at(p, e, g)),
        }
    })
}

/// The first character where two answers differ, and each from there (a few characters).
fn text_drift(reference: &str, got: &str) -> Option<(usize, String, String)> {
    let (r, g): (Vec<char>, Vec<char>) = (reference.chars().collect(), got.chars().collect());
    let at = (0..r.len().max(g.len())).find(|&i| r.get(i) != g.get(i))?;
    let from = |c: &[char]| format!("{:?}", c.iter().skip(at).take(12).collect::<String>());
    Some((at, from(&r), from(&g)))
}

/// The first position where the greedy pick differs, or a top log-probability moved beyond
/// `tolerance`: a token in both tops by more than it, or one in a single top above the other
/// top's last by more than it (it should have been there).
fn token_drift(
    reference: &[CanaryToken],
    got: &[CanaryToken],
    tolerance: f64,
) -> Option<(usize, String, String)> {
    let shown = |t: Option<&CanaryToken>| t.map_or("the end".into(), |t| format!("{:?}", t.text));
    (0..reference.len().max(got.len())).find_map(|i| {
        let (r, g) = (reference.get(i), got.get(i));
        let (Some(r), Some(g)) = (r, g) else {
            return Some((i, shown(r), shown(g)));
        };
        if r.text != g.text {
            return Some((i, shown(Some(r)), shown(Some(g))));
        }
        top_drift(&r.top, &g.top, tolerance).map(|(e, g)| (i, e, g))
    })
}

fn top_drift(r: &[TopLogprob], g: &[TopLogprob], tolerance: f64) -> Option<(String, String)> {
    let floor = |top: &[TopLogprob]| top.iter().map(|t| t.logprob).fold(f64::MAX, f64::min);
    let shown = |t: &TopLogprob| format!("{:?} at {:.3}", t.text, t.logprob);
    for t in r {
        match g.iter().find(|x| x.id == t.id) {
            Some(x) if (x.logprob - t.logprob).abs() > tolerance => {
                return Some((shown(t), shown(x)));
            }
            None if t.logprob > floor(g) + tolerance => {
                return Some((shown(t), format!("{:?} not in the top {}", t.text, g.len())));
            }
            _ => {}
        }
    }
    g.iter()
        .filter(|x| !r.iter().any(|t| t.id == x.id))
        .find(|x| x.logprob > floor(r) + tolerance)
        .map(|x| (format!("{:?} not in the top {}", x.text, r.len()), shown(x)))
}

fn path(state_dir: &Path, profile: &str) -> PathBuf {
    state_dir.join("canary").join(format!("{profile}.json"))
}

/// The profile's reference, when one was recorded and can be read.
pub fn reference(state_dir: &Path, profile: &str) -> Option<CanaryRun> {
    let file = path(state_dir, profile);
    let text = crate::host::regular::read_state(&file)?;
    serde_json::from_str(&text)
        .map_err(|e| tracing::warn!("{}: {e}; the canary is recorded again", file.display()))
        .ok()
}

/// Keeps `run` as the profile's reference.
pub fn record(state_dir: &Path, profile: &str, run: &CanaryRun) -> std::io::Result<()> {
    crate::host::state_file::write_json(&path(state_dir, profile), run)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top(alts: &[(i64, f64)]) -> Vec<TopLogprob> {
        alts.iter()
            .map(|&(id, logprob)| TopLogprob {
                id,
                text: format!("t{id}"),
                logprob,
            })
            .collect()
    }

    fn run(tokens: &[(&str, &[(i64, f64)])]) -> CanaryRun {
        let tokens = tokens
            .iter()
            .map(|(text, alts)| CanaryToken {
                text: text.to_string(),
                top: top(alts),
            })
            .collect();
        CanaryRun {
            prompts: vec![CanaryPrompt {
                prompt: "p".into(),
                text: String::new(),
                tokens,
            }],
            ..CanaryRun::default()
        }
    }

    #[test]
    fn a_drift_is_found_where_it_begins_and_noise_is_not_one() {
        let reference = run(&[
            ("a", &[(1, -0.01), (2, -5.0), (3, -6.0)]),
            ("b", &[(4, -0.2), (5, -1.9), (6, -4.0)]),
        ]);
        type Row<'a> = (
            &'a [(&'a str, &'a [(i64, f64)])],
            Option<(usize, &'a str, &'a str)>,
        );
        let rows: &[Row] = &[
            // The same, and within the tolerance.
            (
                &[
                    ("a", &[(1, -0.01), (2, -5.0), (3, -6.0)]),
                    ("b", &[(4, -0.2), (5, -1.9), (6, -4.0)]),
                ],
                None,
            ),
            (
                &[
                    ("a", &[(1, -0.05), (2, -5.09), (3, -6.0)]),
                    ("b", &[(4, -0.2), (5, -1.9), (6, -4.0)]),
                ],
                None,
            ),
            // The tail of a top may swap near its floor.
            (
                &[
                    ("a", &[(1, -0.01), (2, -5.0), (7, -5.95)]),
                    ("b", &[(4, -0.2), (5, -1.9), (6, -4.0)]),
                ],
                None,
            ),
            // Another greedy pick.
            (
                &[("a", &[(1, -0.01)]), ("c", &[(7, -0.1)])],
                Some((1, "\"b\"", "\"c\"")),
            ),
            // A log-probability moved beyond it.
            (
                &[("a", &[(1, -0.01), (2, -5.3), (3, -6.0)]), ("b", &[])],
                Some((0, "\"t2\" at -5.000", "\"t2\" at -5.300")),
            ),
            // A token that should be in the top is not.
            (
                &[("a", &[(1, -0.01), (3, -6.0), (8, -6.05)]), ("b", &[])],
                Some((0, "\"t2\" at -5.000", "\"t2\" not in the top 3")),
            ),
            // One that was far below the top is in it.
            (
                &[("a", &[(1, -0.01), (2, -5.0), (9, -3.0)]), ("b", &[])],
                Some((0, "\"t9\" not in the top 3", "\"t9\" at -3.000")),
            ),
            // Shorter.
            (
                &[("a", &[(1, -0.01), (2, -5.0), (3, -6.0)])],
                Some((1, "\"b\"", "the end")),
            ),
        ];
        for (got, want) in rows {
            let d = drift(&reference, &run(got), TOLERANCE);
            let d = d
                .as_ref()
                .map(|d| (d.position, d.expected.as_str(), d.got.as_str()));
            assert_eq!(d, *want, "{got:?}");
        }
    }

    #[test]
    fn an_engine_without_log_probabilities_is_compared_by_its_text() {
        let text = |t: &str| CanaryRun {
            prompts: vec![CanaryPrompt {
                prompt: "p".into(),
                text: t.into(),
                tokens: Vec::new(),
            }],
            ..CanaryRun::default()
        };
        assert_eq!(drift(&text("Hi there"), &text("Hi there"), TOLERANCE), None);
        let d = drift(&text("Hi there"), &text("Hi thorn"), TOLERANCE).unwrap();
        assert_eq!((d.prompt, d.position), (1, 5));
        assert_eq!(
            (d.expected.as_str(), d.got.as_str()),
            ("\"ere\"", "\"orn\"")
        );
        assert_eq!(
            d.to_string(),
            "canary drift at prompt 1 (\"p\"), token 5: expected \"ere\", got \"orn\""
        );
        // Other prompts than the reference's: nothing to compare, said as a drift.
        let mut other = text("Hi there");
        other.prompts[0].prompt = "q".into();
        let d = drift(&text("Hi there"), &other, TOLERANCE).unwrap();
        assert_eq!(d.expected, "the prompt \"p\"");
    }
}
