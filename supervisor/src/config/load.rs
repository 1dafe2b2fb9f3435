//! Reading the files, converting the raw serde types, and the checks serde cannot make.

use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams};
use serde::de::DeserializeOwned;

use super::error::{self, Problem};
use super::locate::find_key;
use super::raw::{
    Celsius, Dur, Engine, Flash, Layers, RawProfile, RawSupervisor, Size, PROFILE_KEYS,
    SUPERVISOR_KEYS,
};
use super::units::format_temperature;
use super::{Config, ConfigError, Profile, Supervisor};

const MIB: u64 = 1 << 20;
const MIN_CONTEXT: u32 = 512;

/// One file being checked: problems about a key get the key's position when it can be found.
struct Doc<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Doc<'_> {
    fn problem(&self, path: &[&str], message: impl Into<String>) -> Problem {
        Problem::new(self.file, path.join("."), message).at(find_key(self.text, path))
    }
}

pub(super) fn load(path: &Path) -> Result<Config, ConfigError> {
    let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut problems = Vec::new();

    let text = read(&file, &mut problems);
    let doc = Doc {
        file: &file,
        text: text.as_deref().unwrap_or(""),
    };
    let raw = text
        .as_deref()
        .and_then(|t| parse::<RawSupervisor>(&file, t, SUPERVISOR_KEYS, &mut problems));
    let parsed = raw.is_some();
    let (supervisor, dir_known) = match raw {
        Some(raw) => supervisor_from_raw(raw.unwrap_or_default(), &base, &doc, &mut problems),
        None => fallback_supervisor(&base, text.as_deref()),
    };

    let found = load_profiles(&supervisor.profiles_dir, &doc, dir_known, &mut problems);

    let default = &supervisor.default_profile;
    if parsed
        && !default.is_empty()
        && !found.files.is_empty()
        && !found.files.contains_key(default)
    {
        let names: Vec<&str> = found.files.keys().map(String::as_str).collect();
        problems.push(doc.problem(
            &["default_profile"],
            format!(
                "no profile named {default:?} in {}; available: {}",
                supervisor.profiles_dir.display(),
                names.join(", ")
            ),
        ));
    }

    if problems.is_empty() {
        Ok(Config {
            file,
            supervisor,
            profiles: found.profiles,
        })
    } else {
        Err(ConfigError { problems })
    }
}

fn read(file: &Path, problems: &mut Vec<Problem>) -> Option<String> {
    match fs::read_to_string(file) {
        Ok(text) => Some(text),
        Err(e) => {
            problems.push(Problem::new(file, "", format!("cannot read: {e}")));
            None
        }
    }
}

/// `Some(None)` for an empty document (only comments, or `null`), `None` after a problem.
fn parse<T: DeserializeOwned>(
    file: &Path,
    text: &str,
    top_keys: &[&str],
    problems: &mut Vec<Problem>,
) -> Option<Option<T>> {
    match serde_yaml_ng::from_str::<Option<T>>(text) {
        Ok(value) => Some(value),
        Err(e) => {
            problems.push(error::from_yaml(file, &e, top_keys));
            None
        }
    }
}

fn resolve(base: &Path, path: &str) -> PathBuf {
    base.join(path)
}

/// When `supervisor.yaml` does not parse, the profiles are still checked: in the folder its
/// `profiles_dir` names if that much can be read, else in the default folder. The flag says
/// whether the folder is known for sure (if not, an unreadable or empty folder is not
/// reported, since it may not be the folder meant).
fn fallback_supervisor(base: &Path, text: Option<&str>) -> (Supervisor, bool) {
    let mut supervisor = Supervisor::defaults(base);
    let Some(text) = text else {
        return (supervisor, false);
    };
    let Ok(value) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) else {
        return (supervisor, false);
    };
    match value.get("profiles_dir") {
        None | Some(serde_yaml_ng::Value::Null) => (supervisor, true),
        Some(serde_yaml_ng::Value::String(dir)) if !dir.is_empty() => {
            supervisor.profiles_dir = resolve(base, dir);
            (supervisor, true)
        }
        Some(_) => (supervisor, false),
    }
}

