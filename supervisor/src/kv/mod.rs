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
//! ds4-server keeps checkpoints of its own (`kv_disk_dir`), written after its SIGTERM: there
//! the supervisor gives it the time (no SIGINT, the whole `stop_timeout`), measures it, and
//! reports the line ds4-server logs about it ([`ds4_saved`]).
//!
//! Owns: the [`Book`] (the last save and restore per profile, what the running engine was
//! given back, the tokens served from it). The layout on disk is `store.rs`'s, the engine
//! calls `engine.rs`'s; the actor runs them as tasks.

pub mod engine;
pub mod key;
pub mod store;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use dsv4_client::kv::{KvProfile, KvStatus, KvStep};
use dsv4_engine::EngineKind;

use crate::config::Config;
use crate::lifecycle::state::Gen;

pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

pub fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Default)]
struct Inner {
    last_save: BTreeMap<String, KvStep>,
    last_restore: BTreeMap<String, KvStep>,
    /// The key of the running engine, once its restore step worked it out.
    key: Option<(Gen, key::Key)>,
    /// The checkpoint whose restore into the engine of `Gen` is under way.
    restoring: Option<(Gen, String)>,
    /// Tokens put back into engines by restores, all told.
    restored: u64,
    /// The configuration in force (the actor replaces it on reloads).
    config: Option<Arc<Config>>,
    /// A profile whose engines neither restore nor save (a validation run's: its benchmark
    /// prompts must not replace the real checkpoints).
    suspended: Option<String>,
}

/// What the checkpoint steps did; shared by the actor (which writes) and the status and
/// metrics (which read).
#[derive(Debug, Clone, Default)]
pub struct Book(Arc<Mutex<Inner>>);

impl Book {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Engines of `profile` started from now on skip both steps; `None` ends that.
    pub fn suspend(&self, profile: Option<&str>) {
        self.lock().suspended = profile.map(String::from);
    }

    pub fn suspended(&self, profile: &str) -> bool {
        self.lock().suspended.as_deref() == Some(profile)
    }

    pub fn set_config(&self, config: Arc<Config>) {
        self.lock().config = Some(config);
    }

    pub fn saved(&self, profile: &str, step: KvStep) {
        self.lock().last_save.insert(profile.to_string(), step);
    }

    pub fn restored(&self, profile: &str, step: KvStep) {
        self.lock().last_restore.insert(profile.to_string(), step);
    }

    pub fn set_key(&self, gen: Gen, key: key::Key) {
        self.lock().key = Some((gen, key));
    }

    pub fn key_of(&self, gen: Gen) -> Option<key::Key> {
        self.lock()
            .key
            .as_ref()
            .filter(|(g, _)| *g == gen)
            .map(|(_, k)| k.clone())
    }

    /// The restore of checkpoint `id` into the engine of `gen` begins.
    pub fn set_restoring(&self, gen: Gen, id: &str) {
        self.lock().restoring = Some((gen, id.to_string()));
    }

