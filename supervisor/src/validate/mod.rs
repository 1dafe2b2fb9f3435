//! Validation runs (`dsv4ctl validate`): the 64K profile's reason to exist, run unattended.
//!
//! A run switches to the validation profile by drain and restart, holds one lease on its
//! engine for the whole suite (so it is never stopped for idleness in between), runs each
//! test `runs` times, every run cold (llama-server's native `/completion` with
//! `cache_prompt: false`; for ds4-server a streamed `/v1/completions`, see [`measure`]), and
//! switches back to the profile that was active, whatever happened: a failed
//! test, an engine that died, `dsv4ctl stop --now`, a cancel. Client requests that arrive
//! meanwhile wait at the [`Validator::admit`] gate (or get a 503 when `max_waiting` of them
//! already wait) and are served once the old profile is back.
//!
//! The suite: `decode` (a fixed short prompt, 256 generated tokens), `prefill` (a prompt of
//! 4,096 tokens: exactly, from llama-server's `/tokenize`; within 2% for ds4-server, text
//! measured by its own count), with an mmproj the vision tests (llama-server), and with
//! `--long N` one `long_prefill` of N tokens. Each test gets the host's figures over its span from
//! the monitor's ring. The result is kept as JSON in `state_dir/validations/`.
//!
//! Owns: the one validation that may run, its gate, and its progress stream. Must not:
//! decide about the engine; it goes through the lifecycle's handle like any client.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4_client::validate::{
    mean_sd, Progress, RunDetail, TestResult, TestTelemetry, ValidateRequest, ValidationResult,
};
use serde_json::Value;
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::config::Config;
use crate::host::sysroot::SysRoot;
use crate::lifecycle::actor::{Handle, Lease};
use crate::lifecycle::engine_ref::EngineRef;
use crate::lifecycle::trial::Trial;
use crate::observe::monitor::Telemetry;
use crate::policy::power::PowerPolicy;

mod after_change;
mod canary;
pub mod checks;
mod load;
mod matrix;
mod measure;

/// The largest validation result read back (one run's figures: a few KiB).
const RESULT_MAX: u64 = 16 << 20;

use measure::{build_info, chat, rate, test_image_uri, vision_request, Api, Prompt};

