//! `dsv4ctl validate`: the validation run's request, its progress and its result document,
//! and the arithmetic both ends share (mean, sample SD, the comparison with an earlier run).

use serde::{Deserialize, Serialize};

/// What `Validate(s)` is asked to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValidateRequest {
    /// The validation profile (`64k` when not given).
    pub profile: Option<String>,
    /// How many times each test runs.
    pub runs: u32,
    /// One more cold prefill of exactly this many tokens, with its wall time.
    #[serde(default)]
    pub long: Option<u64>,
    /// Tokens of the prefill test (4,096 when not given).
    #[serde(default)]
    pub prefill: Option<u64>,
}

/// One line of progress (`ValidationProgress` signal).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// What happens: `switching`, `run`, `switching back`, ...
    pub step: String,
    pub test: Option<String>,
    pub run: Option<u32>,
    pub runs: Option<u32>,
    /// The run's figure (tok/s, or s for `long_prefill`'s wall time).
    pub value: Option<f64>,
    pub message: String,
}

/// What the host did over a test's runs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TestTelemetry {
    pub edge_mean_c: Option<f64>,
    pub edge_max_c: Option<f64>,
    pub soc_power_mean_w: Option<f64>,
    /// The hwmon file the SoC power was read from (`power1_average` or `power1_input`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soc_power_source: Option<crate::telemetry::PowerSource>,
    /// Energy per token: the mean SoC power over the test's span divided by its mean rate
    /// (joules per generated token for a decode test, per prefilled token for a prefill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub joules_per_token: Option<f64>,
    pub gtt_before_bytes: Option<u64>,
    pub gtt_after_bytes: Option<u64>,
    pub available_before_bytes: Option<u64>,
    pub available_after_bytes: Option<u64>,
    pub throttle_seconds: f64,
    pub swap_used_bytes: Option<u64>,
}

/// One run of one test, as the engine reported it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunDetail {
    pub value: f64,
    pub prompt_n: u64,
    pub cache_n: u64,
    pub predicted_n: u64,
    pub wall_seconds: f64,
}

/// One test's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    /// `decode`, `prefill`, `vision_prefill`, `vision_decode` or `long_prefill`.
    pub name: String,
    /// `tok/s` (and for `long_prefill`'s wall time, `s` in `wall_seconds`).
    pub unit: String,
    pub runs: Vec<f64>,
    pub mean: f64,
    /// The sample standard deviation (n - 1); 0 for a single run.
    pub sd: f64,
    pub telemetry: TestTelemetry,
    pub details: Vec<RunDetail>,
}

/// The load test: the engine's spawn-to-ready time with the page cache as it was (`warm`),
/// and after the model's files were dropped from it (`cold`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadTest {
    /// The load the switch to the profile made (for a validation of the running profile,
    /// that engine's own).
    pub warm_seconds: f64,
    pub cold_seconds: f64,
    /// The model's files (dropped from the page cache before the cold load), and their bytes.
    pub files: Vec<String>,
    pub bytes: u64,
    /// Of those bytes, how many the page cache held before each load (`mincore`).
    pub cached_before_warm: u64,
    pub cached_before_cold: u64,
    /// How the engine reads its model, as far as its flags say.
    pub method: String,
}

/// The whole run: what `--json` prints and what is kept in `state_dir/validations/`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ValidationResult {
    pub profile: String,
    /// `/props` `build_info` of the engine that ran it.
    pub engine_build: String,
    /// Unix time (s) it started and ended.
    pub started: f64,
    pub finished: f64,
    /// The profile active before, and again after.
    pub previous_profile: String,
    /// `uname -r`.
    pub kernel: String,
    /// The validation profile's settings (its YAML, read as JSON).
    pub settings: serde_json::Value,
    pub tests: Vec<TestResult>,
    /// The load test, when it ran (not in results of older daemons).
    #[serde(default)]
    pub load: Option<LoadTest>,
    /// Why it ended early, when it did (the tests done so far are kept).
    #[serde(default)]
    pub error: Option<String>,
    /// Where the daemon saved it.
    #[serde(default)]
    pub file: Option<String>,
}

