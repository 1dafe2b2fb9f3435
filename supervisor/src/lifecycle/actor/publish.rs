//! The state as others see it: the status watch, the figures, the log line of a change.

use std::time::{Duration, SystemTime};

use dsv4_client::words::KvActivity;

use super::Actor;
use crate::lifecycle::state::Phase;
use crate::lifecycle::Status;

impl Actor {
    pub(super) fn publish(&mut self) {
        self.mark_ready();
        let m = &self.machine;
        let unix = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .ok()
        };
        let idle_deadline = m
            .idle_deadline()
            .and_then(crate::lifecycle::gate::unix_time);
        // Everything but the figures, borrowed: compared with what stands before anything is
        // allocated (every request publishes twice, and mostly only the figures moved).
        let engine_pid = self.engine.as_ref().map(|e| e.shared.pid);
        let ready_since = self.engine.as_ref().and_then(|e| e.ready_at).and_then(unix);
        let load_seconds = self
            .engine
            .as_ref()
            .and_then(|e| e.load_took)
            .map(|d| d.as_secs_f64());
        let last_error = m.last_failure().map(|f| f.summary.as_str());
        let restart_pending = self
            .engine
            .as_ref()
            .is_some_and(|e| self.config.profile(&e.shared.profile) != Some(&e.spawned));
        // The running engine's, else the one the next start would run.
        let engine_key = match &self.engine {
            Some(e) => Some(&e.spawned),
            None => self.config.profile(m.profile()),
        }
        .map(|p| p.engine.key_protection_of(&p.params));
        let kv_step = match m.phase() {
            Phase::Restoring { .. } => Some(KvActivity::Restoring),
            Phase::Saving { .. } => Some(KvActivity::Saving),
            _ => None,
        };
        let same_but_figures = {
            let old = self.status.borrow();
            old.state == m.state()
                && old.profile == m.profile()
                && old.engine_profile.as_deref() == m.phase().engine_profile()
                && old.engine_pid == engine_pid
                && old.generation == m.phase().gen()
                && old.ready_since == ready_since
                && old.load_seconds == load_seconds
                && old.failures == m.failures()
                && old.last_error.as_deref() == last_error
                && old.restart_pending == restart_pending
                && old.engine_key.as_deref() == engine_key
                && old.kv_step == kv_step
                && old.model_cache == self.model_cache
                && old.identity == self.identity
        };
        if same_but_figures {
            self.publish_figures(idle_deadline);
            return;
        }
        let status = Status {
            state: m.state(),
            profile: m.profile().to_string(),
            engine_profile: m.phase().engine_profile().map(String::from),
            engine_pid,
            generation: m.phase().gen(),
            in_flight: m.leases(),
            waiting: m.waiting(),
            idle_deadline,
            ready_since,
            load_seconds,
            failures: m.failures(),
            last_error: last_error.map(String::from),
            restart_pending,
            engine_key: engine_key.map(String::from),
            kv_step,
            model_cache: self.model_cache,
            identity: self.identity.clone(),
        };
        let state = status.state;
        let mut state_changed = false;
        self.status.send_modify(|old| {
            state_changed = old.state != status.state;
            *old = status;
        });
        if state_changed {
            tracing::info!("engine state: {state}");
        }
        if state != dsv4_client::State::Starting {
            self.loading.send_if_modified(|l| l.take().is_some());
        }
    }

    /// An engine that has just become ready: when, and how long its load took.
    fn mark_ready(&mut self) {
        if let (Phase::Ready { .. }, Some(e)) = (self.machine.phase(), self.engine.as_mut()) {
            if e.ready_at.is_none() {
                e.ready_at = Some(SystemTime::now());
                let (profile, took) = (e.shared.profile.clone(), e.spawned_at.elapsed());
                e.load_took = Some(took);
                self.loaded(profile, took);
                if let Some(e) = self.engine.as_ref() {
                    self.identify(e);
                }
            }
        }
    }

    /// Only the per-request figures moved: they are written without waking the state's
    /// watchers, and the figures' own watchers are told (see `figures`).
    fn publish_figures(&mut self, idle_deadline: Option<f64>) {
        let m = &self.machine;
        let (in_flight, waiting) = (m.leases(), m.waiting());
        let mut moved = false;
        self.status.send_if_modified(|s| {
            moved =
                (s.in_flight, s.waiting, s.idle_deadline) != (in_flight, waiting, idle_deadline);
            s.in_flight = in_flight;
            s.waiting = waiting;
            s.idle_deadline = idle_deadline;
            false
        });
        if moved {
            self.figures.tell();
        }
    }

    /// The engine of `profile` serves, `took` after its spawn: the load is over, and its time
    /// goes to `state_dir` (off the runtime's threads: the write is synced), for the estimate
    /// of the next.
    fn loaded(&mut self, profile: String, took: Duration) {
        tracing::info!(
            "engine of {profile} loaded in {}",
            dsv4_client::duration::brief(took)
        );
        self.loading.send_replace(None);
        let state_dir = self.config.supervisor.state_dir.clone();
        let class = self.model_cache.map(|c| c.class);
        tokio::task::spawn_blocking(move || {
            if let Err(e) = crate::host::load_times::record(&state_dir, &profile, took, class) {
                tracing::warn!(
                    "cannot write {}: {e}; the next load of {profile} will not say how long it \
                     should take",
                    crate::host::load_times::path(&state_dir).display()
                );
            }
        });
    }
}
