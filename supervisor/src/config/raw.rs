//! A profile as serde reads it, and the `deserialize_with` functions for the scalars that
//! are read as text and parsed (durations, sizes, temperatures, and the engine's settings), so
//! that the parser's message is the error.
//!
//! Range checks and cross-field checks happen afterwards, in `load.rs`.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::time::Duration;

use dsv4_client::duration;
use dsv4_engine::{EngineKind, FlashAttn, GpuLayers, Readiness};
use nix::sys::signal::Signal;
use serde::{de, Deserialize, Deserializer};

use dsv4_client::units::{parse_size, parse_temperature};

/// `profiles/<name>.yaml`. `engine` and `command` are required, but optional here so that a
/// profile missing both reports both.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping of profile settings")]
pub(crate) struct RawProfile {
    pub description: Option<String>,
    /// `llama-server`, `ds4` or `openai`.
    #[serde(deserialize_with = "engine")]
    pub engine: Option<EngineKind>,
    pub command: Option<String>,
    pub model: Option<String>,
    pub mmproj: Option<String>,
    pub context: Option<u32>,
    pub parallel: Option<u32>,
    pub batch: Option<u32>,
    pub ubatch: Option<u32>,
    pub kv_cache: Option<String>,
    /// `on`, `off`, `auto`, or a boolean (`true` = on, `false` = off).
    #[serde(deserialize_with = "flash_attn")]
    pub flash_attn: Option<FlashAttn>,
    /// `all` or a number of layers.
    #[serde(deserialize_with = "gpu_layers")]
    pub gpu_layers: Option<GpuLayers>,
    pub prefill_chunk: Option<u32>,
    pub kv_disk_dir: Option<String>,
    #[serde(deserialize_with = "size_or_none")]
    pub kv_disk_space: Option<u64>,
    #[serde(deserialize_with = "size_or_none")]
    pub planned_memory: Option<u64>,
    /// llama-server: save the slots' KV cache on planned stops, restore it on start.
    pub kv_checkpoint: Option<RawKvCheckpoint>,
    pub extra_args: Option<Vec<String>>,
    pub env: Option<BTreeMap<String, String>>,
    /// The settings `dsv4ctl validate --matrix` compares on this profile.
    pub matrix: Option<super::matrix::RawMatrix>,
    /// The engine's whole argv, with `{port}` and `{host}` (engines whose command line the
    /// profile gives).
    pub args: Option<Vec<String>>,
    /// A path that answers 200 when the engine can serve, or `connect`.
    #[serde(deserialize_with = "health")]
    pub health: Option<Readiness>,
    /// The environment variable the engine reads its key from.
    pub key_env: Option<String>,
    /// The flag the engine takes its key after, on its command line.
    pub key_arg: Option<String>,
    /// The signal that asks the engine to stop.
    #[serde(deserialize_with = "stop_signal")]
    pub stop_signal: Option<Signal>,
    /// Stop signal to SIGKILL.
    #[serde(deserialize_with = "duration_or_never")]
    pub stop_grace: Option<Duration>,
    /// Profiles of other boxes whose engines lend this one their devices.
    pub workers: Option<Vec<RawWorker>>,
}

/// One of `workers:`; `at`, `profile` and `key_file` are required (optional here so that
/// each missing one is reported).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping with at, profile, key_file (required) and wake")]
pub(crate) struct RawWorker {
    pub at: Option<String>,
    pub profile: Option<String>,
    pub key_file: Option<String>,
    pub wake: Option<RawWake>,
}

/// `wake:` of a worker: its MAC and where its Wake-on-LAN packet goes.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping with mac (required) and broadcast")]
pub(crate) struct RawWake {
    pub mac: Option<String>,
    pub broadcast: Option<String>,
}

/// `kv_checkpoint:` of a profile; `dir` is required (optional here so that its absence is
/// reported with the profile's other problems).
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[serde(expecting = "a mapping with dir (required), max_size, save_timeout, restore_timeout")]
pub(crate) struct RawKvCheckpoint {
    pub dir: Option<String>,
    #[serde(deserialize_with = "size_or_none")]
    pub max_size: Option<u64>,
    #[serde(deserialize_with = "duration_or_never")]
    pub save_timeout: Option<Duration>,
    #[serde(deserialize_with = "duration_or_never")]
    pub restore_timeout: Option<Duration>,
}