/// The mean and the sample standard deviation.
pub fn mean_sd(values: &[f64]) -> (f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (mean, 0.0);
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, var.sqrt())
}

/// One test against the same test of an earlier run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub name: String,
    pub before: f64,
    pub now: f64,
    /// Relative change, in percent (negative: slower).
    pub change_pct: f64,
    /// The drop that counts as beyond the noise: the larger of twice the pooled SD and 5%
    /// of the earlier mean.
    pub threshold: f64,
    /// Slower by more than `threshold`.
    pub flagged: bool,
}

/// The pooled standard deviation of two tests' runs.
fn pooled_sd(a: &TestResult, b: &TestResult) -> f64 {
    let (na, nb) = (a.runs.len() as f64, b.runs.len() as f64);
    if na + nb < 3.0 {
        return a.sd.max(b.sd);
    }
    let num = (na - 1.0).max(0.0) * a.sd.powi(2) + (nb - 1.0).max(0.0) * b.sd.powi(2);
    (num / (na + nb - 2.0)).sqrt()
}

/// Each test of `now` that `before` has too, with the change; tok/s: lower is slower.
pub fn compare(before: &ValidationResult, now: &ValidationResult) -> Vec<Comparison> {
    now.tests
        .iter()
        .filter_map(|t| {
            let old = before.tests.iter().find(|o| o.name == t.name)?;
            let threshold = (2.0 * pooled_sd(old, t)).max(0.05 * old.mean.abs());
            let drop = old.mean - t.mean;
            Some(Comparison {
                name: t.name.clone(),
                before: old.mean,
                now: t.mean,
                change_pct: if old.mean != 0.0 {
                    (t.mean - old.mean) / old.mean * 100.0
                } else {
                    0.0
                },
                threshold,
                flagged: drop > threshold,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_and_sample_sd() {
        // The seeds' decode runs are of this kind: three close figures.
        let (m, sd) = mean_sd(&[14.1, 14.15, 14.17]);
        assert!((m - 14.14).abs() < 1e-9);
        // sqrt(((-.04)^2 + .01^2 + .03^2) / 2) = sqrt(0.0013)
        assert!((sd - 0.0013f64.sqrt()).abs() < 1e-9, "{sd}");
        assert_eq!(mean_sd(&[5.0]), (5.0, 0.0));
        assert_eq!(mean_sd(&[]), (0.0, 0.0));
    }

    fn result(tests: &[(&str, &[f64])]) -> ValidationResult {
        ValidationResult {
            tests: tests
                .iter()
                .map(|(name, runs)| {
                    let (mean, sd) = mean_sd(runs);
                    TestResult {
                        name: name.to_string(),
                        unit: "tok/s".into(),
                        runs: runs.to_vec(),
                        mean,
                        sd,
                        ..TestResult::default()
                    }
                })
                .collect(),
            ..ValidationResult::default()
        }
    }

    #[test]
    fn a_drop_beyond_the_noise_is_flagged_and_noise_is_not() {
        let before = result(&[
            ("decode", &[14.10, 14.15, 14.17]),
            ("prefill", &[200.0, 201.0, 203.0]),
        ]);
        let now = result(&[
            // 10% slower: flagged.
            ("decode", &[12.70, 12.72, 12.75]),
            // 1% slower, within 5%: not.
            ("prefill", &[198.0, 199.5, 200.0]),
        ]);
        let c = compare(&before, &now);
        assert_eq!(c.len(), 2);
        assert!(c[0].flagged, "{c:?}");
        assert!((c[0].change_pct + 10.0).abs() < 0.5, "{c:?}");
        assert!(!c[1].flagged, "{c:?}");
        // Faster is never flagged; a noisy test needs more than twice its pooled SD.
        let noisy = result(&[("decode", &[10.0, 14.0, 18.0])]);
        let lower = result(&[("decode", &[9.0, 13.0, 17.0])]);
        assert!(!compare(&noisy, &lower)[0].flagged);
        assert!(!compare(&now, &before)[0].flagged);
        // A test only one run has is left out.
        assert!(compare(&result(&[("vision_decode", &[1.0])]), &now).is_empty());
    }
}
