//! The save and the restore, as llama-server's slot endpoints do them.
//!
//! `GET /props` gives the engine build, slot count and per-slot context (the key's figures
//! the profile cannot tell for sure); `GET /slots` which slots are busy; `POST
//! /slots/N?action=save|restore|erase` with `{"filename": ...}` does the work, answering
//! `n_saved`/`n_written` or `n_restored`/`n_read`. Found on llama-server (llama.cpp b0-0c1e57098):
//! a full disk answers 500 and leaves a partial file; a slot file from another slot count
//! answers 400; a truncated slot file aborts the engine (so a checkpoint is checked against
//! its manifest before it is offered, and one whose restore never ended is set aside).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dsv4_client::kv::KvStep;
use serde::Deserialize;
use serde_json::json;
use tokio::time::Instant;

use super::engine::Engine;
use super::key::{FileId, Key};
use super::store::{Manifest, SlotFile, Store, FORMAT};
use super::Book;
use crate::config::Profile;

/// What the KV steps learn about one engine generation, kept in the actor's record of that
/// engine (so it goes with it): its key, worked out by the restore and used again by the
/// save, and the checkpoint a restore is putting back (the mark to clear if the actor cuts
/// the restore off).
#[derive(Debug, Default)]
pub struct EngineKv {
    key: std::sync::OnceLock<Key>,
    restoring: std::sync::OnceLock<String>,
}

impl EngineKv {
    /// The checkpoint a restore began to put back into this engine, if one did.
    pub fn restoring(&self) -> Option<&str> {
        self.restoring.get().map(String::as_str)
    }
}

/// Checkpoints one failed save may remove to make room.
const MAX_EVICTIONS: u32 = 16;

/// How long a failed restore waits to learn whether the engine died of it. An engine that
/// aborts (SIGABRT, perhaps writing a core) may break the connection a good while before
/// its exit is reaped; only a failing restore waits, and only until the exit is seen.
const DEATH_WITHIN: Duration = Duration::from_secs(3);

#[derive(Debug, Deserialize)]
struct Props {
    #[serde(default)]
    build_info: String,
    #[serde(default)]
    total_slots: u32,
    #[serde(default)]
    default_generation_settings: Option<GenerationSettings>,
}

#[derive(Debug, Deserialize)]
struct GenerationSettings {
    #[serde(default)]
    n_ctx: u64,
}

#[derive(Debug, Deserialize)]
struct Slot {
    id: u32,
    #[serde(default)]
    is_processing: bool,
}

#[derive(Debug, Deserialize)]
struct Saved {
    n_saved: u64,
    n_written: u64,
}

#[derive(Debug, Deserialize)]
struct Restored {
    n_restored: u64,
}

/// The key of the running engine of `profile`.
pub async fn engine_key(engine: &impl Engine, profile: &Profile) -> Result<Key, String> {
    let props: Props = engine.call_json(http::Method::GET, "/props", None).await?;
    let model = profile.params.model.clone();
    let mmproj = profile.params.mmproj.clone();
    let (model, mmproj) = tokio::task::spawn_blocking(move || {
        let model = model.as_deref().map(FileId::of).transpose();
        let mmproj = mmproj.as_deref().map(FileId::of).transpose();
        (model, mmproj)
    })
    .await
    .map_err(|e| e.to_string())?;
    let model = model
        .map_err(|e| format!("cannot read the model file: {e}"))?
        .ok_or("the profile names no model file")?;
    let mmproj = mmproj.map_err(|e| format!("cannot read the mmproj file: {e}"))?;
    Ok(Key {
        model,
        mmproj,
        n_ctx: props.default_generation_settings.map_or(0, |g| g.n_ctx),
        slots: props.total_slots,
        cache_type: profile
            .params
            .kv_cache
            .clone()
            .unwrap_or_else(|| "default".into()),
        flash_attn: profile
            .params
            .flash_attn
            .map_or("default", |f| f.as_str())
            .to_string(),
        build: props.build_info,
    })
}

/// Runs `f` on the folder off the runtime's thread (file work may block).
async fn on_disk<T: Send + 'static>(
    store: &Store,
    f: impl FnOnce(&Store) -> T + Send + 'static,
) -> Result<T, String> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || f(&store))
        .await
        .map_err(|e| format!("a file task failed: {e}"))
}

/// Removes slot files off the runtime's thread (a checkpoint's files are GiB: unlinking
/// them takes time).
async fn remove_files(store: &Store, files: Vec<String>) {
    let _ = on_disk(store, move |s| {
        for f in &files {
            s.remove_slot_file(f);
        }
    })
    .await;
}

