//! The engine kinds and the settings they are started with. What each kind is (argv,
//! readiness, stop, key, KV, validation) is its description's, in [`crate::kinds`].

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::kinds::{self, Kind};

/// Which engine a profile runs. The default is the kind a profile without a valid `engine:`
/// is taken for while its problems are reported (such a profile is never used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineKind {
    #[default]
    LlamaServer,
    Ds4,
}

impl EngineKind {
    /// Every kind, in the order messages list them.
    pub const ALL: [EngineKind; 2] = [EngineKind::LlamaServer, EngineKind::Ds4];

    /// What dsv4 knows about this kind: the one place that tells the kinds apart.
    pub fn describe(self) -> &'static Kind {
        match self {
            EngineKind::LlamaServer => &kinds::llama_server::KIND,
            EngineKind::Ds4 => &kinds::ds4::KIND,
        }
    }

    /// The `engine:` values, as messages list them.
    pub fn names() -> Vec<&'static str> {
        EngineKind::ALL.iter().map(|k| k.name()).collect()
    }

    pub fn name(self) -> &'static str {
        self.describe().name
    }

    /// How the supervisor learns that a freshly spawned engine can serve.
    pub fn readiness(self) -> Readiness {
        self.describe().readiness
    }

    /// SIGTERM -> SIGINT grace when stopping (see [`Kind::interrupt_grace`]).
    pub fn interrupt_grace(self) -> Option<std::time::Duration> {
        self.describe().interrupt_grace
    }

    /// The flag that makes the engine require a key, read from the file it names, on every
    /// request but its health check; `None` when the engine has no such option.
    pub fn key_file_flag(self) -> Option<&'static str> {
        self.describe().key_file_flag
    }

    /// What keeps other local users off the engine's port, in words for the status.
    pub fn key_protection(self) -> &'static str {
        self.describe().key_protection
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
        let mut a = (self.describe().settings_argv)(p);
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
        let named = |k: &EngineKind| {
            let d = k.describe();
            d.name == s || d.aliases.contains(&s)
        };
        EngineKind::ALL.into_iter().find(named).ok_or_else(|| {
            format!(
                "unknown engine `{s}`, expected one of: {}",
                EngineKind::names().join(", ")
            )
        })
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
