//! The KV steps of an engine generation: started, cut at their deadline, reported.

use tokio::time::Instant;

use super::messages::Internal;
use super::{Actor, Engine, KvTask, TAIL_LINES};
use crate::lifecycle::state::{Event, Gen, Phase};

impl Actor {
    /// Marks the running engine for good when its profile's checkpoints are suspended (a
    /// validation runs on it): its slots hold the benchmark's prompts, so it never saves,
    /// even once the suspension is lifted.
    pub(super) fn mark_validated(&mut self) {
        let Some(e) = self.engine.as_mut() else {
            return;
        };
        if !e.validated && self.kv_suspended.as_ref() == Some(&e.spawned.name) {
            e.validated = true;
            tracing::info!(
                pid = e.shared.pid,
                "a validation runs on this engine: it will not save its KV cache"
            );
        }
    }

    /// Runs the KV restore or save of generation `gen` as a task that reports back.
    pub(super) fn start_kv_task(&mut self, gen: Gen, restore: bool) -> Option<Event> {
        let done = match restore {
            true => Event::KvRestored { gen },
            false => Event::KvSaved { gen },
        };
        let Some(e) = self.engine.as_mut().filter(|e| e.shared.gen == gen) else {
            return Some(done);
        };
        let suspended = self.kv_suspended.as_ref() == Some(&e.spawned.name);
        if e.spawned.kv_checkpoint.is_none() || e.validated || suspended {
            return Some(done);
        }
        let (engine, profile, book) = (e.shared.clone(), e.spawned.clone(), self.kv.clone());
        let facts = e.kv.clone();
        let internal = self.internal.clone();
        tracing::info!(
            profile = profile.name,
            "{} the KV checkpoint",
            if restore { "restoring" } else { "saving" }
        );
        let handle = tokio::spawn(async move {
            let name = profile.name.clone();
            if restore {
                let step = crate::kv::slots::restore(engine, profile, facts, book.clone()).await;
                book.restored(&name, step);
            } else {
                let step = crate::kv::slots::save(engine, profile, facts).await;
                book.saved(&name, step);
            }
            let _ = internal.send(Internal::KvDone { gen, restore });
        });
        let deadline = match self.machine.phase() {
            Phase::Restoring { deadline, .. } | Phase::Saving { deadline, .. } => Some(*deadline),
            _ => None,
        };
        e.kv_task = Some(KvTask {
            restore,
            handle,
            started: Instant::now(),
            deadline,
        });
        None
    }

    /// A KV step whose phase the rules have left (its timeout, a stop) is ended, and said so.
    pub(super) fn end_stale_kv_task(&mut self) {
        let phase = self.machine.phase();
        let Some(e) = self.engine.as_mut() else {
            return;
        };
        let Some(task) = &e.kv_task else { return };
        let current = match phase {
            Phase::Restoring { gen, .. } => task.restore && *gen == e.shared.gen,
            Phase::Saving { gen, .. } => !task.restore && *gen == e.shared.gen,
            _ => false,
        };
        if current {
            return;
        }
        let Some(task) = e.kv_task.take() else { return };
        task.handle.abort();
        let Some(kv) = &e.spawned.kv_checkpoint else {
            return;
        };
        let seconds = task.started.elapsed().as_secs_f64();
        let (what, timeout) = match task.restore {
            true => ("restore", kv.restore_timeout),
            false => ("save", kv.save_timeout),
        };
        // Judged by the phase's deadline, which passes a moment before `timeout` has gone by
        // since the task started (it started after the phase): by the task's own clock a
        // step cut at its timeout read as "cut off by a stop" (seen: 0.997 s of 1 s).
        let timed_out = match task.deadline {
            Some(deadline) => Instant::now() >= deadline,
            None => task.started.elapsed() >= timeout,
        };
        let result = match timed_out {
            true => format!(
                "cut off by kv_checkpoint.{what}_timeout ({})",
                crate::config::format_duration(timeout)
            ),
            false => "cut off by a stop".to_string(),
        };
        match task.restore {
            true => tracing::warn!(
                "the KV checkpoint restore was {result}; the engine serves without it"
            ),
            false => tracing::warn!(
                "the KV checkpoint save was {result}; nothing new was kept (an earlier \
                 checkpoint of this engine, if there is one, stays for the next start)"
            ),
        }
        let step = dsv4_client::kv::KvStep {
            at: dsv4_client::clock::unix_now(),
            seconds,
            result,
            ..Default::default()
        };
        if task.restore {
            // Cut by a stop, the engine did not die on the checkpoint, which stays usable.
            // Cut by its timeout, the restore may still go on inside the engine: the mark
            // stays (the engine's next save replaces the checkpoint and clears it).
            if let Some(id) = e.kv.restoring().filter(|_| !timed_out) {
                let store = crate::kv::store::Store::new(&kv.dir);
                let id = id.to_string();
                tokio::task::spawn_blocking(move || store.clear_restoring(&id));
            }
            self.kv.restored(&e.spawned.name, step);
        } else {
            self.kv.saved(&e.spawned.name, step);
        }
    }

    /// An engine that keeps KV checkpoints of its own saves them after SIGTERM: how long it
    /// took to exit, and what it said.
    pub(super) fn own_save_report(&self, e: &Engine) {
        let kind = e.spawned.engine.describe();
        let Some(own) = kind.own_kv() else { return };
        if e.spawned.params.kv_disk_dir.is_none() {
            return;
        }
        let Some(term_at) = e.term_at else { return };
        let seconds = term_at.elapsed().as_secs_f64();
        let took = dsv4_client::duration::brief_secs(seconds);
        let lines = e.shared.output.last(TAIL_LINES);
        let program = kind.program;
        let step = match (own.saved)(&lines) {
            Some((saved, said)) => {
                tracing::info!(
                    profile = e.spawned.name,
                    "{program} stopped {took} after SIGTERM; it said: {said}"
                );
                let mut step = crate::kv::engine_saved(saved, said);
                step.seconds = seconds;
                step
            }
            None => {
                tracing::info!(
                    profile = e.spawned.name,
                    "{program} stopped {took} after SIGTERM and said nothing of a KV checkpoint ({})",
                    own.silent_when
                );
                dsv4_client::kv::KvStep {
                    at: dsv4_client::clock::unix_now(),
                    seconds,
                    result: "nothing said".into(),
                    ..Default::default()
                }
            }
        };
        self.kv.saved(&e.spawned.name, step);
    }
}

/// An engine that loads its own checkpoints, started with some in its folder: its first word
/// on loading one checks the restore, as a request's reuse checks dsv4d's own.
pub(super) fn expect_own_load(book: &crate::kv::Book, profile: &crate::config::Profile) {
    let kind = profile.engine.describe();
    let (Some(own), Some(dir)) = (kind.own_kv(), &profile.params.kv_disk_dir) else {
        return;
    };
    if crate::kv::own_dir_bytes(dir, own.file_suffix) > 0 {
        book.expect(&profile.name, crate::kv::Expected::Own);
    }
}
