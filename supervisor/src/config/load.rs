//! Reading the files, and the checks serde cannot make: ranges, cross-field rules, the files
//! the configuration names, and the engine arguments.
//!
//! Everything is checked in one pass and every problem is kept; the problems are then sorted
//! by file (`supervisor.yaml` first, then the profiles by name) and position. A check that
//! would only repeat a problem serde reported (a required key whose value was refused, a
//! cross-field rule with a refused side) is skipped.

use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams};

use super::error::Problem;
use super::files::{self, Shown};
use super::raw::{Engine, Flash, Layers, RawProfile, Size};
use super::rules;
use super::yaml::Doc;
use super::{format_duration, format_temperature, Config, ConfigError, Profile, Supervisor};

const MIB: u64 = 1 << 20;
const MIN_CONTEXT: u32 = 512;
const MAX_CONTEXT: u32 = 10_000_000;
const MAX_PARALLEL: u32 = 256;
const MAX_WAITING: usize = 100_000;
const MIN_STOP_TIMEOUT: Duration = Duration::from_secs(1);
/// Plausible limits for `thermal.warn` and `thermal.critical`, in degrees Celsius.
const TEMPERATURE_RANGE: (f64, f64) = (1.0, 150.0);

/// What every check needs to know.
struct Ctx {
    shown: Shown,
    /// Whether the files and programs the configuration names must exist.
    check_files: bool,
}

pub(super) fn load(path: &Path, check_files: bool) -> Result<Config, ConfigError> {
    let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let shown = Shown::new(&base);
    let ctx = Ctx { shown, check_files };
    let mut problems = Vec::new();
    let text = fs::read_to_string(&file)
        .map_err(|e| {
            let message = format!("cannot read {}: {e}", file.display());
            problems.push(Problem::new(&ctx.shown.path(&file), "", message));
        })
        .ok();
    // A null `exit_when_idle` means never, not the default.
    let (doc, raw) = Doc::read::<Supervisor>(
        ctx.shown.path(&file),
        text.as_deref().unwrap_or(""),
        |path| path == "exit_when_idle",
        &mut problems,
    );
    // When supervisor.yaml cannot be read, the profiles are still checked, in the default
    // folder; since that may not be the folder meant, it is not reported as missing or empty.
    let parsed = text.is_some() && raw.is_some();
    let mut supervisor = raw.unwrap_or_default();
    let dir_known = check_supervisor(&mut supervisor, &base, &doc, &ctx, &mut problems) && parsed;

    let dir = &supervisor.profiles_dir;
    let (files, profiles) = load_profiles(dir, &doc, &ctx, dir_known, &mut problems);
    let default = &supervisor.default_profile;
    let checked = parsed && !doc.dropped("default_profile") && !default.is_empty();
    if checked && !files.is_empty() && !files.contains_key(default) {
        let names: Vec<&str> = files.keys().map(String::as_str).collect();
        problems.push(doc.problem(
            "default_profile",
            format!(
                "no profile named {default:?} in {}; available: {}",
                ctx.shown.text(&supervisor.profiles_dir),
                names.join(", ")
            ),
        ));
    }

    if problems.is_empty() {
        return Ok(Config {
            file,
            supervisor,
            profiles,
        });
    }
    // By file (supervisor.yaml first, then in the order the files were checked), then by
    // position, the problems without one first. The sort is stable.
    let mut files = vec![doc.file.clone()];
    for p in &problems {
        if !files.contains(&p.file) {
            files.push(p.file.clone());
        }
    }
    problems.sort_by_key(|p| {
        let rank = files.iter().position(|f| *f == p.file);
        (rank, p.line.unwrap_or(0), p.column.unwrap_or(0))
    });
    Err(ConfigError {
        dir: base,
        problems,
    })
}

