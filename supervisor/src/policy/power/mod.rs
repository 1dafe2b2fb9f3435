//! The power policy: while an engine runs, the CPU on the configured profile (power-saver)
//! and the GPU on its level (auto); when it stops, the user's own settings back.
//!
//! Owns: what it changed and what to give back (a power-profiles-daemon hold, the cpufreq
//! settings it found, the GPU level it found), its own connection to the **system** bus
//! (whatever `--bus` says: that flag places the control interface; `DBUS_SYSTEM_BUS_ADDRESS`
//! is honoured), and `state_dir/power-restore.json`, written before anything is changed so
//! that a daemon that crashed gives the settings back at its next start. Must not: fight the
//! user (a profile chosen by hand while held is logged and shown, not undone), or hold up an
//! engine: every failure is logged, alerted and shown, and the engine runs as it would.
//!
//! It follows the lifecycle's status (an engine exists from its spawn until its exit) and
//! the monitor's samples (the GPU level drifting while the engine runs).

pub mod cpufreq;
pub mod gpu;
pub mod ppd;
pub mod prefill;
pub mod sysfs;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4_client::{AlertKind, PowerStatus};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::config::{Config, CpuPolicy};
use crate::host::sysroot::SysRoot;
use crate::lifecycle::alert::Alerts;
use crate::lifecycle::Status;
use crate::observe::monitor::Telemetry;

use self::cpufreq::PolicySettings;
use self::ppd::Ppd;
use self::prefill::Prefills;
use self::sysfs::Writer;

/// The file in `state_dir` that says what to give back.
pub const RESTORE_FILE: &str = "power-restore.json";

/// What the hold says to whoever lists PPD's holds.
const HOLD_REASON: &str = "dsv4: inference engine running";
const PREFILL_REASON: &str = "dsv4: a long prefill";
const HOLD_APP: &str = "dsv4d";

/// What to give back, as written to [`RESTORE_FILE`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Restore {
    /// The cpufreq settings found before they were changed...
    pub cpufreq: Vec<PolicySettings>,
    /// ...and what they were set to: a policy that no longer holds this was changed by hand
    /// since, and is left as it is.
    #[serde(default)]
    pub cpufreq_set: Vec<PolicySettings>,
    /// The GPU's level file, the level found and the level set.
    pub gpu: Option<GpuRestore>,
    /// The boot it was written in: after a reboot the machine has its own settings again.
    #[serde(default)]
    pub boot: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuRestore {
    pub file: String,
    pub found: GpuLevel,
    pub set: GpuLevel,
}

impl Restore {
    fn path(state_dir: &Path) -> PathBuf {
        state_dir.join(RESTORE_FILE)
    }

    fn save(&self, state_dir: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        crate::host::state_file::write_atomic(&Self::path(state_dir), &json)
    }

    fn load(state_dir: &Path) -> Option<Restore> {
        let text = crate::host::regular::read_state(&Self::path(state_dir))?;
        serde_json::from_str(&text).ok()
    }

    fn clear(state_dir: &Path) {
        let _ = std::fs::remove_file(Self::path(state_dir));
    }

    /// Gives back what it holds; the problems, each naming its file.
    async fn give_back(&self, writer: &Writer) -> Vec<String> {
        let root = writer.root();
        let now = cpufreq::read(root);
        let still_ours = |found: &&PolicySettings| {
            let set = self.cpufreq_set.iter().find(|s| s.policy == found.policy);
            let current = now.iter().find(|c| c.policy == found.policy);
            match (set, current) {
                (Some(s), Some(c)) => {
                    c.governor == s.governor && (s.epp.is_none() || c.epp == s.epp)
                }
                _ => false,
            }
        };
        let (ours, changed): (Vec<&PolicySettings>, Vec<&PolicySettings>) =
            self.cpufreq.iter().partition(still_ours);
        for p in changed {
            tracing::info!(
                "power: {} was changed by hand meanwhile: left as it is",
                p.policy
            );
        }
        let ours: Vec<PolicySettings> = ours.into_iter().cloned().collect();
        let mut problems = cpufreq::apply(writer, &ours).await;
        if let Some(g) = &self.gpu {
            let now = gpu::read(root, &g.file);
            if let Some(level) = gpu::restore_at_stop(&g.found, &g.set, now.as_ref()) {
                if let Err(e) = gpu::write(writer, &g.file, level).await {
                    problems.push(e);
                }
            }
        }
        problems
    }
}

