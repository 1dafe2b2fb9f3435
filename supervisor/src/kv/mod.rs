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

pub mod key;
pub mod store;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use dsv4_client::kv::{KvProfile, KvStatus, KvStep};
use dsv4_engine::EngineKind;

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

    pub fn saved(&self, profile: &str, step: KvStep) {
        self.lock().last_save.insert(profile.to_string(), step);
    }

    pub fn restored(&self, profile: &str, step: KvStep) {
        self.lock().last_restore.insert(profile.to_string(), step);
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
/// line that follows its `... KV cache before shutdown` line, or the failure. `None` when it
/// said nothing about it (it saves nothing below `--kv-cache-min-tokens`, and nothing when an
/// equal checkpoint is on disk already).
///
/// The line is read by its named fields, in any order, and fields not known here are passed
/// over: upstream has reordered and added fields before (`ds4_kvstore.c` at 54b36ed prints
/// `tokens= trimmed= reason= key= size=N MiB save=N ms`).
pub fn ds4_saved(lines: &[String]) -> Option<(KvStep, String)> {
    // What came after the shutdown began; the whole tail when its start was cut off.
    let start = lines
        .iter()
        .rposition(|l| l.contains("KV cache before shutdown"))
        .or_else(|| lines.iter().rposition(|l| l.contains("shutdown requested")))
        .unwrap_or(0);
    let after = &lines[start..];
    let stored = after.iter().map(|l| (l, Ds4KvLine::of(l))).find(|(_, f)| {
        f.as_ref()
            .is_some_and(|f| f.stored && f.reason.as_deref().is_none_or(|r| r == "shutdown"))
    });
    if let Some((line, Some(f))) = stored {
        let said = line.trim().to_string();
        let step = KvStep {
            at: unix_now(),
            seconds: f.save_ms.map_or(0.0, |ms| ms / 1000.0),
            tokens: f.tokens.unwrap_or(0),
            bytes: f.bytes.unwrap_or(0),
            result: "saved".into(),
            ok: true,
            engine_said: Some(said.clone()),
            reason: f.reason,
        };
        return Some((step, said));
    }
    let (failed, f) = after
        .iter()
        .filter_map(|l| Ds4KvLine::of(l).map(|f| (l, f)))
        .find(|(_, f)| !f.stored)?;
    let said = failed.trim().to_string();
    let step = KvStep {
        at: unix_now(),
        tokens: f.tokens.unwrap_or(0),
        result: "not saved (see engine_said)".into(),
        ok: false,
        engine_said: Some(said.clone()),
        reason: f.reason,
        ..KvStep::default()
    };
    Some((step, said))
}

/// The fields of one of ds4-server's `kv cache ...` lines that dsv4d reports.
#[derive(Debug, Default, PartialEq)]
struct Ds4KvLine {
    /// `kv cache stored` (else a failure: `store failed`, `skipped`, `failed to create`).
    stored: bool,
    tokens: Option<u64>,
    bytes: Option<u64>,
    save_ms: Option<f64>,
    reason: Option<String>,
}

impl Ds4KvLine {
    /// `None` for a line that is not about storing a KV checkpoint (loads, evictions...).
    fn of(line: &str) -> Option<Ds4KvLine> {
        let at = line.find("kv cache ")?;
        let rest = &line[at + "kv cache ".len()..];
        let stored = rest.starts_with("stored ");
        let failed = ["store failed", "skipped ", "failed to create"]
            .iter()
            .any(|f| rest.starts_with(f));
        if !stored && !failed {
            return None;
        }
        let mut f = Ds4KvLine {
            stored,
            ..Ds4KvLine::default()
        };
        // `store failed (shutdown): ...` names its reason in parentheses.
        if let Some(r) = rest
            .strip_prefix("store failed (")
            .and_then(|r| r.split_once(')'))
        {
            f.reason = Some(r.0.to_string());
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        for (i, word) in words.iter().enumerate() {
            let Some((name, value)) = word.split_once('=') else {
                continue;
            };
            // A number may have its unit as the next word (`size=1.30 MiB`, `save=2.6 ms`).
            let unit = words.get(i + 1).filter(|u| !u.contains('=')).copied();
            match name {
                "tokens" => f.tokens = value.parse().ok(),
                "reason" => f.reason = Some(value.to_string()),
                "size" => {
                    let scale = match unit {
                        Some("B") => 1.0,
                        Some("KiB") => 1024.0,
                        Some("GiB") => 1024.0 * 1024.0 * 1024.0,
                        _ => 1024.0 * 1024.0,
                    };
                    f.bytes = value.parse::<f64>().ok().map(|v| (v * scale) as u64);
                }
                "save" => {
                    let scale = if unit == Some("s") { 1000.0 } else { 1.0 };
                    f.save_ms = value.parse::<f64>().ok().map(|v| v * scale);
                }
                _ => {}
            }
        }
        Some(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds4_shutdown_lines_are_read() {
        let lines = owned(&[
            "0101 10:00:00 ds4-server: shutdown requested, draining requests",
            "0101 10:00:01 ds4-server: persisting current KV cache before shutdown tokens=40960",
            "0101 10:00:09 ds4-server: kv cache stored tokens=40960 trimmed=0 reason=shutdown \
             key=token-text size=1536.50 MiB save=8123.4 ms",
        ]);
        let (step, said) = ds4_saved(&lines).unwrap();
        assert_eq!(step.tokens, 40960);
        assert_eq!(step.bytes, (1536.5 * 1048576.0) as u64);
        assert!((step.seconds - 8.1234).abs() < 1e-9);
        assert!(step.ok);
        assert!(said.contains("kv cache stored"));

        let failed = owned(&[
            "ds4-server: persisting current KV cache before shutdown tokens=900",
            "ds4-server: kv cache store failed (shutdown): No space left on device save=3.0 ms",
        ]);
        let (step, said) = ds4_saved(&failed).unwrap();
        assert!(!step.ok);
        assert!(said.contains("No space left"));
        // Nothing said about a save (under 512 tokens, ds4 saves nothing and says nothing).
        assert!(ds4_saved(&["ds4-server: shutdown requested".to_string()]).is_none());
    }

    fn owned(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|l| l.to_string()).collect()
    }

    /// What ds4-server at 54b36ed printed here on an idle stop (`persisting resident ...
    /// slot=0`, where the parser looked for an older `persisting current`), and the same
    /// fields shuffled, with one more that is not known here.
    #[test]
    fn ds4_lines_are_read_by_their_named_fields_in_any_order() {
        let real = owned(&[
            "1201 21:37:23 ds4-server: shutdown requested, draining requests",
            "1201 21:37:23 ds4-server: persisting resident KV cache before shutdown slot=0 tokens=85",
            "1201 21:37:23 ds4-server: kv cache stored tokens=85 trimmed=0 reason=shutdown \
             key=token-text size=1.30 MiB save=2.6 ms",
        ]);
        let (step, _) = ds4_saved(&real).unwrap();
        assert_eq!(
            (step.tokens, step.bytes, step.ok, step.reason.as_deref()),
            (85, (1.30 * 1048576.0) as u64, true, Some("shutdown"))
        );
        assert!((step.seconds - 0.0026).abs() < 1e-9, "{}", step.seconds);

        let shuffled = [
            "ds4-server: persisting resident KV cache before shutdown slot=0 tokens=85".to_string(),
            "ds4-server: kv cache stored save=1.5 s hash=abc size=2.00 GiB reason=shutdown \
             tokens=4096 key=token-text"
                .to_string(),
        ];
        let (step, _) = ds4_saved(&shuffled).unwrap();
        assert_eq!((step.tokens, step.bytes), (4096, 2 << 30));
        assert!((step.seconds - 1.5).abs() < 1e-9);

        // A save for another reason earlier in the tail is not the shutdown's.
        let earlier = [
            "ds4-server: kv cache stored tokens=50 trimmed=0 reason=cold key=token-text \
             size=1.00 MiB save=1.2 ms"
                .to_string(),
            "ds4-server: shutdown requested, draining requests".to_string(),
        ];
        assert_eq!(ds4_saved(&earlier), None);

        // A skip names its reason too.
        let skipped = [
            "ds4-server: persisting resident KV cache before shutdown slot=0 tokens=9000".into(),
            "ds4-server: kv cache skipped tokens=9000 reason=shutdown because estimated file \
             size 9.00 MiB (9.50 MiB with safety) exceeds budget 4.00 MiB"
                .to_string(),
        ];
        let (step, said) = ds4_saved(&skipped).unwrap();
        assert!(!step.ok && said.contains("exceeds budget"));
        assert_eq!(
            (step.tokens, step.reason.as_deref()),
            (9000, Some("shutdown"))
        );
    }

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