/// Checks the settings and resolves their paths against `base`. False when `profiles_dir`
/// is unusable.
fn check_supervisor(
    s: &mut Supervisor,
    base: &Path,
    doc: &Doc,
    ctx: &Ctx,
    problems: &mut Vec<Problem>,
) -> bool {
    let mut report = |path: &str, message: String| problems.push(doc.problem(path, message));
    if s.api.listen.parse::<SocketAddr>().is_err() {
        let listen = &s.api.listen;
        report(
            "api.listen",
            format!(
                "invalid address {listen:?}: expected IP:port, e.g. 127.0.0.1:8080 or [::1]:8080"
            ),
        );
    }
    if let Some(keys) = &mut s.api.api_keys_file {
        let written = keys.to_string_lossy().into_owned();
        *keys = base.join(keys.as_path());
        if written.is_empty() {
            let message = "must not be empty (use null for no API keys)";
            report("api.api_keys_file", message.to_string());
        } else if let Some(message) = text_problem(&written) {
            report("api.api_keys_file", message.to_string());
        } else if let Some(message) = ctx
            .check_files
            .then(|| files::check_secret_file(&ctx.shown, keys))
            .flatten()
        {
            report("api.api_keys_file", message);
        }
    }
    if s.api.max_body == 0 {
        report("api.max_body", "must be greater than 0".to_string());
    }
    for (path, d) in [
        ("engine.start_timeout", s.engine.start_timeout),
        ("engine.idle_timeout", s.engine.idle_timeout),
        ("monitor.interval", s.monitor.interval),
        ("monitor.idle_interval", s.monitor.idle_interval),
    ] {
        if d.is_zero() {
            report(path, "must be greater than 0".to_string());
        }
    }
    // The engine needs time to drain and exit; ds4-server also writes its KV cache.
    if s.engine.stop_timeout < MIN_STOP_TIMEOUT {
        let message = format!("must be at least {}", format_duration(MIN_STOP_TIMEOUT));
        report("engine.stop_timeout", message);
    }
    if !(1..=MAX_WAITING).contains(&s.engine.max_waiting) {
        let message = format!("must be between 1 and {MAX_WAITING}");
        report("engine.max_waiting", message);
    }
    let mut dir_known = !doc.dropped("profiles_dir");
    if let Some(message) = text_problem(&s.profiles_dir.to_string_lossy()) {
        report("profiles_dir", message.to_string());
        dir_known = false;
    }
    s.profiles_dir = base.join(&s.profiles_dir);
    if s.default_profile.is_empty() {
        report("default_profile", "must not be empty".to_string());
    }
    if let Some(message) = text_problem(&s.state_dir.to_string_lossy()) {
        report("state_dir", message.to_string());
    }
    s.state_dir = base.join(&s.state_dir);
    if s.exit_when_idle.is_some_and(|d| d.is_zero()) {
        let message = "must be greater than 0 (null = never exit)";
        report("exit_when_idle", message.to_string());
    }

    let (interval, idle) = (s.monitor.interval, s.monitor.idle_interval);
    let monitor_read = !doc.dropped("monitor.interval") && !doc.dropped("monitor.idle_interval");
    if monitor_read && interval > idle && !idle.is_zero() {
        let path = if doc.written("monitor.interval") {
            "monitor.interval"
        } else {
            "monitor.idle_interval"
        };
        report(
            path,
            format!(
                "monitor.interval ({}) must not be longer than monitor.idle_interval ({})",
                format_duration(interval),
                format_duration(idle)
            ),
        );
    }

    let t = &s.thermal;
    let (low, high) = TEMPERATURE_RANGE;
    let mut in_range = ["warn", "critical", "hysteresis"]
        .iter()
        .all(|key| !doc.dropped(&format!("thermal.{key}")));
    for (path, c) in [("thermal.warn", t.warn), ("thermal.critical", t.critical)] {
        if !(low..=high).contains(&c) {
            in_range = false;
            let (low, high) = (format_temperature(low), format_temperature(high));
            report(path, format!("must be between {low} and {high}"));
        }
    }
    // Where a rule between two keys is reported: at the first of them that is written.
    let first_written = |paths: &[&'static str]| {
        let written = paths.iter().find(|p| doc.written(p));
        *written.unwrap_or(&paths[0])
    };
    if in_range && t.warn >= t.critical {
        report(
            first_written(&["thermal.warn", "thermal.critical"]),
            format!(
                "thermal.warn ({}) must be below thermal.critical ({})",
                format_temperature(t.warn),
                format_temperature(t.critical)
            ),
        );
    }
    if t.hysteresis < 0.0 {
        report("thermal.hysteresis", "must not be negative".to_string());
    } else if in_range && t.warn < t.critical && t.hysteresis >= t.critical - t.warn {
        // Otherwise the critical alarm could only clear below the warning threshold.
        report(
            first_written(&["thermal.hysteresis", "thermal.critical", "thermal.warn"]),
            format!(
                "thermal.hysteresis ({}) must be smaller than the gap between thermal.warn and \
                 thermal.critical ({})",
                format_temperature(t.hysteresis),
                format_temperature(t.critical - t.warn)
            ),
        );
    }
    dir_known
}

