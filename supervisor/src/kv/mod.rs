//! KV checkpoints across stops: no long prefix is lost to an idle stop, a profile switch or
//! a restart.
//!
//! A cold prefill of 256K tokens takes two hours; writing its KV cache to disk and reading
//! it back takes seconds. So, for a llama-server profile with `kv_checkpoint`, every planned
//! stop saves the slots that hold tokens once no request is in flight, before the signal,
//! and the next start of an engine the checkpoint is valid for (see [`key`]) restores them
//! after the engine is ready, before the first request is let through. Both are steps of the
//! lifecycle rules (`Phase::Saving`, `Phase::Restoring`), bounded by `save_timeout` and
//! `restore_timeout`, and neither can fail a start or a stop: whatever goes wrong, the
//! engine starts cold as it would without checkpoints, and the step says why.
//!
//! Which engines do that is their kind's description's ([`dsv4_engine::KvKeeping`]). An
//! engine that keeps checkpoints of its own (ds4-server's `kv_disk_dir`) writes them after
//! its SIGTERM: there the supervisor gives it the time (no SIGINT, the whole
//! `stop_timeout`), measures it, and reports what the engine logs about it, as its
//! description reads it ([`dsv4_engine::OwnKv::saved`], made a step by [`engine_saved`]).
//!
//! Owns: the [`Book`] (the last save and restore per profile, what the running engine was
//! given back, the tokens served from it). The layout on disk is `store.rs`'s, the save and
//! the restore through the engine's slot endpoints `slots.rs`'s; the lifecycle actor runs
//! those as tasks of the engine's generation.

pub mod as_chat;
pub mod checks;
pub mod engine;
pub mod key;
pub mod slots;
pub mod store;
pub mod verify;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dsv4_client::kv::{KvProfile, KvStatus, KvStep};
use dsv4_engine::{KvKeeping, KvSaved};

use tokio::sync::watch;

use crate::config::Config;

/// An engine generation's number, as the lifecycle counts them (`lifecycle::state::Gen`).
pub type Gen = u64;

use dsv4_client::clock::unix_now;

#[derive(Debug, Default)]
struct Inner {
    last_save: BTreeMap<String, KvStep>,
    last_restore: BTreeMap<String, KvStep>,
    /// Tokens put back into engines by restores, all told.
    restored: u64,
    /// Per profile, what its last restore is checked by, until a request has checked it
    /// ([`verify`]).
    expected: BTreeMap<String, Expected>,
    /// Restores whose check missed, all told.
    misses: u64,
}

/// What a restore is checked by.
#[derive(Debug, Clone)]
pub enum Expected {
    /// The tokens of each slot dsv4d's restore put back: the first request that shares
    /// them says how many the engine reused.
    Slots(Arc<Vec<Vec<i32>>>),
    /// An engine that loads its own checkpoints when a request's prompt matches one (ds4-server
    /// started with some in its `kv_disk_dir`): its word on the first load it tries.
    Own,
}

/// What the checkpoint steps did; shared by the actor (which writes) and the status and
/// metrics (which read).
/// Why a drop removed nothing.
#[derive(Debug, thiserror::Error)]
pub enum DropError {
    #[error("say what to drop: all, a profile name or a checkpoint id")]
    NoWhat,
    /// Nothing matches (the message lists what there is).
    #[error("{0}")]
    NoMatch(String),
    #[error("{0}")]
    Failed(String),
}

#[derive(Debug, Clone)]
pub struct Book {
    inner: Arc<Mutex<Inner>>,
    /// The configuration in force, as the reloads publish it (the profiles and their folders).
    config: watch::Receiver<Arc<Config>>,
}