/// Builds the settings over the defaults and checks them. The flag is false when
/// `profiles_dir` itself is unusable.
fn supervisor_from_raw(
    raw: RawSupervisor,
    base: &Path,
    doc: &Doc,
    problems: &mut Vec<Problem>,
) -> (Supervisor, bool) {
    let mut s = Supervisor::defaults(base);
    let mut dir_known = true;

    let positive =
        |problems: &mut Vec<Problem>, path: &[&str], value: Option<Dur>, slot: &mut Duration| {
            if let Some(Dur(d)) = value {
                if d.is_zero() {
                    problems.push(doc.problem(path, "must be greater than 0"));
                }
                *slot = d;
            }
        };

    let api = raw.api.unwrap_or_default();
    if let Some(listen) = api.listen {
        if listen.parse::<SocketAddr>().is_err() {
            problems.push(doc.problem(
                &["api", "listen"],
                format!("invalid address {listen:?}: expected IP:port, e.g. 127.0.0.1:8080 or [::1]:8080"),
            ));
        }
        s.api.listen = listen;
    }
    if let Some(keys) = api.api_keys_file {
        if keys.is_empty() {
            problems.push(doc.problem(
                &["api", "api_keys_file"],
                "must not be empty (use null for no API keys)",
            ));
        }
        s.api.api_keys_file = Some(resolve(base, &keys));
    }
    if let Some(Size(max_body)) = api.max_body {
        if max_body == 0 {
            problems.push(doc.problem(&["api", "max_body"], "must be greater than 0"));
        }
        s.api.max_body = max_body;
    }

    let engine = raw.engine.unwrap_or_default();
    positive(
        problems,
        &["engine", "start_timeout"],
        engine.start_timeout,
        &mut s.engine.start_timeout,
    );
    positive(
        problems,
        &["engine", "idle_timeout"],
        engine.idle_timeout,
        &mut s.engine.idle_timeout,
    );
    positive(
        problems,
        &["engine", "stop_timeout"],
        engine.stop_timeout,
        &mut s.engine.stop_timeout,
    );
    if let Some(max_waiting) = engine.max_waiting {
        if max_waiting < 1 {
            problems.push(doc.problem(&["engine", "max_waiting"], "must be at least 1"));
        }
        s.engine.max_waiting = max_waiting;
    }

    if let Some(dir) = raw.profiles_dir {
        if dir.is_empty() {
            problems.push(doc.problem(&["profiles_dir"], "must not be empty"));
            dir_known = false;
        }
        s.profiles_dir = resolve(base, &dir);
    }
    if let Some(name) = raw.default_profile {
        if name.is_empty() {
            problems.push(doc.problem(&["default_profile"], "must not be empty"));
        }
        s.default_profile = name;
    }
    if let Some(dir) = raw.state_dir {
        if dir.is_empty() {
            problems.push(doc.problem(&["state_dir"], "must not be empty"));
        }
        s.state_dir = resolve(base, &dir);
    }
    if let Some(exit) = raw.exit_when_idle {
        if exit.is_some_and(|Dur(d)| d.is_zero()) {
            problems.push(doc.problem(
                &["exit_when_idle"],
                "must be greater than 0 (null = never exit)",
            ));
        }
        s.exit_when_idle = exit.map(|Dur(d)| d);
    }

    let power = raw.power.unwrap_or_default();
    s.power.cpu = power.cpu.unwrap_or(s.power.cpu);
    s.power.gpu = power.gpu.unwrap_or(s.power.gpu);
    s.power.method = power.method.unwrap_or(s.power.method);

    let monitor = raw.monitor.unwrap_or_default();
    positive(
        problems,
        &["monitor", "interval"],
        monitor.interval,
        &mut s.monitor.interval,
    );
    positive(
        problems,
        &["monitor", "idle_interval"],
        monitor.idle_interval,
        &mut s.monitor.idle_interval,
    );

    let thermal = raw.thermal.unwrap_or_default();
    let celsius = |v: Option<Celsius>, default: f64| v.map_or(default, |Celsius(c)| c);
    s.thermal.warn = celsius(thermal.warn, s.thermal.warn);
    s.thermal.critical = celsius(thermal.critical, s.thermal.critical);
    s.thermal.hysteresis = celsius(thermal.hysteresis, s.thermal.hysteresis);
    s.thermal.on_critical = thermal.on_critical.unwrap_or(s.thermal.on_critical);
    if s.thermal.warn >= s.thermal.critical {
        let path: &[&str] = if thermal.warn.is_some() || thermal.critical.is_none() {
            &["thermal", "warn"]
        } else {
            &["thermal", "critical"]
        };
        problems.push(doc.problem(
            path,
            format!(
                "thermal.warn ({}) must be below thermal.critical ({})",
                format_temperature(s.thermal.warn),
                format_temperature(s.thermal.critical)
            ),
        ));
    }
    if s.thermal.hysteresis < 0.0 {
        problems.push(doc.problem(&["thermal", "hysteresis"], "must not be negative"));
    }

    if let Some(Size(reserve)) = raw.memory.unwrap_or_default().reserve {
        s.memory.reserve = reserve;
    }

    (s, dir_known)
}

