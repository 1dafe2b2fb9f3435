//! The checkpoints on disk, in the profile's `kv_checkpoint.dir` (llama-server's
//! `--slot-save-path`, which must hold the slot files themselves: the engine takes bare file
//! names only).
//!
//! Owns: the layout. Must not: talk to the engine (`slots.rs` does).
//!
//! ```text
//!   DIR/<id>.json                   the manifest: profile, key, slots, sizes, when; written
//!                                   last (by a rename), so it names only complete files
//!   DIR/<id>-<stamp>-<slot>.bin     one slot's cache, as llama-server wrote it
//!   DIR/<id>.restoring              present while a restore runs: found at a later start, it
//!                                   means that restore never ended (the engine died on it)
//!   DIR/aside/                      checkpoints set aside, with the reason in the manifest
//! ```
//! `<id>` is the hash of the checkpoint's [`Key`], so there is one checkpoint per kind of
//! engine, whichever profile saved it, and profiles with different settings keep theirs
//! side by side in one folder. Only files of these shapes are ever removed.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use dsv4_client::kv::KvCheckpoint;
use serde::{Deserialize, Serialize};

use super::key::Key;

pub const FORMAT: u32 = 1;
const ASIDE: &str = "aside";
/// The largest manifest read (one lists a checkpoint's slot files: a few hundred bytes each).
const MANIFEST_MAX: u64 = 1 << 20;

/// One slot's file in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotFile {
    pub slot: u32,
    pub file: String,
    pub tokens: u64,
    pub bytes: u64,
}

/// A checkpoint: what the manifest file holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub id: String,
    pub profile: String,
    pub key: Key,
    /// Unix time (s).
    pub saved_at: f64,
    pub save_seconds: f64,
    pub slots: Vec<SlotFile>,
    /// Why it was set aside, once it is.
    #[serde(default)]
    pub aside: Option<String>,
}

impl Manifest {
    pub fn tokens(&self) -> u64 {
        self.slots.iter().map(|s| s.tokens).sum()
    }
    pub fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.bytes).sum()
    }
    pub fn shown(&self) -> KvCheckpoint {
        KvCheckpoint {
            id: self.id.clone(),
            profile: self.profile.clone(),
            tokens: self.tokens(),
            bytes: self.bytes(),
            saved_at: self.saved_at,
            save_seconds: self.save_seconds,
            slots: self.slots.iter().map(|s| s.slot).collect(),
            build: self.key.build.clone(),
            aside: self.aside.clone(),
        }
    }
}

/// What a start finds for its engine.
#[derive(Debug, Default)]
pub struct Lookup {
    /// The checkpoint to restore.
    pub found: Option<Manifest>,
    /// One line per checkpoint set aside on the way.
    pub set_aside: Vec<String>,
}

/// The checkpoint folder of one profile.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

fn is_id(s: &str) -> bool {
    s.len() == 16
        && s.bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
}

/// `<id>-<digits>-<digits>.bin`
fn is_slot_file(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".bin") else {
        return false;
    };
    let mut parts = stem.split('-');
    let (Some(id), Some(stamp), Some(slot), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return false;
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    is_id(id) && digits(stamp) && digits(slot)
}

impl Store {
    pub fn new(dir: &Path) -> Store {
        Store {
            dir: dir.to_path_buf(),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the folder, owner only: it holds what was said to the model, and a file
    /// planted in it would be restored into the engine. A folder that exists with group or
    /// other access is tightened to owner only when it is dsv4d's, and refused when it is
    /// not.
    pub fn ensure(&self) -> io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let meta = fs::metadata(&self.dir)?;
        let mode = meta.mode() & 0o7777;
        if mode & 0o077 == 0 {
            return Ok(());
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(io::Error::other(format!(
                "{} may be used by group or others (mode {mode:04o}) and is uid {}'s, not \
                 dsv4d's (uid {me}) to make private: chmod 700 it",
                self.dir.display(),
                meta.uid()
            )));
        }
        let private = mode & !0o077;
        fs::set_permissions(&self.dir, fs::Permissions::from_mode(private))?;
        tracing::info!(
            "KV checkpoint folder {} was open to group or others (mode {mode:04o}): made \
             private ({private:04o})",
            self.dir.display()
        );
        Ok(())
    }

    pub fn slot_file_name(id: &str, stamp: u64, slot: u32) -> String {
        format!("{id}-{stamp}-{slot}.bin")
    }

    fn manifest_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn marker_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.restoring"))
    }

