//! Validation runs (`dsv4ctl validate`): the 64K profile's reason to exist, run unattended.
//!
//! A run switches to the validation profile by drain and restart, holds one lease on its
//! engine for the whole suite (so it is never stopped for idleness in between), runs each
//! test `runs` times on the native `/completion` endpoint with `cache_prompt: false` (every
//! run cold), and switches back to the profile that was active, whatever happened: a failed
//! test, an engine that died, `dsv4ctl stop --now`, a cancel. Client requests that arrive
//! meanwhile wait at the [`Validator::admit`] gate (or get a 503 when `max_waiting` of them
//! already wait) and are served once the old profile is back.
//!
//! The suite: `decode` (a fixed short prompt, 256 generated tokens), `prefill` (a prompt of
//! exactly 4,096 tokens, built from `/tokenize`'s ids), and with `--long N` one
//! `long_prefill` of exactly N tokens. Each test gets the host's figures over its span from
//! the monitor's ring. The result is kept as JSON in `state_dir/validations/`.
//!
//! Owns: the one validation that may run, its gate, and its progress stream. Must not:
//! decide about the engine; it goes through the lifecycle's handle like any client.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4_client::validate::{
    mean_sd, Progress, RunDetail, TestResult, TestTelemetry, ValidateRequest, ValidationResult,
};
use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::config::Config;
use crate::host::sysroot::SysRoot;
use crate::lifecycle::actor::{Handle, Lease};
use crate::lifecycle::engine_ref::EngineRef;
use crate::observe::monitor::Telemetry;

/// The validation profile when none is named.
pub const DEFAULT_PROFILE: &str = "64k";
/// Tokens of the cold prefill test.
pub const PREFILL_TOKENS: u64 = 4096;
/// Tokens the decode test generates.
pub const DECODE_TOKENS: u64 = 256;
const DECODE_PROMPT: &str = "Write the alphabet, then keep going:";
/// Most runs a request may ask for.
pub const MAX_RUNS: u32 = 100;
/// The file that names the profile to go back to while a validation runs: a daemon that
/// dies in the middle finds it at its next start.
const RUNNING: &str = "validation-running";

/// What a validation tells its watchers.
#[derive(Debug, Clone)]
pub enum ValidationEvent {
    Progress(Progress),
    Done(Box<ValidationResult>),
}

struct Inner {
    lifecycle: Handle,
    telemetry: Telemetry,
    config: watch::Receiver<Arc<Config>>,
    sysroot: SysRoot,
    /// `true` while a validation holds the engine: client requests wait.
    gate: watch::Sender<bool>,
    waiting: AtomicUsize,
    events: broadcast::Sender<ValidationEvent>,
    /// The running validation's cancel switch.
    cancel: Mutex<Option<watch::Sender<bool>>>,
}

/// The validation runner; cheap to clone.
#[derive(Clone)]
pub struct Validator(Arc<Inner>);

/// Why a validation did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("a validation is already running")]
    Running,
    #[error("unknown profile `{name}`; profiles: {}", known.join(", "))]
    UnknownProfile { name: String, known: Vec<String> },
    #[error("{0}")]
    Invalid(String),
}

