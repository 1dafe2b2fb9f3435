//! Configuration reload, on SIGHUP and when a YAML file in the config folder, its drop-in
//! folder (`supervisor.yaml.d`) or the profiles folder changes.
//!
//! Owns: the file watcher and the decision to accept a new configuration. Must not: apply
//! settings itself; a valid configuration is published on the config watch, the one place
//! the configuration in force lives: the lifecycle actor takes it in at its next turn
//! (timeouts and limits apply at once, a changed profile at the engine's next start), the
//! proxy reads limits and keys from it per request, the KV book its folders. An invalid one is
//! rejected whole: the last good configuration stays, the problems are logged with the
//! loader's precise messages, and an `Alert` goes out. The API key file is the exception:
//! every reload reads it again, whatever the YAML, and one that cannot be used (missing,
//! unreadable, open to group or others, empty) refuses every keyed request with 503, with an
//! `Alert`, until a reload finds it good: the last good keys never outlive a revocation.
//!
//! Keys never switch off by themselves: a reload whose configuration would drop
//! `api.api_keys_file` or `api.admin_keys_file` (a drop-in removed, or read half-written) is
//! refused like an invalid one, with a warning and an `Alert`; only a restart takes keys
//! away, and a start without the keys the last configuration had says so at warning (the
//! settings are remembered in `state_dir/keys-required`).
//!
//! Folders are watched, not files: editors save by writing a new file and renaming it over
//! the old one, which a watch on the file itself would lose. Events are debounced, so a
//! save that touches several files is one reload, and a configuration is applied only once
//! it reads the same twice, [`DEBOUNCE`] apart: a file still being written is not.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dsv4_client::AlertKind;
use notify::{EventKind, RecursiveMode, Watcher};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::{mpsc, watch};

use crate::config::Config;
use crate::http::auth::KeyFile;
use crate::lifecycle::alert::Alerts;

/// Quiet time after the last file event before reloading, and between the two reads that
/// must agree.
const DEBOUNCE: Duration = Duration::from_millis(250);
/// How many reads a configuration that keeps changing gets before this reload gives up on it
/// (the next change reads it again).
const STABLE_TRIES: usize = 40;

pub struct Reloader {
    pub path: PathBuf,
    pub config: watch::Sender<Arc<Config>>,
    pub alerts: Alerts,
}

/// Whether a file event can change the configuration: a YAML file (or the config file
/// itself, or its drop-in folder) created, written, renamed or removed. Reads are not (the
/// loader's own reads would otherwise trigger it again).
fn relevant(ev: &notify::Event, config_file: &Path, dropins: &Path) -> bool {
    if matches!(ev.kind, EventKind::Access(_)) {
        return false;
    }
    ev.paths.iter().any(|p| {
        p == config_file
            || p == dropins
            || matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
    })
}

/// Logs the folders watched from now on, when they changed.
fn tell_watched(shown: Option<String>) {
    if let Some(shown) = shown {
        tracing::debug!("watching for configuration changes: {shown}");
    }
}