impl Book {
    pub fn new(config: watch::Receiver<Arc<Config>>) -> Self {
        Book {
            inner: Arc::default(),
            config,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine that was restored is gone: nothing is left to check its restore by.
    pub fn saved(&self, profile: &str, step: KvStep) {
        let mut inner = self.lock();
        inner.expected.remove(profile);
        inner.last_save.insert(profile.to_string(), step);
    }

    pub fn restored(&self, profile: &str, step: KvStep) {
        let mut inner = self.lock();
        if !step.ok {
            inner.expected.remove(profile);
        }
        inner.last_restore.insert(profile.to_string(), step);
    }

    /// A restore of `profile` was made, or may be by its engine: the first request that can
    /// say checks it.
    pub fn expect(&self, profile: &str, check: Expected) {
        self.lock().expected.insert(profile.to_string(), check);
    }

    /// What checks `profile`'s last restore, while no request has.
    pub fn expected(&self, profile: &str) -> Option<Expected> {
        self.lock().expected.get(profile).cloned()
    }

    /// The check of `profile`'s last restore, kept with it; for a miss (`why` it happens), a
    /// warning, and the words of the alert, that say what it cost and why.
    pub fn checked(
        &self,
        profile: &str,
        reused: u64,
        shared: u64,
        missed: Option<&str>,
    ) -> Option<String> {
        let (why, missed) = (missed.unwrap_or_default(), missed.is_some());
        let check = dsv4_client::kv::RestoreCheck {
            at: unix_now(),
            reused,
            shared,
            missed,
        };
        {
            let mut inner = self.lock();
            inner.expected.remove(profile);
            inner.misses += u64::from(missed);
            if let Some(step) = inner.last_restore.get_mut(profile) {
                step.check = Some(check.clone());
            }
        }
        let state_dir = self.config.borrow().supervisor.state_dir.clone();
        let name = profile.to_string();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = checks::record(&state_dir, &name, check) {
                tracing::warn!(
                    "cannot keep the check of {name}'s restore in {}: {e}",
                    checks::path(&state_dir).display()
                );
            }
        });
        if !missed {
            tracing::info!(
                profile,
                "KV checkpoint restore checked: the next request reused {reused} of the \
                 {shared} tokens it shared with it"
            );
            return None;
        }
        let message = format!(
            "profile {profile}: the KV checkpoint restore did nothing: the next request \
             shared {shared} tokens with it and the engine reused {reused}, so their prefill \
             ran again. {why}"
        );
        tracing::warn!("{message}");
        Some(message)
    }

    /// A restore put `tokens` back into an engine: counted once, exactly.
    pub fn credit(&self, tokens: u64) {
        self.lock().restored += tokens;
    }

    pub fn restored_tokens_total(&self) -> u64 {
        self.lock().restored
    }

    pub fn last_save(&self, profile: &str) -> Option<KvStep> {
        self.lock().last_save.get(profile).cloned()
    }

    pub fn last_restore(&self, profile: &str) -> Option<KvStep> {
        self.lock().last_restore.get(profile).cloned()
    }

    /// Runs `f` on a blocking worker: it lists or removes files, which may block (a
    /// checkpoint's files are GiB), and the runtime's thread carries every stream.
    async fn off_thread<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Book) -> T + Send + 'static,
    ) -> Result<T, String> {
        let book = self.clone();
        tokio::task::spawn_blocking(move || f(&book))
            .await
            .map_err(|e| format!("a file task failed: {e}"))
    }

    /// Per profile that keeps checkpoints: what is on disk and the last steps (read on a
    /// blocking worker).
    pub async fn status(&self) -> KvStatus {
        self.off_thread(Book::status_now).await.unwrap_or_default()
    }

    /// Every checkpoint on disk (newest first, those set aside after), read on a blocking
    /// worker.
    pub async fn list(&self) -> Vec<dsv4_client::kv::KvCheckpoint> {
        self.off_thread(Book::list_now).await.unwrap_or_default()
    }

    /// Removes the checkpoints `what` names (`all`, a profile, an id), on a blocking worker;
    /// the ids removed, or why nothing was.
    pub async fn drop_matching(&self, what: &str) -> Result<Vec<String>, DropError> {
        let what = what.to_string();
        self.off_thread(move |b| b.drop_matching_now(&what))
            .await
            .map_err(DropError::Failed)
            .and_then(|r| r)
    }

    /// [`Book::status`], here and now: reads the folders.
    fn status_now(&self) -> KvStatus {
        let config = self.config.borrow().clone();
        let mut profiles = Vec::new();
        for p in config.profiles.values() {
            let kind = p.engine.describe();
            let (dir, checkpoint, dir_bytes, engine_keeps) =
                match (&kind.kv, &p.kv_checkpoint, &p.params.kv_disk_dir) {
                    (KvKeeping::Slots, Some(kv), _) => {
                        let store = store::Store::new(&kv.dir);
                        let newest = store
                            .list()
                            .into_iter()
                            .find(|m| m.profile == p.name && m.aside.is_none());
                        let bytes = store.total_bytes();
                        (kv.dir.clone(), newest.map(|m| m.shown()), bytes, None)
                    }
                    (KvKeeping::OwnFiles(own), _, Some(dir)) => {
                        let bytes = own_dir_bytes(dir, own.file_suffix);
                        (dir.clone(), None, bytes, Some(own.shown.to_string()))
                    }
                    _ => continue,
                };
            profiles.push(KvProfile {
                profile: p.name.clone(),
                engine: kind.name.to_string(),
                engine_keeps,
                dir: dir.display().to_string(),
                checkpoint,
                dir_bytes,
                last_save: self.last_save(&p.name),
                last_restore: self.last_restore(&p.name),
            });
        }
        KvStatus {
            profiles,
            restored_tokens_total: self.restored_tokens_total(),
            restore_misses_total: self.lock().misses,
        }
    }
}