#[derive(Default)]
struct Found {
    /// Every profile file by name, including those with problems.
    files: BTreeMap<String, PathBuf>,
    /// The profiles without problems.
    profiles: BTreeMap<String, Profile>,
}

fn load_profiles(dir: &Path, doc: &Doc, dir_known: bool, problems: &mut Vec<Problem>) -> Found {
    let mut found = Found::default();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            if dir_known {
                problems.push(doc.problem(
                    &["profiles_dir"],
                    format!("cannot read profiles folder {}: {e}", dir.display()),
                ));
            }
            return found;
        }
    };

    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                problems.push(Problem::new(
                    dir,
                    "",
                    format!("cannot list profiles folder: {e}"),
                ));
                continue;
            }
        };
        let path = entry.path();
        let file_name = entry.file_name();
        let lossy = file_name.to_string_lossy();
        if lossy.starts_with('.') || !(lossy.ends_with(".yaml") || lossy.ends_with(".yml")) {
            continue;
        }
        let Some(name) = file_name.to_str() else {
            problems.push(Problem::new(
                &path,
                "",
                "profile file name is not valid UTF-8",
            ));
            continue;
        };
        match fs::metadata(&path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => continue,
            Err(e) => {
                problems.push(Problem::new(&path, "", format!("cannot read: {e}")));
                continue;
            }
        }
        let stem = name
            .strip_suffix(".yaml")
            .or_else(|| name.strip_suffix(".yml"))
            .unwrap_or(name);
        files.push((stem.to_string(), path));
    }
    files.sort();

    if files.is_empty() && dir_known {
        problems.push(doc.problem(
            &["profiles_dir"],
            format!("no profiles (*.yaml or *.yml files) in {}", dir.display()),
        ));
    }

    for (name, path) in files {
        if let Some(first) = found.files.get(&name) {
            problems.push(Problem::new(
                &path,
                "",
                format!(
                    "profile {name:?} is already defined by {}; remove or rename one of them",
                    first.display()
                ),
            ));
            continue;
        }
        found.files.insert(name.clone(), path.clone());
        if let Err(message) = check_profile_name(&name) {
            problems.push(Problem::new(&path, "", message));
            continue;
        }
        let Some(text) = read(&path, problems) else {
            continue;
        };
        let Some(raw) = parse::<RawProfile>(&path, &text, PROFILE_KEYS, problems) else {
            continue;
        };
        let doc = Doc {
            file: &path,
            text: &text,
        };
        if let Some(profile) = profile_from_raw(&name, dir, raw.unwrap_or_default(), &doc, problems)
        {
            found.profiles.insert(name, profile);
        }
    }
    found
}

/// Profile names appear in the API, the CLI and the state file: keep them plain.
fn check_profile_name(name: &str) -> Result<(), String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if !name.is_empty() && !name.starts_with('-') && name.chars().all(plain) {
        Ok(())
    } else {
        Err(format!(
            "invalid profile name {name:?}: use letters, digits, '.', '_' and '-' (not first)"
        ))
    }
}

