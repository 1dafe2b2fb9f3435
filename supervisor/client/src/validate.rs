//! `dsv4ctl validate`: the validation run's request, its progress and its result document,
//! and the arithmetic both ends share (mean, sample SD, the comparison with an earlier run).

use serde::{Deserialize, Serialize};

/// What `Validate(s)` is asked to run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// Run every cell of the profile's `matrix:` (`dsv4ctl validate --matrix`).
    #[serde(default)]
    pub matrix: bool,
    /// Only the correctness canary: no load test, no speed tests (`--canary`).
    #[serde(default)]
    pub canary_only: bool,
    /// Record this run's canary as the profile's reference (`--record`), whatever it gives.
    #[serde(default)]
    pub record: bool,
    /// Narrows the matrix: for an axis named here, only the values given (`cpu` and `gpu`
    /// values by name, an argument axis's variants by number from 1 or by their arguments
    /// joined with spaces).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub only: Vec<Narrowing>,
}

/// `--only AXIS=VALUE[,VALUE...]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Narrowing {
    pub axis: String,
    pub values: Vec<String>,
}

impl std::str::FromStr for Narrowing {
    type Err = String;

    /// `cpu=power-saver,performance`, `ub=2`, `load=--no-mmap`.
    fn from_str(s: &str) -> Result<Narrowing, String> {
        let (axis, values) = s
            .split_once('=')
            .ok_or_else(|| format!("`{s}` is not AXIS=VALUE[,VALUE...]"))?;
        let axis = axis.trim();
        if axis.is_empty() {
            return Err(format!("`{s}` names no axis"));
        }
        let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
        Ok(Narrowing {
            axis: axis.to_string(),
            values,
        })
    }
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
/// after the model's files were dropped from it (`cold`), and after an idle stop without and
/// with `engine.prewarm`.
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
    /// A start after an idle stop: the cold load's engine stopped as an idle stop stops it and
    /// started again, with what its run left of the model in the page cache
    /// (`cached_after_stop`). Not in results of older daemons.
    #[serde(default)]
    pub after_stop_seconds: Option<f64>,
    #[serde(default)]
    pub cached_after_stop: Option<u64>,
    /// The same start with `engine.prewarm`: the model's files read back into the page cache
    /// first (`read_back` bytes, within the memory available less `memory.reserve`), which
    /// then held `cached_after_prewarm`.
    #[serde(default)]
    pub prewarmed_seconds: Option<f64>,
    #[serde(default)]
    pub cached_after_prewarm: Option<u64>,
    /// The bytes the prewarm read: 0 when the page cache held the model already, or when
    /// none of it fit in the memory available less `memory.reserve`.
    #[serde(default)]
    pub read_back: u64,
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
    /// For `--matrix`: every cell's settings and figures, and the verdict (`tests` and `load`
    /// are then empty: each cell has its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix: Option<Matrix>,
    /// The correctness canary: its run, compared with the profile's reference (or recorded as
    /// it). Not in results of older daemons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanaryResult>,
    /// Why it ended early, when it did (the tests done so far are kept).
    #[serde(default)]
    pub error: Option<String>,
    /// Where the daemon saved it.
    #[serde(default)]
    pub file: Option<String>,
}

/// The settings of one matrix cell: the CPU power profile and GPU level (when the matrix has
/// those axes) and, for each argument axis, the variant taken.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CellSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    #[serde(default)]
    pub args: Vec<ArgChoice>,
}

/// One argument axis's variant in a cell.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ArgChoice {
    pub axis: String,
    /// Its number on the axis, from 1.
    pub variant: u32,
    /// Added after the profile's own `extra_args`.
    pub args: Vec<String>,
}

impl CellSettings {
    /// `cpu=power-saver gpu=auto ub=[-ub 512] load=[]`.
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if let Some(cpu) = &self.cpu {
            parts.push(format!("cpu={cpu}"));
        }
        if let Some(gpu) = &self.gpu {
            parts.push(format!("gpu={gpu}"));
        }
        for a in &self.args {
            parts.push(format!("{}=[{}]", a.axis, a.args.join(" ")));
        }
        match parts.is_empty() {
            true => "(the profile as it is)".to_string(),
            false => parts.join(" "),
        }
    }

    /// Every argument the cell adds, axis after axis.
    pub fn added_args(&self) -> Vec<String> {
        self.args.iter().flat_map(|a| a.args.clone()).collect()
    }
}