    /// The checkpoint being restored into the engine of `gen`, if one is.
    pub fn restoring(&self, gen: Gen) -> Option<String> {
        self.lock()
            .restoring
            .as_ref()
            .filter(|(g, _)| *g == gen)
            .map(|(_, id)| id.clone())
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
    pub async fn drop_matching(&self, what: &str) -> Result<Vec<String>, String> {
        let what = what.to_string();
        self.off_thread(move |b| b.drop_matching_now(&what))
            .await
            .and_then(|r| r)
    }

    /// [`Book::status`], here and now: reads the folders.
    fn status_now(&self) -> KvStatus {
        let Some(config) = self.lock().config.clone() else {
            return KvStatus::default();
        };
        let mut profiles = Vec::new();
        for p in config.profiles.values() {
            let (engine, dir) = match (&p.kv_checkpoint, &p.params.kv_disk_dir) {
                (Some(kv), _) if p.engine == EngineKind::LlamaServer => {
                    ("llama-server", kv.dir.clone())
                }
                (_, Some(dir)) if p.engine == EngineKind::Ds4 => ("ds4", dir.clone()),
                _ => continue,
            };
            let (checkpoint, dir_bytes) = match engine {
                "llama-server" => {
                    let store = store::Store::new(&dir);
                    let newest = store
                        .list()
                        .into_iter()
                        .find(|m| m.profile == p.name && m.aside.is_none());
                    (newest.map(|m| m.shown()), store.total_bytes())
                }
                _ => (None, ds4_dir_bytes(&dir)),
            };
            profiles.push(KvProfile {
                profile: p.name.clone(),
                engine: engine.to_string(),
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
        }
    }
}

impl Book {
    /// The checkpoint folders of the profiles that keep checkpoints, each once.
    fn stores(&self) -> Vec<store::Store> {
        let Some(config) = self.lock().config.clone() else {
            return Vec::new();
        };
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

    fn drop_matching_now(&self, what: &str) -> Result<Vec<String>, String> {
        if what.is_empty() {
            return Err("say what to drop: all, a profile name or a checkpoint id".into());
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
            return Err(match known.is_empty() {
                true => format!("no KV checkpoint matches `{what}`: there are none"),
                false => format!(
                    "no KV checkpoint matches `{what}`; there are: {}",
                    known.join(", ")
                ),
            });
        }
        for id in &gone {
            tracing::info!("KV checkpoint {id} dropped on request");
        }
        Ok(gone)
    }
}

/// Bytes of ds4-server's `<sha1>.kv` files in its folder.
fn ds4_dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".kv"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// What ds4-server said it saved at its shutdown, from its last lines: the `kv cache stored`
/// line after `persisting current KV cache before shutdown` (tokens and MiB), or the failure.
/// `None` when it said nothing about it (it saves nothing below 512 tokens, and nothing
/// when an equal file exists).
pub fn ds4_saved(lines: &[String]) -> Option<(KvStep, String)> {
    let start = lines
        .iter()
        .rposition(|l| l.contains("persisting current KV cache before shutdown"))?;
    let after = &lines[start..];
    let field = |line: &str, name: &str| -> Option<f64> {
        let at = line.find(&format!(" {name}="))? + name.len() + 2;
        let value: String = line[at..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        value.parse().ok()
    };
    if let Some(line) = after.iter().find(|l| l.contains("kv cache stored")) {
        let tokens = field(line, "tokens").unwrap_or(0.0) as u64;
        let mib = field(line, "size").unwrap_or(0.0);
        let step = KvStep {
            at: unix_now(),
            seconds: field(line, "save").map_or(0.0, |ms| ms / 1000.0),
            tokens,
            bytes: (mib * (1u64 << 20) as f64) as u64,
            result: "saved".into(),
            ok: true,
            engine_said: Some(line.trim().to_string()),
        };
        return Some((step, line.trim().to_string()));
    }
    let failed = after
        .iter()
        .find(|l| l.contains("kv cache") && (l.contains("failed") || l.contains("skipped")))?;
    let step = KvStep {
        at: unix_now(),
        result: "not saved (see engine_said)".into(),
        ok: false,
        engine_said: Some(failed.trim().to_string()),
        ..KvStep::default()
    };
    Some((step, failed.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds4_shutdown_lines_are_read() {
        let lines: Vec<String> = [
            "0101 10:00:00 ds4-server: shutdown requested, draining requests",
            "0101 10:00:01 ds4-server: persisting current KV cache before shutdown tokens=40960",
            "0101 10:00:09 ds4-server: kv cache stored tokens=40960 trimmed=0 reason=shutdown \
             key=token-text size=1536.50 MiB save=8123.4 ms",
        ]
        .map(String::from)
        .to_vec();
        let (step, said) = ds4_saved(&lines).unwrap();
        assert_eq!(step.tokens, 40960);
        assert_eq!(step.bytes, (1536.5 * 1048576.0) as u64);
        assert!((step.seconds - 8.1234).abs() < 1e-9);
        assert!(step.ok);
        assert!(said.contains("kv cache stored"));

        let failed: Vec<String> = [
            "ds4-server: persisting current KV cache before shutdown tokens=900",
            "ds4-server: kv cache store failed (shutdown): No space left on device save=3.0 ms",
        ]
        .map(String::from)
        .to_vec();
        let (step, said) = ds4_saved(&failed).unwrap();
        assert!(!step.ok);
        assert!(said.contains("No space left"));
        // Nothing said about a save (under 512 tokens, ds4 saves nothing and says nothing).
        assert!(ds4_saved(&["ds4-server: shutdown requested".to_string()]).is_none());
    }

    #[test]
    fn restored_tokens_are_each_restores_own_count() {
        let book = Book::default();
        book.credit(1000);
        assert_eq!(book.restored_tokens_total(), 1000);
        book.credit(2802);
        assert_eq!(book.restored_tokens_total(), 3802);
    }
}
