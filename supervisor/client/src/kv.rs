//! KV checkpoints: the saved KV caches of engines, as `GET /status`, `Status()`,
//! `KvCheckpoints()` and `dsv4ctl kv list` show them.

use serde::{Deserialize, Serialize};

/// The checkpoint part of [`crate::Status`]: one entry per profile that keeps checkpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvStatus {
    pub profiles: Vec<KvProfile>,
    /// Prompt tokens that requests took from a restored cache instead of a prefill.
    pub restored_tokens_total: u64,
    /// Restores whose check missed: the engine reused less than half of what the first
    /// request after them shared with the restored tokens.
    #[serde(default)]
    pub restore_misses_total: u64,
}

/// One profile's checkpoints and its last save and restore.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvProfile {
    pub profile: String,
    /// `llama-server` (slots saved by dsv4d) or `ds4` (ds4-server's own `--kv-disk-dir`).
    pub engine: String,
    /// When the engine keeps its checkpoints itself, what the status calls them (e.g.
    /// `ds4-server's own`); `None` when dsv4d keeps them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_keeps: Option<String>,
    /// Where the checkpoints are kept.
    pub dir: String,
    /// The newest checkpoint this profile saved, when there is one (llama-server only: ds4
    /// keeps its own files).
    pub checkpoint: Option<KvCheckpoint>,
    /// Bytes of the checkpoint files in `dir` (all profiles' that share it, and those set aside).
    pub dir_bytes: u64,
    pub last_save: Option<KvStep>,
    pub last_restore: Option<KvStep>,
}

/// A checkpoint on disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvCheckpoint {
    /// Its name: the hash of what makes a KV cache valid (model, context, slots, KV types,
    /// engine build).
    pub id: String,
    /// The profile that saved it.
    pub profile: String,
    /// Tokens held, over all its slots.
    pub tokens: u64,
    pub bytes: u64,
    /// Unix time (s) of the save.
    pub saved_at: f64,
    /// How long the save took.
    pub save_seconds: f64,
    /// The slots it holds.
    pub slots: Vec<u32>,
    /// The engine build it was made with (`/props` `build_info`).
    pub build: String,
    /// Set for a checkpoint set aside (never restored): why.
    #[serde(default)]
    pub aside: Option<String>,
}

/// What one save or restore did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvStep {
    /// Unix time (s) it ended.
    pub at: f64,
    pub seconds: f64,
    pub tokens: u64,
    pub bytes: u64,
    /// `saved`, `restored`, `nothing to save`, `nothing to restore`, or what went wrong.
    pub result: String,
    /// Whether it did what it was for (a restore that found nothing compatible did not).
    pub ok: bool,
    /// What the engine said about it (ds4-server's log line), when it says something.
    #[serde(default)]
    pub engine_said: Option<String>,
    /// Why the engine saved (ds4-server's `reason=`: `shutdown`, `cold`, `continued`,
    /// `evict`), when it says.
    #[serde(default)]
    pub reason: Option<String>,
    /// For a restore: what the first request that shared its tokens took from the cache,
    /// once one has.
    #[serde(default)]
    pub check: Option<RestoreCheck>,
}

/// A restore checked against the first request that shared its tokens: the tokens the
/// engine took from its cache for it (llama-server's `timings.cache_n`) against the prefix
/// the request had in common with the restored tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RestoreCheck {
    /// Unix time (s) of the check.
    pub at: f64,
    pub reused: u64,
    pub shared: u64,
    /// Less than half the shared prefix was reused: the restore did not work.
    pub missed: bool,
}