/// One cell's run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// Its place in the run, from 1.
    pub index: u32,
    pub settings: CellSettings,
    pub tests: Vec<TestResult>,
    #[serde(default)]
    pub load: Option<LoadTest>,
    /// The host over the cell's tests (peak temperature, mean SoC power, seconds throttled,
    /// GTT peak).
    #[serde(default)]
    pub host: crate::telemetry::Resources,
    /// What the power policy said it had in force during the cell (`power-saver held
    /// through ...`, or why not), and the GPU level it saw.
    #[serde(default)]
    pub applied_cpu: Option<String>,
    #[serde(default)]
    pub applied_gpu: Option<String>,
    /// Why the cell failed, when it did (the run goes on with the next one).
    #[serde(default)]
    pub error: Option<String>,
}

impl Cell {
    pub fn test(&self, name: &str) -> Option<&TestResult> {
        self.tests.iter().find(|t| t.name == name)
    }
}

/// A matrix run: its cells in the order they ran, and the verdict.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    pub cells: Vec<Cell>,
    /// How many cells the matrix has (more than ran, when it ended early).
    pub planned: u32,
    /// Times a client request paused the matrix to be served on the service profile.
    #[serde(default)]
    pub pauses: u32,
    #[serde(default)]
    pub verdict: Option<Verdict>,
    /// The verdict's settings as YAML for the service profile (never applied by dsv4d).
    #[serde(default)]
    pub snippet: Option<String>,
}

/// Which cell to run the service with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The cell with the highest mean decode rate.
    pub fastest: u32,
    /// The cells whose decode is within the noise of the fastest (the `--compare` rule).
    pub within_noise: Vec<u32>,
    /// Among those, the one with the fewest joules per generated token (the fastest when
    /// no cell has a power figure).
    pub pick: u32,
    /// Why that one, in words.
    pub reason: String,
    /// Whether `power.prefill` pays on this box, from the prefill of the cells that differ
    /// from the pick by their CPU profile alone (absent from older daemons, and when no
    /// such cell ran).
    #[serde(default)]
    pub prefill: Option<PrefillVerdict>,
}

/// Whether another CPU profile for long prefills (`power.prefill`) pays.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefillVerdict {
    /// The CPU profile to set as `power.prefill`; `None`: it does not pay.
    pub cpu: Option<String>,
    pub reason: String,
}

/// `power.prefill`'s verdict: among the cells of `cells` with the settings of `pick` but
/// their CPU profile, the fastest prefill; it pays when it is another profile than `pick`'s
/// and `pick`'s prefill is slower beyond the noise. `None` when `pick` has no CPU profile or
/// prefill figure, or no such other cell ran.
pub fn prefill_verdict(cells: &[Cell], pick: &Cell) -> Option<PrefillVerdict> {
    let own_cpu = pick.settings.cpu.as_deref()?;
    let own = pick.test("prefill")?;
    let same_but_cpu = |c: &&Cell| {
        c.error.is_none()
            && c.settings.cpu.is_some()
            && c.settings.gpu == pick.settings.gpu
            && c.settings.args == pick.settings.args
    };
    let others: Vec<(&Cell, &TestResult)> = cells
        .iter()
        .filter(same_but_cpu)
        .filter(|c| c.index != pick.index)
        .filter_map(|c| Some((c, c.test("prefill")?)))
        .collect();
    let (best, fastest) = others
        .iter()
        .copied()
        .reduce(|a, b| if b.1.mean > a.1.mean { b } else { a })?;
    let cpu = best.settings.cpu.clone().unwrap_or_default();
    let joules = |t: &TestResult| {
        t.telemetry
            .joules_per_token
            .map_or_else(|| "-".to_string(), |j| format!("{j:.3} J"))
    };
    let figures = format!(
        "prefill {:.1} tok/s on {cpu} (cell {}, {} a token) against {:.1} tok/s on {own_cpu} \
         ({} a token)",
        fastest.mean,
        best.index,
        joules(fastest),
        own.mean,
        joules(own)
    );
    let (slower, _) = beyond_noise(fastest, own);
    Some(match fastest.mean > own.mean && slower {
        true => PrefillVerdict {
            reason: format!(
                "power.prefill: {cpu} pays: {figures}, {:+.0}%",
                (fastest.mean - own.mean) / own.mean * 100.0
            ),
            cpu: Some(cpu),
        },
        false => PrefillVerdict {
            cpu: None,
            reason: format!("power.prefill does not pay: {figures}, within the noise or slower"),
        },
    })
}

