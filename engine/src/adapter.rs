//! The engine kinds: which one a profile runs, and what is asked of it through its
//! description. What each kind is (argv, readiness, stop, key, KV, validation) is its
//! description's, in [`crate::kinds`]; the settings it is started with are
//! [`crate::settings`]'s.

use std::ffi::OsString;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::kinds::{self, Kind};
pub use crate::settings::{
    EngineParams, FlashAttn, GivenKey, GpuLayers, KeyPassing, Launch, Readiness, Stop,
};

/// Which engine a profile runs. The default is the kind a profile without a valid `engine:`
/// is taken for while its problems are reported (such a profile is never used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineKind {
    #[default]
    LlamaServer,
    Ds4,
    OpenAi,
    RpcServer,
}

impl EngineKind {
    /// Every kind, in the order messages list them.
    pub const ALL: [EngineKind; 4] = [
        EngineKind::LlamaServer,
        EngineKind::Ds4,
        EngineKind::OpenAi,
        EngineKind::RpcServer,
    ];

    /// What dsv4 knows about this kind: the one place that tells the kinds apart.
    pub fn describe(self) -> &'static Kind {
        match self {
            EngineKind::LlamaServer => &kinds::llama_server::KIND,
            EngineKind::Ds4 => &kinds::ds4::KIND,
            EngineKind::OpenAi => &kinds::openai::KIND,
            EngineKind::RpcServer => &kinds::rpc_server::KIND,
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
