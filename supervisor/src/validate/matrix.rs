//! `dsv4ctl validate --matrix`: the validation suite on every cell of the profile's
//! `matrix:`, one after the other, unattended.
//!
//! Each cell sets the [`Trial`](crate::lifecycle::trial::Trial) (the arguments the next
//! engine of the profile gets, the CPU profile and GPU level the power policy applies to
//! it), restarts the engine, and runs the load test and the suite. A cell that fails is
//! kept with its error and the next one runs.
//!
//! Users first: a client request that arrives during a cell waits at the gate until the cell
//! ends. The matrix then pauses: the settings as configured and the profile that was active
//! come back, the gate opens, and the matrix goes on once no request came for
//! `engine.idle_timeout` (the time the idle engine would be stopped anyway).

use std::sync::atomic::Ordering;
use std::time::Duration;

use dsv4_client::validate::{Cell, CellSettings, Matrix, Progress, ValidateRequest};

use super::{StartError, ValidationResult, Validator};
use crate::config::matrix::{cpu_policy, gpu_policy};
use crate::config::Config;
use crate::lifecycle::trial::TrialSettings;

/// The cells a request asks for: the profile's matrix, narrowed.
pub(super) fn cells(
    config: &Config,
    profile: &str,
    req: &ValidateRequest,
) -> Result<Vec<CellSettings>, StartError> {
    let p = config.profile(profile);
    let Some(matrix) = p.and_then(|p| p.matrix.as_ref()) else {
        let file = p.map(|p| p.file.display().to_string()).unwrap_or_default();
        return Err(StartError::Invalid(format!(
            "profile {profile} has no matrix: add one to {file} (see `man supervisor.yaml`, \
             key matrix)"
        )));
    };
    let cells = matrix.cells(&req.only).map_err(StartError::Invalid)?;
    match cells.is_empty() {
        true => Err(StartError::Invalid("the matrix has no cell to run".into())),
        false => Ok(cells),
    }
}

/// After the run: the verdict over the cells, and the snippet of settings that says it.
pub(super) fn conclude(config: &Config, service: &str, m: &mut Matrix) {
    m.verdict = dsv4_client::validate::verdict(&m.cells);
    m.snippet = m.verdict.as_ref().and_then(|v| {
        let cell = m.cells.iter().find(|c| c.index == v.pick)?;
        let prefill = v.prefill.as_ref().and_then(|p| p.cpu.as_deref());
        Some(snippet(config, service, &cell.settings, prefill))
    });
}

/// The settings of `cell` as YAML, for the `service` profile: `power:` for supervisor.yaml
/// (with `prefill`, the profile for long prefills, when it pays) and the profile's
/// `extra_args` with the cell's added. Never applied by dsv4d.
pub(crate) fn snippet(
    config: &Config,
    service: &str,
    cell: &CellSettings,
    prefill: Option<&str>,
) -> String {
    let mut out = String::new();
    if cell.cpu.is_some() || cell.gpu.is_some() || prefill.is_some() {
        out.push_str("# supervisor.yaml (or a drop-in in supervisor.yaml.d/)\npower:\n");
        if let Some(cpu) = &cell.cpu {
            out.push_str(&format!("  cpu: {cpu}\n"));
        }
        if let Some(gpu) = &cell.gpu {
            out.push_str(&format!("  gpu: {gpu}\n"));
        }
        if let Some(cpu) = prefill {
            out.push_str(&format!("  prefill: {cpu}\n"));
        }
    }
    let added = cell.added_args();
    if !added.is_empty() {
        let (file, own) = match config.profile(service) {
            Some(p) => (p.file.display().to_string(), p.params.extra_args.clone()),
            None => (format!("profiles/{service}.yaml"), Vec::new()),
        };
        // JSON strings are YAML flow scalars: every argument reads back as the text it is.
        let items: Vec<String> = own
            .iter()
            .chain(&added)
            .map(|a| serde_json::Value::String(a.clone()).to_string())
            .collect();
        out.push_str(&format!("# {file}\nextra_args: [{}]\n", items.join(", ")));
    }
    if out.is_empty() {
        out.push_str("# the profile as it is: nothing to change\n");
    }
    out
}

impl Validator {
    /// Runs every cell of `cells` on `profile`; the cells done so far are in `result` when it
    /// ends early.
    pub(super) async fn matrix(
        &self,
        profile: &str,
        previous: &str,
        req: &ValidateRequest,
        cells: Vec<CellSettings>,
        result: &mut ValidationResult,
    ) -> Result<(), String> {
        let planned = cells.len() as u32;
        let m = result.matrix.insert(Matrix {
            planned,
            ..Matrix::default()
        });
        for (i, settings) in cells.into_iter().enumerate() {
            let index = i as u32 + 1;
            if self.0.waiting.load(Ordering::SeqCst) > 0 {
                self.pause(profile, previous).await?;
                m.pauses += 1;
            }
            self.say(Progress {
                step: "cell".into(),
                run: Some(index),
                runs: Some(planned),
                message: format!("cell {index}/{planned}: {}", settings.label()),
                ..Progress::default()
            });
            let cell = self
                .cell(profile, req, index, settings, &mut result.engine_build)
                .await;
            if let Some(why) = &cell.error {
                tracing::warn!("validation matrix: cell {index} failed: {why}");
            }
            m.cells.push(cell);
        }
        Ok(())
    }