    fn aside_dir(&self) -> PathBuf {
        self.dir.join(ASIDE)
    }

    /// The manifests in `dir` (`aside`: in `dir/aside`), each with its path; an unreadable
    /// one as the reason.
    fn manifests_in(&self, aside: bool) -> Vec<(PathBuf, Result<Manifest, String>)> {
        let dir = if aside {
            self.aside_dir()
        } else {
            self.dir.clone()
        };
        let Ok(entries) = fs::read_dir(&dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(stem) = name.strip_suffix(".json") else {
                continue;
            };
            let id = stem.split('-').next().unwrap_or_default();
            if !is_id(id) || (!aside && stem != id) {
                continue;
            }
            let path = entry.path();
            let read = crate::host::regular::read(&path, MANIFEST_MAX)
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|bytes| {
                    serde_json::from_slice::<Manifest>(&bytes)
                        .map_err(|e| format!("its manifest is damaged: {e}"))
                })
                .and_then(|m| match (m.format, aside || m.id == id) {
                    (FORMAT, true) => Ok(m),
                    (FORMAT, false) => Err(format!("its manifest names {}", m.id)),
                    (other, _) => Err(format!("unknown manifest format {other}")),
                });
            out.push((path, read));
        }
        out
    }

    /// The checkpoint to restore into an engine of profile `profile` with key `key`, setting
    /// aside on the way every checkpoint that cannot be: one of this key that is truncated
    /// or whose restore never ended, and one of this profile made for another engine.
    pub fn lookup(&self, profile: &str, key: &Key) -> Lookup {
        let mut out = Lookup::default();
        let id = key.id();
        for (path, read) in self.manifests_in(false) {
            let m = match read {
                Ok(m) => m,
                Err(why) => {
                    let name = path.file_name().unwrap_or_default().to_string_lossy();
                    out.set_aside.push(format!("{name}: {why}"));
                    let _ = self.move_aside(&path, &[], &why, None);
                    continue;
                }
            };
            let problem = if m.id == id && m.key == *key {
                self.problem_with(&m)
            } else if m.profile == profile {
                Some(m.key.difference(key))
            } else {
                None // another profile's, for another engine: not ours to judge
            };
            match problem {
                None if m.id == id => out.found = Some(m),
                None => {}
                Some(why) => {
                    out.set_aside.push(format!(
                        "{} (profile {}, {} tokens): {why}",
                        m.id,
                        m.profile,
                        m.tokens()
                    ));
                    let _ = self.set_aside(&m, &why);
                }
            }
        }
        out
    }

    /// The checkpoint of `key` that a start would restore, if there is one that can be: what
    /// stays when a save for it fails. Nothing is set aside here (a start's
    /// [`lookup`](Self::lookup) does that).
    pub fn current(&self, key: &Key) -> Option<Manifest> {
        let bytes = crate::host::regular::read(&self.manifest_path(&key.id()), MANIFEST_MAX);
        let m: Manifest = serde_json::from_slice(&bytes.ok()?).ok()?;
        let ours = m.format == FORMAT && m.id == key.id() && m.key == *key;
        (ours && self.problem_with(&m).is_none()).then_some(m)
    }

    /// Why a checkpoint of the right key cannot be restored, if it cannot.
    fn problem_with(&self, m: &Manifest) -> Option<String> {
        if self.marker_path(&m.id).exists() {
            return Some(
                "an earlier restore of it never ended (the engine died or it timed out)".into(),
            );
        }
        for s in &m.slots {
            if !is_slot_file(&s.file) {
                return Some(format!("its manifest names a file {:?}", s.file));
            }
            match fs::metadata(self.dir.join(&s.file)) {
                Ok(meta) if meta.len() == s.bytes => {}
                Ok(meta) => {
                    return Some(format!(
                        "truncated: {} is {} bytes, {} were saved",
                        s.file,
                        meta.len(),
                        s.bytes
                    ))
                }
                Err(e) => return Some(format!("{} is missing: {e}", s.file)),
            }
        }
        None
    }

    /// Moves a checkpoint to `aside/`, with `reason` in its manifest; it is never restored.
    pub fn set_aside(&self, m: &Manifest, reason: &str) -> io::Result<()> {
        let files: Vec<&str> = m.slots.iter().map(|s| s.file.as_str()).collect();
        let _ = fs::remove_file(self.marker_path(&m.id));
        self.move_aside(&self.manifest_path(&m.id), &files, reason, Some(m))
    }

    fn move_aside(
        &self,
        manifest: &Path,
        files: &[&str],
        reason: &str,
        m: Option<&Manifest>,
    ) -> io::Result<()> {
        let aside = self.aside_dir();
        fs::create_dir_all(&aside)?;
        for f in files.iter().filter(|f| is_slot_file(f)) {
            let _ = fs::rename(self.dir.join(f), aside.join(f));
        }
        let stem = manifest
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("unknown");
        let stamp = dsv4_client::clock::unix_millis();
        let target = aside.join(format!("{stem}-{stamp}.json"));
        match m {
            Some(m) => {
                let mut m = m.clone();
                m.aside = Some(reason.to_string());
                crate::host::state_file::write_atomic(&target, &serde_json::to_vec_pretty(&m)?)?;
                fs::remove_file(manifest).or_else(ignore_missing)
            }
            // Unreadable: kept as it is, for whoever wants to look.
            None => fs::rename(manifest, target),
        }
    }

    pub fn mark_restoring(&self, id: &str) -> io::Result<()> {
        crate::host::state_file::write_atomic(&self.marker_path(id), b"")
    }

    pub fn clear_restoring(&self, id: &str) {
        let _ = fs::remove_file(self.marker_path(id));
    }

    /// Makes `m` the checkpoint of its key: the manifest goes in by a rename, then the files
    /// of the one it replaces go.
    pub fn commit(&self, m: &Manifest) -> io::Result<()> {
        let path = self.manifest_path(&m.id);
        let old = crate::host::regular::read(&path, MANIFEST_MAX)
            .ok()
            .and_then(|b| serde_json::from_slice::<Manifest>(&b).ok());
        crate::host::state_file::write_atomic(&path, &serde_json::to_vec_pretty(m)?)?;
        self.clear_restoring(&m.id);
        if let Some(old) = old {
            for s in old.slots.iter().filter(|s| !m.slots.contains(s)) {
                if is_slot_file(&s.file) && !m.slots.iter().any(|n| n.file == s.file) {
                    let _ = fs::remove_file(self.dir.join(&s.file));
                }
            }
        }
        Ok(())
    }

    /// Removes slot files that no manifest names (left by a save that was cut off).
    pub fn sweep(&self) {
        let named: Vec<String> = self
            .manifests_in(false)
            .into_iter()
            .filter_map(|(_, m)| m.ok())
            .flat_map(|m| m.slots.into_iter().map(|s| s.file))
            .collect();
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if is_slot_file(name) && !named.iter().any(|n| n == name) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    pub fn remove_slot_file(&self, name: &str) {
        if is_slot_file(name) {
            let _ = fs::remove_file(self.dir.join(name));
        }
    }

    pub fn slot_file_len(&self, name: &str) -> Option<u64> {
        fs::metadata(self.dir.join(name)).ok().map(|m| m.len())
    }

    /// Bytes of the files of the checkpoint layout in the folder and in `aside/`.
    pub fn total_bytes(&self) -> u64 {
        let mut total = 0;
        for dir in [self.dir.clone(), self.aside_dir()] {
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if let Ok(meta) = entry.metadata() {
                    if meta.is_file() && ours(&entry.file_name().to_string_lossy()) {
                        total += meta.len();
                    }
                }
            }
        }
        total
    }

    /// Removes the oldest checkpoint other than `keep`: set-aside ones first. Returns what it
    /// removed, in words, or `None` when there is nothing else.
    pub fn evict_oldest(&self, keep: &str) -> Option<String> {
        let mut aside: Vec<(PathBuf, Option<Manifest>)> = self
            .manifests_in(true)
            .into_iter()
            .map(|(p, m)| (p, m.ok()))
            .collect();
        aside.sort_by(|a, b| {
            let t = |m: &Option<Manifest>| m.as_ref().map_or(0.0, |m| m.saved_at);
            t(&a.1).total_cmp(&t(&b.1))
        });
        if let Some((path, m)) = aside.into_iter().next() {
            if let Some(m) = &m {
                for s in &m.slots {
                    if is_slot_file(&s.file) {
                        let _ = fs::remove_file(self.aside_dir().join(&s.file));
                    }
                }
            }
            fs::remove_file(&path).ok()?;
            let name = m.map_or_else(|| path.display().to_string(), |m| m.id.clone());
            return Some(format!("{name} (set aside before)"));
        }
        let mut live: Vec<Manifest> = self
            .manifests_in(false)
            .into_iter()
            .filter_map(|(_, m)| m.ok())
            .filter(|m| m.id != keep)
            .collect();
        live.sort_by(|a, b| a.saved_at.total_cmp(&b.saved_at));
        let m = live.into_iter().next()?;
        fs::remove_file(self.manifest_path(&m.id)).ok()?;
        self.remove(&m);
        Some(format!(
            "{} (profile {}, {} tokens, {} bytes)",
            m.id,
            m.profile,
            m.tokens(),
            m.bytes()
        ))
    }

    /// Removes the oldest checkpoints other than `keep` until the folder holds at most `max`
    /// bytes; what it removed, in words.
    pub fn evict_to(&self, max: u64, keep: &str) -> Vec<String> {
        let mut gone = Vec::new();
        while self.total_bytes() > max {
            match self.evict_oldest(keep) {
                Some(what) => gone.push(what),
                None => break,
            }
        }
        gone
    }

    /// Removes a live checkpoint: manifest first, so nothing ever names a missing file.
    pub fn remove(&self, m: &Manifest) {
        let _ = fs::remove_file(self.manifest_path(&m.id));
        self.clear_restoring(&m.id);
        for s in &m.slots {
            self.remove_slot_file(&s.file);
        }
    }

    /// The live checkpoints, then those set aside.
    pub fn list(&self) -> Vec<Manifest> {
        let mut out: Vec<Manifest> = self
            .manifests_in(false)
            .into_iter()
            .filter_map(|(_, m)| m.ok())
            .collect();
        out.sort_by(|a, b| b.saved_at.total_cmp(&a.saved_at));
        let mut aside: Vec<Manifest> = self
            .manifests_in(true)
            .into_iter()
            .filter_map(|(_, m)| m.ok())
            .collect();
        aside.sort_by(|a, b| b.saved_at.total_cmp(&a.saved_at));
        out.extend(aside);
        out
    }

    /// Removes the checkpoints `what` names: `all`, an id, or a profile (the ones it saved);
    /// set-aside ones too. Returns the ids removed.
    pub fn drop_matching(&self, what: &str) -> Vec<String> {
        let matches = |m: &Manifest| what == "all" || m.id == what || m.profile == what;
        let mut gone = Vec::new();
        for m in self
            .manifests_in(false)
            .into_iter()
            .filter_map(|(_, m)| m.ok())
        {
            if matches(&m) {
                self.remove(&m);
                gone.push(m.id);
            }
        }
        for (path, m) in self.manifests_in(true) {
            let keep = match &m {
                Ok(m) => !matches(m),
                Err(_) => what != "all",
            };
            if keep {
                continue;
            }
            if let Ok(m) = &m {
                for s in &m.slots {
                    if is_slot_file(&s.file) {
                        let _ = fs::remove_file(self.aside_dir().join(&s.file));
                    }
                }
                gone.push(format!("{} (set aside)", m.id));
            }
            let _ = fs::remove_file(path);
        }
        if what == "all" {
            self.sweep();
        }
        gone
    }
}

/// A file name of the layout (manifests, slot files, markers).
fn ours(name: &str) -> bool {
    let id_of = |stem: &str| is_id(stem.split('-').next().unwrap_or_default());
    is_slot_file(name)
        || name.strip_suffix(".json").is_some_and(id_of)
        || name.strip_suffix(".restoring").is_some_and(is_id)
}

fn ignore_missing(e: io::Error) -> io::Result<()> {
    match e.kind() {
        io::ErrorKind::NotFound => Ok(()),
        _ => Err(e),
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