/// A request waiting at the gate, counted while it waits.
struct Waiting<'a>(&'a AtomicUsize);
impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Validator {
    pub fn new(
        lifecycle: Handle,
        telemetry: Telemetry,
        config: watch::Receiver<Arc<Config>>,
        sysroot: SysRoot,
    ) -> Validator {
        let (gate, _) = watch::channel(false);
        let (events, _) = broadcast::channel(256);
        Validator(Arc::new(Inner {
            lifecycle,
            telemetry,
            config,
            sysroot,
            gate,
            waiting: AtomicUsize::new(0),
            events,
            cancel: Mutex::new(None),
        }))
    }

    pub fn subscribe(&self) -> broadcast::Receiver<ValidationEvent> {
        self.0.events.subscribe()
    }

    pub fn running(&self) -> bool {
        *self.0.gate.borrow()
    }

    /// A client request passes when no validation runs, else waits for its end; `Err` when
    /// `max_waiting` requests wait already (the caller answers 503).
    pub async fn admit(&self, max_waiting: usize) -> Result<(), usize> {
        let mut gate = self.0.gate.subscribe();
        if !*gate.borrow_and_update() {
            return Ok(());
        }
        if self.0.waiting.fetch_add(1, Ordering::SeqCst) >= max_waiting {
            self.0.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(max_waiting);
        }
        let _counted = Waiting(&self.0.waiting);
        let _ = gate.wait_for(|running| !running).await;
        Ok(())
    }

    /// Starts a validation; its progress and result come as [`ValidationEvent`]s. Refused
    /// while one runs, or for a profile that does not exist.
    pub fn start(&self, req: ValidateRequest) -> Result<String, StartError> {
        let config = self.0.config.borrow().clone();
        let profile = req
            .profile
            .clone()
            .unwrap_or_else(|| DEFAULT_PROFILE.to_string());
        if config.profile(&profile).is_none() {
            return Err(StartError::UnknownProfile {
                name: profile,
                known: config
                    .profile_names()
                    .into_iter()
                    .map(String::from)
                    .collect(),
            });
        }
        if req.runs == 0 || req.runs > MAX_RUNS {
            return Err(StartError::Invalid(format!(
                "runs must be between 1 and {MAX_RUNS}"
            )));
        }
        let context = config.profile(&profile).and_then(|p| p.context());
        if let Some(n) = req.long {
            let most = context.map_or(10_000_000, u64::from);
            if n == 0 || n >= most {
                return Err(StartError::Invalid(format!(
                    "--long must be at least 1 token and fewer than the profile's context \
                     ({most})"
                )));
            }
        }
        let mut slot = self.0.cancel.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return Err(StartError::Running);
        }
        let (cancel_tx, cancel_rx) = watch::channel(false);
        *slot = Some(cancel_tx);
        self.0.gate.send_replace(true);
        drop(slot);
        let this = self.clone();
        let name = profile.clone();
        let previous = self.0.lifecycle.status().profile;
        tokio::spawn(async move {
            let run = {
                let (this, name, previous) = (this.clone(), name.clone(), previous.clone());
                tokio::spawn(async move { this.run(&name, &previous, &req, cancel_rx).await })
            };
            let result = match run.await {
                Ok(result) => result,
                // A run that panicked: nothing may stay held for it.
                Err(e) => this.aborted(&name, &previous, e.to_string()).await,
            };
            // The result first, then the slot: a next run's watcher cannot take this one's
            // result for its own.
            let _ = this.0.events.send(ValidationEvent::Done(Box::new(result)));
            *this.0.cancel.lock().unwrap_or_else(|p| p.into_inner()) = None;
        });
        Ok(profile)
    }

    /// Ends the running validation (it switches back); `false` when none runs.
    pub fn cancel(&self) -> bool {
        let slot = self.0.cancel.lock().unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some(tx) => {
                tx.send_replace(true);
                true
            }
            None => false,
        }
    }

    /// The saved runs of `profile` (every profile's with `None`), newest first.
    pub fn saved(&self, profile: Option<&str>) -> Vec<ValidationResult> {
        let dir = self
            .0
            .config
            .borrow()
            .supervisor
            .state_dir
            .join("validations");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        let mut runs: Vec<ValidationResult> = entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
            .filter(|r: &ValidationResult| profile.is_none_or(|p| r.profile == p))
            .collect();
        runs.sort_by(|a, b| b.started.total_cmp(&a.started));
        runs
    }

    /// After a run that did not end by itself: back to `previous`, the gate open.
    async fn aborted(&self, profile: &str, previous: &str, why: String) -> ValidationResult {
        tracing::error!("the validation of profile {profile} failed: {why}");
        self.0.lifecycle.suspend_kv(None).await;
        if self.0.lifecycle.status().profile == profile && profile != previous {
            let _ = self.0.lifecycle.set_profile(previous).await;
        }
        let state_dir = self.0.config.borrow().supervisor.state_dir.clone();
        let _ = std::fs::remove_file(state_dir.join(RUNNING));
        self.0.gate.send_replace(false);
        ValidationResult {
            profile: profile.to_string(),
            previous_profile: previous.to_string(),
            started: dsv4_client::clock::unix_now(),
            finished: dsv4_client::clock::unix_now(),
            error: Some(format!("the validation failed inside dsv4d: {why}")),
            ..ValidationResult::default()
        }
    }

    fn say(&self, p: Progress) {
        tracing::info!("validation: {}", p.message);
        let _ = self.0.events.send(ValidationEvent::Progress(p));
    }

    /// Runs the suite on `profile`, then goes back to `previous`.
    async fn run(
        &self,
        profile: &str,
        previous: &str,
        req: &ValidateRequest,
        mut cancel: watch::Receiver<bool>,
    ) -> ValidationResult {
        let config = self.0.config.borrow().clone();
        let lifecycle = &self.0.lifecycle;
        let previous = previous.to_string();
        let state_dir = config.supervisor.state_dir.clone();
        let mut result = ValidationResult {
            profile: profile.to_string(),
            started: dsv4_client::clock::unix_now(),
            previous_profile: previous.clone(),
            kernel: std::fs::read_to_string(self.0.sysroot.path("/proc/sys/kernel/osrelease"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            settings: config
                .profile(profile)
                .and_then(|p| std::fs::read_to_string(&p.file).ok())
                .and_then(|text| serde_yaml_ng::from_str::<Value>(&text).ok())
                .unwrap_or(Value::Null),
            ..ValidationResult::default()
        };
        let _ =
            crate::host::state_file::write_atomic(&state_dir.join(RUNNING), previous.as_bytes());
        // Its engine neither restores nor saves a KV checkpoint: the benchmark prompts must
        // not replace the profile's real one, or push others out of the folder.
        lifecycle.suspend_kv(Some(profile)).await;
        let outcome = tokio::select! {
            r = self.suite(profile, req, &mut result) => r,
            _ = cancel.wait_for(|c| *c) => Err("cancelled (CancelValidation)".to_string()),
        };
        if let Err(why) = outcome {
            tracing::warn!("validation of profile {profile} ended early: {why}");
            result.error = Some(why);
        }
        // Back, whatever happened (the lease went with the suite), unless someone chose
        // another profile meanwhile.
        if lifecycle.status().profile == profile && profile != previous {
            self.say(Progress {
                step: "switching back".into(),
                message: format!("switching back to profile {previous}"),
                ..Progress::default()
            });
            if let Err(e) = lifecycle.set_profile(&previous).await {
                let why = format!("cannot switch back to profile {previous}: {e}");
                tracing::error!("{why}");
                result.error.get_or_insert(why);
            }
        }
        let _ = std::fs::remove_file(state_dir.join(RUNNING));
        lifecycle.suspend_kv(None).await;
        self.0.gate.send_replace(false);
        result.finished = dsv4_client::clock::unix_now();
        if let Err(e) = save(&state_dir, &mut result) {
            tracing::warn!("cannot keep the validation's result: {e}");
            result.file = None;
        }
        result
    }

    async fn suite(
        &self,
        profile: &str,
        req: &ValidateRequest,
        result: &mut ValidationResult,
    ) -> Result<(), String> {
        let lifecycle = &self.0.lifecycle;
        self.say(Progress {
            step: "switching".into(),
            message: format!("switching to profile {profile} (drain and restart)"),
            ..Progress::default()
        });
        lifecycle
            .set_profile(profile)
            .await
            .map_err(|e| e.to_string())?;
        let lease = self.lease_on(profile).await?;
        let engine = lease.engine.clone();
        result.engine_build = build_info(&engine).await.unwrap_or_default();
        let runs = req.runs;
        let decode = self
            .test("decode", runs, &engine, || async {
                let body = json!({
                    "prompt": DECODE_PROMPT,
                    "n_predict": DECODE_TOKENS,
                    "ignore_eos": true,
                    "cache_prompt": false,
                });
                let d = complete(&engine, body).await?;
                Ok(RunDetail {
                    value: rate(d.predicted_n, d.predicted_ms),
                    ..d.detail
                })
            })
            .await;
        result.tests.push(decode?);
        let prompt = exact_prompt(&engine, PREFILL_TOKENS).await?;
        let prefill = self
            .test("prefill", runs, &engine, || async {
                let body = json!({"prompt": prompt, "n_predict": 1, "cache_prompt": false});
                let d = complete(&engine, body).await?;
                Ok(RunDetail {
                    value: rate(d.detail.prompt_n, d.prompt_ms),
                    ..d.detail
                })
            })
            .await;
        result.tests.push(prefill?);
        let has_mmproj = self
            .0
            .config
            .borrow()
            .profile(profile)
            .is_some_and(|p| p.params.mmproj.is_some());
        if has_mmproj {
            let image = test_image_uri().map_err(|e| format!("cannot make the test image: {e}"))?;
            for (name, decode) in [("vision_prefill", false), ("vision_decode", true)] {
                let vision = self
                    .test(name, runs, &engine, || async {
                        let body = vision_request(&image, decode);
                        let d = chat(&engine, body).await?;
                        let value = match decode {
                            true => rate(d.predicted_n, d.predicted_ms),
                            false => rate(d.detail.prompt_n, d.prompt_ms),
                        };
                        Ok(RunDetail { value, ..d.detail })
                    })
                    .await;
                result.tests.push(vision?);
            }
        }
        if let Some(n) = req.long {
            let prompt = exact_prompt(&engine, n).await?;
            let long = self
                .test("long_prefill", 1, &engine, || async {
                    let body = json!({"prompt": prompt, "n_predict": 32, "cache_prompt": false});
                    let d = complete(&engine, body).await?;
                    Ok(RunDetail {
                        value: rate(d.detail.prompt_n, d.prompt_ms),
                        ..d.detail
                    })
                })
                .await;
            result.tests.push(long?);
        }
        drop(lease);
        Ok(())
    }

    /// A lease on an engine of `profile` (a lease on the old engine, granted before the
    /// switch took hold, is given back).
    async fn lease_on(&self, profile: &str) -> Result<Lease, String> {
        for _ in 0..100 {
            let lease = self
                .0
                .lifecycle
                .start_and_acquire()
                .await
                .map_err(|r| r.message())?;
            if lease.engine.profile == profile {
                return Ok(lease);
            }
            drop(lease);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("the engine of profile {profile} did not come up"))
    }

    /// Runs one test `runs` times, with the host's figures over its span.
    async fn test<F, Fut>(
        &self,
        name: &str,
        runs: u32,
        engine: &EngineRef,
        mut once: F,
    ) -> Result<TestResult, String>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<RunDetail, String>>,
    {
        let before = self.0.telemetry.latest();
        let from = dsv4_client::clock::unix_now();
        let mut details = Vec::new();
        for run in 1..=runs {
            let t = Instant::now();
            let mut d = match once().await {
                Ok(d) => d,
                Err(e) => {
                    let gone = engine.gone_within(Duration::from_millis(500)).await;
                    return Err(match gone {
                        true => format!("{name} run {run}: the engine went away ({e})"),
                        false => format!("{name} run {run}: {e}"),
                    });
                }
            };
            d.wall_seconds = t.elapsed().as_secs_f64();
            self.say(Progress {
                step: "run".into(),
                test: Some(name.to_string()),
                run: Some(run),
                runs: Some(runs),
                value: Some(d.value),
                message: format!("{name} run {run}/{runs}: {:.3} tok/s", d.value),
            });
            details.push(d);
        }
        let to = dsv4_client::clock::unix_now();
        let after = self.0.telemetry.latest();
        let span = self.0.telemetry.resources(from, to);
        let gtt = |s: &Option<Arc<dsv4_client::telemetry::Sample>>| {
            s.as_ref()
                .and_then(|s| s.gpu.as_ref())
                .and_then(|g| g.gtt_used)
        };
        let available = |s: &Option<Arc<dsv4_client::telemetry::Sample>>| {
            s.as_ref()
                .and_then(|s| s.memory.as_ref())
                .map(|m| m.available)
        };
        let values: Vec<f64> = details.iter().map(|d| d.value).collect();
        let (mean, sd) = mean_sd(&values);
        Ok(TestResult {
            name: name.to_string(),
            unit: "tok/s".into(),
            runs: values,
            mean,
            sd,
            telemetry: TestTelemetry {
                edge_mean_c: span.edge_mean_c,
                edge_max_c: span.edge_max_c,
                soc_power_mean_w: span.soc_power_mean_w,
                gtt_before_bytes: gtt(&before),
                gtt_after_bytes: gtt(&after),
                available_before_bytes: available(&before),
                available_after_bytes: available(&after),
                throttle_seconds: span.throttle_seconds,
                swap_used_bytes: after
                    .as_ref()
                    .and_then(|s| s.memory.as_ref())
                    .map(|m| m.swap_used()),
            },
            details,
        })
    }
}

fn rate(tokens: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// One completion's figures.
struct Done {
    detail: RunDetail,
    prompt_ms: f64,
    predicted_n: u64,
    predicted_ms: f64,
}

async fn complete(engine: &EngineRef, body: Value) -> Result<Done, String> {
    timed(engine, "/completion", body).await
}

async fn chat(engine: &EngineRef, body: Value) -> Result<Done, String> {
    timed(engine, "/v1/chat/completions", body).await
}

/// A request whose answer carries llama-server's `timings`.
async fn timed(engine: &EngineRef, path: &str, body: Value) -> Result<Done, String> {
    let v: Value =
        crate::lifecycle::kv_steps::call_json(engine, http::Method::POST, path, Some(body)).await?;
    let t = &v["timings"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    let f = |k: &str| t[k].as_f64().unwrap_or(0.0);
    if t.is_null() {
        return Err("the engine's answer has no timings".into());
    }
    Ok(Done {
        detail: RunDetail {
            prompt_n: n("prompt_n"),
            cache_n: n("cache_n"),
            predicted_n: n("predicted_n"),
            ..RunDetail::default()
        },
        prompt_ms: f("prompt_ms"),
        predicted_n: n("predicted_n"),
        predicted_ms: f("predicted_ms"),
    })
}

/// The vision test's image: 512 x 512 pixels of colour gradients and a grid, as a PNG in a
/// data URI (a photo-like image of the size a vision projector tiles).
fn test_image_uri() -> Result<String, String> {
    use base64::Engine as _;
    const SIDE: u32 = 512;
    let mut pixels = Vec::with_capacity((SIDE * SIDE * 3) as usize);
    for y in 0..SIDE {
        for x in 0..SIDE {
            let grid = x % 64 < 2 || y % 64 < 2;
            let (r, g, b) = match grid {
                true => (255, 255, 255),
                false => ((x / 2) as u8, (y / 2) as u8, ((x + y) / 4) as u8),
            };
            pixels.extend_from_slice(&[r, g, b]);
        }
    }
    let mut png = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut png, SIDE, SIDE);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
        writer
            .write_image_data(&pixels)
            .map_err(|e| e.to_string())?;
    }
    Ok(format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(&png)
    ))
}

