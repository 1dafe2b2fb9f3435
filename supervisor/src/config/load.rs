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

use dsv4_engine::{EngineKind, EngineParams, KeyPassing, Setting};

use super::error::Problem;
use super::files::{self, Shown};
use super::matrix;
use super::names;
use super::raw::{RawProfile, RawWorker};
use super::rules;
use super::yaml::Doc;
use super::{
    format_duration, format_temperature, Config, ConfigError, KvCheckpoint, Profile, Supervisor,
    Worker,
};

const MIB: u64 = 1 << 20;
const MIN_CONTEXT: u32 = 512;
const MAX_CONTEXT: u32 = 10_000_000;
const MAX_PARALLEL: u32 = 256;
const MAX_WAITING: usize = 100_000;
const MIN_STOP_TIMEOUT: Duration = Duration::from_secs(1);
/// Plausible limits for `thermal.warn` and `thermal.critical`, in degrees Celsius.
const TEMPERATURE_RANGE: (f64, f64) = (1.0, 150.0);
const EMPTY: &str = "must not be empty";
const POSITIVE: &str = "must be greater than 0";

/// Where the problems found in one file go, and what every check needs to know.
struct Check<'a> {
    shown: &'a Shown,
    /// Whether the files and programs the configuration names must exist.
    check_files: bool,
    /// Whether the key files (`api.api_keys_file`, `api.admin_keys_file`) are checked on disk
    /// too (a reload leaves it to the keys).
    check_key_file: bool,
    doc: &'a Doc,
    problems: &'a mut Vec<Problem>,
    credentials: &'a Credentials,
}

/// Where a key file written `credential:NAME` is: systemd's credentials folder for the
/// service (`$CREDENTIALS_DIRECTORY`, set for a unit with `LoadCredential=`).
#[derive(Debug, Clone)]
pub(crate) enum Credentials {
    /// The folder.
    In(PathBuf),
    /// There is none: a key file that is a credential is a problem.
    Missing,
    /// There is none here, and the credential is checked where it is: left as written,
    /// unchecked (`dsv4d --check-config` run by hand; the service's own check has them).
    Elsewhere,
}

impl Credentials {
    /// As this process has them; `elsewhere` when their absence is not a problem.
    pub fn from_env(elsewhere: bool) -> Credentials {
        match files::credentials_dir() {
            Some(dir) => Credentials::In(dir),
            None if elsewhere => Credentials::Elsewhere,
            None => Credentials::Missing,
        }
    }
}

/// The prefix of a key file that is a systemd credential: `credential:api-keys`.
pub(crate) const CREDENTIAL: &str = "credential:";

pub(super) fn load(
    path: &Path,
    check_files: bool,
    check_key_file: bool,
) -> Result<Config, ConfigError> {
    load_with(
        path,
        check_files,
        check_key_file,
        &Credentials::from_env(false),
    )
}

pub(super) fn load_with(
    path: &Path,
    check_files: bool,
    check_key_file: bool,
    credentials: &Credentials,
) -> Result<Config, ConfigError> {
    let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    // The folder of supervisor.yaml: its relative paths and the paths in messages start there.
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let shown = Shown(dir.clone());
    let mut problems = Vec::new();
    let text = super::yaml::read_file(&file);
    if let Err(e) = &text {
        let message = match e.strip_prefix("cannot read: ") {
            Some(why) => format!("cannot read {}: {why}", file.display()),
            None => format!("{}: {e}", file.display()),
        };
        problems.push(Problem::new(&shown.path(&file), "", message));
    }
    let text = text.ok();
    let dropins = read_dropins(&file, &shown, &mut problems);
    let layers = layers(&shown, &file, text.as_deref().unwrap_or(""), &dropins);
    let (doc, raw) = Doc::read_layers::<Supervisor>(&layers, never, &mut problems);
    // When supervisor.yaml cannot be read, the profiles are still checked, in the default
    // folder; since that may not be the folder meant, it is not reported as missing or empty.
    let parsed = text.is_some() && raw.is_some();
    let mut supervisor = raw.unwrap_or_default();
    let mut check = Check {
        shown: &shown,
        check_files,
        check_key_file: check_files && check_key_file,
        doc: &doc,
        problems: &mut problems,
        credentials,
    };
    let dir_known = check.supervisor(&mut supervisor, &dir) && parsed;
    let (files, profiles) = check.profiles(&supervisor.profiles_dir, dir_known);
    let default = &supervisor.default_profile;
    let checked = parsed && !doc.dropped("default_profile") && !default.is_empty();
    if checked && !files.is_empty() && !files.contains_key(default) {
        let names: Vec<&str> = files.keys().map(String::as_str).collect();
        let (folder, names) = (shown.text(&supervisor.profiles_dir), names.join(", "));
        let message = format!("no profile named {default:?} in {folder}; available: {names}");
        check.to("default_profile", message);
    }

    if problems.is_empty() {
        return Ok(Config {
            file,
            supervisor,
            profiles,
        });
    }
    // supervisor.yaml first, then its drop-ins, then the other files in the order they were
    // checked (each file's problems are found together), each by position, the problems
    // without one first.
    problems.sort_by_key(|p| doc.rank(p));
    for file in problems.chunk_by_mut(|a, b| a.file == b.file) {
        file.sort_by_key(|p| (p.line.unwrap_or(0), p.column.unwrap_or(0)));
    }
    Err(ConfigError { dir, problems })
}

