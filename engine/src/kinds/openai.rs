//! Any OpenAI-compatible server (vLLM, SGLang, TabbyAPI, another llama.cpp build): the
//! profile says everything dsv4 knows of it.
//!
//! Its whole command line is the profile's `args`, with `{port}` and `{host}` in place of
//! the address dsv4d picks (dsv4d appends no flag of its own). It is ready when `GET health`
//! answers 200, without a key, or, with `health: connect`, when its port takes a connection.
//! Its key goes in the environment variable `key_env` names, or after the flag `key_arg`
//! names (on the command line, which every local user can read), or nowhere. It is stopped
//! by `stop_signal` (SIGTERM when unset) and killed `stop_grace` later (`engine.stop_timeout`
//! when unset), never interrupted in between. It keeps no KV cache across stops that dsv4d
//! knows of, and has no native API: validation times the OpenAI stream.

use std::ffi::OsString;

use nix::sys::signal::Signal;

use super::{BackendReport, Identify, Kind, KvKeeping, PrefillReport, ValidationApi};
use crate::settings::{EngineParams, KeyPassing, Readiness, Setting, Stop};

pub const KIND: Kind = Kind {
    name: "openai",
    aliases: &["openai-compatible"],
    program: "the engine",
    readiness,
    stop,
    key,
    key_protection,
    requires_model: false,
    requires: &[
        (
            Setting::Args,
            "the engine's command line, with {port} (and {host}) where dsv4d's address goes",
        ),
        (
            Setting::Health,
            "a path that answers 200 without a key once the engine serves (such as /health), \
             or connect",
        ),
    ],
    reads: &[
        Setting::Args,
        Setting::Health,
        Setting::KeyEnv,
        Setting::KeyArg,
        Setting::StopSignal,
        Setting::StopGrace,
    ],
    ignores: &[],
    kv: KvKeeping::None,
    validation: ValidationApi::Streamed,
    prefill: PrefillReport::None,
    settings_argv,
    address_flags: false,
    load_method: |_| "not known: the server's own flags decide".to_string(),
    identify: Identify {
        version: None,
        backend: BackendReport::Unknown,
    },
};

/// The placeholders `args` may hold, filled in at each start.
pub const PORT: &str = "{port}";
pub const HOST: &str = "{host}";

/// The signals a profile may stop its engine with (`stop_signal`): those whose default is to
/// end a process. Others (SIGSTOP, SIGCHLD, SIGWINCH...) would leave it running until the
/// grace ends.
pub const STOP_SIGNALS: &[Signal] = &[
    Signal::SIGTERM,
    Signal::SIGINT,
    Signal::SIGQUIT,
    Signal::SIGHUP,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGKILL,
];

fn readiness(p: &EngineParams) -> Readiness {
    // A profile of this kind always has `health` (the config requires it).
    p.health.clone().unwrap_or(Readiness::Connect)
}

fn stop(p: &EngineParams) -> Stop {
    Stop {
        signal: p.stop_signal.unwrap_or(Signal::SIGTERM),
        interrupt_grace: None,
        grace: p.stop_grace,
    }
}

fn key(p: &EngineParams) -> KeyPassing {
    p.key.clone()
}

fn key_protection(key: &KeyPassing) -> &'static str {
    match key {
        KeyPassing::None => "none (the profile gives the engine no key: key_env or key_arg)",
        KeyPassing::File(_) => "per-generation secret",
        KeyPassing::Env(_) => "per-generation secret, in the engine's environment",
        KeyPassing::Arg(_) => {
            "per-generation secret, on the engine's command line (any local user can read it)"
        }
    }
}

/// `args`, each with `{port}` and `{host}` filled in.
fn settings_argv(p: &EngineParams, host: &str, port: u16) -> Vec<OsString> {
    p.args.iter().map(|a| fill(a, host, port).into()).collect()
}

/// `arg` with every `{port}` and `{host}` replaced; any other brace is kept as written (an
/// argument may be JSON).
pub fn fill(arg: &str, host: &str, port: u16) -> String {
    arg.replace(PORT, &port.to_string()).replace(HOST, host)
}