/// One image and a question, cold; `decode`: 256 tokens generated, else one.
fn vision_request(image: &str, decode: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture in detail."},
            {"type": "image_url", "image_url": {"url": image}},
        ]}],
        "max_tokens": if decode { DECODE_TOKENS } else { 1 },
        "ignore_eos": decode,
        "cache_prompt": false,
    })
}

async fn build_info(engine: &EngineRef) -> Result<String, String> {
    let v: Value =
        crate::lifecycle::kv_steps::call_json(engine, http::Method::GET, "/props", None).await?;
    Ok(v["build_info"].as_str().unwrap_or_default().to_string())
}

/// Exactly `n` token ids of ordinary text, from the engine's own tokenizer.
async fn exact_prompt(engine: &EngineRef, n: u64) -> Result<Vec<u64>, String> {
    const TEXT: &str = "The quick brown fox jumps over the lazy dog while the five boxing \
                        wizards jump quickly and a sphinx of black quartz judges my vow. ";
    let mut text = TEXT.repeat(64);
    loop {
        let v: Value = crate::lifecycle::kv_steps::call_json(
            engine,
            http::Method::POST,
            "/tokenize",
            Some(json!({"content": text, "add_special": false})),
        )
        .await?;
        let tokens: Vec<u64> = v["tokens"]
            .as_array()
            .ok_or("the engine's /tokenize answered no tokens")?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        if tokens.len() as u64 >= n {
            return Ok(tokens[..n as usize].to_vec());
        }
        if tokens.is_empty() {
            return Err("the engine's /tokenize answered no tokens".into());
        }
        let factor = (n as usize / tokens.len()).max(1) + 1;
        text = text.repeat(factor);
    }
}