/// The key of the engine of `engine`: the one its restore worked out, else read now (and
/// kept for its save).
async fn key_of(engine: &impl Engine, profile: &Profile, facts: &EngineKv) -> Result<Key, String> {
    if let Some(key) = facts.key.get() {
        return Ok(key.clone());
    }
    let key = engine_key(engine, profile)
        .await
        .map_err(|e| format!("cannot tell the engine's key: {e}"))?;
    Ok(facts.key.get_or_init(|| key).clone())
}

/// A step that did nothing, and why.
fn failed(started: Instant, why: String) -> KvStep {
    step(started, 0, 0, false, why)
}

fn step(started: Instant, tokens: u64, bytes: u64, ok: bool, result: String) -> KvStep {
    KvStep {
        at: dsv4_client::clock::unix_now(),
        seconds: started.elapsed().as_secs_f64(),
        tokens,
        bytes,
        result,
        ok,
        engine_said: None,
        reason: None,
        check: None,
    }
}

/// Puts the checkpoint that fits the engine of `engine` back into its slots. Never fails the
/// start: whatever goes wrong, the engine serves with a cold cache and the step says why.
pub async fn restore(
    engine: Arc<impl Engine>,
    profile: Profile,
    facts: Arc<EngineKv>,
    book: Book,
) -> KvStep {
    let started = Instant::now();
    let Some(kv) = profile.kv_checkpoint.clone() else {
        return failed(started, "checkpoints are off".into());
    };
    let key = match key_of(&*engine, &profile, &facts).await {
        Ok(key) => key,
        Err(e) => return failed(started, e),
    };
    let store = Store::new(&kv.dir);
    let name = profile.name.clone();
    let shown = kv.dir.display().to_string();
    let lookup = on_disk(&store, move |s| {
        // A folder others may write could hold a planted checkpoint: never restored from.
        s.ensure()
            .map_err(|e| format!("cannot use {shown}: {e}"))
            .map(|()| s.lookup(&name, &key))
    })
    .await
    .and_then(|r| r);
    let lookup = match lookup {
        Ok(l) => l,
        Err(e) => return failed(started, e),
    };
    for line in &lookup.set_aside {
        tracing::warn!(
            "KV checkpoint set aside, not restored: {line}; the engine starts without it"
        );
    }
    let Some(m) = lookup.found else {
        return failed(started, "nothing to restore".into());
    };
    let _ = facts.restoring.set(m.id.clone());
    if let Err(why) = mark_restoring(&store, &m.id, &kv.dir).await {
        return failed(started, why);
    }
    let restored = match restore_slots(&*engine, &m).await {
        Ok(restored) => restored,
        Err(why) => {
            tracing::warn!(
                "KV checkpoint {} set aside, not restored: {why}; the engine serves without it",
                m.id
            );
            let (aside, reason) = (m.clone(), why.clone());
            let _ = on_disk(&store, move |s| s.set_aside(&aside, &reason)).await;
            return failed(started, why);
        }
    };
    let id = m.id.clone();
    let _ = on_disk(&store, move |s| s.clear_restoring(&id)).await;
    let tokens: u64 = restored.iter().map(|(_, n)| n).sum();
    book.credit(tokens);
    expect_check(&book, &profile.name, &kv.dir, &m).await;
    let done = step(started, tokens, m.bytes(), true, "restored".into());
    tracing::info!(
        profile = profile.name,
        "KV checkpoint {} restored: {tokens} tokens, {} bytes in {} (saved {} by profile {})",
        m.id,
        m.bytes(),
        dsv4_client::duration::brief_secs(done.seconds),
        ago(m.saved_at),
        m.profile
    );
    done
}