/// The verdict over `cells`: `None` when no cell has a decode figure.
pub fn verdict(cells: &[Cell]) -> Option<Verdict> {
    let measured: Vec<(&Cell, &TestResult)> = cells
        .iter()
        .filter(|c| c.error.is_none())
        .filter_map(|c| Some((c, c.test("decode")?)))
        .collect();
    let (fastest, best) =
        measured
            .iter()
            .copied()
            .reduce(|a, b| if b.1.mean > a.1.mean { b } else { a })?;
    let within: Vec<(&Cell, &TestResult)> = measured
        .iter()
        .copied()
        .filter(|(_, t)| !beyond_noise(best, t).0)
        .collect();
    let energy = |t: &TestResult| t.telemetry.joules_per_token;
    let frugal = within
        .iter()
        .copied()
        .filter(|(_, t)| energy(t).is_some())
        .reduce(|a, b| match energy(b.1) < energy(a.1) {
            true => b,
            false => a,
        });
    let (pick, reason) = match frugal {
        Some((c, t)) => {
            let j = energy(t).unwrap_or_default();
            let reason = match c.index == fastest.index {
                true => format!(
                    "the fastest decode ({:.2} tok/s), and the fewest joules per token \
                     ({j:.3} J) of the {} cells within its noise",
                    t.mean,
                    within.len()
                ),
                false => format!(
                    "decode {:.2} tok/s, within the noise of the fastest ({:.2} tok/s, cell \
                     {}), at the fewest joules per token ({j:.3} J) of the {} cells within it",
                    t.mean,
                    best.mean,
                    fastest.index,
                    within.len()
                ),
            };
            (c.index, reason)
        }
        None => (
            fastest.index,
            format!(
                "the fastest decode ({:.2} tok/s); no cell has a power figure to compare \
                 energy by",
                best.mean
            ),
        ),
    };
    let prefill = cells
        .iter()
        .find(|c| c.index == pick)
        .and_then(|c| prefill_verdict(cells, c));
    Some(Verdict {
        fastest: fastest.index,
        within_noise: within.iter().map(|(c, _)| c.index).collect(),
        pick,
        reason,
        prefill,
    })
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

/// Whether `now` is slower than `before` beyond the noise: the larger of twice the pooled SD
/// and 5% of `before`'s mean. With the threshold.
fn beyond_noise(before: &TestResult, now: &TestResult) -> (bool, f64) {
    let threshold = (2.0 * pooled_sd(before, now)).max(0.05 * before.mean.abs());
    (before.mean - now.mean > threshold, threshold)
}

/// Each test of `now` that `before` has too, with the change; tok/s: lower is slower.
pub fn compare(before: &ValidationResult, now: &ValidationResult) -> Vec<Comparison> {
    compare_tests(&before.tests, &now.tests)
}

/// One matrix run against an earlier one, cell by cell: each cell of `now` whose settings
/// `before` ran too, with its comparison.
pub fn compare_cells<'a>(before: &'a Matrix, now: &'a Matrix) -> Vec<(&'a Cell, Vec<Comparison>)> {
    now.cells
        .iter()
        .filter_map(|c| {
            let old = before.cells.iter().find(|o| o.settings == c.settings)?;
            Some((c, compare_tests(&old.tests, &c.tests)))
        })
        .collect()
}

