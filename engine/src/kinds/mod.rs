//! One description per engine kind: everything dsv4 knows about an engine lives in its
//! module here, and the rest of dsv4 asks the [`Kind`] rather than naming the engine.
//!
//! A description says how the engine is started (its argv from the profile's settings and
//! the profile keys it reads), how its readiness shows, how it is stopped, how it is given
//! its key, how its KV cache is kept across stops and how it reports that, which API its
//! validation uses, and what the status shows of it. What may differ from profile to profile
//! (readiness, stop, key, argv) the description gives as a function of the profile's settings. A new kind is a new module here, a
//! variant of [`crate::EngineKind`] with its arm in `EngineKind::describe`, and the profile
//! keys it reads in the supervisor's config.

pub mod ds4;
pub mod llama_server;
pub mod openai;
pub mod rpc_server;

use std::ffi::OsString;

use crate::settings::{EngineParams, KeyPassing, Readiness, Setting, Stop};

/// What dsv4 knows about one engine kind.
#[derive(Debug)]
pub struct Kind {
    /// The profile's `engine:` value, and how the kind is shown.
    pub name: &'static str,
    /// Other `engine:` values that mean this kind.
    pub aliases: &'static [&'static str],
    /// The engine's program, as messages name it.
    pub program: &'static str,
    /// How the supervisor learns that a freshly spawned engine can serve, from the
    /// profile's settings.
    pub readiness: fn(&EngineParams) -> Readiness,
    /// How it is stopped: its signal, its SIGINT and SIGKILL graces.
    pub stop: fn(&EngineParams) -> Stop,
    /// How it is given its key.
    pub key: fn(&EngineParams) -> KeyPassing,
    /// What keeps other local users off the engine's port when it is given its key so, in
    /// words for the status.
    pub key_protection: fn(&KeyPassing) -> &'static str,
    /// Whether a profile must name a `model`.
    pub requires_model: bool,
    /// Profile keys a profile of this kind must set (besides `engine` and `command`), and
    /// what each is, for the message when one is missing.
    pub requires: &'static [(Setting, &'static str)],
    /// The profile keys whose values the engine takes.
    pub reads: &'static [Setting],
    /// Keys other kinds read that a profile of this kind may hold all the same, ignored (their
    /// files need not exist); any other key another kind reads is refused in its profiles.
    pub ignores: &'static [Setting],
    /// How its KV cache is kept across stops.
    pub kv: KvKeeping,
    /// The API its validation measures through.
    pub validation: ValidationApi,
    /// How it tells how far a prompt's prefill has got.
    pub prefill: PrefillReport,
    /// The argv the profile's settings give for an engine that listens on `host:port` (before
    /// `extra_args` and the key, which [`crate::EngineKind::launch`] adds).
    pub settings_argv: fn(&EngineParams, &str, u16) -> Vec<OsString>,
    /// Whether dsv4d sets the address itself, `--host HOST --port PORT` last in the argv
    /// (else the settings' argv names it).
    pub address_flags: bool,
    /// How the engine reads its model, as far as the profile's `extra_args` say, in words
    /// for the validation's load test.
    pub load_method: fn(&[String]) -> String,
    /// How it tells what it is: its version and its backend.
    pub identify: Identify,
}

/// How an engine tells its version and its backend, for its identity at each start.
#[derive(Debug)]
pub struct Identify {
    /// Arguments that make the program print its version and exit; `None` when it has none.
    pub version: Option<&'static [&'static str]>,
    /// How it names the backend it runs on.
    pub backend: BackendReport,
}

/// Where an engine names its backend.
#[derive(Debug)]
pub enum BackendReport {
    /// The program, run with these arguments, lists its devices; `read` names the backend
    /// of one line of that list (`Vulkan0: ...` is Vulkan); none listed is the CPU.
    Devices {
        args: &'static [&'static str],
        read: fn(&str) -> Option<String>,
    },
    /// A line of its log names it (`read`).
    Log(fn(&str) -> Option<String>),
    /// Nowhere dsv4d can read.
    Unknown,
}

impl Kind {
    /// Whether the engine takes the setting `key`.
    pub fn reads(&self, key: Setting) -> bool {
        self.reads.contains(&key)
    }

    /// Whether dsv4d saves and restores the engine's slots itself (`kv_checkpoint`).
    pub fn slots_kept_by_dsv4d(&self) -> bool {
        matches!(self.kv, KvKeeping::Slots)
    }

    /// The engine's own checkpoints, when it keeps them itself.
    pub fn own_kv(&self) -> Option<&OwnKv> {
        match &self.kv {
            KvKeeping::OwnFiles(own) => Some(own),
            _ => None,
        }
    }
}

/// How an engine's KV cache outlives a stop.
#[derive(Debug)]
pub enum KvKeeping {
    /// dsv4d saves the slots through the engine's slot API before a planned stop and
    /// restores them after the next start (the profile's `kv_checkpoint`).
    Slots,
    /// The engine writes checkpoints of its own into `kv_disk_dir` after SIGTERM.
    OwnFiles(OwnKv),
    /// Not at all.
    None,
}