/// The tokens of each slot of checkpoint `m` (in folder `dir`), which the first request
/// that shares them checks the restore by ([`super::verify`]); a slot file whose tokens
/// cannot be read leaves the restore unchecked, and says so.
async fn expect_check(book: &Book, profile: &str, dir: &Path, m: &Manifest) {
    let files: Vec<_> = m.slots.iter().map(|s| dir.join(&s.file)).collect();
    let read = tokio::task::spawn_blocking(move || {
        files
            .iter()
            .map(|f| {
                let file = std::fs::File::open(f).map_err(|e| e.to_string())?;
                super::verify::slot_tokens(std::io::BufReader::new(file))
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await;
    match read {
        Ok(Ok(slots)) => book.expect(profile, super::Expected::Slots(Arc::new(slots))),
        Ok(Err(e)) => tracing::info!(
            "KV checkpoint {}: its tokens cannot be read ({e}); the restore is not checked",
            m.id
        ),
        Err(e) => tracing::info!("KV checkpoint {}: {e}; the restore is not checked", m.id),
    }
}

/// The restore of checkpoint `id` marked in its folder `dir` before it begins: without the
/// mark, a file that kills the engine would be offered again at every start, so no restore
/// then.
async fn mark_restoring(store: &Store, id: &str, dir: &Path) -> Result<(), String> {
    let id = id.to_string();
    let marked = on_disk(store, move |s| {
        s.mark_restoring(&id).map_err(|e| e.to_string())
    })
    .await;
    marked.and_then(|r| r).map_err(|e| {
        let why = format!(
            "cannot mark the restore in {} ({e}); not restored",
            dir.display()
        );
        tracing::warn!("{why}");
        why
    })
}

/// Each slot of checkpoint `m` put back into the engine: the tokens of each; else why not,
/// with what went in taken out again (a half-restored engine is worse than a cold one).
async fn restore_slots(engine: &impl Engine, m: &Manifest) -> Result<Vec<(u32, u64)>, String> {
    let mut restored = Vec::new();
    for s in &m.slots {
        let path = format!("/slots/{}?action=restore", s.slot);
        let body = Some(json!({ "filename": s.file }));
        match engine
            .call_json::<Restored>(http::Method::POST, &path, body)
            .await
        {
            Ok(r) => restored.push((s.slot, r.n_restored)),
            Err(e) => {
                for (slot, _) in &restored {
                    let path = format!("/slots/{slot}?action=erase");
                    let _ = engine.call(http::Method::POST, &path, None).await;
                }
                // An engine that aborts on the file (llama-server does on some damage) breaks
                // the connection: tell that from a refusal.
                return Err(match engine.gone_within(DEATH_WITHIN).await {
                    true => format!("the engine died restoring it ({e})"),
                    false => format!("the engine refused it: {e}"),
                });
            }
        }
    }
    Ok(restored)
}

fn ago(at: f64) -> String {
    ago_from(at, dsv4_client::clock::unix_now())
}

fn ago_from(at: f64, now: f64) -> String {
    let s = (now - at).max(0.0);
    dsv4_client::duration::brief_secs(s) + " ago"
}

/// What the next start does after a save that failed, from the checkpoint that stays
/// (`previous`, if a start can restore it) at `now`.
fn after_failed_save(previous: Option<&Manifest>, now: f64) -> String {
    match previous {
        Some(m) => format!(
            "the next start restores the previous checkpoint, {} tokens saved {} ({})",
            m.tokens(),
            ago_from(m.saved_at, now),
            m.id
        ),
        None => "there is no earlier checkpoint of this engine, so the next start is cold".into(),
    }
}

/// The warning of a save of `key` that failed for `why`, saying what the next start does.
async fn save_failed(store: &Store, profile: &str, key: &Key, why: &str) {
    let key = key.clone();
    let previous = on_disk(store, move |s| s.current(&key))
        .await
        .ok()
        .flatten();
    let next = after_failed_save(previous.as_ref(), dsv4_client::clock::unix_now());
    tracing::warn!(profile, "KV checkpoint not saved: {why}; {next}");
}

/// Saves every slot that holds tokens, as the checkpoint of the engine's key, and keeps the
/// folder within `max_size` (the oldest go first; on a full disk too).
pub async fn save(engine: Arc<impl Engine>, profile: Profile, facts: Arc<EngineKv>) -> KvStep {
    let started = Instant::now();
    let Some(kv) = profile.kv_checkpoint.clone() else {
        return failed(started, "checkpoints are off".into());
    };
    let key = match key_of(&*engine, &profile, &facts).await {
        Ok(key) => key,
        Err(e) => return failed(started, e),
    };
    let store = Store::new(&kv.dir);
    let shown = kv.dir.display().to_string();
    let prepared = on_disk(&store, move |s| {
        s.ensure()
            .map(|()| s.sweep())
            .map_err(|e| format!("cannot use {shown}: {e}"))
    })
    .await;
    if let Err(why) = prepared.and_then(|r| r) {
        return failed(started, why);
    }
    let slots: Vec<Slot> = match engine.call_json(http::Method::GET, "/slots", None).await {
        Ok(s) => s,
        Err(e) => return failed(started, format!("cannot list the slots: {e}")),
    };
    let id = key.id();
    let stamp = dsv4_client::clock::unix_millis();
    let mut files: Vec<SlotFile> = Vec::new();
    let mut failure = None;
    for slot in &slots {
        if slot.is_processing {
            tracing::info!("slot {} is busy: not saved", slot.id);
            continue;
        }
        match save_slot(&*engine, &store, &id, stamp, slot.id).await {
            Ok(Some(file)) => files.push(file),
            Ok(None) => {}
            Err(why) => {
                failure = Some(why);
                break;
            }
        }
    }
    if let Some(why) = failure {
        remove_files(&store, files.iter().map(|f| f.file.clone()).collect()).await;
        save_failed(&store, &profile.name, &key, &why).await;
        return failed(started, why);
    }
    if files.is_empty() {
        return step(started, 0, 0, true, "nothing to save".into());
    }
    let manifest = Manifest {
        format: FORMAT,
        id: id.clone(),
        profile: profile.name.clone(),
        key,
        saved_at: dsv4_client::clock::unix_now(),
        save_seconds: started.elapsed().as_secs_f64(),
        slots: files,
        aside: None,
    };
    commit(&store, manifest, kv.max_size, started).await
}

/// Saves slot `slot` of the engine as a file of checkpoint `id` (`stamp`): the file, or
/// `None` when the slot held nothing. A full disk makes room: the partial file goes, and so
/// does the oldest other checkpoint, before one more try (up to [`MAX_EVICTIONS`]).
async fn save_slot(
    engine: &impl Engine,
    store: &Store,
    id: &str,
    stamp: u64,
    slot: u32,
) -> Result<Option<SlotFile>, String> {
    let file = Store::slot_file_name(id, stamp, slot);
    let mut evictions = 0;
    loop {
        let path = format!("/slots/{slot}?action=save");
        let body = Some(json!({ "filename": file }));
        let e = match engine
            .call_json::<Saved>(http::Method::POST, &path, body)
            .await
        {
            Ok(r) if r.n_saved == 0 => {
                remove_files(store, vec![file.clone()]).await;
                return Ok(None);
            }
            Ok(r) => {
                let name = file.clone();
                let written = on_disk(store, move |s| s.slot_file_len(&name))
                    .await
                    .ok()
                    .flatten();
                if written != Some(r.n_written) {
                    remove_files(store, vec![file.clone()]).await;
                    return Err(format!(
                        "slot {slot} was written short ({written:?} of {} bytes)",
                        r.n_written
                    ));
                }
                let (tokens, bytes) = (r.n_saved, r.n_written);
                return Ok(Some(SlotFile {
                    slot,
                    file,
                    tokens,
                    bytes,
                }));
            }
            Err(e) => e,
        };
        // A full disk (llama-server: 500 "Unable to save slot", and a partial file) makes
        // room. Nothing else evicts anything.
        remove_files(store, vec![file.clone()]).await;
        let full = e.contains(": 500 ") && !engine.exited();
        evictions += 1;
        let gone = match full && evictions <= MAX_EVICTIONS {
            true => {
                let keep = id.to_string();
                on_disk(store, move |s| s.evict_oldest(&keep))
                    .await
                    .ok()
                    .flatten()
            }
            false => None,
        };
        let Some(gone) = gone else {
            return Err(format!("the engine could not save slot {slot}: {e}"));
        };
        tracing::info!(
            "the save of slot {slot} failed ({e}): removed the oldest checkpoint, {gone}, to \
             make room, and trying again"
        );
    }
}

/// Commits `manifest` (its files written) as the key's checkpoint, within `max` bytes, the
/// oldest others evicted to stay within it; its files go again when it is not kept.
async fn commit(store: &Store, manifest: Manifest, max: Option<u64>, started: Instant) -> KvStep {
    let id = manifest.id.clone();
    let profile = manifest.profile.clone();
    let (tokens, bytes) = (manifest.tokens(), manifest.bytes());
    let m = manifest.clone();
    let committed = on_disk(store, move |s| -> Result<Vec<String>, String> {
        if let Some(max) = max.filter(|max| m.bytes() > *max) {
            // Not committed (its files go below): the previous checkpoint stays.
            return Err(format!(
                "not kept: its {} bytes are more than kv_checkpoint.max_size ({max} bytes)",
                m.bytes()
            ));
        }
        s.commit(&m)
            .map_err(|e| format!("cannot write its manifest: {e}"))?;
        Ok(max.map(|max| s.evict_to(max, &m.id)).unwrap_or_default())
    })
    .await
    .and_then(|r| r);
    match committed {
        Ok(evicted) => {
            for gone in evicted {
                tracing::info!("KV checkpoint {gone} removed: kv_checkpoint.max_size reached");
            }
            let done = step(started, tokens, bytes, true, "saved".into());
            tracing::info!(
                profile,
                "KV checkpoint {id} saved: {tokens} tokens, {bytes} bytes in {}",
                dsv4_client::duration::brief_secs(done.seconds)
            );
            done
        }
        Err(why) => {
            let files = manifest.slots.iter().map(|f| f.file.clone()).collect();
            remove_files(store, files).await;
            save_failed(store, &profile, &manifest.key, &format!("{id}: {why}")).await;
            failed(started, why)
        }
    }
}