/// The task's handle: its status, and the way to end it (giving everything back).
#[derive(Clone)]
pub struct PowerPolicy {
    status: watch::Receiver<PowerStatus>,
    stop: mpsc::Sender<oneshot::Sender<()>>,
}

impl PowerPolicy {
    /// A policy that never acts, for tests and tools that need a handle.
    pub fn none() -> PowerPolicy {
        let (_, status) = watch::channel(PowerStatus::default());
        let (stop, _) = mpsc::channel(1);
        PowerPolicy { status, stop }
    }

    pub fn status(&self) -> PowerStatus {
        self.status.borrow().clone()
    }

    /// Gives back what the policy changed and ends the task (at the daemon's shutdown, once
    /// the engine is gone).
    pub async fn shutdown(&self) {
        let (tx, rx) = oneshot::channel();
        if self.stop.send(tx).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// What the task needs.
pub struct Parts {
    pub config: watch::Receiver<Arc<Config>>,
    pub lifecycle: watch::Receiver<Status>,
    pub telemetry: Telemetry,
    pub sysroot: SysRoot,
    pub alerts: Alerts,
    /// A validation matrix cell's CPU profile and GPU level, in place of `power:`'s for its
    /// profile's engine.
    pub trial: crate::lifecycle::trial::Trial,
    /// The requests in flight: how long one has been in its prefill (`power.prefill`).
    pub flights: crate::observe::flights::Flights,
}

/// Starts the task: first it gives back what a daemon that crashed had left changed.
pub fn spawn(parts: Parts) -> PowerPolicy {
    let (status_tx, status) = watch::channel(PowerStatus::default());
    let (stop, stop_rx) = mpsc::channel(1);
    let state_dir = parts.config.borrow().supervisor.state_dir.clone();
    let left = Restore::load(&state_dir);
    let this_boot = crate::lifecycle::leftover::boot_id(Path::new("/proc")).ok();
    let left = match left {
        Some(l) if l.boot.is_some() && l.boot != this_boot => {
            tracing::info!(
                "power: {} is from before a reboot: the machine's own settings stand",
                Restore::path(&state_dir).display()
            );
            Restore::clear(&state_dir);
            None
        }
        other => other,
    };
    let writer = Writer::new(parts.sysroot.clone());
    let task = Task {
        parts,
        status: status_tx,
        writer,
        applied: None,
        last_choice: None,
    };
    tokio::spawn(async move {
        if let Some(left) = left {
            tracing::warn!(
                "power: giving back the settings a previous dsv4d changed and did not restore"
            );
            for p in left.give_back(&task.writer).await {
                tracing::warn!("power: {p}");
            }
            Restore::clear(&state_dir);
        }
        task.run(stop_rx).await
    });
    PowerPolicy { status, stop }
}

/// What is in force while an engine runs.
struct Applied {
    /// The settings applied (`power:`, or a matrix cell's).
    wanted: crate::config::PowerSettings,
    method: Method,
    /// power-profiles-daemon, when that is the method...
    ppd: Option<Ppd>,
    /// ...and the cookie of its hold, while dsv4d holds a profile.
    hold: Option<u32>,
    /// `power.prefill`'s profile is in force instead of `power.cpu`'s.
    prefill: bool,
    /// The user chose a profile while it was held: PPD ended the hold.
    released_by_user: bool,
    restore: Restore,
    state_dir: PathBuf,
}

/// What `power` changes with `method`, and so what is to be given back (saved in
/// `state_dir` before anything changes), and a note on the CPU policies left alone.
fn plan_restore(
    root: &SysRoot,
    power: &crate::config::PowerSettings,
    method: Method,
    state_dir: &Path,
) -> (Restore, Option<String>) {
    let mut restore = Restore {
        boot: crate::lifecycle::leftover::boot_id(Path::new("/proc")).ok(),
        ..Restore::default()
    };
    let cpu_target = cpufreq::target(power.cpu);
    let mut left_note = None;
    if method == Method::Cpufreq && cpu_target.is_some() {
        let found = cpufreq::read(root);
        let targets = cpufreq::targeted(root, &found, power.cpu);
        left_note = targets.left_note();
        // Only the policies dsv4 sets are given back.
        restore.cpufreq = found
            .into_iter()
            .filter(|p| targets.set.iter().any(|t| t.policy == p.policy))
            .collect();
        restore.cpufreq_set = targets.set;
    }
    let gpu_file = gpu::wanted(power.gpu).and_then(|_| gpu::level_file(root));
    let gpu_found = gpu_file.as_deref().and_then(|f| gpu::read(root, f));
    if let (Some(file), Some(found), Some(set)) = (&gpu_file, &gpu_found, gpu::wanted(power.gpu)) {
        restore.gpu = Some(GpuRestore {
            file: file.clone(),
            found: found.clone(),
            set,
        });
    }
    let something = !restore.cpufreq.is_empty() || restore.gpu.is_some();
    let saved = if something {
        restore.save(state_dir)
    } else {
        Ok(())
    };
    if let Err(e) = saved {
        tracing::warn!(
            "power: cannot write {}: {e}; a crash would leave the settings changed",
            Restore::path(state_dir).display()
        );
    }
    (restore, left_note)
}

/// The method decided on: the client's word, which the status carries.
use dsv4_client::words::{GpuLevel, PowerMethod as Method};

struct Task {
    parts: Parts,
    status: watch::Sender<PowerStatus>,
    /// The sysfs writes: dsv4d's own, or through the `dsv4-sysfs@` unit; it also holds the
    /// policy's one system-bus connection.
    writer: Writer,
    applied: Option<Applied>,
    /// The last method chosen and why, logged when it changes.
    last_choice: Option<(Method, String)>,
}

impl Task {
    async fn run(mut self, mut stop: mpsc::Receiver<oneshot::Sender<()>>) {
        let mut telemetry = self.parts.telemetry.watch();
        let flights = self.parts.flights.clone();
        let mut released: Option<zbus::proxy::SignalStream<'static>> = None;
        // Once the monitor is gone (it never is, but a closed channel is always ready).
        let mut samples_open = true;
        loop {
            let (engine, profile) = {
                let status = self.parts.lifecycle.borrow_and_update();
                (status.state.has_engine(), status.engine_profile.clone())
            };
            // A new engine that is to run with other settings (the next cell of a validation
            // matrix): what the last one had is given back first.
            if engine && self.applied.is_some() {
                let wanted = self.wanted(profile.as_deref());
                if self.applied.as_ref().is_some_and(|a| a.wanted != wanted) {
                    self.undo().await;
                }
            }
            if engine && self.applied.is_none() {
                released = self.apply().await;
            } else if !engine && self.applied.is_some() {
                self.undo().await;
                released = None;
            }
            // The requests' prefills wake this task only while `power.prefill` is in force.
            let (following, recheck) = match self.follow_prefill().await {
                Prefills::Ignored => (false, None),
                Prefills::Followed { recheck } => (true, recheck),
            };
            tokio::select! {
                () = flights.prefills_changed(), if following => {}
                () = tokio::time::sleep_until(recheck.unwrap_or_else(Instant::now)),
                    if recheck.is_some() => {}
                changed = self.parts.lifecycle.changed() => {
                    if changed.is_err() {
                        self.undo().await;
                        return;
                    }
                }
                changed = telemetry.changed(), if samples_open => {
                    match changed {
                        Ok(()) => {
                            let sample = telemetry.borrow_and_update().clone();
                            self.on_sample(sample.as_deref()).await;
                        }
                        Err(_) => samples_open = false,
                    }
                }
                Some(msg) = async {
                    match released.as_mut() {
                        Some(s) => s.next().await,
                        None => std::future::pending().await,
                    }
                } => self.on_released(&msg),
                reply = stop.recv() => {
                    self.undo().await;
                    if let Some(reply) = reply {
                        let _ = reply.send(());
                    }
                    return;
                }
            }
        }
    }

    /// The power settings for an engine of `profile`.
    fn wanted(&self, profile: Option<&str>) -> crate::config::PowerSettings {
        let config = self.parts.config.borrow();
        self.parts
            .trial
            .power_for(profile, &config.supervisor.power)
    }

    fn update(&self, f: impl FnOnce(&mut PowerStatus)) {
        self.status.send_modify(f);
    }

    async fn system_bus(&mut self) -> Result<zbus::Connection, String> {
        self.writer.system_bus().await
    }

    /// The method to use now, and why; PPD when asked for (or found, with `auto`).
    /// (`method` is `power.method`: `None` for `auto`.)
    async fn choose(&mut self, method: Option<Method>) -> (Method, String, Option<Ppd>) {
        let root = self.parts.sysroot.clone();
        let ppd = match method {
            Some(Method::None) => return (Method::None, "power.method is none".into(), None),
            Some(Method::Cpufreq) => None,
            None | Some(Method::Ppd) => match self.system_bus().await {
                Ok(conn) => match Ppd::find(&conn).await {
                    Ok(found) => found
                        .ok_or_else(|| "no power-profiles-daemon on the system bus".to_string()),
                    Err(e) => Err(format!(
                        "cannot ask the system bus for power-profiles-daemon: {e}"
                    )),
                }
                .map(Some)
                .unwrap_or_else(|why| {
                    self.update(|s| s.cpu_note = Some(why.clone()));
                    tracing::debug!("power: {why}");
                    None
                }),
                Err(why) => {
                    tracing::debug!("power: {why}");
                    self.update(|s| s.cpu_note = Some(why));
                    None
                }
            },
        };
        if let Some(p) = ppd {
            return (
                Method::Ppd,
                format!(
                    "power-profiles-daemon is on the system bus as {}",
                    p.service
                ),
                Some(p),
            );
        }
        if method == Some(Method::Ppd) {
            let why = self.status.borrow().cpu_note.clone().unwrap_or_default();
            return (
                Method::None,
                format!("power.method is ppd, but {why}"),
                None,
            );
        }
        let policies = cpufreq::read(&root).len();
        let how = if policies == 0 {
            None
        } else if cpufreq::writable(&root) {
            Some("writable".to_string())
        } else if self.writer.helper_installed().await {
            Some(format!("written through {}", sysfs::template_unit()))
        } else {
            None
        };
        if let Some(how) = how {
            let why = match method {
                Some(Method::Cpufreq) => {
                    format!("power.method is cpufreq ({policies} policies, {how})")
                }
                _ => format!(
                    "no power-profiles-daemon on the system bus; {policies} cpufreq policies, {how}"
                ),
            };
            return (Method::Cpufreq, why, None);
        }
        let why = if policies == 0 {
            format!(
                "no power-profiles-daemon on the system bus, and no cpufreq policy under {}",
                root.path("/sys/devices/system/cpu/cpufreq").display()
            )
        } else {
            format!("no power-profiles-daemon on the system bus, and the {policies} cpufreq policies are not writable by dsv4d, nor is {} installed", sysfs::template_unit())
        };
        (Method::None, why, None)
    }

    async fn apply(&mut self) -> Option<zbus::proxy::SignalStream<'static>> {
        let config = self.parts.config.borrow().clone();
        let profile = self.parts.lifecycle.borrow().engine_profile.clone();
        let power = &self.wanted(profile.as_deref());
        let root = self.parts.sysroot.clone();
        let state_dir = config.supervisor.state_dir.clone();
        let soc_before = self.parts.telemetry.latest().and_then(|s| s.power.soc);
        let (method, why, ppd) = self.choose(power.method).await;
        if self.last_choice.as_ref() != Some(&(method, why.clone())) {
            tracing::info!("power: method {} ({why})", method.as_str());
            self.last_choice = Some((method, why.clone()));
        }
        self.update(|s| {
            s.method = Some(method);
            s.why = why.clone();
            s.soc_watts_before = soc_before;
            s.cpu = None;
            s.held = false;
            s.gpu_note = None;
            if method != Method::None {
                s.cpu_note = None;
            }
        });
        // What to give back, written down before anything changes.
        let (restore, left_note) = plan_restore(&root, power, method, &state_dir);
        let (mut hold, mut released) = (None, None);
        match (method, power.cpu) {
            (_, CpuPolicy::Keep) | (Method::None, _) => {}
            (Method::Ppd, cpu) => (hold, released) = self.hold_ppd(cpu, ppd.as_ref()).await,
            (Method::Cpufreq, cpu) => {
                self.set_cpufreq(&restore.cpufreq_set, cpu, left_note).await;
            }
        }
        self.applied = Some(Applied {
            wanted: power.clone(),
            method,
            ppd,
            hold,
            prefill: false,
            released_by_user: false,
            restore,
            state_dir,
        });
        // The GPU after the hold, read again: power-profiles-daemon may change it as the hold
        // begins.
        self.check_gpu(None, true).await;
        released
    }

    /// `cpu` held through power-profiles-daemon `ppd`: the hold and the stream of its
    /// releases, or neither (with the reason in the status and, for a refusal, an alert).
    async fn hold_ppd(
        &mut self,
        cpu: CpuPolicy,
        ppd: Option<&Ppd>,
    ) -> (Option<u32>, Option<zbus::proxy::SignalStream<'static>>) {
        let (Some(profile), Some(p)) = (prefill::ppd_profile(cpu), ppd) else {
            let note = "power-profiles-daemon holds only power-saver and performance: the \
                        balanced profile is left as it is"
                .to_string();
            self.update(|s| s.cpu_note = Some(note));
            return (None, None);
        };
        // Subscribed first: a release right after the hold is not missed.
        let released = p.released().await.ok();
        match p.hold(profile, HOLD_REASON, HOLD_APP).await {
            Ok(cookie) => {
                tracing::info!(
                    "power: holding {profile} through {} (cookie {cookie})",
                    p.service
                );
                self.update(|s| {
                    s.cpu = Some(format!("{profile} held through {}", p.service));
                    s.held = true;
                });
                (Some(cookie), released)
            }
            Err(e) => {
                let message = format!(
                    "power: cannot hold {profile} through {}: {e}; dsv4d's user needs the \
                     polkit action {}.hold-profile (see units/50-dsv4.rules)",
                    p.service, p.service
                );
                tracing::warn!("{message}");
                self.parts.alerts.raise(AlertKind::Power, message.clone());
                self.update(|s| s.cpu_note = Some(message));
                (None, None)
            }
        }
    }

    /// `cpu` set through cpufreq on the policies `target` (`left_note`: those left alone).
    async fn set_cpufreq(
        &mut self,
        target: &[cpufreq::PolicySettings],
        cpu: CpuPolicy,
        left_note: Option<String>,
    ) {
        let problems = cpufreq::apply(&self.writer, target).await;
        let (governor, epp) = cpufreq::target(cpu).unwrap_or_default();
        let with_epp = target.iter().filter(|t| t.epp.is_some()).count();
        let text = format!(
            "governor {governor} on {} policies, EPP {epp} on {with_epp}",
            target.len()
        );
        tracing::info!("power: {text}");
        if let Some(note) = &left_note {
            tracing::info!("power: {note}");
        }
        let mut notes: Vec<String> = left_note.into_iter().collect();
        if !problems.is_empty() {
            let message = format!("power: {}", problems.join("; "));
            tracing::warn!("{message}");
            self.parts.alerts.raise(AlertKind::Power, message.clone());
            notes.push(message);
        }
        if !notes.is_empty() {
            self.update(|s| s.cpu_note = Some(notes.join("; ")));
        }
        self.update(|s| s.cpu = Some(text));
    }

    /// Sets the GPU's level back to the wanted one if it is not (at the start, or when it
    /// drifted while the engine runs), with an alert that names the cause.
    async fn check_gpu(&mut self, level: Option<&GpuLevel>, at_start: bool) {
        let Some(applied) = &self.applied else {
            return;
        };
        let Some(g) = applied.restore.gpu.clone() else {
            self.update(|s| s.gpu_level = level.cloned());
            return;
        };
        let root = &self.parts.sysroot;
        let level = level.cloned().or_else(|| gpu::read(root, &g.file));
        let Some(level) = level else {
            return;
        };
        if level == g.set {
            self.update(|s| s.gpu_level = Some(level));
            return;
        }
        let cause = if applied.method == Method::Ppd && !at_start {
            "power-profiles-daemon's amdgpu_dpm action sets it in power-saver; to stop it, \
             run powerprofilesctl configure-action amdgpu_dpm --disable (PPD 0.30 and later)"
                .to_string()
        } else if at_start {
            format!("it goes back to {level} when the engine stops")
        } else {
            "something else changed it while the engine runs".to_string()
        };
        let (note, message) = match gpu::write(&self.writer, &g.file, &g.set).await {
            Ok(()) => {
                let note = format!("set to {} (it was {level})", g.set);
                let message = format!(
                    "the GPU's performance level was {level}, not {}, while the engine runs \
                     (low costs up to 40% of decode speed): set to {}; {cause}",
                    g.set, g.set
                );
                self.update(|s| s.gpu_level = Some(g.set.clone()));
                (note, message)
            }
            Err(e) => {
                // Said once: a file that cannot be written now will not be at the next
                // sample either.
                if self.status.borrow().gpu_note.as_deref() == Some(e.as_str()) {
                    return;
                }
                self.update(|s| s.gpu_level = Some(level.clone()));
                (
                    e.clone(),
                    format!("{e}; the engine runs with the GPU on {level}"),
                )
            }
        };
        tracing::warn!("power: {message}");
        self.parts.alerts.raise(AlertKind::Power, message);
        self.update(|s| s.gpu_note = Some(note));
    }

    async fn on_sample(&mut self, sample: Option<&dsv4_client::telemetry::Sample>) {
        let Some(sample) = sample else {
            return;
        };
        let soc = sample.power.soc;
        self.update(|s| s.soc_watts_now = soc);
        if self.applied.is_none() {
            let level = sample
                .gpu
                .as_ref()
                .and_then(|g| g.performance_level.clone());
            self.update(|s| s.gpu_level = level);
            return;
        }
        // The sample says when to look; the file says what is there now (a sample taken
        // as the engine started may still show the level before dsv4d set it).
        if sample.gpu.is_some() {
            self.check_gpu(None, false).await;
        }
    }

    fn on_released(&mut self, msg: &zbus::Message) {
        let Ok(cookie) = msg.body().deserialize::<u32>() else {
            return;
        };
        let Some(applied) = self.applied.as_mut() else {
            return;
        };
        if applied.hold != Some(cookie) {
            return;
        }
        applied.hold = None;
        applied.released_by_user = true;
        let note = "the user chose another power profile while it was held: left as chosen \
                    until the next engine start"
            .to_string();
        tracing::info!("power: {note}");
        self.update(|s| {
            s.held = false;
            s.cpu = None;
            s.cpu_note = Some(note);
        });
    }

    async fn undo(&mut self) {
        let Some(applied) = self.applied.take() else {
            return;
        };
        if let (Some(p), Some(cookie)) = (&applied.ppd, applied.hold) {
            match p.release(cookie).await {
                Ok(()) => tracing::info!("power: released the hold on {}", p.service),
                Err(e) => tracing::warn!("power: releasing the hold on {}: {e}", p.service),
            }
        }
        let problems = applied.restore.give_back(&self.writer).await;
        for p in &problems {
            tracing::warn!("power: {p}");
        }
        if !applied.restore.cpufreq.is_empty() {
            tracing::info!("power: cpufreq settings restored");
        }
        Restore::clear(&applied.state_dir);
        let level = applied
            .restore
            .gpu
            .as_ref()
            .and_then(|g| gpu::read(&self.parts.sysroot, &g.file));
        self.update(|s| {
            s.cpu = None;
            s.held = false;
            if !applied.released_by_user {
                s.cpu_note = None;
            }
            if level.is_some() {
                s.gpu_level = level;
            }
        });
    }
}