/// A null `exit_when_idle` or `notify.long_request` means never, and a null
/// `api.stream_keepalive` off, not the default.
fn never(path: &str) -> bool {
    matches!(
        path,
        "exit_when_idle" | "api.stream_keepalive" | "notify.long_request"
    )
}

/// The drop-in folder of the configuration file `file`: `supervisor.yaml.d` beside it.
pub(super) fn dropin_dir(file: &Path) -> PathBuf {
    let mut name = file.file_name().unwrap_or_default().to_os_string();
    name.push(".d");
    file.with_file_name(name)
}

/// The drop-ins of `file`, in the order they are laid over it: each `*.yaml` in its
/// drop-in folder by name (byte order, as `ls` with `LC_ALL=C`), hidden files left out. No
/// folder is no drop-ins.
pub(super) fn dropin_files(file: &Path) -> Result<Vec<PathBuf>, std::io::Error> {
    let dir = dropin_dir(file);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut names = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        let text = name.as_encoded_bytes();
        if text.ends_with(b".yaml") && !text.starts_with(b".") {
            names.push(name);
        }
    }
    names.sort();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// Reads the drop-ins of `file`; each that cannot be read, or that is not held as a key file
/// is ([`files::held`]: root's or dsv4d's user's, not writable by group or others), is a
/// problem of its own. A folder not so held gives one problem, and no drop-in is read.
fn read_dropins(file: &Path, shown: &Shown, problems: &mut Vec<Problem>) -> Vec<(PathBuf, String)> {
    let dir = dropin_dir(file);
    let me = nix::unistd::geteuid().as_raw();
    let folder = fs::metadata(&dir).ok();
    if let Some(message) = folder.and_then(|m| files::held("the drop-in folder", &dir, &m, me)) {
        problems.push(Problem::new(&shown.path(&dir), "", message));
        return Vec::new();
    }
    let files = match dropin_files(file) {
        Ok(files) => files,
        Err(e) => {
            let message = format!("cannot read the drop-in folder {}: {e}", dir.display());
            problems.push(Problem::new(&shown.path(&dir), "", message));
            return Vec::new();
        }
    };
    let mut read = Vec::new();
    for path in files {
        let held = |m: &fs::Metadata| files::held("the drop-in", &path, m, me);
        match super::yaml::read_file_held(&path, held) {
            Ok(text) => read.push((path, text)),
            Err(e) => problems.push(Problem::new(&shown.path(&path), "", e)),
        }
    }
    read
}

/// The file `file` with the text `text`, then its drop-ins, each as messages show it.
fn layers<'a>(
    shown: &Shown,
    file: &Path,
    text: &'a str,
    dropins: &'a [(PathBuf, String)],
) -> Vec<(PathBuf, &'a str)> {
    let mut layers = vec![(shown.path(file), text)];
    layers.extend(dropins.iter().map(|(f, t)| (shown.path(f), t.as_str())));
    layers
}

/// `supervisor.yaml` at `path` with its drop-ins laid over it, as YAML, each value with the
/// file and line it comes from.
pub(super) fn merged(path: &Path) -> Result<String, ConfigError> {
    let file = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let dir = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let shown = Shown(dir.clone());
    let mut problems = Vec::new();
    let text = match super::yaml::read_file(&file) {
        Ok(text) => text,
        Err(e) => {
            problems.push(Problem::new(&shown.path(&file), "", e));
            return Err(ConfigError { dir, problems });
        }
    };
    let dropins = read_dropins(&file, &shown, &mut problems);
    let layers = layers(&shown, &file, &text, &dropins);
    match Doc::merged_text(&layers, never, &mut problems) {
        Some(text) if problems.is_empty() => Ok(text),
        _ => Err(ConfigError { dir, problems }),
    }
}