impl Reloader {
    /// Runs until the config watch has no receivers left.
    pub async fn run(self) {
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!("cannot handle SIGHUP, reload on file changes only: {e}");
                None
            }
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<()>();
        let (file, dropins) = {
            let config = self.config.borrow();
            (config.file.clone(), config.dropin_dir())
        };
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if res.is_ok_and(|ev| relevant(&ev, &file, &dropins)) {
                let _ = tx.send(());
            }
        });
        let mut watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("cannot watch the configuration files, reload on SIGHUP only: {e}");
                None
            }
        };
        let mut watched: Vec<PathBuf> = Vec::new();
        let first = self.watch_folders(watcher.as_mut(), &mut watched);
        // A change made between the start's load and the watch above was seen by nobody. The
        // watch is told only after this compare: a change made from then on comes as an event.
        if self.changed_since_load().await {
            self.reload("a configuration file changed as dsv4d started")
                .await;
        }
        tell_watched(first);
        loop {
            tell_watched(self.watch_folders(watcher.as_mut(), &mut watched));
            let why = tokio::select! {
                _ = async { hup.as_mut().unwrap().recv().await }, if hup.is_some() => "SIGHUP",
                Some(()) = rx.recv() => {
                    while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {}
                    // A drop-in folder just made is watched before it is read, so that a file
                    // written into it from now on is seen.
                    tell_watched(self.watch_folders(watcher.as_mut(), &mut watched));
                    "a configuration file changed"
                }
                _ = self.config.closed() => return,
            };
            self.reload(why).await;
        }
    }

    /// Whether the files now read otherwise than the configuration in force.
    async fn changed_since_load(&self) -> bool {
        let path = self.path.clone();
        let now = tokio::task::spawn_blocking(move || Config::load_for_reload(&path)).await;
        match now {
            Ok(Ok(now)) => now != **self.config.borrow(),
            // A problem is the reload's to tell.
            Ok(Err(_)) => true,
            Err(_) => false,
        }
    }

    /// Watches the config file's folder, its drop-in folder when there is one, and the
    /// profiles folder (again, if it moved), with the watcher when there is one; the folders
    /// now watched, for the log, when that changed.
    fn watch_folders(
        &self,
        w: Option<&mut notify::RecommendedWatcher>,
        watched: &mut Vec<PathBuf>,
    ) -> Option<String> {
        let w = w?;
        let c = self.config.borrow().clone();
        let mut want: Vec<PathBuf> = c.file.parent().map(Path::to_path_buf).into_iter().collect();
        let dropins = c.dropin_dir();
        if dropins.is_dir() {
            want.push(dropins);
        }
        want.push(c.supervisor.profiles_dir.clone());
        want.dedup();
        if *watched == want {
            return None;
        }
        for old in watched.drain(..) {
            let _ = w.unwatch(&old);
        }
        for dir in want {
            match w.watch(&dir, RecursiveMode::NonRecursive) {
                Ok(()) => watched.push(dir),
                Err(e) => tracing::warn!("cannot watch {}: {e}", dir.display()),
            }
        }
        let shown: Vec<_> = watched.iter().map(|d| d.display().to_string()).collect();
        Some(shown.join(", "))
    }

    async fn reload(&self, why: &str) {
        let old = self.config.borrow().clone();
        let Some(loaded) = self.load_stable(why).await else {
            return;
        };
        let problem = match loaded {
            Ok(new) => match keys_dropped(&old, &new) {
                dropped if dropped.is_empty() => {
                    if let Some(config) = self.apply(why, &old, new).await {
                        self.check_keys(why, &config).await;
                    }
                    return;
                }
                dropped => format!(
                    "it has no {} where the configuration in force has: keys are turned off \
                     only by a restart (`systemctl restart dsv4`), never by a reload",
                    dropped.join(" and ")
                ),
            },
            Err(problems) => problems.to_string(),
        };
        tracing::error!(
            "{why}: the new configuration is rejected, the last good one stays:\n{problem}"
        );
        self.alerts.raise(
            AlertKind::Config,
            format!("configuration change rejected; the last good configuration stays:\n{problem}"),
        );
        // Not its keys: they are read again, as after any reload, so that a key file made
        // unusable refuses requests instead of the old keys staying good.
        if keyed(&old) {
            let again = Arc::new((*old).clone());
            self.config.send_replace(again.clone());
            self.check_keys(why, &again).await;
        }
    }

    /// The configuration, once two reads [`DEBOUNCE`] apart agree; `None` when it kept
    /// changing (still being written) or could not be loaded at all.
    async fn load_stable(&self, why: &str) -> Option<Result<Config, crate::config::ConfigError>> {
        let load = || {
            let path = self.path.clone();
            tokio::task::spawn_blocking(move || Config::load_for_reload(&path))
        };
        let mut last = load().await;
        for _ in 0..STABLE_TRIES {
            tokio::time::sleep(DEBOUNCE).await;
            let again = load().await;
            match (&last, &again) {
                (Ok(a), Ok(b)) if same(a, b) => return again.ok(),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::error!("{why}: loading the configuration failed: {e}");
                    return None;
                }
                _ => last = again,
            }
        }
        tracing::warn!(
            "{why}: the configuration still changed after {} of reading it; not applied \
             until it reads the same twice",
            dsv4_client::duration::format(DEBOUNCE * STABLE_TRIES as u32)
        );
        None
    }

    /// Hands a loaded configuration on; returns it when it is now in force.
    async fn apply(&self, why: &str, old: &Config, new: Config) -> Option<Arc<Config>> {
        // SIGHUP always republishes, and so does any reload when API keys are configured,
        // so that the key file, which the YAML only names, is read again.
        if new == *old && why != "SIGHUP" && !keyed(&new) {
            tracing::debug!("{why}: the configuration is unchanged");
            return None;
        }
        for (what, changed) in [
            (
                "api.listen",
                new.supervisor.api.listen != old.supervisor.api.listen,
            ),
            (
                "state_dir",
                new.supervisor.state_dir != old.supervisor.state_dir,
            ),
        ] {
            if changed {
                tracing::warn!("{what} changed: it takes effect when dsv4d restarts");
            }
        }
        if key_settings(&new) != key_settings(old) {
            remember_keys(&new);
        }
        let new = Arc::new(new);
        // The lifecycle actor takes it from there too, before its next command.
        self.config.send_replace(new.clone());
        tracing::info!("{why}: configuration reloaded");
        Some(new)
    }

    /// Reads the key file `config` names: one that cannot be used (missing, unreadable, open
    /// to group or others, without a key) refuses every keyed request with 503 from now on
    /// (the proxy reads the same file for the configuration just published), which is
    /// alerted.
    async fn check_keys(&self, why: &str, config: &Arc<Config>) {
        for file in [KeyFile::Api, KeyFile::Admin, KeyFile::Peers] {
            let Some(path) = file.path(config).map(Path::to_path_buf) else {
                continue;
            };
            let what = file.what();
            let config = config.clone();
            let read =
                tokio::task::spawn_blocking(move || file.read(&path, &config).map(|_| ())).await;
            let Ok(Err(e)) = read else { continue };
            let refused = file.refused();
            match file {
                KeyFile::Peers => tracing::error!("{why}: {e}; {refused} is now refused"),
                _ => tracing::error!("{why}: {e}; {refused} now gets 503 api_keys_unavailable"),
            }
            self.alerts.raise(
                AlertKind::Config,
                format!(
                    "{what}s unavailable, {refused} is refused until the key file is fixed \
                     and dsv4d reloaded: {e}"
                ),
            );
        }
    }
}

