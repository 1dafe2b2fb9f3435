//! What makes a saved KV cache valid for an engine: the checkpoint's key.
//!
//! A slot file of llama-server holds the KV tensors of its tokens as the engine laid them out:
//! they mean something only to the same weights (the model file), the same per-slot context
//! and slot count (llama-server refuses or aborts otherwise, seen with a slot count change),
//! the same K/V cache types and attention layout (flash attention stores V untransposed), and
//! an engine build that writes the same format. Any difference: the checkpoint is not used.
//!
//! The model file is known by its size, its modification time and a SHA-256 of its first
//! [`HEAD_BYTES`] (the GGUF header and metadata): hashing 80 GiB at every start would cost
//! minutes, and a changed file of the same size and time is not a case worth that price.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;
use std::time::UNIX_EPOCH;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Bytes of a model file that are hashed.
pub const HEAD_BYTES: u64 = 4 << 20;

/// A file known by size, time and the hash of its head.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub size: u64,
    /// Modification time, ns since the epoch.
    pub mtime_ns: i64,
    /// SHA-256 of the first [`HEAD_BYTES`], in hex.
    pub head_sha256: String,
}

impl FileId {
    pub fn of(path: &Path) -> io::Result<FileId> {
        let mut file = File::open(path)?;
        let meta = file.metadata()?;
        let mtime_ns = meta
            .modified()?
            .duration_since(UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        let mut head = Vec::new();
        (&mut file).take(HEAD_BYTES).read_to_end(&mut head)?;
        Ok(FileId {
            size: meta.len(),
            mtime_ns,
            head_sha256: hex(&Sha256::digest(&head)),
        })
    }
}

/// The key of a checkpoint: it is restored only into an engine with an equal key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Key {
    pub model: FileId,
    pub mmproj: Option<FileId>,
    /// Context per slot and slot count, as the engine reports them (`/props`).
    pub n_ctx: u64,
    pub slots: u32,
    /// `kv_cache` of the profile (both K and V), or `default`.
    pub cache_type: String,
    /// `flash_attn` of the profile, or `default`.
    pub flash_attn: String,
    /// The engine's `/props` `build_info`.
    pub build: String,
}

impl Key {
    /// The checkpoint's name: 16 hex digits of the SHA-256 of the key.
    pub fn id(&self) -> String {
        let text = serde_json::to_vec(self).unwrap_or_default();
        hex(&Sha256::digest(&text)[..8])
    }

    /// What differs between a checkpoint's key (`self`) and an engine's, in words.
    pub fn difference(&self, engine: &Key) -> String {
        let mut parts = Vec::new();
        if self.model != engine.model {
            let what = if self.model.size != engine.model.size {
                format!(
                    "another model file ({} bytes, now {})",
                    self.model.size, engine.model.size
                )
            } else {
                "another model file (same size, other time or header)".to_string()
            };
            parts.push(what);
        }
        if self.mmproj != engine.mmproj {
            parts.push("another mmproj".to_string());
        }
        if self.n_ctx != engine.n_ctx {
            parts.push(format!(
                "context per slot {} (now {})",
                self.n_ctx, engine.n_ctx
            ));
        }
        if self.slots != engine.slots {
            parts.push(format!("{} slots (now {})", self.slots, engine.slots));
        }
        if self.cache_type != engine.cache_type {
            parts.push(format!(
                "KV cache type {} (now {})",
                self.cache_type, engine.cache_type
            ));
        }
        if self.flash_attn != engine.flash_attn {
            parts.push(format!(
                "flash_attn {} (now {})",
                self.flash_attn, engine.flash_attn
            ));
        }
        if self.build != engine.build {
            parts.push(format!(
                "engine build {} (now {})",
                self.build, engine.build
            ));
        }
        if parts.is_empty() {
            "nothing (equal keys)".to_string()
        } else {
            format!("made with {}", parts.join(", "))
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key {
            model: FileId {
                size: 10,
                mtime_ns: 5,
                head_sha256: "ab".into(),
            },
            mmproj: None,
            n_ctx: 4096,
            slots: 1,
            cache_type: "q8_0".into(),
            flash_attn: "on".into(),
            build: "b1-abc".into(),
        }
    }

    #[test]
    fn every_field_changes_the_id_and_is_named_in_the_difference() {
        let base = key();
        let variants: Vec<(Key, &str)> = vec![
            (
                Key {
                    model: FileId {
                        size: 11,
                        ..base.model.clone()
                    },
                    ..base.clone()
                },
                "another model file (10 bytes, now 11)",
            ),
            (
                Key {
                    model: FileId {
                        head_sha256: "cd".into(),
                        ..base.model.clone()
                    },
                    ..base.clone()
                },
                "another model file (same size",
            ),
            (
                Key {
                    n_ctx: 2048,
                    ..base.clone()
                },
                "context per slot 4096 (now 2048)",
            ),
            (
                Key {
                    slots: 2,
                    ..base.clone()
                },
                "1 slots (now 2)",
            ),
            (
                Key {
                    cache_type: "f16".into(),
                    ..base.clone()
                },
                "KV cache type q8_0 (now f16)",
            ),
            (
                Key {
                    flash_attn: "off".into(),
                    ..base.clone()
                },
                "flash_attn on (now off)",
            ),
            (
                Key {
                    build: "b2-def".into(),
                    ..base.clone()
                },
                "engine build b1-abc (now b2-def)",
            ),
        ];
        for (other, words) in variants {
            assert_ne!(other.id(), base.id(), "{words}");
            let said = base.difference(&other);
            assert!(said.contains(words), "{said}");
        }
        assert_eq!(base.id(), key().id(), "the id is stable");
        assert_eq!(base.id().len(), 16);
    }

    #[test]
    fn a_file_is_known_by_size_time_and_head() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"GGUF header").unwrap();
        let a = FileId::of(&path).unwrap();
        assert_eq!(a.size, 11);
        // SHA-256 of "GGUF header".
        assert_eq!(a.head_sha256.len(), 64);
        std::fs::write(&path, b"GGUF HEADER").unwrap();
        let b = FileId::of(&path).unwrap();
        assert_ne!(a.head_sha256, b.head_sha256);
        assert!(FileId::of(&dir.path().join("gone")).is_err());
    }
}