impl Check<'_> {
    /// The file of the systemd credential `name`: `None` when it is checked elsewhere.
    fn credential(&self, name: &str) -> Result<Option<PathBuf>, String> {
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains('/')
            && text_problem(name).is_none();
        if !plain {
            return Err(format!(
                "{CREDENTIAL} must be followed by a credential's name, as in the unit's \
                 LoadCredential=NAME:FILE (no '/', not empty)"
            ));
        }
        match self.credentials {
            Credentials::In(dir) => Ok(Some(dir.join(name))),
            Credentials::Elsewhere => Ok(None),
            Credentials::Missing => Err(format!(
                "names the systemd credential {name:?}, but there are none \
                 ($CREDENTIALS_DIRECTORY is not set): give dsv4.service \
                 LoadCredential={name}:/etc/dsv4/{name} (a drop-in; see docs/security.md)"
            )),
        }
    }

    /// A problem about the value at `path`.
    fn to(&mut self, path: &str, message: impl Into<String>) {
        self.problems.push(self.doc.problem(path, message));
    }

    /// A problem about the value at `path`, if there is one.
    fn add(&mut self, path: &str, message: Option<String>) {
        if let Some(message) = message {
            self.to(path, message);
        }
    }

    /// A problem about the value at `path` when `bad`.
    fn when(&mut self, bad: bool, path: &str, message: impl Into<String>) {
        if bad {
            self.to(path, message);
        }
    }

    /// A problem about a rule between the values at `paths` when `bad`, at the first of them
    /// that is written.
    fn rule(&mut self, bad: bool, paths: &[&str], message: String) {
        self.when(bad, self.doc.first_written(paths), message);
    }

    /// Whether any of `paths` was set aside (so a rule about it would only repeat that).
    fn dropped(&self, paths: &[&str]) -> bool {
        paths.iter().any(|p| self.doc.dropped(p))
    }

    /// A problem about the item `i` of the list at `key`.
    fn item(&mut self, key: &str, i: usize, message: String) {
        let path = format!("{key}[{i}]");
        self.problems.push(self.doc.at(key, &path, false, message));
    }

    /// A problem about the whole file at `path`.
    fn whole(&mut self, path: &Path, message: impl Into<String>) {
        let file = self.shown.path(path);
        self.problems.push(Problem::new(&file, "", message));
    }

    /// What is wrong with `value`, text that ends up in argv or a path, or else with what it
    /// names on disk, by `check` (when files are checked).
    fn on_disk(&self, value: &str, check: impl FnOnce(&Shown) -> Option<String>) -> Option<String> {
        text_problem(value).or_else(|| self.check_files.then(|| check(self.shown)).flatten())
    }

    /// Checks the settings and resolves their paths against `base`. False when
    /// `profiles_dir` is unusable.
    fn supervisor(&mut self, s: &mut Supervisor, base: &Path) -> bool {
        let listen = &s.api.listen;
        let message = format!(
            "invalid address {listen:?}: expected IP:port, e.g. 127.0.0.1:8080 or [::1]:8080"
        );
        self.when(listen.parse::<SocketAddr>().is_err(), "api.listen", message);
        if let Some(listen) = &s.peers.listen {
            let message = format!(
                "invalid address {listen:?}: expected IP:port on the link between the boxes, \
                 e.g. 10.77.0.2:8090"
            );
            self.when(
                listen.parse::<SocketAddr>().is_err(),
                "peers.listen",
                message,
            );
        }
        self.key_files(s, base);
        // The same file for both would make every API client an admin. Checked at a reload
        // too, and by the keys themselves whenever they are read.
        let keys = ["api.api_keys_file", "api.admin_keys_file"];
        if let (Some(api), Some(admin)) = (&s.api.api_keys_file, &s.api.admin_keys_file) {
            if !self.dropped(&keys) {
                let message = files::shared_key_file(api, admin, &self.shown.text(api));
                self.add("api.admin_keys_file", message);
            }
        }
        // Each item is kept in its canonical form.
        let api = &mut s.api;
        let canonical: [(_, _, fn(&str) -> _); 2] = [
            (
                "api.cors_origins",
                &mut api.cors_origins,
                names::origin_entry,
            ),
            (
                "api.allowed_hosts",
                &mut api.allowed_hosts,
                names::host_entry,
            ),
        ];
        for (key, items, canonical) in canonical {
            for (i, item) in items.iter_mut().enumerate() {
                match canonical(item) {
                    Ok(text) => *item = text,
                    Err(message) => self.item(key, i, message),
                }
            }
        }
        self.limits(s);
        let dir_known = self.folders(s, base);
        self.thermal(&s.thermal);
        dir_known
    }

    /// `api.api_keys_file` and `api.admin_keys_file`: a `credential:` resolved, a path made
    /// absolute, the file checked (when it is to be read now).
    fn key_files(&mut self, s: &mut Supervisor, base: &Path) {
        let (api, peers) = (&mut s.api, &mut s.peers);
        for (path, file) in [
            ("api.api_keys_file", &mut api.api_keys_file),
            ("api.admin_keys_file", &mut api.admin_keys_file),
            ("peers.keys_file", &mut peers.keys_file),
        ] {
            let Some(keys) = file else { continue };
            let written = keys.to_string_lossy().into_owned();
            let credential = written.strip_prefix(CREDENTIAL);
            let message = match credential.map(|name| self.credential(name)) {
                // Left as written, unchecked.
                Some(Ok(None)) => continue,
                Some(Ok(Some(file))) => {
                    *keys = file;
                    self.check_key_file
                        .then(|| files::check_credential_file(self.shown, keys))
                        .flatten()
                }
                Some(Err(message)) => Some(message),
                None => {
                    *keys = base.join(&*keys);
                    match written.is_empty() {
                        true => Some("must not be empty (use null for no keys)".to_string()),
                        false if self.check_key_file => {
                            self.on_disk(&written, |shown| files::check_secret_file(shown, keys))
                        }
                        false => text_problem(&written),
                    }
                }
            };
            self.add(path, message);
        }
    }

    /// The settings that must be positive, or within a range, or agree with another.
    fn limits(&mut self, s: &Supervisor) {
        for (path, zero) in [
            ("api.max_body", s.api.max_body == 0),
            ("api.body_timeout", s.api.body_timeout.is_zero()),
            ("api.max_connections", s.api.max_connections == 0),
            ("api.max_event_streams", s.api.max_event_streams == 0),
            ("engine.start_timeout", s.engine.start_timeout.is_zero()),
            ("engine.idle_timeout", s.engine.idle_timeout.is_zero()),
            ("monitor.interval", s.monitor.interval.is_zero()),
            ("monitor.idle_interval", s.monitor.idle_interval.is_zero()),
        ] {
            self.when(zero, path, POSITIVE);
        }
        // A body as large as api.max_body must fit, or such a request could never be served.
        let small = s.api.max_buffered < s.api.max_body;
        let message = format!(
            "must be at least api.max_body ({})",
            dsv4_client::units::format_size(s.api.max_body)
        );
        self.when(small, "api.max_buffered", message);
        // The engine needs time to drain and exit; ds4-server also writes its KV cache.
        let short = s.engine.stop_timeout < MIN_STOP_TIMEOUT;
        let message = format!("must be at least {}", format_duration(MIN_STOP_TIMEOUT));
        self.when(short, "engine.stop_timeout", message);
        let waiting = !(1..=MAX_WAITING).contains(&s.engine.max_waiting);
        let message = format!("must be between 1 and {MAX_WAITING}");
        self.when(waiting, "engine.max_waiting", message);
        let never = s.api.stream_keepalive.is_some_and(|d| d.is_zero());
        let message = "must be greater than 0 (null = no keep-alive)";
        self.when(never, "api.stream_keepalive", message);
        // The loading words go out on the keep-alive's ticks: without them, none would.
        let keys = ["api.loading_reasoning", "api.stream_keepalive"];
        let message = "api.loading_reasoning needs api.stream_keepalive (its words go out on \
                       the keep-alive's ticks)"
            .to_string();
        let alone = s.api.loading_reasoning && s.api.stream_keepalive.is_none();
        self.rule(alone && !self.dropped(&keys), &keys, message);
        let never = s.exit_when_idle.is_some_and(|d| d.is_zero());
        let message = "must be greater than 0 (null = never exit)";
        self.when(never, "exit_when_idle", message);
        let never = s.notify.long_request.is_some_and(|d| d.is_zero());
        let message = "must be greater than 0 (null = no alert for long requests)";
        self.when(never, "notify.long_request", message);

        let monitor = ["monitor.interval", "monitor.idle_interval"];
        let (interval, idle) = (s.monitor.interval, s.monitor.idle_interval);
        let (shown, shown_idle) = (format_duration(interval), format_duration(idle));
        let message = format!(
            "monitor.interval ({shown}) must not be longer than monitor.idle_interval ({shown_idle})"
        );
        let longer = interval > idle && !idle.is_zero();
        self.rule(longer && !self.dropped(&monitor), &monitor, message);
    }

    /// `profiles_dir` and `state_dir` made absolute, `default_profile` named; whether the
    /// profiles folder is known.
    fn folders(&mut self, s: &mut Supervisor, base: &Path) -> bool {
        let dir_problem = text_problem(&s.profiles_dir.to_string_lossy());
        let dir_known = dir_problem.is_none() && !self.doc.dropped("profiles_dir");
        self.add("profiles_dir", dir_problem);
        s.profiles_dir = base.join(&s.profiles_dir);
        self.when(s.default_profile.is_empty(), "default_profile", EMPTY);
        self.add("state_dir", text_problem(&s.state_dir.to_string_lossy()));
        // Not written: the state folder systemd made for the unit (`StateDirectory=`, first of
        // `$STATE_DIRECTORY`'s), so a user unit needs no state_dir of its own.
        let from_systemd = std::env::var_os("STATE_DIRECTORY")
            .and_then(|dirs| std::env::split_paths(&dirs).next())
            .filter(|d| d.is_absolute());
        match from_systemd {
            Some(dir) if !self.doc.written("state_dir") => s.state_dir = dir,
            _ => s.state_dir = base.join(&s.state_dir),
        }
        dir_known
    }

    /// `thermal:`: the thresholds within range and in order, the hysteresis within the gap.
    fn thermal(&mut self, t: &crate::config::ThermalSettings) {
        let c = format_temperature;
        let (low, high) = TEMPERATURE_RANGE;
        let range = format!("must be between {} and {}", c(low), c(high));
        let mut in_range = true;
        for (path, value) in [("thermal.warn", t.warn), ("thermal.critical", t.critical)] {
            let bad = !(low..=high).contains(&value);
            in_range &= !bad;
            self.when(bad, path, &range);
        }
        let keys = ["thermal.warn", "thermal.critical", "thermal.hysteresis"];
        let in_range = in_range && !self.dropped(&keys);
        let (warn, critical) = (c(t.warn), c(t.critical));
        let message = format!("thermal.warn ({warn}) must be below thermal.critical ({critical})");
        self.rule(in_range && t.warn >= t.critical, &keys[..2], message);
        let gap = t.critical - t.warn;
        if t.hysteresis < 0.0 {
            self.to("thermal.hysteresis", "must not be negative");
        } else if in_range && t.warn < t.critical && t.hysteresis >= gap {
            // Otherwise the critical alarm could only clear below the warning threshold.
            let (hysteresis, gap) = (c(t.hysteresis), c(gap));
            let message = format!(
                "thermal.hysteresis ({hysteresis}) must be smaller than the gap between \
                 thermal.warn and thermal.critical ({gap})"
            );
            let keys = ["thermal.hysteresis", "thermal.critical", "thermal.warn"];
            self.rule(true, &keys, message);
        }
    }

    /// Every profile file in `dir` by name (those with problems too), and the profiles
    /// without problems.
    fn profiles(&mut self, dir: &Path, dir_known: bool) -> Profiles {
        let (mut found, mut profiles) = Profiles::default();
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) => {
                let message = format!("cannot read profiles folder {}: {e}", self.shown.text(dir));
                self.when(dir_known, "profiles_dir", message);
                return (found, profiles);
            }
        };
        let mut files = Vec::new();
        for entry in entries {
            let path = match entry {
                Ok(entry) => entry.path(),
                Err(e) => {
                    self.whole(dir, format!("cannot list profiles folder: {e}"));
                    continue;
                }
            };
            let name = path.file_name().unwrap_or_default();
            let text = name.to_string_lossy();
            let stem = text.strip_suffix(".yaml").or(text.strip_suffix(".yml"));
            let Some(stem) = stem.filter(|_| !text.starts_with('.')) else {
                continue;
            };
            match fs::metadata(&path) {
                _ if name.to_str().is_none() => {
                    self.whole(&path, "profile file name is not valid UTF-8")
                }
                Ok(meta) if meta.is_file() => files.push((stem.to_string(), path.clone())),
                Ok(_) => {}
                Err(e) => self.whole(&path, format!("cannot read: {e}")),
            }
        }
        files.sort();
        let message = format!(
            "no profiles (*.yaml or *.yml files) in {}",
            self.shown.text(dir)
        );
        self.when(files.is_empty() && dir_known, "profiles_dir", message);

        for (name, path) in files {
            let text = if let Some(first) = found.get(&name) {
                let first = self.shown.text(first);
                Err(format!(
                    "profile {name:?} is already defined by {first}; remove or rename one of them"
                ))
            } else if let Some(message) = rules::check_profile_name(&name) {
                Err(message)
            } else {
                self.profile_text(&path, dir)
            };
            found.entry(name.clone()).or_insert(path.clone());
            let text = match text {
                Ok(text) => text,
                Err(message) => {
                    self.whole(&path, message);
                    continue;
                }
            };
            let before = self.problems.len();
            let shown = self.shown.path(&path);
            let (doc, raw) = Doc::read::<RawProfile>(shown, &text, |_| true, self.problems);
            let Some(raw) = raw else { continue };
            let problems = &mut *self.problems;
            let profile = Check {
                doc: &doc,
                problems,
                ..*self
            }
            .profile(&name, &path, dir, raw);
            if self.problems.len() == before {
                profiles.insert(name, profile);
            }
        }
        (found, profiles)
    }

    /// The text of the profile file at `path` in the profiles folder `dir`. A symbolic link
    /// that leads out of the folder is refused, naming where it leads: what it names could be
    /// any file dsv4d may read (a key file, `/etc/shadow` when it runs as root), and a
    /// profile's problems go to the log, to a D-Bus alert and to `/events`.
    fn profile_text(&self, path: &Path, dir: &Path) -> Result<String, String> {
        let link = fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
        if !link {
            return super::yaml::read_file(path);
        }
        let target = fs::canonicalize(path).map_err(|e| format!("cannot read: {e}"))?;
        let folder = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        if !target.starts_with(&folder) {
            let (target, folder) = (self.shown.text(&target), self.shown.text(dir));
            return Err(format!(
                "is a symbolic link to {target}, outside the profiles folder {folder}: a \
                 profile must be a file in that folder (copy it there, or link to a file inside \
                 it)"
            ));
        }
        // The file the link led to when it was judged, not whatever it leads to a moment later.
        super::yaml::read_file(&target)
    }

    /// The profile, and the problems with it (when there are any, the profile is not used).
    fn profile(&mut self, name: &str, file: &Path, dir: &Path, raw: RawProfile) -> Profile {
        let (doc, engine) = (self.doc, raw.engine);
        let required = format!("required: one of {}", EngineKind::names().join(", "));
        let missing = engine.is_none() && !doc.dropped("engine");
        self.when(missing, "engine", required);

        let resolved = self.command(&raw, dir);
        let kind = engine.map(EngineKind::describe);
        self.kind_keys(kind, &raw);
        self.sizes(&raw);
        let key = self.engine_key(&raw);
        self.launch(&raw);
        // An engine ignores the keys it does not read: their files need not exist. Without an
        // engine, every file is checked.
        let reads = |key: Setting| kind.is_none_or(|k| k.reads(key));
        let model = self.path("model", raw.model, dir, Some(files::check_model));
        let mmproj = reads(Setting::Mmproj).then_some(files::check_mmproj as DiskCheck);
        let mmproj = self.path("mmproj", raw.mmproj, dir, mmproj);
        let kv_disk_dir =
            reads(Setting::KvDiskDir).then_some(files::check_creatable_dir as DiskCheck);
        let kv_disk_dir = self.path("kv_disk_dir", raw.kv_disk_dir, dir, kv_disk_dir);

        let kv_disk_space_mb = raw.kv_disk_space.map(|bytes| bytes / MIB);
        let (batch, ubatch, chunk) = (raw.batch, raw.ubatch, raw.prefill_chunk);
        let planned_memory = raw.planned_memory;
        let slots = kind.is_some_and(|k| k.slots_kept_by_dsv4d());
        let kv_checkpoint = raw
            .kv_checkpoint
            .and_then(|kv| self.kv_checkpoint(kv, dir, slots));

        let extra_args = raw.extra_args.unwrap_or_default();
        for (i, arg) in extra_args.iter().enumerate() {
            if let Some(message) = rules::check_extra_arg(arg) {
                self.item("extra_args", i, message);
            }
        }
        let matrix = raw.matrix.map(|m| self.matrix(m));
        let env = self.env(raw.env.unwrap_or_default());
        let workers = self.workers(raw.workers.unwrap_or_default(), dir);
        Profile {
            name: name.to_string(),
            file: file.to_path_buf(),
            description: raw.description,
            engine: engine.unwrap_or_default(),
            command: resolved,
            params: EngineParams {
                model,
                mmproj,
                context: raw.context,
                parallel: raw.parallel,
                batch,
                ubatch,
                kv_cache: raw.kv_cache,
                flash_attn: raw.flash_attn,
                gpu_layers: raw.gpu_layers,
                prefill_chunk: chunk,
                kv_disk_dir,
                kv_disk_space_mb,
                slot_save_path: kv_checkpoint
                    .as_ref()
                    .filter(|_| slots)
                    .map(|kv| kv.dir.clone()),
                extra_args,
                args: raw.args.unwrap_or_default(),
                health: raw.health,
                key,
                stop_signal: raw.stop_signal,
                stop_grace: raw.stop_grace,
                workers: Vec::new(),
            },
            planned_memory,
            env,
            // The key is for engines whose slots dsv4d keeps; others keep their own checkpoints
            // (kv_disk_dir) or none.
            kv_checkpoint: kv_checkpoint.filter(|_| slots),
            matrix,
            workers,
        }
    }

    /// `workers:`, each with its box's address, the profile held there and the key file
    /// (resolved against the profiles folder, checked as a secret), and how to wake the box.
    fn workers(&mut self, raw: Vec<RawWorker>, dir: &Path) -> Vec<Worker> {
        let mut workers = Vec::new();
        for (i, w) in raw.into_iter().enumerate() {
            let at_key = format!("workers[{i}]");
            let required = |me: &mut Self, field: &str, value: Option<String>| {
                let path = format!("{at_key}.{field}");
                let missing = value.is_none() && !me.doc.dropped(&path);
                me.when(missing, &path, "required");
                value
            };
            let at = required(self, "at", w.at);
            let profile = required(self, "profile", w.profile);
            let key_file = required(self, "key_file", w.key_file);
            if let Some(at) = &at {
                self.add(&format!("{at_key}.at"), rules::check_peer_address(at));
            }
            if let Some(p) = &profile {
                self.add(&format!("{at_key}.profile"), rules::check_profile_name(p));
            }
            let key_file = key_file.map(|k| {
                let path = dir.join(&k);
                let check = |shown: &Shown| files::check_secret_file(shown, &path);
                let message = self.on_disk(&k, check);
                self.add(&format!("{at_key}.key_file"), message);
                path
            });
            let wake = w.wake.and_then(|wake| {
                let parsed = rules::wake(wake.mac.as_deref(), wake.broadcast.as_deref());
                parsed
                    .map_err(|(field, message)| self.to(&format!("{at_key}.wake.{field}"), message))
                    .ok()
            });
            if let (Some(at), Some(profile), Some(key_file)) = (at, profile, key_file) {
                workers.push(Worker {
                    at,
                    profile,
                    key_file,
                    wake,
                });
            }
        }
        workers
    }

    /// The engine's program: required, and found (a bare name in `PATH`, the profile's own
    /// `env.PATH` first); resolved against the profiles folder.
    fn command(&mut self, raw: &RawProfile, dir: &Path) -> PathBuf {
        let command = raw.command.as_deref().unwrap_or_default();
        // A bare program name is looked up in PATH at spawn, with the profile's env.PATH when
        // it sets one.
        let resolved = match command.contains('/') {
            true => dir.join(command),
            false => PathBuf::from(command),
        };
        let missing = raw.command.is_none() && !self.doc.dropped("command");
        self.when(missing, "command", "required: the engine executable");
        if raw.command.is_some() {
            let env_path = raw.env.as_ref().and_then(|env| env.get("PATH"));
            let message = self.on_disk(command, |shown| {
                let env_path = env_path.map(String::as_str);
                files::check_command(shown, command, &resolved, dir, env_path)
            });
            self.add("command", message);
        }

        resolved
    }

    /// How the engine is launched and stopped: `args` (no NUL byte, placeholders the kind
    /// knows) and `stop_grace`.
    fn launch(&mut self, raw: &RawProfile) {
        if let Some(args) = &raw.args {
            for (i, arg) in args.iter().enumerate() {
                if arg.contains('\0') {
                    self.item("args", i, "contains a NUL byte".to_string());
                }
            }
            self.add("args", dsv4_engine::check_args(args));
        }
        let grace = raw.stop_grace;
        let message = format!("must be at least {}", format_duration(MIN_STOP_TIMEOUT));
        self.when(
            grace.is_some_and(|g| g < MIN_STOP_TIMEOUT),
            "stop_grace",
            message,
        );
    }

    /// The keys the profile's engine kind requires, and those another kind reads that this one
    /// does not (a setting that would do nothing).
    fn kind_keys(&mut self, kind: Option<&'static dsv4_engine::Kind>, raw: &RawProfile) {
        let doc = self.doc;
        if let Some(kind) = kind.filter(|k| k.requires_model) {
            let required = raw.model.is_none() && !doc.dropped("model");
            let message = format!("required for engine {}", kind.name);
            self.when(required, "model", message);
        }
        if let Some(kind) = kind {
            for (setting, what) in kind.requires {
                let key = setting.key();
                let missing = !doc.written(key) && !doc.dropped(key);
                let message = format!("required for engine {}: {what}", kind.name);
                self.when(missing, key, message);
            }
            // A key another kind reads that this one neither reads nor passes over is a
            // mistake (a setting that would do nothing).
            let mut others: Vec<Setting> = EngineKind::ALL
                .iter()
                .flat_map(|k| k.describe().reads.iter().copied())
                .collect();
            others.sort_unstable_by_key(|s| s.key());
            others.dedup();
            let reads: Vec<&str> = kind.reads.iter().map(|s| s.key()).collect();
            for setting in others {
                let key = setting.key();
                let unread = !kind.reads(setting) && !kind.ignores.contains(&setting);
                let message = format!(
                    "engine {} does not read {key}; it reads: {}",
                    kind.name,
                    reads.join(", ")
                );
                self.when(unread && doc.written(key), key, message);
            }
        }
    }

    /// The sizes and counts: the KV cache type, the context, parallel, batch sizes, the disk
    /// KV's space and the planned memory, each within its bounds.
    fn sizes(&mut self, raw: &RawProfile) {
        let kv = raw.kv_cache.as_deref();
        let message = kv.and_then(|kv| text_problem(kv).or_else(|| rules::check_kv_cache(kv)));
        self.add("kv_cache", message);
        let context = raw.context.unwrap_or(MIN_CONTEXT);
        let message = format!("must be at least {MIN_CONTEXT}");
        self.when(context < MIN_CONTEXT, "context", message);
        let message = format!("must be at most {MAX_CONTEXT}");
        self.when(context > MAX_CONTEXT, "context", message);
        let parallel = raw.parallel.unwrap_or(1);
        let message = format!("must be between 1 and {MAX_PARALLEL}");
        self.when(!(1..=MAX_PARALLEL).contains(&parallel), "parallel", message);
        let (batch, ubatch, chunk) = (raw.batch, raw.ubatch, raw.prefill_chunk);
        for (key, value) in [
            ("batch", batch),
            ("ubatch", ubatch),
            ("prefill_chunk", chunk),
        ] {
            self.when(value == Some(0), key, "must be at least 1");
        }
        if let (Some(batch), Some(ubatch)) = (batch, ubatch) {
            let message = format!("ubatch ({ubatch}) must not be larger than batch ({batch})");
            self.when(batch > 0 && ubatch > batch, "ubatch", message);
        }
        let kv_disk_space_mb = raw.kv_disk_space.map(|bytes| bytes / MIB);
        let message = "must be at least 1MiB";
        self.when(kv_disk_space_mb == Some(0), "kv_disk_space", message);
        self.when(raw.planned_memory == Some(0), "planned_memory", POSITIVE);
    }

    /// `env:`: each name one a program can be given, no value with a NUL byte.
    fn env(&mut self, env: BTreeMap<String, String>) -> BTreeMap<String, String> {
        let doc = self.doc;
        for (key, value) in &env {
            let path = format!("env.{key}");
            if let Some(message) = rules::check_env_name(key) {
                self.problems.push(doc.at("env", &path, true, message));
            } else {
                self.when(value.contains('\0'), &path, "contains a NUL byte");
            }
        }

        env
    }

    /// `matrix:`: every axis lists something, `cpu` and `gpu` name what they can, every
    /// argument passes the rules of `extra_args`, and the cells are not too many.
    fn matrix(&mut self, raw: matrix::RawMatrix) -> matrix::Matrix {
        use matrix::{RawValues, Values, CPU_VALUES, GPU_VALUES};
        let mut axes = Vec::new();
        for (name, values) in raw.0 {
            let path = format!("matrix.{name}");
            let empty = match &values {
                RawValues::Names(v) => v.is_empty(),
                RawValues::Args(v) => v.is_empty(),
            };
            self.when(empty, &path, "lists no value: give at least one");
            let values = match values {
                RawValues::Names(names) => {
                    let known: &[&str] = match name.as_str() {
                        "cpu" => &CPU_VALUES,
                        _ => &GPU_VALUES,
                    };
                    for (i, n) in names.iter().enumerate() {
                        let message = format!(
                            "`{n}` is not a {} this axis takes: {}",
                            if name == "cpu" {
                                "power profile"
                            } else {
                                "GPU level"
                            },
                            known.join(", ")
                        );
                        self.when(
                            !known.contains(&n.as_str()),
                            &format!("{path}[{i}]"),
                            message,
                        );
                        let twice = names[..i].contains(n);
                        self.when(
                            twice,
                            &format!("{path}[{i}]"),
                            format!("`{n}` is listed twice"),
                        );
                    }
                    match name.as_str() {
                        "cpu" => Values::Cpu(names),
                        _ => Values::Gpu(names),
                    }
                }
                RawValues::Args(variants) => {
                    for (i, args) in variants.iter().enumerate() {
                        for (j, arg) in args.iter().enumerate() {
                            let at = format!("{path}[{i}][{j}]");
                            self.add(&at, rules::check_extra_arg(arg));
                        }
                        let twice = variants[..i].contains(args);
                        let message = format!("variant {} repeats an earlier one", i + 1);
                        self.when(twice, &format!("{path}[{i}]"), message);
                    }
                    Values::Args(variants)
                }
            };
            axes.push(matrix::Axis { name, values });
        }
        let m = matrix::Matrix { axes };
        let size = m.size();
        let message = format!(
            "has {size} cells (every combination of its axes); at most {} are allowed",
            matrix::MAX_CELLS
        );
        self.when(size > matrix::MAX_CELLS, "matrix", message);
        m
    }

    /// How the engine is given its key: `key_env: NAME`, `key_arg: FLAG`, or neither.
    fn engine_key(&mut self, raw: &RawProfile) -> KeyPassing {
        if let Some(name) = &raw.key_env {
            self.add("key_env", rules::check_env_name(name));
            let in_env = raw.env.as_ref().is_some_and(|env| env.contains_key(name));
            let message = format!(
                "{name} is also set in env; remove it there (the engine gets its key in it)"
            );
            self.when(in_env, "key_env", message);
        }
        if let Some(flag) = &raw.key_arg {
            self.add("key_arg", dsv4_engine::check_key_arg(flag));
        }
        match (&raw.key_env, &raw.key_arg) {
            (Some(_), Some(_)) => {
                let message = "set key_env or key_arg, not both: the engine takes its key one way"
                    .to_string();
                self.rule(true, &["key_arg", "key_env"], message);
                KeyPassing::None
            }
            (Some(name), None) => KeyPassing::Env(name.clone()),
            (None, Some(flag)) => KeyPassing::Arg(flag.clone()),
            (None, None) => KeyPassing::None,
        }
    }

    /// `kv_checkpoint:`; `slots`: the profile's engine has its slots kept by dsv4d (others
    /// ignore the key, so its folder need not be creatable).
    fn kv_checkpoint(
        &mut self,
        raw: super::raw::RawKvCheckpoint,
        dir: &Path,
        slots: bool,
    ) -> Option<KvCheckpoint> {
        let missing = raw.dir.is_none() && !self.doc.dropped("kv_checkpoint.dir");
        self.when(
            missing,
            "kv_checkpoint",
            "kv_checkpoint.dir is required: the folder the checkpoints are kept in",
        );
        if let Some(text) = raw.dir.as_deref() {
            self.add("kv_checkpoint.dir", text_problem(text));
        }
        let check = slots.then_some(files::check_makeable_dir as DiskCheck);
        let folder = self.path("kv_checkpoint.dir", raw.dir, dir, check)?;
        let message = "must be at least 1MiB";
        let small = raw.max_size.is_some_and(|b| b < MIB);
        self.when(small, "kv_checkpoint.max_size", message);
        for (key, value) in [
            ("kv_checkpoint.save_timeout", raw.save_timeout),
            ("kv_checkpoint.restore_timeout", raw.restore_timeout),
        ] {
            self.when(value == Some(Duration::ZERO), key, POSITIVE);
        }
        Some(KvCheckpoint {
            dir: folder,
            max_size: raw.max_size,
            save_timeout: raw
                .save_timeout
                .unwrap_or(KvCheckpoint::DEFAULT_SAVE_TIMEOUT),
            restore_timeout: raw
                .restore_timeout
                .unwrap_or(KvCheckpoint::DEFAULT_RESTORE_TIMEOUT),
        })
    }

    /// A path the engine reads (`value` at `key`), resolved against the profiles folder;
    /// `check` says what must hold on disk, when the engine uses the key.
    fn path(
        &mut self,
        key: &str,
        value: Option<String>,
        dir: &Path,
        check: Option<DiskCheck>,
    ) -> Option<PathBuf> {
        let value = value?;
        let path = dir.join(&value);
        let message = self.on_disk(&value, |shown| check.and_then(|check| check(shown, &path)));
        self.add(key, message);
        Some(path)
    }
}

/// What must hold on disk for a path.
type DiskCheck = fn(&Shown, &Path) -> Option<String>;

/// Every profile file by name (those with problems too), and the profiles without problems.
type Profiles = (BTreeMap<String, PathBuf>, BTreeMap<String, Profile>);

/// Text that ends up in argv or a path must be non-empty and free of NUL bytes.
fn text_problem(value: &str) -> Option<String> {
    match value {
        "" => Some("must not be empty".to_string()),
        _ if value.contains('\0') => Some("contains a NUL byte".to_string()),
        _ => None,
    }
}
