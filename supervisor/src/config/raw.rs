//! The files as written: serde types that mirror the YAML, unknown keys refused.
//!
//! Values with units and the engine-specific enums are checked while deserializing, so their
//! errors carry serde_yaml_ng's line, column and key path. Range checks and cross-field checks
//! happen afterwards, in `load.rs`.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use dsv4_engine::{EngineKind, FlashAttn, GpuLayers};
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

use super::units::{parse_duration, parse_size, parse_temperature};
use super::{CpuPolicy, GpuPolicy, OnCritical, PowerMethod};

/// Top-level keys of `supervisor.yaml` (keep in step with [`RawSupervisor`]).
pub(crate) const SUPERVISOR_KEYS: &[&str] = &[
    "api",
    "engine",
    "profiles_dir",
    "default_profile",
    "state_dir",
    "exit_when_idle",
    "power",
    "monitor",
    "thermal",
    "memory",
];

/// Top-level keys of a profile (keep in step with [`RawProfile`]).
pub(crate) const PROFILE_KEYS: &[&str] = &[
    "description",
    "engine",
    "command",
    "model",
    "mmproj",
    "context",
    "parallel",
    "batch",
    "ubatch",
    "kv_cache",
    "flash_attn",
    "gpu_layers",
    "prefill_chunk",
    "kv_disk_dir",
    "kv_disk_space",
    "planned_memory",
    "extra_args",
    "env",
];

// A section written as `api:` with nothing under it is null and means "all defaults", like a
// missing section; so does a null scalar, except `exit_when_idle: null`, which means "never".

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of supervisor settings")]
pub(crate) struct RawSupervisor {
    pub api: Option<RawApi>,
    pub engine: Option<RawEngineLimits>,
    pub profiles_dir: Option<String>,
    pub default_profile: Option<String>,
    pub state_dir: Option<String>,
    /// Missing: `None` (the default applies); `null`: `Some(None)` (never exit).
    #[serde(default, deserialize_with = "present")]
    pub exit_when_idle: Option<Option<Dur>>,
    pub power: Option<RawPower>,
    pub monitor: Option<RawMonitor>,
    pub thermal: Option<RawThermal>,
    pub memory: Option<RawMemory>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `api` settings")]
pub(crate) struct RawApi {
    pub listen: Option<String>,
    /// Missing or null: no API keys.
    pub api_keys_file: Option<String>,
    pub max_body: Option<Size>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `engine` settings")]
pub(crate) struct RawEngineLimits {
    pub start_timeout: Option<Dur>,
    pub idle_timeout: Option<Dur>,
    pub stop_timeout: Option<Dur>,
    pub max_waiting: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `power` settings")]
pub(crate) struct RawPower {
    pub cpu: Option<CpuPolicy>,
    pub gpu: Option<GpuPolicy>,
    pub method: Option<PowerMethod>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `monitor` settings")]
pub(crate) struct RawMonitor {
    pub interval: Option<Dur>,
    pub idle_interval: Option<Dur>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `thermal` settings")]
pub(crate) struct RawThermal {
    pub warn: Option<Celsius>,
    pub critical: Option<Celsius>,
    pub hysteresis: Option<Celsius>,
    pub on_critical: Option<OnCritical>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of `memory` settings")]
pub(crate) struct RawMemory {
    pub reserve: Option<Size>,
}

/// `profiles/<name>.yaml`. `engine` and `command` are required, but optional here so that a
/// profile missing both reports both.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of profile settings")]
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

/// Wraps a present value in `Some` (with `#[serde(default)]`, a missing key stays `None`),
/// so that `Option<Option<T>>` tells a missing key from an explicit null.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// A scalar read as text and parsed by `parse`; its error message becomes the serde error.
struct TextVisitor<T> {
    expecting: &'static str,
    parse: fn(&str) -> Result<T, String>,
    _out: PhantomData<T>,
}

impl<T> TextVisitor<T> {
    fn new(expecting: &'static str, parse: fn(&str) -> Result<T, String>) -> Self {
        TextVisitor {
            expecting,
            parse,
            _out: PhantomData,
        }
    }
}

impl<T> Visitor<'_> for TextVisitor<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        (self.parse)(v).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        self.visit_str(&v.to_string())
    }
}

/// A duration such as `90s` or `15m`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::new(
            "a duration such as 90s or 15m",
            parse_duration,
        ))
        .map(Dur)
    }
}