fn profile_from_raw(
    name: &str,
    dir: &Path,
    raw: RawProfile,
    doc: &Doc,
    problems: &mut Vec<Problem>,
) -> Option<Profile> {
    let before = problems.len();

    let engine = raw.engine.map(|Engine(kind)| kind);
    if engine.is_none() {
        problems.push(doc.problem(
            &["engine"],
            format!("required: one of {}", EngineKind::NAMES.join(", ")),
        ));
    }

    let command = match raw.command.as_deref() {
        None => {
            problems.push(doc.problem(&["command"], "required: the engine executable"));
            None
        }
        Some(command) => {
            text_check(doc, &["command"], command, problems);
            // A bare program name is looked up in PATH at spawn.
            Some(if command.contains('/') {
                resolve(dir, command)
            } else {
                PathBuf::from(command)
            })
        }
    };

    if engine == Some(EngineKind::LlamaServer) && raw.model.is_none() {
        problems.push(doc.problem(&["model"], "required for engine llama-server"));
    }
    let mut path_field = |key: &str, value: Option<String>| {
        value.map(|v| {
            text_check(doc, &[key], &v, problems);
            resolve(dir, &v)
        })
    };
    let model = path_field("model", raw.model);
    let mmproj = path_field("mmproj", raw.mmproj);
    let kv_disk_dir = path_field("kv_disk_dir", raw.kv_disk_dir);

    if let Some(kv) = &raw.kv_cache {
        text_check(doc, &["kv_cache"], kv, problems);
    }
    if let Some(context) = raw.context {
        if context < MIN_CONTEXT {
            problems.push(doc.problem(&["context"], format!("must be at least {MIN_CONTEXT}")));
        }
    }
    for (key, value) in [
        ("parallel", raw.parallel),
        ("batch", raw.batch),
        ("ubatch", raw.ubatch),
        ("prefill_chunk", raw.prefill_chunk),
    ] {
        if value == Some(0) {
            problems.push(doc.problem(&[key], "must be at least 1"));
        }
    }
    let kv_disk_space_mb = raw.kv_disk_space.map(|Size(bytes)| bytes / MIB);
    if kv_disk_space_mb == Some(0) {
        problems.push(doc.problem(&["kv_disk_space"], "must be at least 1MiB"));
    }
    let planned_memory = raw.planned_memory.map(|Size(bytes)| bytes);
    if planned_memory == Some(0) {
        problems.push(doc.problem(&["planned_memory"], "must be greater than 0"));
    }

    let extra_args = raw.extra_args.unwrap_or_default();
    for (i, arg) in extra_args.iter().enumerate() {
        if arg.contains('\0') {
            problems
                .push(doc.problem(&["extra_args"], format!("argument {i} contains a NUL byte")));
        }
    }
    let env = raw.env.unwrap_or_default();
    for (key, value) in &env {
        if key.is_empty() || key.contains(['=', '\0']) {
            problems.push(
                doc.problem(
                    &["env"],
                    format!("invalid variable name {key:?}: must be non-empty, without '=' or NUL"),
                )
                .at(find_key(doc.text, &["env", key])),
            );
        } else if value.contains('\0') {
            problems.push(doc.problem(&["env", key], "contains a NUL byte"));
        }
    }

    if problems.len() > before {
        return None;
    }
    Some(Profile {
        name: name.to_string(),
        file: doc.file.to_path_buf(),
        description: raw.description,
        engine: engine?,
        command: command?,
        params: EngineParams {
            model,
            mmproj,
            context: raw.context,
            parallel: raw.parallel,
            batch: raw.batch,
            ubatch: raw.ubatch,
            kv_cache: raw.kv_cache,
            flash_attn: raw.flash_attn.map(|Flash(f)| f),
            gpu_layers: raw.gpu_layers.map(|Layers(l)| l),
            prefill_chunk: raw.prefill_chunk,
            kv_disk_dir,
            kv_disk_space_mb,
            extra_args,
        },
        planned_memory,
        env,
    })
}

/// Text that ends up in argv or a path must be non-empty and free of NUL bytes.
fn text_check(doc: &Doc, path: &[&str], value: &str, problems: &mut Vec<Problem>) {
    if value.is_empty() {
        problems.push(doc.problem(path, "must not be empty"));
    } else if value.contains('\0') {
        problems.push(doc.problem(path, "contains a NUL byte"));
    }
}