/// What is wrong with a profile's `args`, if anything: the engine must listen on the port
/// dsv4d picks, so `{port}` must be in them.
pub fn check_args(args: &[String]) -> Option<String> {
    if args.iter().any(|a| a.contains(PORT)) {
        return None;
    }
    Some(format!(
        "must contain {PORT}, where the engine is told its port (such as --port, \"{PORT}\"): \
         dsv4d picks a free port at each start"
    ))
}

/// `health`: `connect`, or a path that answers 200 (without a key) once the engine serves.
pub fn parse_health(text: &str) -> Result<Readiness, String> {
    match text {
        "connect" => Ok(Readiness::Connect),
        _ if text.starts_with('/') && !text.contains(char::is_whitespace) => {
            Ok(Readiness::Get(text.to_string().into()))
        }
        _ => Err(format!(
            "invalid health {text:?}: expected a path that answers 200 when the engine is \
             ready (starting with /, such as /health) or connect"
        )),
    }
}

/// `stop_signal`: a name from [`STOP_SIGNALS`], with or without `SIG` (`SIGTERM`, `TERM`).
pub fn parse_stop_signal(text: &str) -> Result<Signal, String> {
    let name = text.trim().to_ascii_uppercase();
    let name = match name.starts_with("SIG") {
        true => name,
        false => format!("SIG{name}"),
    };
    STOP_SIGNALS
        .iter()
        .find(|s| s.as_str() == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = STOP_SIGNALS.iter().map(|s| s.as_str()).collect();
            format!(
                "unknown stop_signal {text:?}: expected one of {}",
                names.join(", ")
            )
        })
}

