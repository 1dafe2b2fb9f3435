//! llama.cpp's `rpc-server`: a worker box's devices, lent to a `llama-server` on another box
//! (a coordinator's profile with `workers:`), which places layers on them over the RPC
//! protocol.
//!
//! It holds no model (the coordinator sends the tensors; with `-c` in `extra_args` it keeps
//! them in a file cache under `LLAMA_CACHE`, so that a next start need not send them again)
//! and serves no HTTP: it only takes the coordinator's RPC connection, relayed by the dsv4d
//! of both boxes (`peers:`). It binds its port at once, so it is ready when the port takes a
//! connection. It takes no key, and anyone who reaches its port may run anything on its
//! devices: it listens on loopback only, where dsv4d's relay reaches it. It has no signal
//! handler: SIGTERM ends it at once.

use std::ffi::OsString;

use nix::sys::signal::Signal;

use super::{BackendReport, Identify, Kind, KvKeeping, PrefillReport, ValidationApi};
use crate::settings::{EngineParams, KeyPassing, Readiness, Stop};

pub const KIND: Kind = Kind {
    name: "rpc-server",
    aliases: &[],
    program: "rpc-server",
    readiness: |_| Readiness::Connect,
    stop: |_| Stop {
        signal: Signal::SIGTERM,
        interrupt_grace: None,
        grace: None,
    },
    key: |_| KeyPassing::None,
    key_protection: |_| {
        "none (rpc-server takes no key: it listens on loopback, where any local user may reach \
         it while it runs; other boxes reach it only through dsv4d's peers port, with a key)"
    },
    requires_model: false,
    requires: &[],
    reads: &[],
    ignores: &[],
    kv: KvKeeping::None,
    validation: ValidationApi::Lends,
    prefill: PrefillReport::None,
    settings_argv,
    address_flags: true,
    load_method: |extra_args| match extra_args.iter().any(|a| a == "-c" || a == "--cache") {
        true => "no model of its own: the coordinator's tensors, kept in its file cache (-c)"
            .to_string(),
        false => "no model of its own: the coordinator sends its tensors at each start".to_string(),
    },
    identify: Identify {
        version: None,
        backend: BackendReport::Unknown,
    },
};

/// No setting of a profile goes on its command line: `--host` and `--port` are dsv4d's, and
/// its own flags (`-t`, `-d`, `-c`) are the profile's `extra_args`.
fn settings_argv(_p: &EngineParams, _host: &str, _port: u16) -> Vec<OsString> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineKind;

    /// Its argv is dsv4d's address, then the profile's own flags; nothing else.
    #[test]
    fn it_listens_where_dsv4d_says_with_the_profiles_flags() {
        let p = EngineParams {
            extra_args: vec!["-c".into(), "-t".into(), "4".into()],
            ..EngineParams::default()
        };
        let kind: EngineKind = "rpc-server".parse().unwrap();
        let launch = kind.launch(&p, "127.0.0.1", 50052, None);
        let argv: Vec<_> = launch.args.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            argv,
            ["-c", "-t", "4", "--host", "127.0.0.1", "--port", "50052"]
        );
        assert!(launch.env.is_empty());
        assert_eq!(kind.readiness(&p), Readiness::Connect);
        assert!((kind.describe().load_method)(&p.extra_args).contains("file cache"));
    }
}