/// A byte size such as `64MiB` or `87.82GiB`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::new("a size such as 64MiB or 8GiB", parse_size))
            .map(Size)
    }
}

/// A temperature such as `85C`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Celsius(pub f64);

impl<'de> Deserialize<'de> for Celsius {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::new(
            "a temperature such as 85C",
            parse_temperature,
        ))
        .map(Celsius)
    }
}

/// `llama-server` or `ds4`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Engine(pub EngineKind);

impl<'de> Deserialize<'de> for Engine {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        fn parse(s: &str) -> Result<EngineKind, String> {
            s.parse()
        }
        d.deserialize_str(TextVisitor::new(
            "an engine name (llama-server or ds4)",
            parse,
        ))
        .map(Engine)
    }
}

/// `on`, `off`, `auto`, or a boolean (`true` = on, `false` = off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Flash(pub FlashAttn);

fn parse_flash(s: &str) -> Result<FlashAttn, String> {
    match s {
        "on" | "true" => Ok(FlashAttn::On),
        "off" | "false" => Ok(FlashAttn::Off),
        "auto" => Ok(FlashAttn::Auto),
        other => Err(format!(
            "invalid flash_attn {other:?}: expected on, off or auto"
        )),
    }
}

impl<'de> Deserialize<'de> for Flash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = FlashAttn;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("on, off or auto")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<FlashAttn, E> {
                Ok(if v { FlashAttn::On } else { FlashAttn::Off })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<FlashAttn, E> {
                parse_flash(v).map_err(E::custom)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<FlashAttn, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<FlashAttn, E> {
                self.visit_str(&v.to_string())
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<FlashAttn, E> {
                self.visit_str(&v.to_string())
            }
        }
        d.deserialize_any(V).map(Flash)
    }
}

/// `all` or a number of layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Layers(pub GpuLayers);

fn parse_layers(s: &str) -> Result<GpuLayers, String> {
    if s == "all" {
        return Ok(GpuLayers::All);
    }
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = s.parse::<u32>() {
            return Ok(GpuLayers::Count(n));
        }
    }
    Err(format!(
        "invalid gpu_layers {s:?}: expected \"all\" or a number of layers (0 or more)"
    ))
}

impl<'de> Deserialize<'de> for Layers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(TextVisitor::new(
            "\"all\" or a number of layers",
            parse_layers,
        ))
        .map(Layers)
    }
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
        assert_eq!(
            profile("flash_attn: yes").unwrap_err(),
            "flash_attn: invalid flash_attn \"yes\": expected on, off or auto at line 1 column 13"
        );
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
        for bad in ["-1", "some", "1.5", "99999999999"] {
            assert!(profile(&format!("gpu_layers: {bad}")).is_err(), "{bad}");
        }
    }

    #[test]
    fn scalars_stay_text() {
        let p = profile("extra_args: [--power, 100, 1.10, true]\nenv: {CUDA_VISIBLE_DEVICES: 0}")
            .unwrap();
        assert_eq!(p.extra_args.unwrap(), ["--power", "100", "1.10", "true"]);
        assert_eq!(p.env.unwrap()["CUDA_VISIBLE_DEVICES"], "0");
    }

    #[test]
    fn key_lists_match_the_structs() {
        for key in SUPERVISOR_KEYS {
            let r: Result<RawSupervisor, _> = serde_yaml_ng::from_str(&format!("{key}: null"));
            assert!(r.is_ok(), "{key}: {r:?}");
        }
        for key in PROFILE_KEYS {
            let r: Result<RawProfile, _> = serde_yaml_ng::from_str(&format!("{key}: null"));
            assert!(r.is_ok(), "{key}: {r:?}");
        }
        let err = serde_yaml_ng::from_str::<RawSupervisor>("x: 1")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err.matches('`').count() / 2,
            SUPERVISOR_KEYS.len() + 1,
            "{err}"
        );
        let err = serde_yaml_ng::from_str::<RawProfile>("x: 1")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err.matches('`').count() / 2,
            PROFILE_KEYS.len() + 1,
            "{err}"
        );
    }
}