/// `key_arg`: the flag the engine takes its key after, such as `--api-key`.
pub fn check_key_arg(flag: &str) -> Option<String> {
    let plain = flag.starts_with('-')
        && flag.len() > 1
        && !flag.contains(|c: char| c.is_whitespace() || c == '\0' || c == '=');
    (!plain).then(|| {
        format!(
            "invalid key_arg {flag:?}: expected the flag the engine takes its key after, \
             such as --api-key"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineKind;
    use std::time::Duration;

    fn strs(v: Vec<OsString>) -> Vec<String> {
        v.into_iter().map(|s| s.into_string().unwrap()).collect()
    }

    #[test]
    fn placeholders_are_filled_and_other_braces_kept() {
        for (arg, want) in [
            ("{port}", "8123"),
            ("{host}", "127.0.0.1"),
            ("--port={port}", "--port=8123"),
            ("http://{host}:{port}/v1", "http://127.0.0.1:8123/v1"),
            ("{port}{port}", "81238123"),
            ("{PORT}", "{PORT}"),
            ("{ port }", "{ port }"),
            ("{\"temperature\": 0}", "{\"temperature\": 0}"),
            ("{{port}}", "{8123}"),
            ("", ""),
        ] {
            assert_eq!(fill(arg, "127.0.0.1", 8123), want, "{arg}");
        }
    }

    #[test]
    fn args_must_name_the_port() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(check_args(&args(&["--port", "{port}"])), None);
        assert_eq!(check_args(&args(&["--bind={host}:{port}"])), None);
        for bad in [&[][..], &["--port", "8080"], &["{host}"], &["{PORT}"]] {
            let message = check_args(&args(bad)).expect("refused");
            assert!(message.starts_with("must contain {port}"), "{message}");
        }
    }

    #[test]
    fn health_is_a_path_or_connect() {
        assert_eq!(parse_health("connect"), Ok(Readiness::Connect));
        assert_eq!(
            parse_health("/health"),
            Ok(Readiness::Get("/health".into()))
        );
        assert_eq!(
            parse_health("/v1/models?x=1"),
            Ok(Readiness::Get("/v1/models?x=1".into()))
        );
        for bad in [
            "health",
            "",
            "Connect",
            "http://x/health",
            "/a b",
            " /health",
        ] {
            let e = parse_health(bad).unwrap_err();
            assert!(e.starts_with(&format!("invalid health {bad:?}")), "{e}");
        }
    }

    #[test]
    fn stop_signals_by_name() {
        for (text, want) in [
            ("SIGTERM", Signal::SIGTERM),
            ("TERM", Signal::SIGTERM),
            ("sigint", Signal::SIGINT),
            ("QUIT", Signal::SIGQUIT),
            ("SIGHUP", Signal::SIGHUP),
            ("USR1", Signal::SIGUSR1),
            ("SIGKILL", Signal::SIGKILL),
        ] {
            assert_eq!(parse_stop_signal(text), Ok(want), "{text}");
        }
        for bad in ["SIGSTOP", "CHLD", "15", "", "SIGTERMX", "WINCH"] {
            let e = parse_stop_signal(bad).unwrap_err();
            assert!(
                e.starts_with(&format!(
                    "unknown stop_signal {bad:?}: expected one of SIGTERM"
                )),
                "{e}"
            );
        }
    }

    #[test]
    fn key_args_are_flags() {
        for good in ["--api-key", "-k", "--key_x"] {
            assert_eq!(check_key_arg(good), None, "{good}");
        }
        for bad in ["api-key", "-", "", "--api-key=", "--a b", "--a\0"] {
            assert!(check_key_arg(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn the_command_line_is_the_profiles_and_the_key_goes_as_asked() {
        let secret = "0123abcd";
        let file = std::path::Path::new("/run/dsv4/engine-keys/engine-3.key");
        let given = crate::GivenKey { file, secret };
        let mut p = EngineParams {
            args: ["-m", "m.gguf", "--host", "{host}", "--port", "{port}"]
                .map(String::from)
                .to_vec(),
            extra_args: vec!["--metrics".into()],
            ..Default::default()
        };
        let base = "-m m.gguf --host 127.0.0.1 --port 4100 --metrics";
        for (key, args, env) in [
            (KeyPassing::None, base.to_string(), vec![]),
            (
                KeyPassing::Env("LLAMA_API_KEY".into()),
                base.to_string(),
                vec![("LLAMA_API_KEY".to_string(), secret.to_string())],
            ),
            (
                KeyPassing::Arg("--api-key".into()),
                format!("{base} --api-key {secret}"),
                vec![],
            ),
        ] {
            p.key = key.clone();
            let launch = EngineKind::OpenAi.launch(&p, "127.0.0.1", 4100, Some(&given));
            assert_eq!(strs(launch.args).join(" "), args, "{key:?}");
            let env: Vec<(OsString, OsString)> =
                env.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
            assert_eq!(launch.env, env, "{key:?}");
        }
        // No key made (none asked): nothing of it anywhere.
        p.key = KeyPassing::Env("K".into());
        let launch = EngineKind::OpenAi.launch(&p, "127.0.0.1", 4100, None);
        assert_eq!(strs(launch.args).join(" "), base);
        assert!(launch.env.is_empty());
    }

    #[test]
    fn stop_and_readiness_come_from_the_profile() {
        let k = EngineKind::OpenAi;
        let mut p = EngineParams::default();
        assert_eq!(
            k.stop(&p),
            Stop {
                signal: Signal::SIGTERM,
                interrupt_grace: None,
                grace: None
            }
        );
        p.stop_signal = Some(Signal::SIGINT);
        p.stop_grace = Some(Duration::from_secs(3));
        p.health = Some(Readiness::Get("/health".into()));
        assert_eq!(
            k.stop(&p),
            Stop {
                signal: Signal::SIGINT,
                interrupt_grace: None,
                grace: Some(Duration::from_secs(3))
            }
        );
        assert_eq!(k.readiness(&p).path(), Some("/health"));
        p.health = Some(Readiness::Connect);
        assert_eq!(k.readiness(&p), Readiness::Connect);
        assert!(k.key_protection_of(&p).starts_with("none"));
        p.key = KeyPassing::Arg("--api-key".into());
        assert!(k.key_protection_of(&p).contains("command line"));
    }
}
