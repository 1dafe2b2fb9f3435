//! An engine's identity at its start: what it is, what it runs, and on what, so that a change
//! of any of them since the last start is seen (a rebuilt engine, a new model file, a driver
//! or firmware update: any of them can change the answers at full speed).

use serde::{Deserialize, Serialize};

/// A file as it was at a start: its size, modification time and a hash (of the whole
/// program; of a model file's GGUF header, its tensor data aside).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileMark {
    pub path: String,
    pub size: u64,
    /// Modification time, Unix seconds and nanoseconds.
    pub modified: (i64, u32),
    /// SHA-256, lowercase hex; empty when the file could not be read.
    pub sha256: String,
}

/// What an engine was at a start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineIdentity {
    /// The engine's kind (`llama-server`, `ds4-server`, ...).
    pub engine: String,
    pub program: FileMark,
    /// What the program says of its version (`--version`), when it says.
    #[serde(default)]
    pub version: Option<String>,
    /// The backend it runs on, as it reports it (`ROCm`, `Vulkan`, `CPU`, ...).
    #[serde(default)]
    pub backend: Option<String>,
    pub models: Vec<FileMark>,
    /// `/proc/sys/kernel/osrelease`.
    #[serde(default)]
    pub kernel: Option<String>,
    /// The GPU's firmware versions (amdgpu's `fw_version` files), `name=value` joined.
    #[serde(default)]
    pub gpu_firmware: Option<String>,
}

/// The running engine's identity, and what changed since the profile's last start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityStatus {
    pub profile: String,
    pub identity: EngineIdentity,
    /// What differs from the profile's last start, in words; empty when nothing does or
    /// there was none (`first` says which).
    #[serde(default)]
    pub changed: Vec<String>,
    /// No start of the profile was recorded before this one.
    #[serde(default)]
    pub first: bool,
}

impl EngineIdentity {
    /// `llama-server 0.5.0-dev (build 0, commit 0c1e57098), CPU`: its name, version and
    /// backend, as far as known.
    pub fn brief(&self) -> String {
        let mut out = self.engine.clone();
        match &self.version {
            Some(v) => out.push_str(&format!(" {v}")),
            None => out.push_str(&format!(" {}", short_hash(&self.program.sha256))),
        }
        if let Some(b) = &self.backend {
            out.push_str(&format!(" ({b})"));
        }
        out
    }
}

/// The first 12 hex digits of a hash, as a build is named by it.
pub fn short_hash(sha256: &str) -> String {
    format!("sha256:{}", sha256.get(..12).unwrap_or(sha256))
}