/// Whether two loads read the same: the same configuration, or the same problems.
fn same(
    a: &Result<Config, crate::config::ConfigError>,
    b: &Result<Config, crate::config::ConfigError>,
) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => a.to_string() == b.to_string(),
        _ => false,
    }
}

/// The key settings `config` has, by name.
pub fn key_settings(config: &Config) -> Vec<&'static str> {
    [
        (KeyFile::Api, "api.api_keys_file"),
        (KeyFile::Admin, "api.admin_keys_file"),
    ]
    .into_iter()
    .filter(|(f, _)| f.path(config).is_some())
    .map(|(_, name)| name)
    .collect()
}

/// The key settings `old` has and `new` lacks.
fn keys_dropped(old: &Config, new: &Config) -> Vec<&'static str> {
    let now = key_settings(new);
    key_settings(old)
        .into_iter()
        .filter(|k| !now.contains(k))
        .collect()
}

/// At a start: a warning for each key setting the last configuration in force had and this
/// one lacks (keys turned off by the restart), then this one's remembered.
pub fn note_start(config: &Config) {
    let state_dir = &config.supervisor.state_dir;
    let now = key_settings(config);
    let before = crate::host::state_file::load_keys(state_dir).unwrap_or_default();
    for gone in before.iter().filter(|k| !now.contains(&k.as_str())) {
        tracing::warn!(
            "{gone} is not set, where the configuration dsv4d ran with before had it: its keys \
             are off since this start"
        );
    }
    remember_keys(config);
}