    /// One cell: its settings in force, its engine restarted, the load test and the suite.
    async fn cell(
        &self,
        profile: &str,
        req: &ValidateRequest,
        index: u32,
        settings: CellSettings,
        build: &mut String,
    ) -> Cell {
        let mut cell = Cell {
            index,
            settings,
            ..Cell::default()
        };
        self.0.trial.set(Some(TrialSettings {
            profile: profile.to_string(),
            cpu: cell.settings.cpu.as_deref().and_then(cpu_policy),
            gpu: cell.settings.gpu.as_deref().and_then(gpu_policy),
            args: cell.settings.added_args(),
        }));
        if let Err(why) = self.cell_run(profile, req, &mut cell, build).await {
            cell.error = Some(why);
        }
        cell
    }

    async fn cell_run(
        &self,
        profile: &str,
        req: &ValidateRequest,
        cell: &mut Cell,
        build: &mut String,
    ) -> Result<(), String> {
        let lifecycle = &self.0.lifecycle;
        let files = self.files(profile);
        // The engine that runs now has another cell's settings (or the service profile's):
        // this cell's is a new one.
        let status = lifecycle.status();
        let last = status.generation.unwrap_or(0);
        if status.profile != profile {
            lifecycle
                .set_profile(profile)
                .await
                .map_err(|e| e.to_string())?;
        } else if status.engine_pid.is_some() {
            self.stopped(last).await?;
        }
        let before = self.cached(&files).await;
        let lease = self.lease_after(profile, last).await?;
        let (lease, load) = self.load_test(profile, lease, &files, before).await?;
        cell.load = Some(load);
        if build.is_empty() {
            *build = super::build_info(&lease.engine).await.unwrap_or_default();
        }
        let from = dsv4_client::clock::unix_now();
        let outcome = self
            .tests(profile, req, &lease.engine, &mut cell.tests)
            .await;
        let to = dsv4_client::clock::unix_now();
        cell.host = self.0.telemetry.resources(from, to);
        let power = self.0.power.status();
        cell.applied_cpu = power.cpu.or(power.cpu_note);
        cell.applied_gpu = power.gpu_level.map(|l| l.to_string());
        drop(lease);
        outcome
    }

    /// A client waits: the profile that was active serves, as configured, until no request
    /// came for `engine.idle_timeout`; then the gate closes again.
    async fn pause(&self, profile: &str, previous: &str) -> Result<(), String> {
        let lifecycle = &self.0.lifecycle;
        let idle = self.0.config.borrow().supervisor.engine.idle_timeout;
        self.say(Progress {
            step: "paused".into(),
            message: format!(
                "a client request waits: the matrix pauses while profile {previous} serves, \
                 and goes on after {} without requests",
                crate::config::format_duration(idle)
            ),
            ..Progress::default()
        });
        self.0.trial.set(None);
        let status = lifecycle.status();
        if previous != profile {
            lifecycle
                .set_profile(previous)
                .await
                .map_err(|e| e.to_string())?;
        } else if status.engine_pid.is_some() {
            // The same profile serves, without the cell's settings.
            self.stopped(status.generation.unwrap_or(0)).await?;
        }
        lifecycle.suspend_kv(None).await;
        self.0.gate.send_replace(false);
        self.quiet_for(idle).await;
        self.0.gate.send_replace(true);
        lifecycle.suspend_kv(Some(profile)).await;
        self.say(Progress {
            step: "resumed".into(),
            message: format!(
                "no request for {}: the matrix goes on",
                crate::config::format_duration(idle)
            ),
            ..Progress::default()
        });
        Ok(())
    }

    /// Returns once `idle` passed with no request admitted, none in flight and none waiting
    /// for the engine.
    async fn quiet_for(&self, idle: Duration) {
        let step = idle.max(Duration::from_millis(50));
        loop {
            let seen = self.0.admitted.load(Ordering::SeqCst);
            tokio::time::sleep(step).await;
            let status = self.0.lifecycle.status();
            let busy = status.in_flight > 0 || status.waiting > 0;
            // Since the last request ended, the engine's own idle clock.
            let left = status
                .idle_deadline
                .map(|d| d - dsv4_client::clock::unix_now())
                .filter(|s| *s > 0.0);
            if self.0.admitted.load(Ordering::SeqCst) != seen || busy {
                continue;
            }
            if let Some(left) = left {
                tokio::time::sleep(Duration::from_secs_f64(left.min(idle.as_secs_f64()))).await;
                continue;
            }
            return;
        }
    }
}