/// An engine's own checkpoints: how they are found on disk, shown and reported.
#[derive(Debug)]
pub struct OwnKv {
    /// The ending of its checkpoint files' names in `kv_disk_dir`.
    pub file_suffix: &'static str,
    /// How the status shows the folder (`<profile>: <shown>, <size> in <dir>`).
    pub shown: &'static str,
    /// Why the engine may say nothing of a save at its stop, for the log.
    pub silent_when: &'static str,
    /// What the engine said it saved at its shutdown, from its last output lines, and the
    /// line that said it; `None` when it said nothing about it.
    pub saved: fn(&[String]) -> Option<(KvSaved, String)>,
    /// What a line of its output says of loading one of its checkpoints for a request;
    /// `None` for a line that says nothing of it.
    pub loaded: fn(&str) -> Option<OwnLoad>,
    /// The tokens a checkpoint file holds, from its header.
    pub tokens_in: fn(&std::path::Path) -> Option<u64>,
}

/// An engine's word on loading one of its own checkpoints for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum OwnLoad {
    /// It took `tokens` from the checkpoint, in `seconds`.
    Loaded { tokens: u64, seconds: f64 },
    /// The checkpoint in `file` matched the request and could not be loaded: the request's
    /// prefill runs whole. `why` is the engine's reason.
    Failed { why: String, file: String },
}

/// A save an engine reported in its output.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvSaved {
    /// Whether it was saved (else it failed or was skipped).
    pub ok: bool,
    /// How long the engine said the save took.
    pub seconds: f64,
    pub tokens: u64,
    pub bytes: u64,
    /// The reason the engine gave.
    pub reason: Option<String>,
}

/// How far a prompt's prefill has got, as an engine tells it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prefill {
    /// New prompt tokens processed so far, of `total` (those its cache held are in neither).
    pub done: u64,
    pub total: u64,
    /// Prompt tokens its cache already held.
    pub cached: u64,
    /// Seconds the prefill has taken so far, when told.
    pub seconds: Option<f64>,
}

/// A line of an engine's output about a prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PrefillLine {
    /// A prefill began: `total` new tokens, after `cached` its cache held.
    Started { total: u64, cached: u64 },
    /// How far it has got.
    Progress(Prefill),
    /// It ended, after `seconds`.
    Done { seconds: f64 },
}

/// How an engine tells how far a prompt's prefill has got.
#[derive(Debug, Clone, Copy)]
pub enum PrefillReport {
    /// In a streamed answer's events, when the request asks for it: the request's field
    /// that asks (set to `true`), the events' field that carries it, and its reader (of an
    /// event's data; `None` for other events).
    Stream {
        ask: &'static str,
        field: &'static str,
        read: fn(&[u8]) -> Option<Prefill>,
    },
    /// In its output lines, whatever the request.
    Lines(fn(&str) -> Option<PrefillLine>),
    /// Not at all.
    None,
}

/// What follows `"key":` (and any spaces) in the JSON text `json`, at its first `"key"`.
pub(crate) fn after_key<'a>(json: &'a [u8], key: &str) -> Option<&'a [u8]> {
    let quoted = format!("\"{key}\"");
    let at = json
        .windows(quoted.len())
        .position(|w| w == quoted.as_bytes())?;
    let rest = json[at + quoted.len()..].trim_ascii_start();
    Some(rest.strip_prefix(b":")?.trim_ascii_start())
}

/// The unsigned number after `"key":` in the flat JSON object `object`.
pub(crate) fn json_number(object: &[u8], key: &str) -> Option<u64> {
    let rest = after_key(object, key)?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

/// An engine's command line, made from a profile's settings: each flag with its value, for
/// the settings the profile gives.
#[derive(Debug, Default)]
pub(crate) struct Argv(Vec<OsString>);

impl Argv {
    /// `flag value`, when `value` is given.
    pub(crate) fn flag(mut self, flag: &str, value: Option<impl Into<OsString>>) -> Self {
        if let Some(v) = value {
            self.0.push(flag.into());
            self.0.push(v.into());
        }
        self
    }

    pub(crate) fn into_vec(self) -> Vec<OsString> {
        self.0
    }
}

/// The API an engine's validation measures through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValidationApi {
    /// llama-server's native endpoints (token ids, `n_predict`, `ignore_eos`, timings).
    Native,
    /// The OpenAI API, timed from the stream.
    Streamed,
    /// None: the engine serves no API of its own. It lends its box's devices to a
    /// coordinator on another box (`rpc-server`), whose profile is the one validated.
    Lends,
}

#[cfg(test)]
mod tests {
    use crate::settings::Setting;
    use crate::EngineKind;

    /// Each kind is found by its names, and what it reads agrees with how it keeps its KV
    /// cache: the key that configures the keeping is one it reads.
    #[test]
    fn every_kind_is_named_and_reads_the_keys_its_kv_keeping_needs() {
        for kind in EngineKind::ALL {
            let d = kind.describe();
            for name in std::iter::once(&d.name).chain(d.aliases) {
                assert_eq!(name.parse::<EngineKind>(), Ok(kind), "{name}");
            }
            let key = match d.kv {
                super::KvKeeping::Slots => Some(Setting::KvCheckpoint),
                super::KvKeeping::OwnFiles(_) => Some(Setting::KvDiskDir),
                super::KvKeeping::None => None,
            };
            assert!(key.is_none_or(|k| d.reads(k)), "{}: {key:?}", d.name);
            assert_eq!(
                d.requires_model,
                d.requires_model && d.reads(Setting::Model)
            );
            for (key, _) in d.requires {
                assert!(
                    d.reads(*key),
                    "{}: requires {key:?}, which it does not read",
                    d.name
                );
            }
            for key in d.ignores {
                assert!(!d.reads(*key), "{}: reads and ignores {key:?}", d.name);
            }
        }
        assert_eq!(
            EngineKind::names(),
            ["llama-server", "ds4", "openai", "rpc-server"]
        );
    }
}