fn compare_tests(before: &[TestResult], now: &[TestResult]) -> Vec<Comparison> {
    now.iter()
        .filter_map(|t| {
            let old = before.iter().find(|o| o.name == t.name)?;
            let (flagged, threshold) = beyond_noise(old, t);
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
                flagged,
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

    fn cell(index: u32, cpu: &str, decode: &[f64], watts: Option<f64>) -> Cell {
        let (mean, sd) = mean_sd(decode);
        Cell {
            index,
            settings: CellSettings {
                cpu: Some(cpu.to_string()),
                ..CellSettings::default()
            },
            tests: vec![TestResult {
                name: "decode".into(),
                runs: decode.to_vec(),
                mean,
                sd,
                telemetry: TestTelemetry {
                    soc_power_mean_w: watts,
                    joules_per_token: watts.map(|w| w / mean),
                    ..TestTelemetry::default()
                },
                ..TestResult::default()
            }],
            ..Cell::default()
        }
    }

    #[test]
    fn the_verdict_is_the_most_frugal_cell_within_the_noise_of_the_fastest() {
        // The seeds' findings: power-saver decodes as fast for 17 W less; the GPU on low
        // costs a fifth of decode and is out whatever it saves.
        let cells = [
            cell(1, "performance", &[16.01, 16.03, 16.02], Some(102.0)),
            cell(2, "power-saver", &[16.00, 16.02, 16.04], Some(85.0)),
            cell(3, "gpu-low", &[12.58, 12.59, 12.60], Some(60.0)),
        ];
        let v = verdict(&cells).unwrap();
        assert_eq!(v.fastest, 1, "{v:?}");
        assert_eq!(v.within_noise, vec![1, 2]);
        assert_eq!(v.pick, 2, "{v:?}");
        assert!(v.reason.contains("cell 1"), "{}", v.reason);
        // The fastest is also the most frugal: its own words.
        let v = verdict(&cells[..1]).unwrap();
        assert_eq!((v.fastest, v.pick), (1, 1));
        assert!(v.reason.starts_with("the fastest decode"), "{}", v.reason);
        // Without power figures: the fastest.
        let dark = [
            cell(1, "performance", &[16.0], None),
            cell(2, "power-saver", &[16.5], None),
        ];
        let v = verdict(&dark).unwrap();
        assert_eq!((v.fastest, v.pick), (2, 2));
        assert!(
            v.reason.contains("no cell has a power figure"),
            "{}",
            v.reason
        );
        // A failed cell is never picked, and no decode at all is no verdict.
        let mut failed = cell(3, "balanced", &[30.0], Some(1.0));
        failed.error = Some("the engine went away".into());
        let v = verdict(&[cells[1].clone(), failed]).unwrap();
        assert_eq!(v.pick, 2);
        assert_eq!(verdict(&[]), None);
    }

    /// `cell`, with a prefill test of `rate` tok/s (three close runs) at `joules` a token.
    fn with_prefill(mut c: Cell, rate: f64, joules: Option<f64>) -> Cell {
        let runs = [rate * 0.995, rate, rate * 1.005];
        let (mean, sd) = mean_sd(&runs);
        c.tests.push(TestResult {
            name: "prefill".into(),
            runs: runs.to_vec(),
            mean,
            sd,
            telemetry: TestTelemetry {
                joules_per_token: joules,
                ..TestTelemetry::default()
            },
            ..TestResult::default()
        });
        c
    }

    #[test]
    fn power_prefill_pays_when_another_cpu_profile_prefills_faster_beyond_the_noise() {
        // Strix Halo's finding: prompt processing 29% faster in performance, decode equal.
        let cells = [
            with_prefill(
                cell(1, "performance", &[16.01, 16.03], Some(102.0)),
                158.0,
                Some(0.6),
            ),
            with_prefill(
                cell(2, "power-saver", &[16.00, 16.04], Some(85.0)),
                122.5,
                Some(0.7),
            ),
        ];
        let v = verdict(&cells).unwrap();
        assert_eq!(v.pick, 2);
        let p = v.prefill.unwrap();
        assert_eq!(p.cpu.as_deref(), Some("performance"), "{}", p.reason);
        assert!(
            p.reason.starts_with(
                "power.prefill: performance pays: prefill 158.0 tok/s on \
                 performance (cell 1, 0.600 J a token) against 122.5 tok/s on power-saver \
                 (0.700 J a token), +29%"
            ),
            "{}",
            p.reason
        );
        // Within the noise: it does not pay.
        let close = [
            with_prefill(cell(1, "performance", &[16.0], Some(102.0)), 124.0, None),
            with_prefill(cell(2, "power-saver", &[16.0], Some(85.0)), 122.5, None),
        ];
        let p = verdict(&close).unwrap().prefill.unwrap();
        assert_eq!(p.cpu, None);
        assert!(
            p.reason.starts_with("power.prefill does not pay"),
            "{}",
            p.reason
        );
        // Cells that differ by more than the CPU profile, a failed cell, or none to compare
        // with: no word on it.
        let mut other_gpu = cells[0].clone();
        other_gpu.settings.gpu = Some("high".into());
        assert_eq!(
            verdict(&[other_gpu, cells[1].clone()]).unwrap().prefill,
            None
        );
        let mut failed = cells[0].clone();
        failed.error = Some("the engine went away".into());
        assert_eq!(verdict(&[failed, cells[1].clone()]).unwrap().prefill, None);
        assert_eq!(verdict(&cells[1..]).unwrap().prefill, None);
    }

    #[test]
    fn matrix_runs_compare_cell_by_cell() {
        let before = Matrix {
            cells: vec![
                cell(1, "performance", &[16.0, 16.1, 16.0], None),
                cell(2, "power-saver", &[16.0, 16.1, 16.0], None),
            ],
            ..Matrix::default()
        };
        let now = Matrix {
            cells: vec![
                cell(1, "power-saver", &[12.0, 12.1, 12.0], None),
                cell(2, "balanced", &[16.0], None),
            ],
            ..Matrix::default()
        };
        let c = compare_cells(&before, &now);
        // Matched by settings, not by place: power-saver is cell 2 before, 1 now.
        assert_eq!(c.len(), 1, "{c:?}");
        assert_eq!(c[0].0.settings.cpu.as_deref(), Some("power-saver"));
        assert!(c[0].1[0].flagged);
    }

    #[test]
    fn narrowing_reads_axis_and_values() {
        let n: Narrowing = "cpu=power-saver, performance".parse().unwrap();
        assert_eq!(n.axis, "cpu");
        assert_eq!(n.values, vec!["power-saver", "performance"]);
        let n: Narrowing = "load=--no-mmap".parse().unwrap();
        assert_eq!(n.values, vec!["--no-mmap"]);
        assert!("cpu"
            .parse::<Narrowing>()
            .unwrap_err()
            .contains("AXIS=VALUE"));
        assert!("=x".parse::<Narrowing>().is_err());
    }

    #[test]
    fn a_cell_is_labelled_by_its_settings() {
        let s = CellSettings {
            cpu: Some("power-saver".into()),
            gpu: Some("low".into()),
            args: vec![
                ArgChoice {
                    axis: "ub".into(),
                    variant: 2,
                    args: vec!["-ub".into(), "2048".into()],
                },
                ArgChoice {
                    axis: "load".into(),
                    variant: 1,
                    args: vec![],
                },
            ],
        };
        assert_eq!(s.label(), "cpu=power-saver gpu=low ub=[-ub 2048] load=[]");
        assert_eq!(s.added_args(), vec!["-ub", "2048"]);
        assert_eq!(CellSettings::default().label(), "(the profile as it is)");
    }
}

/// One token the canary generated: the engine's greedy pick, and its top log-probabilities
/// when it gives them (the pick among them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CanaryToken {
    pub text: String,
    #[serde(default)]
    pub top: Vec<TopLogprob>,
}

/// A token among the top of a position, by its id and log-probability.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub id: i64,
    pub text: String,
    pub logprob: f64,
}

