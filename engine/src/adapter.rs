//! The per-engine knowledge: argv from profile parameters, and how readiness shows.
//!
//! llama-server answers `GET /health` with 503 while loading and 200 when ready.
//! ds4-server loads its model before it opens its port and has no `/health`: a connect that
//! succeeds followed by `GET /v1/models` 200 means ready.
//!
//! The engine's port is open to every local user, so an engine that can require a key gets
//! one: llama-server reads its keys from the file `--api-key-file` names (a key on the command
//! line would show in `/proc/PID/cmdline`, which everyone can read) and then answers 401 to
//! any request without one, except `GET /health`. ds4-server has no such option.

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// Which engine a profile runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    LlamaServer,
    Ds4,
}

impl EngineKind {
    pub const NAMES: [&'static str; 2] = ["llama-server", "ds4"];

    pub fn name(self) -> &'static str {
        match self {
            EngineKind::LlamaServer => "llama-server",
            EngineKind::Ds4 => "ds4",
        }
    }

    /// How the supervisor learns that a freshly spawned engine can serve.
    pub fn readiness(self) -> Readiness {
        match self {
            EngineKind::LlamaServer => Readiness { path: "/health" },
            EngineKind::Ds4 => Readiness { path: "/v1/models" },
        }
    }

    /// SIGTERM -> SIGINT grace when stopping. llama-server can deadlock in its SIGTERM handler
    /// with a request in flight (SIGINT still ends it); ds4-server writes its KV checkpoint
    /// after SIGTERM and must get the whole stop timeout, so it is never interrupted.
    pub fn interrupt_grace(self) -> Option<std::time::Duration> {
        match self {
            EngineKind::LlamaServer => Some(std::time::Duration::from_secs(10)),
            EngineKind::Ds4 => None,
        }
    }

    /// The flag that makes the engine require a key, read from the file it names, on every
    /// request but its health check; `None` when the engine has no such option.
    pub fn key_file_flag(self) -> Option<&'static str> {
        match self {
            EngineKind::LlamaServer => Some("--api-key-file"),
            // Its options (`ds4-server --help`: host, port, CORS, queue, trace, ...) include
            // no key or authentication of any kind.
            EngineKind::Ds4 => None,
        }
    }

    /// What keeps other local users off the engine's port, in words for the status.
    pub fn key_protection(self) -> &'static str {
        match self.key_file_flag() {
            Some(_) => "per-generation secret",
            None => "none (ds4-server has no key option)",
        }
    }

    /// The full argv (without argv[0]) for this engine, listening on `host:port`, and
    /// requiring the key in `key_file` when the engine can (see [`key_file_flag`]).
    ///
    /// Order: the profile's typed settings, then `extra_args` verbatim, then the key file,
    /// host and port last so that nothing in `extra_args` can move the engine off the port
    /// the supervisor picked (both engines take the last occurrence of a flag).
    ///
    /// [`key_file_flag`]: Self::key_file_flag
    pub fn argv(
        self,
        p: &EngineParams,
        host: &str,
        port: u16,
        key_file: Option<&Path>,
    ) -> Vec<OsString> {
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: &str| a.push(OsString::from(s));
        match self {
            EngineKind::LlamaServer => {
                if let Some(m) = &p.model {
                    push("-m");
                    a.push(m.clone().into_os_string());
                }
                let mut push = |s: &str| a.push(OsString::from(s));
                if let Some(c) = p.context {
                    push("-c");
                    push(&c.to_string());
                }
                if let Some(n) = p.parallel {
                    push("-np");
                    push(&n.to_string());
                }
                if let Some(kv) = &p.kv_cache {
                    push("-ctk");
                    push(kv);
                    push("-ctv");
                    push(kv);
                }
                if let Some(fa) = p.flash_attn {
                    push("-fa");
                    push(fa.as_str());
                }
                if let Some(ngl) = p.gpu_layers {
                    push("-ngl");
                    push(&ngl.to_string());
                }
                if let Some(b) = p.batch {
                    push("-b");
                    push(&b.to_string());
                }
                if let Some(ub) = p.ubatch {
                    push("-ub");
                    push(&ub.to_string());
                }
                if let Some(mm) = &p.mmproj {
                    a.push(OsString::from("--mmproj"));
                    a.push(mm.clone().into_os_string());
                }
                if let Some(dir) = &p.slot_save_path {
                    a.push(OsString::from("--slot-save-path"));
                    a.push(dir.clone().into_os_string());
                }
            }
            EngineKind::Ds4 => {
                if let Some(m) = &p.model {
                    push("-m");
                    a.push(m.clone().into_os_string());
                }
                let mut push = |s: &str| a.push(OsString::from(s));
                if let Some(c) = p.context {
                    push("--ctx");
                    push(&c.to_string());
                }
                if let Some(ch) = p.prefill_chunk {
                    push("--prefill-chunk");
                    push(&ch.to_string());
                }
                if let Some(dir) = &p.kv_disk_dir {
                    a.push(OsString::from("--kv-disk-dir"));
                    a.push(dir.clone().into_os_string());
                }
                if let Some(mb) = p.kv_disk_space_mb {
                    a.push(OsString::from("--kv-disk-space-mb"));
                    a.push(OsString::from(mb.to_string()));
                }
            }
        }
        a.extend(p.extra_args.iter().map(OsString::from));
        if let (Some(flag), Some(file)) = (self.key_file_flag(), key_file) {
            a.push(flag.into());
            a.push(file.into());
        }
        a.push("--host".into());
        a.push(host.into());
        a.push("--port".into());
        a.push(port.to_string().into());
        a
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for EngineKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "llama-server" => Ok(EngineKind::LlamaServer),
            "ds4" | "ds4-server" => Ok(EngineKind::Ds4),
            other => Err(format!(
                "unknown engine `{other}`, expected one of: {}",
                EngineKind::NAMES.join(", ")
            )),
        }
    }
}