/// Reads a scalar as text and parses it; the parser's message is the error.
fn parsed<'de, D: Deserializer<'de>, T, E: Display>(
    d: D,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<T, D::Error> {
    parse(&String::deserialize(d)?).map_err(de::Error::custom)
}

/// [`parsed`], with `null` as `None`.
fn optional<'de, D: Deserializer<'de>, T, E: Display>(
    d: D,
    parse: impl FnOnce(&str) -> Result<T, E>,
) -> Result<Option<T>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|text| parse(&text).map_err(de::Error::custom))
        .transpose()
}

type Read<'de, D, T> = Result<T, <D as Deserializer<'de>>::Error>;

pub(crate) fn duration<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Duration> {
    parsed(d, duration::parse)
}

/// `null` is `None` (never).
pub(crate) fn duration_or_never<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<Duration>> {
    optional(d, duration::parse)
}

pub(crate) fn size<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, u64> {
    parsed(d, parse_size)
}

/// A rate in bytes a second: a size followed by `/s` (`1KiB/s`), or `0` for none.
pub(crate) fn rate<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, u64> {
    parsed(d, parse_rate)
}

fn parse_rate(text: &str) -> Result<u64, String> {
    match text.trim().strip_suffix("/s") {
        Some(size) => parse_size(size),
        None if text.trim() == "0" => Ok(0),
        None => Err(format!(
            "invalid rate {text:?}: expected a size a second, e.g. 1KiB/s (or 0 for none)"
        )),
    }
}

/// `true` or `false`; `yes`, `on` and the like are refused by name.
pub(crate) fn flag<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, bool> {
    parsed(d, |text| match text {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("invalid value {text:?}: expected true or false")),
    })
}

fn size_or_none<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<u64>> {
    optional(d, parse_size)
}

/// `power.method`: `auto` is `None` (power-profiles-daemon when present, else cpufreq),
/// anything else one method by its name.
pub(crate) fn power_method<'de, D: Deserializer<'de>>(
    d: D,
) -> Read<'de, D, Option<dsv4_client::words::PowerMethod>> {
    parsed(d, |text| match text {
        "auto" => Ok(None),
        _ => text.parse().map(Some).map_err(|_| {
            format!("unknown variant `{text}`, expected one of `auto`, `ppd`, `cpufreq`, `none`")
        }),
    })
}

/// `power.prefill`: `none` is `None` (the CPU stays on `power.cpu`), else a CPU profile that
/// can be set (`keep` cannot).
pub(crate) fn prefill_policy<'de, D: Deserializer<'de>>(
    d: D,
) -> Read<'de, D, Option<super::CpuPolicy>> {
    use super::CpuPolicy;
    parsed(d, |text| match text {
        "none" => Ok(None),
        "power-saver" => Ok(Some(CpuPolicy::PowerSaver)),
        "balanced" => Ok(Some(CpuPolicy::Balanced)),
        "performance" => Ok(Some(CpuPolicy::Performance)),
        _ => Err(format!(
            "unknown variant `{text}`, expected one of `none`, `power-saver`, `balanced`, \
             `performance`"
        )),
    })
}

pub(crate) fn celsius<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, f64> {
    parsed(d, parse_temperature)
}

fn engine<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<EngineKind>> {
    optional(d, str::parse)
}

fn health<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<Readiness>> {
    optional(d, dsv4_engine::parse_health)
}

fn stop_signal<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<Signal>> {
    optional(d, dsv4_engine::parse_stop_signal)
}

fn flash_attn<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<FlashAttn>> {
    optional(d, |text| match text {
        "on" | "true" => Ok(FlashAttn::On),
        "off" | "false" => Ok(FlashAttn::Off),
        "auto" => Ok(FlashAttn::Auto),
        _ => Err(format!(
            "invalid flash_attn {text:?}: expected on, off or auto"
        )),
    })
}

fn gpu_layers<'de, D: Deserializer<'de>>(d: D) -> Read<'de, D, Option<GpuLayers>> {
    optional(d, |text| match text.parse::<u32>() {
        _ if text == "all" => Ok(GpuLayers::All),
        Ok(n) if !text.starts_with('+') => Ok(GpuLayers::Count(n)),
        _ => Err(format!(
            "invalid gpu_layers {text:?}: expected \"all\" or a number of layers (0 or more)"
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(text: &str) -> Result<RawProfile, String> {
        dsv4_yaml::from_str(text)
            .map(Option::unwrap_or_default)
            .map_err(|e| e.message)
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
            assert_eq!(p.flash_attn, Some(want), "{text}");
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
            Some(GpuLayers::All)
        );
        assert_eq!(
            profile("gpu_layers: 99").unwrap().gpu_layers,
            Some(GpuLayers::Count(99))
        );
        assert_eq!(
            profile("gpu_layers: '12'").unwrap().gpu_layers,
            Some(GpuLayers::Count(12))
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