/// One canary prompt and what the engine made of it, greedy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CanaryPrompt {
    pub prompt: String,
    /// The generated text.
    pub text: String,
    /// Token by token, when the engine says them (llama-server); empty for one that gives
    /// only the text (ds4-server), which is then compared character by character.
    #[serde(default)]
    pub tokens: Vec<CanaryToken>,
}

/// A canary run: each prompt's answer, on which engine, when.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CanaryRun {
    pub prompts: Vec<CanaryPrompt>,
    /// The engine's identity in brief (`llama-server 8123 (0c1e570) (ROCm)`).
    #[serde(default)]
    pub engine: String,
    /// The engine's whole identity at the run, when it was known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<crate::identity::EngineIdentity>,
    /// Unix time (s).
    pub at: f64,
}

/// Where a canary run first left its reference.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Drift {
    /// The prompt's number, from 1, and its text.
    pub prompt: usize,
    pub prompt_text: String,
    /// The generated token's number (a character's, for an engine that gives only text),
    /// from 0.
    pub position: usize,
    pub expected: String,
    pub got: String,
}

impl std::fmt::Display for Drift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "canary drift at prompt {} ({:?}), token {}: expected {}, got {}",
            self.prompt, self.prompt_text, self.position, self.expected, self.got
        )
    }
}