/// How readiness is probed: `GET path` until it answers 200. Until then a refused
/// connection and any other answer both mean "still loading", which covers both engines:
/// llama-server binds its port at once and answers `/health` with 503 while it loads;
/// ds4-server opens its port only once the model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    pub path: &'static str,
}

impl Readiness {
    pub fn path(self) -> &'static str {
        self.path
    }
}

/// `-fa on|off|auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttn {
    On,
    Off,
    Auto,
}

impl FlashAttn {
    pub fn as_str(self) -> &'static str {
        match self {
            FlashAttn::On => "on",
            FlashAttn::Off => "off",
            FlashAttn::Auto => "auto",
        }
    }
}

/// `-ngl`: every layer, or a count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuLayers {
    All,
    Count(u32),
}

impl fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuLayers::All => f.write_str("all"),
            GpuLayers::Count(n) => write!(f, "{n}"),
        }
    }
}

/// The engine settings of a profile, already validated; `None` leaves the engine's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineParams {
    pub model: Option<PathBuf>,
    pub mmproj: Option<PathBuf>,
    pub context: Option<u32>,
    pub parallel: Option<u32>,
    pub batch: Option<u32>,
    pub ubatch: Option<u32>,
    pub kv_cache: Option<String>,
    pub flash_attn: Option<FlashAttn>,
    pub gpu_layers: Option<GpuLayers>,
    pub prefill_chunk: Option<u32>,
    pub kv_disk_dir: Option<PathBuf>,
    pub kv_disk_space_mb: Option<u64>,
    /// llama-server `--slot-save-path`: where slots are saved and restored from.
    pub slot_save_path: Option<PathBuf>,
    pub extra_args: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: Vec<OsString>) -> Vec<String> {
        v.into_iter().map(|s| s.into_string().unwrap()).collect()
    }

    #[test]
    fn llama_server_argv_in_contract_order() {
        let p = EngineParams {
            model: Some("/m/a.gguf".into()),
            mmproj: Some("/m/mm.gguf".into()),
            context: Some(327_680),
            parallel: Some(1),
            batch: Some(2048),
            ubatch: Some(512),
            kv_cache: Some("q8_0".into()),
            flash_attn: Some(FlashAttn::On),
            gpu_layers: Some(GpuLayers::All),
            slot_save_path: Some("/var/lib/dsv4/kv".into()),
            extra_args: vec!["--metrics".into(), "--no-webui".into()],
            ..Default::default()
        };
        let key = Path::new("/run/dsv4/engine-keys/engine-1.key");
        let got = strs(EngineKind::LlamaServer.argv(&p, "127.0.0.1", 40001, Some(key)));
        let want = "-m /m/a.gguf -c 327680 -np 1 -ctk q8_0 -ctv q8_0 -fa on -ngl all -b 2048 \
                    -ub 512 --mmproj /m/mm.gguf --slot-save-path /var/lib/dsv4/kv --metrics --no-webui \
                    --api-key-file /run/dsv4/engine-keys/engine-1.key --host 127.0.0.1 --port 40001";
        assert_eq!(got.join(" "), want);
    }

    #[test]
    fn unset_settings_are_left_to_the_engine() {
        let p = EngineParams {
            model: Some("m.gguf".into()),
            ..Default::default()
        };
        let got = strs(EngineKind::LlamaServer.argv(&p, "127.0.0.1", 9, None));
        assert_eq!(got.join(" "), "-m m.gguf --host 127.0.0.1 --port 9");
    }

    #[test]
    fn ds4_argv_has_ctx_and_kv_disk() {
        let p = EngineParams {
            context: Some(327_680),
            prefill_chunk: Some(4096),
            kv_disk_dir: Some("/var/cache/ds4".into()),
            kv_disk_space_mb: Some(20480),
            extra_args: vec!["--power".into(), "100".into()],
            ..Default::default()
        };
        // ds4-server takes no key: the file is left out.
        let key = Path::new("/run/dsv4/engine-keys/engine-1.key");
        let got = strs(EngineKind::Ds4.argv(&p, "127.0.0.1", 8123, Some(key)));
        assert_eq!(
            got.join(" "),
            "--ctx 327680 --prefill-chunk 4096 --kv-disk-dir /var/cache/ds4 \
             --kv-disk-space-mb 20480 --power 100 --host 127.0.0.1 --port 8123"
        );
    }

    #[test]
    fn which_engines_take_a_key() {
        assert_eq!(
            EngineKind::LlamaServer.key_file_flag(),
            Some("--api-key-file")
        );
        assert_eq!(EngineKind::Ds4.key_file_flag(), None);
        assert_eq!(
            EngineKind::LlamaServer.key_protection(),
            "per-generation secret"
        );
        assert_eq!(
            EngineKind::Ds4.key_protection(),
            "none (ds4-server has no key option)"
        );
    }

    #[test]
    fn engine_names_parse() {
        assert_eq!(
            "llama-server".parse::<EngineKind>(),
            Ok(EngineKind::LlamaServer)
        );
        assert_eq!("ds4".parse::<EngineKind>(), Ok(EngineKind::Ds4));
        let err = "vllm".parse::<EngineKind>().unwrap_err();
        assert!(err.contains("llama-server, ds4"), "{err}");
    }
}
