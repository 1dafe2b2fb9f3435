//! What an engine of a profile will hold once loaded: its `planned_memory` when the profile
//! gives one, else an estimate from its files and launch flags.
//!
//! The estimate is the model's files (weights, and the vision projector), the KV cache for
//! the whole context (from the GGUF header: layers, KV heads and their widths, or the
//! latent width of an MLA model, at the cache type's size), and the largest compute buffer,
//! the logits of one micro-batch (`-ub` tokens x vocabulary x 4 bytes), which llama.cpp pins
//! at load: with `-ub 16384` at a 262K context, GTT held 93.75 GB right after load
//! (pwilkin/strix-halo #6). It is an estimate, said as one; a validation's measured GTT
//! peak, written as `planned_memory`, is better. Owns: the figure the admission rule and
//! the doctor both use. Must not: read more of a model than its header.

use crate::config::Profile;
use crate::host::gguf;

/// llama.cpp's default micro-batch (`-ub`).
const DEFAULT_UBATCH: u64 = 512;
/// Bytes of one logit.
const LOGIT_BYTES: u64 = 4;

/// A profile's memory need, and how it was arrived at.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Need {
    /// The profile's `planned_memory`, when it gives one: it is the need.
    pub planned: Option<u64>,
    /// The model's files (all shards, and `mmproj`), as found on disk.
    pub weights: u64,
    /// The KV cache for the whole context, when the header tells its shape.
    pub kv: Option<u64>,
    /// The logits of one micro-batch, when the header tells the vocabulary.
    pub compute: Option<u64>,
    /// What could not be read, in words (a file, a header).
    pub unknown: Vec<String>,
}

impl Need {
    /// The estimate: weights, KV and compute.
    pub fn estimate(&self) -> u64 {
        self.weights + self.kv.unwrap_or(0) + self.compute.unwrap_or(0)
    }

    /// What the admission rule charges: `planned_memory`, else the estimate (`None` when
    /// nothing at all is known: never refused).
    pub fn charged(&self) -> Option<u64> {
        self.planned
            .or_else(|| (self.estimate() > 0).then(|| self.estimate()))
    }

    /// `86.0 GiB (planned_memory)` or `84.2 GiB estimated: weights 80.8 GiB, KV 2.3 GiB,
    /// compute 1.1 GiB`.
    pub fn describe(&self) -> String {
        let gib = dsv4_client::units::format_gib;
        let mut parts = vec![format!("weights {}", gib(self.weights))];
        if let Some(kv) = self.kv {
            parts.push(format!("KV {}", gib(kv)));
        }
        if let Some(c) = self.compute {
            parts.push(format!("compute {}", gib(c)));
        }
        let estimate = format!("{} estimated ({})", gib(self.estimate()), parts.join(", "));
        match self.planned {
            Some(p) => format!("{} (planned_memory; {estimate})", gib(p)),
            None => estimate,
        }
    }
}

/// The KV cache of `tokens` tokens for a model of this shape.
pub fn kv_bytes(meta: &gguf::Meta, tokens: u64, cache_type: Option<&str>) -> Option<u64> {
    let layers = meta.block_count?;
    let per_token_elems = match meta.kv_lora_rank {
        // MLA: one latent vector and the rotary part per token and layer.
        Some(rank) => rank + meta.rope_dimension_count.unwrap_or(0),
        None => {
            let heads = meta.head_count?;
            let kv_heads = meta.head_count_kv.unwrap_or(heads);
            let head_width = meta.embedding_length? / heads.max(1);
            let k = meta.key_length.unwrap_or(head_width);
            let v = meta.value_length.unwrap_or(head_width);
            kv_heads * (k + v)
        }
    };
    // The configuration's own table of cache types; f16, llama-server's default, when unset.
    let (bytes, per) = cache_type
        .and_then(crate::config::kv_cache_type_size)
        .unwrap_or((2, 1));
    let elems = layers.checked_mul(tokens)?.checked_mul(per_token_elems)?;
    Some(elems / per * bytes)
}

/// The need of `profile`, reading its files' sizes and its model's header.
pub fn of(profile: &Profile) -> Need {
    let mut need = Need {
        planned: profile.planned_memory,
        ..Need::default()
    };
    let params = &profile.params;
    let Some(model) = &params.model else {
        return need;
    };
    for file in crate::config::model_files(model)
        .into_iter()
        .chain(params.mmproj.clone())
    {
        match std::fs::metadata(&file) {
            Ok(m) => need.weights += m.len(),
            Err(e) => need.unknown.push(format!("{}: {e}", file.display())),
        }
    }
    let header = match gguf::read(model) {
        Ok(h) => h,
        Err(e) => {
            need.unknown.push(format!("{}: {e}", model.display()));
            return need;
        }
    };
    let meta = &header.meta;
    let context = params
        .context
        .map(u64::from)
        .or(meta.context_length)
        .unwrap_or(0);
    need.kv = kv_bytes(meta, context, params.kv_cache.as_deref());
    let ubatch = params
        .ubatch
        .map(u64::from)
        .or(params.batch.map(u64::from))
        .unwrap_or(DEFAULT_UBATCH);
    need.compute = meta
        .vocab_size
        .map(|v| v.saturating_mul(ubatch).saturating_mul(LOGIT_BYTES));
    need
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_like() -> gguf::Meta {
        gguf::Meta {
            block_count: Some(32),
            embedding_length: Some(4096),
            head_count: Some(32),
            head_count_kv: Some(8),
            ..gguf::Meta::default()
        }
    }

    #[test]
    fn kv_for_grouped_heads_and_for_mla() {
        // 32 layers x 8 KV heads x (128 + 128) x 2 bytes = 128 KiB per token.
        assert_eq!(kv_bytes(&llama_like(), 1, None), Some(131_072));
        assert_eq!(kv_bytes(&llama_like(), 8192, Some("f16")), Some(1 << 30));
        // q8_0 keeps 34 bytes per 32 elements.
        assert_eq!(
            kv_bytes(&llama_like(), 8192, Some("q8_0")),
            Some((1u64 << 29) / 32 * 34)
        );
        let mla = gguf::Meta {
            block_count: Some(61),
            kv_lora_rank: Some(512),
            rope_dimension_count: Some(64),
            ..gguf::Meta::default()
        };
        assert_eq!(kv_bytes(&mla, 1000, None), Some(61 * 1000 * 576 * 2));
        assert_eq!(kv_bytes(&gguf::Meta::default(), 1000, None), None);
    }

    #[test]
    fn planned_memory_wins_and_nothing_known_charges_nothing() {
        let need = Need {
            planned: Some(10),
            weights: 5,
            kv: Some(1),
            compute: None,
            unknown: vec![],
        };
        assert_eq!(need.charged(), Some(10));
        assert_eq!(need.estimate(), 6);
        let none = Need::default();
        assert_eq!(none.charged(), None);
        let estimated = Need {
            planned: None,
            ..need
        };
        assert_eq!(estimated.charged(), Some(6));
    }
}