/// Keeps `result` in `state_dir/validations/`, with its own path in it.
fn save(state_dir: &Path, result: &mut ValidationResult) -> std::io::Result<()> {
    let dir = state_dir.join("validations");
    std::fs::create_dir_all(&dir)?;
    let path: PathBuf = dir.join(format!(
        "{}-{}.json",
        (result.started * 1000.0) as u64,
        result.profile
    ));
    result.file = Some(path.display().to_string());
    crate::host::state_file::write_atomic(&path, &serde_json::to_vec_pretty(result)?)
}

/// At start-up: a validation that a dead daemon left running is undone, so the next start
/// uses the profile that was active before it (returned, when there was one).
pub fn recover(state_dir: &Path) -> Option<String> {
    let file = state_dir.join(RUNNING);
    let previous = std::fs::read_to_string(&file).ok()?;
    let previous = previous.trim().to_string();
    let _ = std::fs::remove_file(&file);
    if previous.is_empty() {
        return None;
    }
    match crate::host::state_file::save_profile(state_dir, &previous) {
        Ok(()) => {
            tracing::warn!(
                "a validation did not finish (the daemon stopped during it): back to profile \
                 {previous}"
            );
            Some(previous)
        }
        Err(e) => {
            tracing::warn!("cannot go back to profile {previous} after a validation: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn the_test_image_is_a_512_pixel_png() {
        let uri = test_image_uri().unwrap();
        let data = uri.strip_prefix("data:image/png;base64,").unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let reader = decoder.read_info().unwrap();
        let info = reader.info();
        assert_eq!((info.width, info.height), (512, 512));
        assert_eq!(info.color_type, png::ColorType::Rgb);
    }

    #[test]
    fn a_validation_left_running_is_undone_at_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        crate::host::state_file::save_profile(dir.path(), "64k").unwrap();
        assert_eq!(recover(dir.path()), None, "nothing ran");
        std::fs::write(dir.path().join(RUNNING), "320k\n").unwrap();
        assert_eq!(recover(dir.path()).as_deref(), Some("320k"));
        assert_eq!(
            crate::host::state_file::load_profile(dir.path()).as_deref(),
            Some("320k")
        );
        assert!(!dir.path().join(RUNNING).exists());
    }
}