/// Every profile file in `dir` by name (those with problems too), and the profiles without
/// problems.
type Profiles = (BTreeMap<String, PathBuf>, BTreeMap<String, Profile>);

fn load_profiles(
    dir: &Path,
    doc: &Doc,
    ctx: &Ctx,
    dir_known: bool,
    problems: &mut Vec<Problem>,
) -> Profiles {
    let (mut found, mut profiles) = Profiles::default();
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if dir_known => {
            let message = format!("cannot read profiles folder {}: {e}", ctx.shown.text(dir));
            problems.push(doc.problem("profiles_dir", message));
            return (found, profiles);
        }
        Err(_) => return (found, profiles),
    };

    let mut files: Vec<(String, PathBuf)> = Vec::new();
    for entry in entries {
        let path = match entry {
            Ok(entry) => entry.path(),
            Err(e) => {
                let message = format!("cannot list profiles folder: {e}");
                problems.push(Problem::new(&ctx.shown.path(dir), "", message));
                continue;
            }
        };
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let stem = name.strip_suffix(".yaml").or(name.strip_suffix(".yml"));
        let Some(stem) = stem.filter(|_| !name.starts_with('.')).map(str::to_string) else {
            continue;
        };
        let problem = match fs::metadata(&path) {
            _ if path.file_name().and_then(|n| n.to_str()).is_none() => {
                "profile file name is not valid UTF-8".to_string()
            }
            Ok(meta) if meta.is_file() => {
                files.push((stem, path));
                continue;
            }
            Ok(_) => continue,
            Err(e) => format!("cannot read: {e}"),
        };
        problems.push(Problem::new(&ctx.shown.path(&path), "", problem));
    }
    files.sort();

    if files.is_empty() && dir_known {
        problems.push(doc.problem(
            "profiles_dir",
            format!(
                "no profiles (*.yaml or *.yml files) in {}",
                ctx.shown.text(dir)
            ),
        ));
    }

    for (name, path) in files {
        let shown = ctx.shown.path(&path);
        if let Some(first) = found.get(&name) {
            let message = format!(
                "profile {name:?} is already defined by {}; remove or rename one of them",
                ctx.shown.text(first)
            );
            problems.push(Problem::new(&shown, "", message));
            continue;
        }
        found.insert(name.clone(), path.clone());
        // Profile names appear in the API, the CLI and the state file: keep them plain.
        let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        if name.is_empty() || name.starts_with('-') || !name.chars().all(plain) {
            let message = format!(
                "invalid profile name {name:?}: use letters, digits, '.', '_' and '-' (not first)"
            );
            problems.push(Problem::new(&shown, "", message));
            continue;
        }
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) => {
                problems.push(Problem::new(&shown, "", format!("cannot read: {e}")));
                continue;
            }
        };
        let before = problems.len();
        let (doc, raw) = Doc::read::<RawProfile>(shown, &text, |_| true, problems);
        let Some(raw) = raw else {
            continue;
        };
        let profile = profile_from_raw(&name, &path, dir, raw, &doc, ctx, problems);
        if problems.len() == before {
            profiles.insert(name, profile);
        }
    }
    (found, profiles)
}