/// The validation profile when none is named.
pub const DEFAULT_PROFILE: &str = "64k";
/// Tokens of the cold prefill test.
pub const PREFILL_TOKENS: u64 = 4096;
/// Tokens the decode test generates.
pub const DECODE_TOKENS: u64 = 256;
pub(crate) const DECODE_PROMPT: &str = "Write the alphabet, then keep going:";
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
    /// A matrix cell's settings, which the engine and the power policy take up.
    trial: Trial,
    /// The power policy, whose status says what a cell had in force.
    power: PowerPolicy,
    /// Client requests admitted: a paused matrix resumes once none came for a while.
    admitted: AtomicU64,
    /// Each profile's last canary, and the one due or running.
    checks: checks::Checks,
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
        trial: Trial,
        power: PowerPolicy,
    ) -> Validator {
        let (gate, _) = watch::channel(false);
        let (events, _) = broadcast::channel(256);
        let checks = checks::Checks::load(&config.borrow().supervisor.state_dir);
        Validator(Arc::new(Inner {
            lifecycle,
            telemetry,
            config,
            sysroot,
            gate,
            waiting: AtomicUsize::new(0),
            events,
            cancel: Mutex::new(None),
            trial,
            power,
            admitted: AtomicU64::new(0),
            checks,
        }))
    }

    /// Each profile's last canary, and the one due or running.
    pub fn checks(&self) -> &checks::Checks {
        &self.0.checks
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
        self.0.admitted.fetch_add(1, Ordering::Relaxed);
        // The common case, without a receiver made and dropped for every request.
        if !self.running() {
            return Ok(());
        }
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
        check_request(&config, &profile, &req)?;
        let cells = match req.matrix {
            true => Some(matrix::cells(&config, &profile, &req)?),
            false => None,
        };
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
        let previous = self.0.lifecycle.profile();
        tokio::spawn(async move {
            let run = {
                let (this, name, previous) = (this.clone(), name.clone(), previous.clone());
                tokio::spawn(
                    async move { this.run(&name, &previous, &req, cells, cancel_rx).await },
                )
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
        let state_dir = self.0.config.borrow().supervisor.state_dir.clone();
        saved_in(&state_dir, profile)
    }

    /// After a run that did not end by itself: back to `previous`, the gate open.
    async fn aborted(&self, profile: &str, previous: &str, why: String) -> ValidationResult {
        tracing::error!("the validation of profile {profile} failed: {why}");
        self.0.trial.set(None);
        self.0.lifecycle.suspend_kv(None).await;
        let _ = self.switch_back(profile, previous).await;
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

    /// Back to `previous`, unless someone chose another profile meanwhile. The mark of the
    /// running validation goes only once that worked: after a failed switch (the daemon
    /// shutting down, say) the next start goes back instead.
    async fn switch_back(&self, profile: &str, previous: &str) -> Result<(), String> {
        let lifecycle = &self.0.lifecycle;
        if lifecycle.profile() == profile && profile != previous {
            self.say(Progress {
                step: "switching back".into(),
                message: format!("switching back to profile {previous}"),
                ..Progress::default()
            });
            lifecycle
                .set_profile(previous)
                .await
                .map_err(|e| format!("cannot switch back to profile {previous}: {e}"))?;
        }
        let state_dir = self.0.config.borrow().supervisor.state_dir.clone();
        let _ = std::fs::remove_file(state_dir.join(RUNNING));
        Ok(())
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
        cells: Option<Vec<dsv4_client::validate::CellSettings>>,
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
                .and_then(|text| crate::config::yaml_to_json(&text))
                .unwrap_or(Value::Null),
            ..ValidationResult::default()
        };
        let _ =
            crate::host::state_file::write_atomic(&state_dir.join(RUNNING), previous.as_bytes());
        // Its engine neither restores nor saves a KV checkpoint: the benchmark prompts must
        // not replace the profile's real one, or push others out of the folder.
        lifecycle.suspend_kv(Some(profile)).await;
        let outcome = tokio::select! {
            r = async {
                match cells {
                    Some(cells) => self.matrix(profile, &previous, req, cells, &mut result).await,
                    None => self.suite(profile, req, &mut result).await,
                }
            } => r,
            _ = cancel.wait_for(|c| *c) => Err("cancelled (CancelValidation)".to_string()),
        };
        if let Err(why) = outcome {
            tracing::warn!("validation of profile {profile} ended early: {why}");
            result.error = Some(why);
        }
        // The engines after it run as configured.
        self.0.trial.set(None);
        if let Some(m) = result.matrix.as_mut() {
            matrix::conclude(&config, &previous, m);
        }
        // Back, whatever happened (the lease went with the suite).
        if let Err(why) = self.switch_back(profile, &previous).await {
            tracing::error!("{why}");
            result.error.get_or_insert(why);
        }
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
        // What the page cache holds of the model before the switch loads it.
        let files = self.files(profile);
        let before = self.cached(&files).await;
        lifecycle
            .set_profile(profile)
            .await
            .map_err(|e| e.to_string())?;
        let lease = self.lease_on(profile).await?;
        let lease = match req.canary_only {
            true => lease,
            false => {
                let (lease, load) = self.load_test(profile, lease, &files, before).await?;
                result.load = Some(load);
                lease
            }
        };
        result.engine_build = build_info(&lease.engine).await.unwrap_or_default();
        if !req.canary_only {
            self.tests(profile, req, &lease.engine, &mut result.tests)
                .await?;
        }
        result.canary = Some(self.canary(profile, req, &lease.engine).await?);
        drop(lease);
        Ok(())
    }

    /// The canary on `engine`, compared with `profile`'s reference; recorded as the reference
    /// when there is none or `req.record` asks it.
    async fn canary(
        &self,
        profile: &str,
        req: &ValidateRequest,
        engine: &EngineRef,
    ) -> Result<dsv4_client::validate::CanaryResult, String> {
        let config = self.0.config.borrow().clone();
        let kind = config
            .profile(profile)
            .map(|p| p.engine)
            .unwrap_or_default();
        let api = Api::of(kind).ok_or("the profile's engine serves no API to measure")?;
        self.say(Progress {
            step: "canary".into(),
            test: Some("canary".into()),
            message: format!(
                "canary: {} prompts, {} tokens each, greedy",
                canary::PROMPTS.len(),
                canary::TOKENS
            ),
            ..Progress::default()
        });
        // The engine's identity is read once it serves, beside the suite.
        let mut status = self.0.lifecycle.watch_status();
        let known = status.wait_for(|s| s.identity.is_some());
        let identity = match tokio::time::timeout(Duration::from_secs(30), known).await {
            Ok(Ok(s)) => s.identity.clone(),
            _ => None,
        };
        let identity = identity.map(|i| i.identity);
        let run = dsv4_client::validate::CanaryRun {
            prompts: canary::run(api, engine).await?,
            engine: identity.as_ref().map(|i| i.brief()).unwrap_or_default(),
            identity,
            at: dsv4_client::clock::unix_now(),
        };
        let state_dir = config.supervisor.state_dir.clone();
        let reference = match req.record {
            true => None,
            false => canary::reference(&state_dir, profile),
        };
        let mut result = dsv4_client::validate::CanaryResult {
            recorded: reference.is_none(),
            tolerance: canary::TOLERANCE,
            ..Default::default()
        };
        let message = match &reference {
            Some(r) => {
                result.reference_engine = r.engine.clone();
                result.reference_at = r.at;
                result.drift = canary::drift(r, &run, canary::TOLERANCE);
                match &result.drift {
                    Some(d) => format!("{d} (the reference: {})", r.engine),
                    None => format!("canary: as its reference ({})", r.engine),
                }
            }
            None => {
                canary::record(&state_dir, profile, &run).map_err(|e| {
                    format!(
                        "cannot record the canary's reference in {}: {e}",
                        state_dir.display()
                    )
                })?;
                format!("canary: recorded as profile {profile}'s reference")
            }
        };
        self.say(Progress {
            step: "canary".into(),
            test: Some("canary".into()),
            message,
            ..Progress::default()
        });
        result.run = run;
        self.0.checks.validated(profile, &result);
        Ok(result)
    }

    /// The files of `profile`'s model.
    fn files(&self, profile: &str) -> Vec<PathBuf> {
        let files = self
            .0
            .config
            .borrow()
            .profile(profile)
            .map(crate::config::load_files);
        files.unwrap_or_default()
    }

    /// The suite's tests on `engine`, each added to `tests` as it ends.
    async fn tests(
        &self,
        profile: &str,
        req: &ValidateRequest,
        engine: &EngineRef,
        tests: &mut Vec<TestResult>,
    ) -> Result<(), String> {
        let (api, has_mmproj) = {
            let config = self.0.config.borrow();
            let p = config.profile(profile);
            let api = Api::of(p.map(|p| p.engine).unwrap_or_default());
            (api, p.is_some_and(|p| p.params.mmproj.is_some()))
        };
        // Refused at the start; the profile may have changed since.
        let api = api.ok_or("the profile's engine serves no API to measure")?;
        let runs = req.runs;
        // Each run's number, for the streamed API's marks.
        let mut run = 0;
        let decode = self
            .test("decode", runs, engine, || {
                run += 1;
                let this = run;
                async move {
                    let d = api.decode(engine, this).await?;
                    Ok(RunDetail {
                        value: rate(d.predicted_n, d.predicted_ms),
                        ..d.detail
                    })
                }
            })
            .await;
        tests.push(decode?);
        let prompt = api
            .prompt(engine, req.prefill.unwrap_or(PREFILL_TOKENS))
            .await?;
        let prefill = self
            .test("prefill", runs, engine, || {
                run += 1;
                prefill_run(api, engine, &prompt, 1, run)
            })
            .await;
        tests.push(prefill?);
        // The vision projector is llama-server's (ds4-server has none).
        if has_mmproj && api == Api::Native {
            let image = test_image_uri();
            for (name, decode) in [("vision_prefill", false), ("vision_decode", true)] {
                let vision = self
                    .test(name, runs, engine, || async {
                        let body = vision_request(&image, decode);
                        let d = chat(engine, body).await?;
                        let value = match decode {
                            true => rate(d.predicted_n, d.predicted_ms),
                            false => rate(d.detail.prompt_n, d.prompt_ms),
                        };
                        Ok(RunDetail { value, ..d.detail })
                    })
                    .await;
                tests.push(vision?);
            }
        }
        if let Some(n) = req.long {
            let prompt = api.prompt(engine, n).await?;
            let long = self
                .test("long_prefill", 1, engine, || {
                    run += 1;
                    prefill_run(api, engine, &prompt, 32, run)
                })
                .await;
            tests.push(long?);
        }
        Ok(())
    }

    /// The load test, around the switch: `before` is what the page cache held of the
    /// model's `files` before it. The warm load is the switch's own (the engine `lease`
    /// holds; for a validation of the running profile, that engine's load). Then the engine
    /// is stopped, the model's files dropped from the page cache, and the load timed again;
    /// then twice more, as a start after an idle stop finds the box: with what the engine's
    /// run left in the page cache, and after `engine.prewarm`'s reading. The lease on the
    /// engine the rest of the suite runs on, and the figures.
    async fn load_test(
        &self,
        profile: &str,
        lease: Lease,
        files: &[PathBuf],
        before: u64,
    ) -> Result<(Lease, dsv4_client::validate::LoadTest), String> {
        let method = {
            let config = self.0.config.borrow();
            let p = config.profile(profile);
            let p = p.ok_or_else(|| format!("no profile {profile}"))?;
            // A matrix cell's arguments count: `--no-mmap` may be one.
            let mut args = p.params.extra_args.clone();
            args.extend(self.0.trial.args_for(profile));
            (p.engine.describe().load_method)(&args)
        };
        let warm = self.load_seconds(lease.engine.gen).await?;
        self.say_load(
            warm,
            format!(
                "load with the page cache as it was: {} ({method})",
                dsv4_client::duration::brief_secs(warm)
            ),
        );
        // Client requests wait at the validation's gate meanwhile, and the engine is idle
        // (the lease was the only one): a planned stop refuses no one.
        let dropped = files.to_vec();
        let (lease, cold, cached_before_cold, bytes) = self
            .reload(profile, lease, files, move || {
                load::drop_from_cache(&dropped)
            })
            .await?;
        self.say_load(
            cold,
            format!(
                "load after {} dropped from the page cache: {}",
                crate::config::format_size(bytes),
                dsv4_client::duration::brief_secs(cold)
            ),
        );
        let (lease, after_stop, cached_after_stop, ()) =
            self.reload(profile, lease, files, || Ok(())).await?;
        self.say_load(
            after_stop,
            format!(
                "load after an idle stop, with the {} of the model its run left in the page \
                 cache: {}",
                crate::config::format_size(cached_after_stop),
                dsv4_client::duration::brief_secs(after_stop)
            ),
        );
        let (lease, prewarmed, cached_after_prewarm, read_back) =
            self.prewarmed_load(profile, lease, files).await?;
        let load = dsv4_client::validate::LoadTest {
            warm_seconds: warm,
            cold_seconds: cold,
            files: files.iter().map(|f| f.display().to_string()).collect(),
            bytes,
            cached_before_warm: before,
            cached_before_cold,
            after_stop_seconds: Some(after_stop),
            cached_after_stop: Some(cached_after_stop),
            prewarmed_seconds: Some(prewarmed),
            cached_after_prewarm: Some(cached_after_prewarm),
            read_back,
            method,
        };
        Ok((lease, load))
    }

    /// The engine of `lease` stopped, `between` done (blocking) while none runs, and the
    /// profile's engine started again: the lease on the new one, its load time, what the
    /// page cache held of `files` before it, and what `between` said.
    async fn reload<T: Send + 'static>(
        &self,
        profile: &str,
        lease: Lease,
        files: &[PathBuf],
        between: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<(Lease, f64, u64, T), String> {
        let gone = lease.engine.gen;
        drop(lease);
        self.stopped(gone).await?;
        let said = tokio::task::spawn_blocking(between)
            .await
            .map_err(|e| e.to_string())??;
        let cached = self.cached(files).await;
        let lease = self.lease_after(profile, gone).await?;
        let seconds = self.load_seconds(lease.engine.gen).await?;
        Ok((lease, seconds, cached, said))
    }

    /// A start after an idle stop with `engine.prewarm`: the model's `files` read back into
    /// the page cache as its prewarm reads them (within the memory available less
    /// `memory.reserve`, stopping at memory pressure), then the load. A validation leaves the
    /// page cache so, not colder than it found it. The lease, the load time, what the page
    /// cache held before it, and the bytes read.
    async fn prewarmed_load(
        &self,
        profile: &str,
        lease: Lease,
        files: &[PathBuf],
    ) -> Result<(Lease, f64, u64, u64), String> {
        let reserve = self.0.config.borrow().supervisor.memory.reserve;
        let (asked, root) = (files.to_vec(), self.0.sysroot.clone());
        let (lease, seconds, cached, read) = self
            .reload(profile, lease, files, move || {
                Ok(crate::host::prewarm::run(&asked, &root, reserve, &|| false))
            })
            .await?;
        if let crate::host::prewarm::Ended::Failed(why) = &read.ended {
            tracing::warn!("validate: engine.prewarm's reading failed: {why}");
        }
        self.say(Progress {
            step: "load".into(),
            test: Some("load".into()),
            message: format!("engine.prewarm before it: {}", read.said()),
            ..Progress::default()
        });
        self.say_load(
            seconds,
            format!(
                "load after an idle stop with engine.prewarm, the page cache holding {} of \
                 the model: {}",
                crate::config::format_size(cached),
                dsv4_client::duration::brief_secs(seconds)
            ),
        );
        Ok((lease, seconds, cached, read.read))
    }

    fn say_load(&self, seconds: f64, message: String) {
        self.say(Progress {
            step: "load".into(),
            test: Some("load".into()),
            value: Some(seconds),
            message,
            ..Progress::default()
        });
    }

    /// How many bytes of `files` the page cache holds.
    async fn cached(&self, files: &[PathBuf]) -> u64 {
        let files = files.to_vec();
        tokio::task::spawn_blocking(move || load::cached(&files))
            .await
            .unwrap_or_default()
    }

    /// Stops the engine of generation `gen` and waits until it is gone: the status then
    /// names another generation or none, which stays true once it is.
    async fn stopped(&self, gen: u64) -> Result<(), String> {
        let lifecycle = &self.0.lifecycle;
        let within =
            self.0.config.borrow().supervisor.engine.stop_timeout * 2 + Duration::from_secs(30);
        lifecycle.stop(false).await.map_err(|e| e.to_string())?;
        let mut status = lifecycle.watch_status();
        let gone = status.wait_for(|s| {
            s.generation != Some(gen) && s.engine_pid.is_none()
                || s.generation.is_some_and(|g| g > gen)
        });
        let outcome = match tokio::time::timeout(within, gone).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(_)) => Err("the lifecycle went away".into()),
            Err(_) => Err(format!(
                "the engine did not stop within {}",
                dsv4_client::duration::format(within)
            )),
        };
        outcome
    }

    /// How long the engine of generation `gen` took to load, once its status says.
    async fn load_seconds(&self, gen: u64) -> Result<f64, String> {
        let mut status = self.0.lifecycle.watch_status();
        let loaded = status.wait_for(|s| s.generation == Some(gen) && s.load_seconds.is_some());
        let seconds = match tokio::time::timeout(Duration::from_secs(10), loaded).await {
            Ok(Ok(s)) => s.load_seconds,
            _ => None,
        };
        seconds
            .ok_or_else(|| format!("the load time of engine generation {gen} was never published"))
    }

    /// A lease on an engine of `profile` newer than generation `gen`.
    async fn lease_after(&self, profile: &str, gen: u64) -> Result<Lease, String> {
        for _ in 0..100 {
            let lease = self.lease_on(profile).await?;
            if lease.engine.gen > gen {
                return Ok(lease);
            }
            drop(lease);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(format!("no new engine of profile {profile} came up"))
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
                .and_then(|g| g.memory.gtt_used)
        };
        let available = |s: &Option<Arc<dsv4_client::telemetry::Sample>>| {
            s.as_ref()
                .and_then(|s| s.memory.as_ref())
                .map(|m| m.available)
        };
        let values: Vec<f64> = details.iter().map(|d| d.value).collect();
        let (mean, sd) = mean_sd(&values);
        let soc_power_source = [&after, &before]
            .into_iter()
            .find_map(|s| s.as_ref().and_then(|s| s.power.soc_source));
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
                soc_power_source,
                joules_per_token: joules_per_token(span.soc_power_mean_w, mean),
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

/// Joules per token at `watts` (the mean power over a test) and `rate` tokens a second;
/// `None` without a power figure or a rate.
fn joules_per_token(watts: Option<f64>, rate: f64) -> Option<f64> {
    let j = watts? / rate;
    (rate > 0.0 && j.is_finite()).then_some(j)
}

/// One cold run of `prompt`: its prefill rate, over the tokens the engine evaluated (ds4-server
/// renders every prompt in its chat template and keeps the template's opening from the last
/// request: those few are in `cache_n` and not counted).
async fn prefill_run(
    api: Api,
    engine: &EngineRef,
    prompt: &Prompt,
    n_predict: u64,
    run: u32,
) -> Result<RunDetail, String> {
    let d = api.prefill(engine, prompt, n_predict, run).await?;
    let evaluated = d.detail.prompt_n.saturating_sub(d.detail.cache_n);
    Ok(RunDetail {
        value: rate(evaluated, d.prompt_ms),
        ..d.detail
    })
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
    let previous = crate::host::regular::read_state(&file)?;
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

/// The runs of `profile` (every profile's with `None`) kept in `state_dir`, newest first.
pub fn saved_in(state_dir: &Path, profile: Option<&str>) -> Vec<ValidationResult> {
    let Ok(entries) = std::fs::read_dir(state_dir.join("validations")) else {
        return Vec::new();
    };
    let mut runs: Vec<ValidationResult> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| {
            let bytes = crate::host::regular::read(&e.path(), RESULT_MAX);
            serde_json::from_slice(&bytes.ok()?).ok()
        })
        .filter(|r: &ValidationResult| profile.is_none_or(|p| r.profile == p))
        .collect();
    runs.sort_by(|a, b| b.started.total_cmp(&a.started));
    runs
}

/// The canary's reference of `profile`, when one was recorded.
pub fn canary_reference(
    state_dir: &Path,
    profile: &str,
) -> Option<dsv4_client::validate::CanaryRun> {
    canary::reference(state_dir, profile)
}

/// What a validation of `profile` asks, checked before anything changes: an engine that
/// serves an API, runs and prompt lengths in bounds, no canary in a matrix.
fn check_request(config: &Config, profile: &str, req: &ValidateRequest) -> Result<(), StartError> {
    if let Some(p) = config.profile(profile) {
        if Api::of(p.engine).is_none() {
            return Err(StartError::Invalid(format!(
                "profile `{profile}` runs {}, which serves no API of its own: it lends \
                 this box's devices to a coordinator; validate the coordinator's profile \
                 on its box",
                p.engine
            )));
        }
    }
    if req.runs == 0 || req.runs > MAX_RUNS {
        return Err(StartError::Invalid(format!(
            "runs must be between 1 and {MAX_RUNS}"
        )));
    }
    let most = config
        .profile(profile)
        .and_then(|p| p.context())
        .map_or(10_000_000, u64::from);
    for (flag, asked) in [("--prefill", req.prefill), ("--long", req.long)] {
        if asked.is_some_and(|n| n == 0 || n >= most) {
            return Err(StartError::Invalid(format!(
                "{flag} must be at least 1 token and fewer than the profile's context \
                 ({most})"
            )));
        }
    }
    if req.matrix && (req.canary_only || req.record) {
        return Err(StartError::Invalid(
            "a matrix runs no canary: --canary and --record are for a validation of one \
             profile"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn energy_per_token_is_the_mean_power_over_the_rate() {
        let table = [
            // The seeds' decode: 16.02 tok/s at about 85 W.
            (Some(85.0), 16.02, Some(85.0 / 16.02)),
            (Some(60.0), 300.0, Some(0.2)),
            (None, 16.0, None),
            (Some(85.0), 0.0, None),
            (Some(85.0), f64::NAN, None),
        ];
        for (watts, rate, want) in table {
            let got = joules_per_token(watts, rate);
            match (got, want) {
                (Some(g), Some(w)) => assert!((g - w).abs() < 1e-9, "{watts:?} {rate}: {g}"),
                _ => assert_eq!(got, want, "{watts:?} {rate}"),
            }
        }
    }
}
