//! Reading the files, converting the raw serde types, and the checks serde cannot make:
//! ranges, cross-field rules, the files the configuration names, and the engine arguments.
//!
//! Everything is checked in one pass and every problem is kept; the problems are then sorted
//! by file (`supervisor.yaml` first, then the profiles by name) and position.

use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams};
use serde::de::DeserializeOwned;

use super::error::{self, Problem};
use super::files::{self, Role, Shown};
use super::locate::{find, find_item, find_key, Spot};
use super::raw::{
    Celsius, Dur, Engine, Flash, Layers, RawProfile, RawSupervisor, Size, PROFILE_KEYS,
    SUPERVISOR_KEYS,
};
use super::rules;
use super::units::{format_duration, format_temperature};
use super::{Config, ConfigError, Profile, Supervisor};

const MIB: u64 = 1 << 20;
pub(crate) const MIN_CONTEXT: u32 = 512;
pub(crate) const MAX_CONTEXT: u32 = 10_000_000;
pub(crate) const MAX_PARALLEL: u32 = 256;
pub(crate) const MAX_WAITING: usize = 100_000;
pub(crate) const MIN_STOP_TIMEOUT: Duration = Duration::from_secs(1);
/// Plausible limits for `thermal.warn` and `thermal.critical`, in degrees Celsius.
pub(crate) const TEMPERATURE_RANGE: (f64, f64) = (1.0, 150.0);

/// What [`load`] checks besides the text.
#[derive(Debug, Clone, Copy)]
pub(super) struct Options {
    /// Whether the files and programs the configuration names must exist.
    pub check_files: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { check_files: true }
    }
}

/// What every check needs to know.
struct Ctx {
    shown: Shown,
    check_files: bool,
}

/// One file being checked: problems about a key get the key's position when it can be found.
struct Doc<'a> {
    /// As shown in messages.
    file: PathBuf,
    text: &'a str,
}

impl<'a> Doc<'a> {
    fn new(ctx: &Ctx, file: &Path, text: &'a str) -> Doc<'a> {
        Doc {
            file: ctx.shown.path(file),
            text,
        }
    }

    /// A problem with the value at `path`: at the value when it is on the key's line, else at
    /// the key; without a position when the key is not written.
    fn problem(&self, path: &[&str], message: impl Into<String>) -> Problem {
        let position = find(self.text, path).map(Spot::value_or_key);
        self.at(path.join("."), position, message)
    }

    /// A problem about item `index` of the sequence at `path`.
    fn item_problem(&self, path: &[&str], index: usize, message: impl Into<String>) -> Problem {
        let position = find_item(self.text, path, index)
            .or_else(|| find(self.text, path).map(Spot::value_or_key));
        self.at(path.join("."), position, message)
    }

    /// A problem about the key at `path` itself (its name), reported under `field`.
    fn key_problem(&self, field: &str, path: &[&str], message: impl Into<String>) -> Problem {
        let position = find_key(self.text, path).or_else(|| find_key(self.text, &path[..1]));
        self.at(field, position, message)
    }

    fn at(
        &self,
        field: impl Into<String>,
        position: Option<(usize, usize)>,
        message: impl Into<String>,
    ) -> Problem {
        Problem::new(&self.file, field, message).at(position)
    }
}

pub(super) fn load(path: &Path, options: Options) -> Result<Config, ConfigError> {
    let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let ctx = Ctx {
        shown: Shown::new(&base),
        check_files: options.check_files,
    };
    let mut problems = Vec::new();

    let text = match fs::read_to_string(&file) {
        Ok(text) => Some(text),
        Err(e) => {
            problems.push(Problem::new(
                &ctx.shown.path(&file),
                "",
                format!("cannot read {}: {e}", file.display()),
            ));
            None
        }
    };
    let doc = Doc::new(&ctx, &file, text.as_deref().unwrap_or(""));
    let raw = text
        .as_deref()
        .and_then(|t| parse::<RawSupervisor>(&doc.file, t, SUPERVISOR_KEYS, &mut problems));
    let parsed = raw.is_some();
    let (supervisor, dir_known) = match raw {
        Some(raw) => supervisor_from_raw(raw.unwrap_or_default(), &base, &doc, &ctx, &mut problems),
        None => fallback_supervisor(&base, text.as_deref()),
    };

    let found = load_profiles(
        &supervisor.profiles_dir,
        &doc,
        &ctx,
        dir_known,
        &mut problems,
    );

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
                ctx.shown.text(&supervisor.profiles_dir),
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
        sort(&doc.file, &mut problems);
        Err(ConfigError {
            dir: base,
            problems,
        })
    }
}

