//! The engine kinds and the settings they are started with. What each kind is (argv,
//! readiness, stop, key, KV, validation) is its description's, in [`crate::kinds`].

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use nix::sys::signal::Signal;

use crate::kinds::{self, Kind};

/// Which engine a profile runs. The default is the kind a profile without a valid `engine:`
/// is taken for while its problems are reported (such a profile is never used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineKind {
    #[default]
    LlamaServer,
    Ds4,
    OpenAi,
}

impl EngineKind {
    /// Every kind, in the order messages list them.
    pub const ALL: [EngineKind; 3] = [EngineKind::LlamaServer, EngineKind::Ds4, EngineKind::OpenAi];

    /// What dsv4 knows about this kind: the one place that tells the kinds apart.
    pub fn describe(self) -> &'static Kind {
        match self {
            EngineKind::LlamaServer => &kinds::llama_server::KIND,
            EngineKind::Ds4 => &kinds::ds4::KIND,
            EngineKind::OpenAi => &kinds::openai::KIND,
        }
    }

    /// The `engine:` values, as messages list them.
    pub fn names() -> Vec<&'static str> {
        EngineKind::ALL.iter().map(|k| k.name()).collect()
    }

    pub fn name(self) -> &'static str {
        self.describe().name
    }

    /// How the supervisor learns that a freshly spawned engine of profile settings `p` can
    /// serve.
    pub fn readiness(self, p: &EngineParams) -> Readiness {
        (self.describe().readiness)(p)
    }

    /// How an engine of profile settings `p` is stopped.
    pub fn stop(self, p: &EngineParams) -> Stop {
        (self.describe().stop)(p)
    }

    /// How an engine of profile settings `p` is given its key.
    pub fn key_passing(self, p: &EngineParams) -> KeyPassing {
        (self.describe().key)(p)
    }

    /// The flag that makes the engine require a key, read from the file it names, on every
    /// request but its health check, when the kind always takes its key so; `None` otherwise.
    pub fn key_file_flag(self) -> Option<&'static str> {
        match self.key_passing(&EngineParams::default()) {
            KeyPassing::File(flag) => Some(flag),
            _ => None,
        }
    }

    /// What keeps other local users off the engine's port, in words for the status, for an
    /// engine of the default settings (see [`key_protection_of`](Self::key_protection_of)).
    pub fn key_protection(self) -> &'static str {
        self.key_protection_of(&EngineParams::default())
    }

    /// What keeps other local users off the port of an engine of profile settings `p`.
    pub fn key_protection_of(self, p: &EngineParams) -> &'static str {
        (self.describe().key_protection)(&self.key_passing(p))
    }

    /// The full argv (without argv[0]) for this engine, listening on `host:port`, and
    /// requiring the key in `key_file` when the engine takes its key from a file (see
    /// [`launch`](Self::launch), which gives the key in every way a kind takes it).
    pub fn argv(
        self,
        p: &EngineParams,
        host: &str,
        port: u16,
        key_file: Option<&Path>,
    ) -> Vec<OsString> {
        let key = key_file.map(|file| GivenKey { file, secret: "" });
        self.launch(p, host, port, key.as_ref()).args
    }

    /// What an engine of profile settings `p` is started with: its argv (without argv[0])
    /// and the environment it gets besides the profile's `env`, listening on `host:port`,
    /// and given `key` as the kind takes it ([`KeyPassing`]).
    ///
    /// Order: the profile's typed settings, then `extra_args` verbatim, then the key, then,
    /// for a kind whose address dsv4d sets ([`Kind::address_flags`]), host and port last so
    /// that nothing in `extra_args` can move the engine off the port the supervisor picked
    /// (both engines take the last occurrence of a flag).
    pub fn launch(self, p: &EngineParams, host: &str, port: u16, key: Option<&GivenKey>) -> Launch {
        let d = self.describe();
        let mut args = (d.settings_argv)(p, host, port);
        args.extend(p.extra_args.iter().map(OsString::from));
        let mut env = Vec::new();
        if let Some(key) = key {
            match self.key_passing(p) {
                KeyPassing::None => {}
                KeyPassing::File(flag) => {
                    args.push(flag.into());
                    args.push(key.file.into());
                }
                KeyPassing::Env(name) => env.push((name.into(), key.secret.into())),
                KeyPassing::Arg(flag) => {
                    args.push(flag.into());
                    args.push(key.secret.into());
                }
            }
        }
        if d.address_flags {
            args.push("--host".into());
            args.push(host.into());
            args.push("--port".into());
            args.push(port.to_string().into());
        }
        Launch { args, env }
    }
}

/// The key dsv4d made for one engine: the private file it is written to, and its value.
#[derive(Debug, Clone, Copy)]
pub struct GivenKey<'a> {
    pub file: &'a Path,
    pub secret: &'a str,
}

/// What an engine is started with (see [`EngineKind::launch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub args: Vec<OsString>,
    /// Added to its environment, after the profile's `env`.
    pub env: Vec<(OsString, OsString)>,
}

/// How an engine is given the key that it then requires on every request but its
/// readiness check.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum KeyPassing {
    /// It is given none: any local user can use its port.
    #[default]
    None,
    /// `FLAG FILE`: it reads the key from the private file named after the flag.
    File(&'static str),
    /// In the environment variable of this name (`/proc/PID/environ` is readable by its own
    /// user alone).
    Env(String),
    /// `FLAG KEY` on its command line, which every local user can read in
    /// `/proc/PID/cmdline`: only when a profile asks for it.
    Arg(String),
}

impl KeyPassing {
    /// Whether the engine is given a key at all.
    pub fn takes_key(&self) -> bool {
        !matches!(self, KeyPassing::None)
    }
}

/// How an engine is stopped: `signal` to its process group; SIGINT after `interrupt_grace`
/// when it has one; SIGKILL after `grace` (`None`: the supervisor's `engine.stop_timeout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop {
    pub signal: Signal,
    /// `signal` -> SIGINT, for an engine that may deadlock in its handler; `None`: never
    /// interrupted, it gets the whole grace.
    pub interrupt_grace: Option<Duration>,
    /// `signal` -> SIGKILL; `None`: `engine.stop_timeout`.
    pub grace: Option<Duration>,
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

/// How readiness is probed. Until it succeeds a refused connection and any other answer
/// both mean "still loading", which covers both ways engines load: llama-server binds its
/// port at once and answers `/health` with 503 while it loads; ds4-server opens its port only
/// once the model is loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// `GET path` answers 200.
    Get(Cow<'static, str>),
    /// The port accepts a connection (for an engine that opens it only once it can serve).
    Connect,
}

impl Readiness {
    /// The path asked, when readiness is an answer to a request.
    pub fn path(&self) -> Option<&str> {
        match self {
            Readiness::Get(path) => Some(path),
            Readiness::Connect => None,
        }
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
    /// The engine's whole argv, with `{port}` and `{host}` (a kind whose command line the
    /// profile gives: `args`).
    pub args: Vec<String>,
    /// How its readiness shows (`health`).
    pub health: Option<Readiness>,
    /// How it is given its key (`key_env`, `key_arg`).
    pub key: KeyPassing,
    /// `stop_signal`; `None`: the kind's.
    pub stop_signal: Option<Signal>,
    /// `stop_grace`: stop signal to SIGKILL; `None`: `engine.stop_timeout`.
    pub stop_grace: Option<Duration>,
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