/// The profile, and the problems with it (when there are any, the profile is not used).
fn profile_from_raw(
    name: &str,
    file: &Path,
    dir: &Path,
    raw: RawProfile,
    doc: &Doc,
    ctx: &Ctx,
    problems: &mut Vec<Problem>,
) -> Profile {
    let mut report = |path: &str, message: String| problems.push(doc.problem(path, message));
    let engine = raw.engine.map(|Engine(kind)| kind);
    if engine.is_none() && !doc.dropped("engine") {
        report(
            "engine",
            format!("required: one of {}", EngineKind::NAMES.join(", ")),
        );
    }

    let command = raw.command.as_deref().unwrap_or_default();
    // A bare program name is looked up in PATH at spawn, with the profile's env.PATH when it
    // sets one.
    let resolved = if command.contains('/') {
        dir.join(command)
    } else {
        PathBuf::from(command)
    };
    if raw.command.is_none() {
        if !doc.dropped("command") {
            report("command", "required: the engine executable".to_string());
        }
    } else if let Some(message) = text_problem(command).map(str::to_string).or_else(|| {
        let env_path = raw.env.as_ref().and_then(|env| env.get("PATH"));
        let env_path = env_path.map(String::as_str);
        ctx.check_files
            .then(|| files::check_command(&ctx.shown, command, &resolved, dir, env_path))
            .flatten()
    }) {
        report("command", message);
    }

    if engine == Some(EngineKind::LlamaServer) && raw.model.is_none() && !doc.dropped("model") {
        report("model", "required for engine llama-server".to_string());
    }
    // A path the engine reads, resolved against the profiles folder; `check` says what must
    // hold on disk, when the engine uses the key (ds4 ignores mmproj, llama-server
    // kv_disk_dir, so their files need not exist).
    type Check = fn(&Shown, &Path) -> Option<String>;
    let mut path_field = |key: &str, value: Option<String>, check: Option<Check>| {
        let value = value?;
        let path = dir.join(&value);
        let message = text_problem(&value).map(str::to_string).or_else(|| {
            let check = check.filter(|_| ctx.check_files)?;
            check(&ctx.shown, &path)
        });
        if let Some(message) = message {
            report(key, message);
        }
        Some(path)
    };
    let model: Check = |s, p| {
        let example = "edit it to point at your model";
        files::check_file(s, p, Some(example)).or_else(|| files::check_shards(s, p))
    };
    let model = path_field("model", raw.model, Some(model));
    let mmproj: Check = |s, p| {
        let example = "edit it to point at your vision projector, or remove mmproj";
        files::check_file(s, p, Some(example))
    };
    let mmproj = (engine != Some(EngineKind::Ds4)).then_some(mmproj);
    let mmproj = path_field("mmproj", raw.mmproj, mmproj);
    let folder: Check = files::check_creatable_dir;
    let folder = (engine != Some(EngineKind::LlamaServer)).then_some(folder);
    let kv_disk_dir = path_field("kv_disk_dir", raw.kv_disk_dir, folder);

    if let Some(kv) = &raw.kv_cache {
        let message = text_problem(kv).map(str::to_string);
        if let Some(message) = message.or_else(|| rules::check_kv_cache(kv)) {
            report("kv_cache", message);
        }
    }
    match raw.context {
        Some(c) if c < MIN_CONTEXT => report("context", format!("must be at least {MIN_CONTEXT}")),
        Some(c) if c > MAX_CONTEXT => report("context", format!("must be at most {MAX_CONTEXT}")),
        _ => {}
    }
    if raw
        .parallel
        .is_some_and(|p| !(1..=MAX_PARALLEL).contains(&p))
    {
        report("parallel", format!("must be between 1 and {MAX_PARALLEL}"));
    }
    for (key, value) in [
        ("batch", raw.batch),
        ("ubatch", raw.ubatch),
        ("prefill_chunk", raw.prefill_chunk),
    ] {
        if value == Some(0) {
            report(key, "must be at least 1".to_string());
        }
    }
    if let (Some(batch), Some(ubatch)) = (raw.batch, raw.ubatch) {
        if batch > 0 && ubatch > batch {
            let message = format!("ubatch ({ubatch}) must not be larger than batch ({batch})");
            report("ubatch", message);
        }
    }
    let kv_disk_space_mb = raw.kv_disk_space.map(|Size(bytes)| bytes / MIB);
    if kv_disk_space_mb == Some(0) {
        report("kv_disk_space", "must be at least 1MiB".to_string());
    }
    let planned_memory = raw.planned_memory.map(|Size(bytes)| bytes);
    if planned_memory == Some(0) {
        report("planned_memory", "must be greater than 0".to_string());
    }

    let extra_args = raw.extra_args.unwrap_or_default();
    for (i, arg) in extra_args.iter().enumerate() {
        if let Some(message) = rules::check_extra_arg(arg) {
            problems.push(doc.at("extra_args", &format!("extra_args[{i}]"), false, message));
        }
    }
    let env = raw.env.unwrap_or_default();
    for (key, value) in &env {
        let path = format!("env.{key}");
        if let Some(message) = rules::check_env_name(key) {
            problems.push(doc.at("env", &path, true, message));
        } else if value.contains('\0') {
            problems.push(doc.problem(&path, "contains a NUL byte"));
        }
    }

    Profile {
        name: name.to_string(),
        file: file.to_path_buf(),
        description: raw.description,
        engine: engine.unwrap_or(EngineKind::LlamaServer),
        command: resolved,
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
    }
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