/// A profile's last correctness canary: a validation's, or the one dsv4d runs by itself once
/// the engine is idle after a start that found it changed (`Status.canary`, kept in
/// `state_dir/canary/checks/`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CanaryCheck {
    pub profile: String,
    pub state: CanaryState,
    /// Unix time (s) it came to that state.
    pub since: f64,
    /// What changed in the engine since the canary last ran (why this one runs); empty for a
    /// validation's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// The result, once it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<CanaryResult>,
    /// Why it could not run (`failed`), or why it waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Requests to the profile are refused until its drift is accepted (`canary.hold`).
    #[serde(default)]
    pub held: bool,
}

/// Where a profile's canary stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CanaryState {
    /// Due: the engine changed; it runs once no request is in flight or waiting.
    Waiting,
    Running,
    /// As its reference.
    Passed,
    /// Not as its reference: `result.drift` says where.
    Drifted,
    /// This run is the reference now: the profile's first, `--record`, or an accepted drift
    /// (`dsv4ctl canary accept`).
    Recorded,
    /// It could not run (`error`); it runs again after the next start.
    Failed,
}

impl CanaryState {
    pub fn as_str(self) -> &'static str {
        match self {
            CanaryState::Waiting => "waiting",
            CanaryState::Running => "running",
            CanaryState::Passed => "passed",
            CanaryState::Drifted => "drifted",
            CanaryState::Recorded => "recorded",
            CanaryState::Failed => "failed",
        }
    }
}

impl std::fmt::Display for CanaryState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl CanaryCheck {
    /// One line: `drifted since llama-server b6922 (ROCm): canary drift at prompt 1 ...`.
    pub fn line(&self) -> String {
        let engine = self.result.as_ref().map(|r| r.run.engine.as_str());
        let on = engine
            .filter(|e| !e.is_empty())
            .map_or(String::new(), |e| format!(" on {e}"));
        match (
            self.state,
            self.result.as_ref().and_then(|r| r.drift.as_ref()),
        ) {
            (CanaryState::Drifted, Some(d)) => {
                let held = if self.held {
                    "; requests refused until accepted"
                } else {
                    ""
                };
                format!("drifted{on}: {d}{held}")
            }
            (CanaryState::Waiting | CanaryState::Running, _) if !self.changed.is_empty() => {
                format!(
                    "{} (the engine changed: {})",
                    self.state,
                    self.changed.join("; ")
                )
            }
            (CanaryState::Failed, _) => format!(
                "failed{on}: {}",
                self.error.as_deref().unwrap_or("no reason given")
            ),
            (state, _) => format!("{state}{on}"),
        }
    }
}

/// The canary of a validation: its run, against the reference.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CanaryResult {
    pub run: CanaryRun,
    /// This run became the profile's reference (the first canary of the profile, or
    /// `--record`).
    pub recorded: bool,
    /// The reference compared with: its engine and time.
    #[serde(default)]
    pub reference_engine: String,
    #[serde(default)]
    pub reference_at: f64,
    /// The largest difference of a log-probability from the reference that is not a drift.
    pub tolerance: f64,
    /// Where it drifted, when it did.
    #[serde(default)]
    pub drift: Option<Drift>,
}
