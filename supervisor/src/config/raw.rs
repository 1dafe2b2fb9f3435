//! The values as written: a profile as serde reads it, and the scalars that are read as text
//! and parsed (sizes and the engine's settings, each a newtype that serde builds through
//! `TryFrom<String>`; durations, sizes and temperatures in the settings types), so that the
//! parser's message is the error.
//!
//! Range checks and cross-field checks happen afterwards, in `load.rs`.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::time::Duration;

use dsv4_client::duration;
use dsv4_engine::{EngineKind, FlashAttn, GpuLayers};
use serde::{de, Deserialize, Deserializer};

use super::units::{parse_size, parse_temperature};

/// `profiles/<name>.yaml`. `engine` and `command` are required, but optional here so that a
/// profile missing both reports both.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[serde(expecting = "a mapping of profile settings")]
pub(crate) struct RawProfile {
    pub description: Option<String>,
    pub engine: Option<Engine>,
    pub command: Option<String>,
    pub model: Option<String>,
    pub mmproj: Option<String>,
    pub context: Option<u32>,
    pub parallel: Option<u32>,
    pub batch: Option<u32>,
    pub ubatch: Option<u32>,
    pub kv_cache: Option<String>,
    pub flash_attn: Option<Flash>,
    pub gpu_layers: Option<Layers>,
    pub prefill_chunk: Option<u32>,
    pub kv_disk_dir: Option<String>,
    pub kv_disk_space: Option<Size>,
    pub planned_memory: Option<Size>,
    pub extra_args: Option<Vec<String>>,
    pub env: Option<BTreeMap<String, String>>,
}

/// A byte size such as `64MiB` or `87.82GiB`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct Size(pub u64);

impl TryFrom<String> for Size {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        parse_size(&text).map(Size)
    }
}

/// `llama-server` or `ds4`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct Engine(pub EngineKind);

impl TryFrom<String> for Engine {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        text.parse().map(Engine)
    }
}

/// `on`, `off`, `auto`, or a boolean (`true` = on, `false` = off).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct Flash(pub FlashAttn);

impl TryFrom<String> for Flash {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        match text.as_str() {
            "on" | "true" => Ok(Flash(FlashAttn::On)),
            "off" | "false" => Ok(Flash(FlashAttn::Off)),
            "auto" => Ok(Flash(FlashAttn::Auto)),
            _ => Err(format!(
                "invalid flash_attn {text:?}: expected on, off or auto"
            )),
        }
    }
}

/// `all` or a number of layers.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(try_from = "String")]
pub(crate) struct Layers(pub GpuLayers);

impl TryFrom<String> for Layers {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        match text.parse::<u32>() {
            _ if text == "all" => Ok(Layers(GpuLayers::All)),
            Ok(n) if !text.starts_with('+') => Ok(Layers(GpuLayers::Count(n))),
            _ => Err(format!(
                "invalid gpu_layers {text:?}: expected \"all\" or a number of layers (0 or more)"
            )),
        }
    }
}

// The fields of the public settings types hold the parsed values themselves.

/// Reads a scalar as text and parses it; the parser's message is the error.
fn parsed<'de, D: Deserializer<'de>, T, E: Display>(
    d: D,
    parse: fn(&str) -> Result<T, E>,
) -> Result<T, D::Error> {
    parse(&String::deserialize(d)?).map_err(de::Error::custom)
}

pub(crate) fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    parsed(d, duration::parse)
}

/// `null` is `None` (never).
pub(crate) fn duration_or_never<'de, D>(d: D) -> Result<Option<Duration>, D::Error>
where
    D: Deserializer<'de>,
{
    Option::<String>::deserialize(d)?
        .map(|text| duration::parse(&text).map_err(de::Error::custom))
        .transpose()
}

pub(crate) fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    parsed(d, parse_size)
}

pub(crate) fn celsius<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    parsed(d, parse_temperature)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(text: &str) -> Result<RawProfile, String> {
        serde_yaml_ng::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn flash_attn_spellings() {
        for (text, want) in [
            ("on", FlashAttn::On),
            ("off", FlashAttn::Off),
            ("auto", FlashAttn::Auto),
            ("true", FlashAttn::On),
            ("false", FlashAttn::Off),
            ("\"on\"", FlashAttn::On),
        ] {
            let p = profile(&format!("flash_attn: {text}")).unwrap();
            assert_eq!(p.flash_attn, Some(Flash(want)), "{text}");
        }
        assert!(profile("flash_attn: yes")
            .unwrap_err()
            .starts_with("invalid flash_attn \"yes\": expected on, off or auto"));
        assert!(profile("flash_attn: 1").is_err());
        assert_eq!(profile("flash_attn:").unwrap().flash_attn, None);
    }

    #[test]
    fn gpu_layers_spellings() {
        assert_eq!(
            profile("gpu_layers: all").unwrap().gpu_layers,
            Some(Layers(GpuLayers::All))
        );
        assert_eq!(
            profile("gpu_layers: 99").unwrap().gpu_layers,
            Some(Layers(GpuLayers::Count(99)))
        );
        assert_eq!(
            profile("gpu_layers: '12'").unwrap().gpu_layers,
            Some(Layers(GpuLayers::Count(12)))
        );
        for bad in ["-1", "+1", "some", "1.5", "99999999999", ""] {
            assert!(profile(&format!("gpu_layers: '{bad}'")).is_err(), "{bad}");
        }
    }

    #[test]
    fn scalars_stay_text() {
        let p = profile(
            "extra_args: [--power, 100, 1.10, true, 0x10, 007]\nenv: {CUDA_VISIBLE_DEVICES: 0}",
        )
        .unwrap();
        assert_eq!(
            p.extra_args.unwrap(),
            ["--power", "100", "1.10", "true", "0x10", "007"]
        );
        assert_eq!(p.env.unwrap()["CUDA_VISIBLE_DEVICES"], "0");
    }
}
