//! llama.cpp's `llama-server`.
//!
//! It binds its port at once and answers `GET /health` with 503 while it loads and 200 when
//! ready. It reads its keys from the file `--api-key-file` names (a key on the command line
//! would show in `/proc/PID/cmdline`, which everyone can read) and then answers 401 to any
//! request without one, except `GET /health`. It can deadlock in its SIGTERM handler with a
//! request in flight; SIGINT still ends it. Its slots are saved and restored by dsv4d
//! through its slot API (`--slot-save-path`). Asked with `"return_progress": true`, a
//! streamed answer carries events of their own with a `prompt_progress` object while the
//! prompt is processed.

use std::ffi::OsString;
use std::time::Duration;

use super::{
    after_key, json_number, Argv, BackendReport, Identify, Kind, KvKeeping, Prefill, PrefillReport,
    ValidationApi,
};
use nix::sys::signal::Signal;

use crate::settings::{EngineParams, KeyPassing, Readiness, Setting, Stop};

pub const KIND: Kind = Kind {
    name: "llama-server",
    aliases: &[],
    program: "llama-server",
    readiness: |_| Readiness::Get("/health".into()),
    stop: |_| Stop {
        signal: Signal::SIGTERM,
        interrupt_grace: Some(Duration::from_secs(10)),
        grace: None,
    },
    key: |_| KeyPassing::File("--api-key-file"),
    key_protection: |_| "per-generation secret",
    requires_model: true,
    requires: &[],
    reads: &[
        Setting::Model,
        Setting::Mmproj,
        Setting::Context,
        Setting::Parallel,
        Setting::Batch,
        Setting::Ubatch,
        Setting::KvCache,
        Setting::FlashAttn,
        Setting::GpuLayers,
        Setting::KvCheckpoint,
        Setting::Workers,
    ],
    ignores: &[
        Setting::PrefillChunk,
        Setting::KvDiskDir,
        Setting::KvDiskSpace,
    ],
    kv: KvKeeping::Slots,
    validation: ValidationApi::Native,
    prefill: PrefillReport::Stream {
        ask: "return_progress",
        field: PROGRESS_FIELD,
        read: prompt_progress,
    },
    settings_argv,
    address_flags: true,
    load_method,
    identify: Identify {
        version: Some(&["--version"]),
        backend: BackendReport::Devices {
            args: &["--list-devices"],
            read: device_backend,
        },
    },
};

/// The backend of a line of `--list-devices`' list (`  ROCm0: AMD Radeon 8060S ...`,
/// `  Vulkan0: ...`): the device's name less its number. `None` for the heading and for
/// `(none)`, which a build for the CPU alone lists.
pub fn device_backend(line: &str) -> Option<String> {
    let (device, _) = line.trim().split_once(": ")?;
    let name = device.trim_end_matches(|c: char| c.is_ascii_digit());
    let plain = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    (plain && name.len() < device.len()).then(|| name.to_string())
}

/// llama.cpp maps the model by default. Newer builds choose with `-lm`/`--load-mode`
/// (`auto`, `none`, `mmap`, `mlock`, `mmap+mlock`); older ones with `--no-mmap`, `--mmap`
/// and `--mlock`. The last of the flags that choose wins, as in its own parsing.
fn load_method(extra_args: &[String]) -> String {
    const DEFAULT: &str = "mapped (llama.cpp's default mmap)";
    let mut chosen: Option<String> = None;
    let mut locked = false;
    let mut args = extra_args.iter();
    while let Some(arg) = args.next() {
        let mode = match arg.as_str() {
            "-lm" | "--load-mode" => args.next().cloned(),
            other => other.strip_prefix("--load-mode=").map(String::from),
        };
        if let Some(mode) = mode {
            chosen = Some(match mode.as_str() {
                "auto" => format!("{DEFAULT}, unless a device cannot map (--load-mode auto)"),
                "none" => "read whole into memory (--load-mode none)".to_string(),
                "mmap" => "mapped (--load-mode mmap)".to_string(),
                "mlock" => "read into memory and locked there (--load-mode mlock)".to_string(),
                "mmap+mlock" => "mapped and locked in memory (--load-mode mmap+mlock)".to_string(),
                other => format!("--load-mode {other}"),
            });
            continue;
        }
        match arg.as_str() {
            "--no-mmap" => chosen = Some("read whole into memory (--no-mmap)".to_string()),
            "--mmap" => chosen = Some(DEFAULT.to_string()),
            "--mlock" => locked = true,
            _ => {}
        }
    }
    let mut method = chosen.unwrap_or_else(|| DEFAULT.to_string());
    if locked {
        method.push_str(", locked in memory (--mlock)");
    }
    method
}

/// `-m -c -np -ctk/-ctv -fa -ngl -b -ub --mmproj --slot-save-path`.
fn settings_argv(p: &EngineParams, _host: &str, _port: u16) -> Vec<OsString> {
    let number = |n: Option<u32>| n.map(|n| n.to_string());
    Argv::default()
        .flag("-m", p.model.clone())
        .flag("-c", number(p.context))
        .flag("-np", number(p.parallel))
        .flag("-ctk", p.kv_cache.as_deref())
        .flag("-ctv", p.kv_cache.as_deref())
        .flag("-fa", p.flash_attn.map(|f| f.as_str()))
        .flag("-ngl", p.gpu_layers.map(|n| n.to_string()))
        .flag("-b", number(p.batch))
        .flag("-ub", number(p.ubatch))
        .flag("--mmproj", p.mmproj.clone())
        .flag("--slot-save-path", p.slot_save_path.clone())
        .flag(
            "--rpc",
            (!p.workers.is_empty()).then(|| p.workers.join(",")),
        )
        .into_vec()
}