impl Book {
    /// The checkpoint folders of the profiles that keep checkpoints, each once.
    fn stores(&self) -> Vec<store::Store> {
        let config = self.config.borrow().clone();
        let mut dirs: Vec<std::path::PathBuf> = config
            .profiles
            .values()
            .filter_map(|p| p.kv_checkpoint.as_ref().map(|kv| kv.dir.clone()))
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs.iter().map(|d| store::Store::new(d)).collect()
    }

    fn list_now(&self) -> Vec<dsv4_client::kv::KvCheckpoint> {
        let mut all: Vec<store::Manifest> = self.stores().iter().flat_map(|s| s.list()).collect();
        all.sort_by(|a, b| {
            (a.aside.is_some(), -a.saved_at)
                .partial_cmp(&(b.aside.is_some(), -b.saved_at))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        all.iter().map(store::Manifest::shown).collect()
    }

    fn drop_matching_now(&self, what: &str) -> Result<Vec<String>, DropError> {
        if what.is_empty() {
            return Err(DropError::NoWhat);
        }
        let gone: Vec<String> = self
            .stores()
            .iter()
            .flat_map(|s| s.drop_matching(what))
            .collect();
        if gone.is_empty() && what != "all" {
            let known: Vec<String> = self
                .list_now()
                .into_iter()
                .map(|c| format!("{} (profile {})", c.id, c.profile))
                .collect();
            return Err(DropError::NoMatch(match known.is_empty() {
                true => format!("no KV checkpoint matches `{what}`: there are none"),
                false => format!(
                    "no KV checkpoint matches `{what}`; there are: {}",
                    known.join(", ")
                ),
            }));
        }
        for id in &gone {
            tracing::info!("KV checkpoint {id} dropped on request");
        }
        Ok(gone)
    }
}

/// The step an engine's own report of its save at shutdown makes, with the line that said it.
pub fn engine_saved(saved: KvSaved, said: String) -> KvStep {
    KvStep {
        at: unix_now(),
        seconds: saved.seconds,
        tokens: saved.tokens,
        bytes: saved.bytes,
        result: match saved.ok {
            true => "saved",
            false => "not saved (see engine_said)",
        }
        .into(),
        ok: saved.ok,
        engine_said: Some(said),
        reason: saved.reason,
        check: None,
    }
}

/// Bytes of an engine's own checkpoint files (their names end in `suffix`) in its folder.
pub(crate) fn own_dir_bytes(dir: &std::path::Path, suffix: &str) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(suffix))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restored_tokens_are_each_restores_own_count() {
        let config = Config {
            file: "supervisor.yaml".into(),
            supervisor: crate::config::Supervisor::defaults(std::path::Path::new("/")),
            profiles: Default::default(),
        };
        let (_, config) = watch::channel(Arc::new(config));
        let book = Book::new(config);
        book.credit(1000);
        assert_eq!(book.restored_tokens_total(), 1000);
        book.credit(2802);
        assert_eq!(book.restored_tokens_total(), 3802);
    }
}