/// By file (`top` first, then in the order the files were checked), then by position, the
/// problems without one first. The sort is stable.
fn sort(top: &Path, problems: &mut [Problem]) {
    let mut files: Vec<PathBuf> = vec![top.to_path_buf()];
    for p in problems.iter() {
        if !files.contains(&p.file) {
            files.push(p.file.clone());
        }
    }
    problems.sort_by_key(|p| {
        let rank = files.iter().position(|f| *f == p.file);
        (rank, p.line.unwrap_or(0), p.column.unwrap_or(0))
    });
}

fn read(ctx: &Ctx, file: &Path, problems: &mut Vec<Problem>) -> Option<String> {
    match fs::read_to_string(file) {
        Ok(text) => Some(text),
        Err(e) => {
            problems.push(Problem::new(
                &ctx.shown.path(file),
                "",
                format!("cannot read: {e}"),
            ));
            None
        }
    }
}

/// `Some(None)` for an empty document (only comments, or `null`), `None` after a problem.
/// `shown` is the file as messages show it.
fn parse<T: DeserializeOwned>(
    shown: &Path,
    text: &str,
    top_keys: &[&str],
    problems: &mut Vec<Problem>,
) -> Option<Option<T>> {
    match serde_yaml_ng::from_str::<Option<T>>(text) {
        Ok(value) => Some(value),
        Err(e) => {
            problems.push(error::from_yaml(shown, &e, top_keys));
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
    ctx: &Ctx,
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
        let path = resolve(base, &keys);
        if keys.is_empty() {
            problems.push(doc.problem(
                &["api", "api_keys_file"],
                "must not be empty (use null for no API keys)",
            ));
        } else if text_check(doc, &["api", "api_keys_file"], &keys, problems) && ctx.check_files {
            if let Some(message) = files::check_secret_file(&ctx.shown, &path) {
                problems.push(doc.problem(&["api", "api_keys_file"], message));
            }
        }
        s.api.api_keys_file = Some(path);
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
    if let Some(Dur(stop)) = engine.stop_timeout {
        // The engine needs time to drain and exit; ds4-server also writes its KV cache.
        if stop < MIN_STOP_TIMEOUT {
            problems.push(doc.problem(
                &["engine", "stop_timeout"],
                format!("must be at least {}", format_duration(MIN_STOP_TIMEOUT)),
            ));
        }
        s.engine.stop_timeout = stop;
    }
    if let Some(max_waiting) = engine.max_waiting {
        if !(1..=MAX_WAITING).contains(&max_waiting) {
            problems.push(doc.problem(
                &["engine", "max_waiting"],
                format!("must be between 1 and {MAX_WAITING}"),
            ));
        }
        s.engine.max_waiting = max_waiting;
    }

    if let Some(dir) = raw.profiles_dir {
        if dir.is_empty() {
            problems.push(doc.problem(&["profiles_dir"], "must not be empty"));
            dir_known = false;
        } else if !text_check(doc, &["profiles_dir"], &dir, problems) {
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
        text_check(doc, &["state_dir"], &dir, problems);
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
    if s.monitor.interval > s.monitor.idle_interval && !s.monitor.idle_interval.is_zero() {
        let path: &[&str] = if monitor.interval.is_some() {
            &["monitor", "interval"]
        } else {
            &["monitor", "idle_interval"]
        };
        problems.push(doc.problem(
            path,
            format!(
                "monitor.interval ({}) must not be longer than monitor.idle_interval ({})",
                format_duration(s.monitor.interval),
                format_duration(s.monitor.idle_interval)
            ),
        ));
    }

    thermal_from_raw(raw.thermal.unwrap_or_default(), &mut s, doc, problems);

    if let Some(Size(reserve)) = raw.memory.unwrap_or_default().reserve {
        s.memory.reserve = reserve;
    }

    (s, dir_known)
}

fn thermal_from_raw(
    thermal: super::raw::RawThermal,
    s: &mut Supervisor,
    doc: &Doc,
    problems: &mut Vec<Problem>,
) {
    let celsius = |v: Option<Celsius>, default: f64| v.map_or(default, |Celsius(c)| c);
    s.thermal.warn = celsius(thermal.warn, s.thermal.warn);
    s.thermal.critical = celsius(thermal.critical, s.thermal.critical);
    s.thermal.hysteresis = celsius(thermal.hysteresis, s.thermal.hysteresis);
    s.thermal.on_critical = thermal.on_critical.unwrap_or(s.thermal.on_critical);

    let (low, high) = TEMPERATURE_RANGE;
    let mut in_range = true;
    for (key, value) in [("warn", thermal.warn), ("critical", thermal.critical)] {
        if let Some(Celsius(c)) = value {
            if !(low..=high).contains(&c) {
                in_range = false;
                problems.push(doc.problem(
                    &["thermal", key],
                    format!(
                        "must be between {} and {}",
                        format_temperature(low),
                        format_temperature(high)
                    ),
                ));
            }
        }
    }
    let (warn, critical, hysteresis) = (s.thermal.warn, s.thermal.critical, s.thermal.hysteresis);
    if in_range && warn >= critical {
        let path: &[&str] = if thermal.warn.is_some() || thermal.critical.is_none() {
            &["thermal", "warn"]
        } else {
            &["thermal", "critical"]
        };
        problems.push(doc.problem(
            path,
            format!(
                "thermal.warn ({}) must be below thermal.critical ({})",
                format_temperature(warn),
                format_temperature(critical)
            ),
        ));
    }
    if hysteresis < 0.0 {
        problems.push(doc.problem(&["thermal", "hysteresis"], "must not be negative"));
    } else if in_range && warn < critical && hysteresis >= critical - warn {
        // Otherwise the critical alarm could only clear below the warning threshold.
        let path: &[&str] = if thermal.hysteresis.is_some() {
            &["thermal", "hysteresis"]
        } else if thermal.critical.is_some() {
            &["thermal", "critical"]
        } else {
            &["thermal", "warn"]
        };
        problems.push(doc.problem(
            path,
            format!(
                "thermal.hysteresis ({}) must be smaller than the gap between thermal.warn and \
                 thermal.critical ({})",
                format_temperature(hysteresis),
                format_temperature(critical - warn)
            ),
        ));
    }
}

#[derive(Default)]
struct Found {
    /// Every profile file by name, including those with problems.
    files: BTreeMap<String, PathBuf>,
    /// The profiles without problems.
    profiles: BTreeMap<String, Profile>,
}

fn load_profiles(
    dir: &Path,
    doc: &Doc,
    ctx: &Ctx,
    dir_known: bool,
    problems: &mut Vec<Problem>,
) -> Found {
    let mut found = Found::default();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            if dir_known {
                problems.push(doc.problem(
                    &["profiles_dir"],
                    format!("cannot read profiles folder {}: {e}", ctx.shown.text(dir)),
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
                    &ctx.shown.path(dir),
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
                &ctx.shown.path(&path),
                "",
                "profile file name is not valid UTF-8",
            ));
            continue;
        };
        match fs::metadata(&path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => continue,
            Err(e) => {
                problems.push(Problem::new(
                    &ctx.shown.path(&path),
                    "",
                    format!("cannot read: {e}"),
                ));
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
            format!(
                "no profiles (*.yaml or *.yml files) in {}",
                ctx.shown.text(dir)
            ),
        ));
    }

    for (name, path) in files {
        let shown = ctx.shown.path(&path);
        if let Some(first) = found.files.get(&name) {
            problems.push(Problem::new(
                &shown,
                "",
                format!(
                    "profile {name:?} is already defined by {}; remove or rename one of them",
                    ctx.shown.text(first)
                ),
            ));
            continue;
        }
        found.files.insert(name.clone(), path.clone());
        if let Err(message) = check_profile_name(&name) {
            problems.push(Problem::new(&shown, "", message));
            continue;
        }
        let Some(text) = read(ctx, &path, problems) else {
            continue;
        };
        let Some(raw) = parse::<RawProfile>(&shown, &text, PROFILE_KEYS, problems) else {
            continue;
        };
        let doc = Doc::new(ctx, &path, &text);
        let raw = raw.unwrap_or_default();
        if let Some(profile) = profile_from_raw(&name, &path, dir, raw, &doc, ctx, problems) {
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
    file: &Path,
    dir: &Path,
    raw: RawProfile,
    doc: &Doc,
    ctx: &Ctx,
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
            // A bare program name is looked up in PATH at spawn, with the profile's env.PATH
            // when it sets one.
            let resolved = if command.contains('/') {
                resolve(dir, command)
            } else {
                PathBuf::from(command)
            };
            let env_path = raw.env.as_ref().and_then(|env| env.get("PATH"));
            let message = text_problem(command).map(str::to_string).or_else(|| {
                ctx.check_files
                    .then(|| {
                        let env_path = env_path.map(String::as_str);
                        files::check_command(&ctx.shown, command, &resolved, dir, env_path)
                    })
                    .flatten()
            });
            if let Some(message) = message {
                problems.push(doc.problem(&["command"], message));
            }
            Some(resolved)
        }
    };

    if engine == Some(EngineKind::LlamaServer) && raw.model.is_none() {
        problems.push(doc.problem(&["model"], "required for engine llama-server"));
    }
    type Check<'c> = &'c dyn Fn(&Path) -> Option<String>;
    let model_check = |p: &Path| {
        files::check_file(&ctx.shown, p, Role::Model).or_else(|| files::check_shards(&ctx.shown, p))
    };
    let mmproj_check = |p: &Path| files::check_file(&ctx.shown, p, Role::Mmproj);
    let dir_check = |p: &Path| files::check_creatable_dir(&ctx.shown, p);
    // A path the engine reads, resolved against the profiles folder; `check` is what must
    // hold on disk (none when the engine ignores the key).
    let mut path_field = |key: &str, value: Option<String>, check: Option<Check>| {
        let value = value?;
        let path = resolve(dir, &value);
        let message = text_problem(&value).map(str::to_string).or_else(|| {
            check
                .filter(|_| ctx.check_files)
                .and_then(|check| check(&path))
        });
        if let Some(message) = message {
            problems.push(doc.problem(&[key], message));
        }
        Some(path)
    };
    let model = path_field("model", raw.model, Some(&model_check));
    // ds4 ignores mmproj, and llama-server kv_disk_dir, so their files need not exist.
    let mmproj = path_field(
        "mmproj",
        raw.mmproj,
        (engine != Some(EngineKind::Ds4)).then_some(&mmproj_check as Check),
    );
    let kv_disk_dir = path_field(
        "kv_disk_dir",
        raw.kv_disk_dir,
        (engine != Some(EngineKind::LlamaServer)).then_some(&dir_check as Check),
    );

    if let Some(kv) = &raw.kv_cache {
        if let Some(message) = text_problem(kv)
            .map(str::to_string)
            .or_else(|| rules::check_kv_cache(kv))
        {
            problems.push(doc.problem(&["kv_cache"], message));
        }
    }
    if let Some(context) = raw.context {
        if context < MIN_CONTEXT {
            problems.push(doc.problem(&["context"], format!("must be at least {MIN_CONTEXT}")));
        } else if context > MAX_CONTEXT {
            problems.push(doc.problem(&["context"], format!("must be at most {MAX_CONTEXT}")));
        }
    }
    if let Some(parallel) = raw.parallel {
        if !(1..=MAX_PARALLEL).contains(&parallel) {
            problems.push(doc.problem(
                &["parallel"],
                format!("must be between 1 and {MAX_PARALLEL}"),
            ));
        }
    }
    for (key, value) in [
        ("batch", raw.batch),
        ("ubatch", raw.ubatch),
        ("prefill_chunk", raw.prefill_chunk),
    ] {
        if value == Some(0) {
            problems.push(doc.problem(&[key], "must be at least 1"));
        }
    }
    if let (Some(batch), Some(ubatch)) = (raw.batch, raw.ubatch) {
        if batch > 0 && ubatch > batch {
            problems.push(doc.problem(
                &["ubatch"],
                format!("ubatch ({ubatch}) must not be larger than batch ({batch})"),
            ));
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
        if let Some(message) = rules::check_extra_arg(arg) {
            problems.push(doc.item_problem(&["extra_args"], i, message));
        }
    }
    let env = raw.env.unwrap_or_default();
    for (key, value) in &env {
        if let Some(message) = rules::check_env_name(key) {
            problems.push(doc.key_problem("env", &["env", key], message));
        } else if value.contains('\0') {
            problems.push(doc.problem(&["env", key], "contains a NUL byte"));
        }
    }

    if problems.len() > before {
        return None;
    }
    Some(Profile {
        name: name.to_string(),
        file: file.to_path_buf(),
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
fn text_problem(value: &str) -> Option<&'static str> {
    if value.is_empty() {
        Some("must not be empty")
    } else if value.contains('\0') {
        Some("contains a NUL byte")
    } else {
        None
    }
}

/// [`text_problem`] reported at `path`; true when the text is fine.
fn text_check(doc: &Doc, path: &[&str], value: &str, problems: &mut Vec<Problem>) -> bool {
    match text_problem(value) {
        Some(message) => {
            problems.push(doc.problem(path, message));
            false
        }
        None => true,
    }
}