/// The field of a streamed event that says how far the prompt has got.
const PROGRESS_FIELD: &str = "prompt_progress";

/// The prefill's progress an event's data carries (`"prompt_progress": {"total": 1523,
/// "cache": 0, "processed": 64, "time_ms": 1}`: `processed` counts the cached tokens too).
pub fn prompt_progress(data: &[u8]) -> Option<Prefill> {
    let object = after_key(data, PROGRESS_FIELD)?.strip_prefix(b"{")?;
    let object = &object[..object.iter().position(|&b| b == b'}')?];
    let total = json_number(object, "total")?;
    let cached = json_number(object, "cache").unwrap_or(0).min(total);
    let processed = json_number(object, "processed")?.min(total);
    Some(Prefill {
        done: processed.saturating_sub(cached),
        total: total - cached,
        cached,
        seconds: json_number(object, "time_ms").map(|ms| ms as f64 / 1000.0),
    })
}

#[cfg(test)]
mod progress_tests {
    use super::*;

    #[test]
    fn the_backend_is_read_from_the_device_list() {
        let rows: &[(&str, Option<&str>)] = &[
            (
                "  ROCm0: AMD Radeon 8060S Graphics (98304 MiB, 97000 MiB free)",
                Some("ROCm"),
            ),
            (
                "  Vulkan0: AMD Radeon 8060S Graphics (RADV GFX1151) (1 MiB, 1 MiB free)",
                Some("Vulkan"),
            ),
            (
                "  CUDA1: NVIDIA RTX 4090 (24564 MiB, 24000 MiB free)",
                Some("CUDA"),
            ),
            ("Available devices:", None),
            ("  (none)", None),
            (
                "load_backend: loaded RPC backend from /usr/lib/libggml-rpc.so",
                None,
            ),
        ];
        for (line, want) in rows {
            assert_eq!(device_backend(line).as_deref(), *want, "{line}");
        }
    }

    /// Events as llama-server streams them with `return_progress` (b0-0c1e57098), and the
    /// ones it streams besides.
    #[test]
    fn the_prompts_progress_is_read_from_its_events() {
        let event = |progress: &str| {
            format!(
                r#"{{"choices":[{{"finish_reason":null,"index":0,"delta":{{"role":"assistant","content":null}}}}],"created":1796415870,"object":"chat.completion.chunk"{progress}}}"#
            )
        };
        for (data, want) in [
            (
                event(r#","prompt_progress":{"total":1523,"cache":0,"processed":64,"time_ms":1}"#),
                Some((64, 1523, 0, Some(0.001))),
            ),
            (
                event(
                    r#","prompt_progress":{"total":2023,"cache":2000,"processed":2023,"time_ms":1500}"#,
                ),
                Some((23, 23, 2000, Some(1.5))),
            ),
            // Spaces, as another JSON writer puts them.
            (
                event(r#", "prompt_progress": { "total": 10, "cache": 2, "processed": 6 }"#),
                Some((4, 8, 2, None)),
            ),
            // The answer's own events carry none.
            (event(""), None),
            (
                r#"{"choices":[{"delta":{"content":"a"}}]}"#.to_string(),
                None,
            ),
            ("[DONE]".to_string(), None),
            // Broken objects give nothing rather than a wrong figure.
            (event(r#","prompt_progress":{"cache":0}"#), None),
            (event(r#","prompt_progress":"#), None),
        ] {
            let got =
                prompt_progress(data.as_bytes()).map(|p| (p.done, p.total, p.cached, p.seconds));
            assert_eq!(got, want, "{data}");
        }
    }
}

#[cfg(test)]
mod load_tests {
    use super::load_method;

    #[test]
    fn the_load_method_is_what_the_flags_say() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let table = [
            (args(&[]), "mapped (llama.cpp's default mmap)"),
            (args(&["--mmap"]), "mapped (llama.cpp's default mmap)"),
            (args(&["--no-mmap"]), "read whole into memory (--no-mmap)"),
            (args(&["--no-mmap", "--mmap"]), "llama.cpp's default mmap"),
            (
                args(&["-lm", "none"]),
                "read whole into memory (--load-mode none)",
            ),
            (
                args(&["--load-mode=mlock"]),
                "locked there (--load-mode mlock)",
            ),
            (
                args(&["--no-mmap", "--load-mode", "mmap"]),
                "mapped (--load-mode mmap)",
            ),
            (args(&["-lm", "none", "--mmap"]), "llama.cpp's default mmap"),
            (args(&["-lm", "dio"]), "--load-mode dio"),
            (
                args(&["-ub", "512", "--mlock"]),
                "locked in memory (--mlock)",
            ),
        ];
        for (extra, want) in table {
            let got = load_method(&extra);
            assert!(got.contains(want), "{extra:?}: {got}");
        }
    }
}