/// Remembers the key settings of `config`, now in force.
fn remember_keys(config: &Config) {
    let state_dir = &config.supervisor.state_dir;
    if let Err(e) = crate::host::state_file::save_keys(state_dir, &key_settings(config)) {
        tracing::warn!(
            "cannot remember the key settings in {}: {e}",
            state_dir.display()
        );
    }
}

/// Whether `config` names a key file: a reload then publishes it even unchanged, so that the
/// keys, which the YAML only names, are read again.
fn keyed(config: &Config) -> bool {
    [KeyFile::Api, KeyFile::Admin, KeyFile::Peers]
        .iter()
        .any(|f| f.path(config).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use notify::event::{AccessKind, CreateKind, ModifyKind};

    fn ev(kind: EventKind, path: &str) -> notify::Event {
        notify::Event::new(kind).add_path(path.into())
    }

    /// A copy of a good fixture configuration in a folder of its own.
    fn good_config() -> (tempfile::TempDir, PathBuf) {
        let fixture = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/config/good/openai"
        ));
        let dir = tempfile::tempdir().unwrap();
        let copy = std::process::Command::new("cp")
            .arg("-a")
            .arg(fixture.join("."))
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(copy.success());
        let path = dir.path().join("supervisor.yaml");
        (dir, path)
    }

    /// A change made between the start's load and the watch (no file event comes for it) is
    /// applied all the same: the reloader compares the files with the configuration in force
    /// once it watches.
    #[tokio::test]
    async fn a_change_made_before_the_watch_began_is_applied() {
        let (_dir, path) = good_config();
        let loaded = Config::load(&path).unwrap();
        assert_ne!(
            loaded.supervisor.engine.idle_timeout,
            Duration::from_secs(7 * 60)
        );
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, format!("{text}engine: {{ idle_timeout: 7m }}\n")).unwrap();
        let (tx, mut rx) = watch::channel(Arc::new(loaded));
        let reloader = Reloader {
            path,
            config: tx,
            alerts: Alerts::default(),
        };
        tokio::spawn(reloader.run());
        let applied = tokio::time::timeout(
            Duration::from_secs(20),
            rx.wait_for(|c| c.supervisor.engine.idle_timeout == Duration::from_secs(7 * 60)),
        )
        .await;
        assert!(
            applied.is_ok_and(|r| r.is_ok()),
            "the change was not applied"
        );
    }

    #[test]
    fn only_changes_to_yaml_files_and_the_drop_in_folder_count() {
        let cfg = Path::new("/etc/dsv4/supervisor.yaml");
        let dropins = Path::new("/etc/dsv4/supervisor.yaml.d");
        let modify = EventKind::Modify(ModifyKind::Any);
        let create = EventKind::Create(CreateKind::File);
        let folder = EventKind::Create(CreateKind::Folder);
        let read = EventKind::Access(AccessKind::Any);
        let table = [
            (modify, "/etc/dsv4/profiles/64k.yaml", true),
            (create, "/etc/dsv4/profiles/x.yml", true),
            (modify, "/etc/dsv4/supervisor.yaml", true),
            (create, "/etc/dsv4/supervisor.yaml.d/10-local.yaml", true),
            (folder, "/etc/dsv4/supervisor.yaml.d", true),
            (
                EventKind::Remove(notify::event::RemoveKind::Folder),
                "/etc/dsv4/supervisor.yaml.d",
                true,
            ),
            (read, "/etc/dsv4/supervisor.yaml", false),
            (read, "/etc/dsv4/supervisor.yaml.d/10-local.yaml", false),
            (create, "/etc/dsv4/.supervisor.yaml.swp", false),
            (create, "/etc/dsv4/supervisor.yaml.d/README", false),
            (modify, "/etc/dsv4/keys", false),
        ];
        for (kind, path, counts) in table {
            assert_eq!(
                relevant(&ev(kind, path), cfg, dropins),
                counts,
                "{kind:?} {path}"
            );
        }
    }
}
