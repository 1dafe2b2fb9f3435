//! Starting an engine: its port, its key, its process, its readiness probe.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Arc;

use dsv4_engine::{EngineChild, ExitReport, SpawnSpec};
use tokio::time::Instant;

use super::engine::failed_start;
use super::messages::{Internal, PortLook};
use super::probe::probe_ready;
use super::{Actor, Engine, TAIL_LINES};
use crate::lifecycle::engine_key::EngineKey;
use crate::lifecycle::leftover;
use crate::lifecycle::state::{Event, Gen, KvSteps};
use crate::lifecycle::upstream::Upstream;
use crate::lifecycle::EngineRef;

impl Actor {
    pub(super) fn spawn_engine(&mut self, gen: Gen, profile_name: &str) -> Option<Event> {
        self.spawn_attempt(gen, profile_name, 0)
    }

    /// The span of the current engine generation, or of the active profile with none: the
    /// turn that acts on it runs in it.
    pub(super) fn turn_span(&self) -> tracing::Span {
        match &self.engine {
            Some(e) => e.span.clone(),
            None => crate::log::journal::engine_span(self.machine.profile(), None),
        }
    }

    /// Starts the engine of `gen`; `port_tries` earlier engines of this start found their port
    /// taken by another process.
    pub(super) fn spawn_attempt(
        &mut self,
        gen: Gen,
        profile_name: &str,
        port_tries: u32,
    ) -> Option<Event> {
        let fail = |summary: String| failed_start(gen, summary);
        // Its own handle on the configuration: the profile is read while the actor changes.
        let config = self.config.clone();
        let Some(profile) = config.profile(profile_name) else {
            return fail(format!(
                "profile `{profile_name}` is not in the configuration any more"
            ));
        };
        let holds = match self.workers_for(gen, profile) {
            super::workers::Workers::None => None,
            super::workers::Workers::Held(holds) => Some(holds),
            super::workers::Workers::Waiting => return None,
        };
        let relays = holds.as_ref().map(|h| h.addresses()).unwrap_or_default();
        let Prepared {
            params,
            port,
            key,
            tag,
            spec,
        } = match self.prepare(gen, profile_name, profile, relays) {
            Ok(p) => p,
            Err(summary) => return fail(summary),
        };
        let before = self.before_spawn(profile);
        // Once a start: a spawn again on another port would find what the first read.
        if port_tries == 0 {
            self.new_start(profile);
        }
        // The engine's output readers log in its span (see `crate::log::journal`).
        let span = crate::log::journal::engine_span(profile_name, Some(gen));
        let child = match span.in_scope(|| EngineChild::spawn(&spec)) {
            Ok(c) => c,
            Err(e) => return fail(e.to_string()),
        };
        span.record("engine_pid", child.pid());
        if let Some(h) = &holds {
            h.attach(child.output().clone());
        }
        let state_dir = &self.config.supervisor.state_dir;
        let since = self.publish_loading(profile_name, port_tries, None);
        let group = match leftover::Guard::write(state_dir, child.pid(), &tag) {
            Ok(g) => Some(g),
            Err(e) => {
                // The engine runs all the same; only a crash of dsv4d could leave it behind.
                tracing::warn!(
                    "cannot write {}: {e}; an engine left running by a killed dsv4d would not \
                     be ended at its next start",
                    leftover::record_path(state_dir).display()
                );
                None
            }
        };
        self.set_rules(profile_name, profile, &params);
        let upstream = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let shared = Arc::new(EngineRef {
            gen,
            profile: profile_name.to_string(),
            pid: child.pid(),
            upstream,
            connections: Upstream::new(upstream, key.as_ref().map(|k| k.authorization().clone())),
            output: child.output().clone(),
            exit: child.exit_watch(),
            kind: profile.engine.describe(),
        });
        let probe = tokio::spawn(probe_ready(
            profile.engine.readiness(&params),
            shared.clone(),
            Arc::from(tag.as_str()),
            self.internal.clone(),
        ));
        self.watch_exit(gen, child.exit_watch());
        self.engine = Some(Engine {
            spawned: profile.clone(),
            child,
            shared,
            probe,
            kv_task: None,
            kv: Default::default(),
            validated: false,
            term_at: None,
            ready_at: None,
            load_took: None,
            spawned_at: since,
            memory_before: before,
            oom_kills_before: crate::host::hw::cgroup::oom_kills(&self.sysroot).map(|(_, n)| n),
            _key: key,
            _group: group,
            port_tries,
            port_taken: None,
            span,
            holds,
            lost: None,
        });
        None
    }

    /// A start's first spawn (not one again on another port): what the page cache holds of
    /// the model, no identity until this engine's is read, and the restore the engine may
    /// make of its own checkpoints, to be checked.
    fn new_start(&mut self, profile: &crate::config::Profile) {
        self.model_cache = model_cache(profile);
        self.identity = None;
        if self.kv_suspended.as_ref() != Some(&profile.name) {
            super::kv::expect_own_load(&self.kv, profile);
        }
    }

    /// What the engine of `gen` is spawned with: the profile's settings (and a matrix cell's
    /// arguments after them), a free port, a fresh key when the kind takes one, the process
    /// mark and the spawn spec; logged as any local user would see its argv, key aside. The
    /// reason, when one of them cannot be had.
    fn prepare<'p>(
        &self,
        gen: Gen,
        profile_name: &str,
        profile: &'p crate::config::Profile,
        workers: Vec<String>,
    ) -> Result<Prepared<'p>, String> {
        // A validation matrix cell adds its arguments after the profile's own; held workers
        // are reached through their relays.
        let added = self.trial.args_for(profile_name);
        let params = match added.is_empty() && workers.is_empty() {
            true => std::borrow::Cow::Borrowed(&profile.params),
            false => {
                let mut params = profile.params.clone();
                params.extra_args.extend(added);
                params.workers = workers;
                std::borrow::Cow::Owned(params)
            }
        };
        let port = match free_port() {
            Ok(p) => p,
            Err(e) => {
                return Err(format!(
                    "cannot find a free loopback port for the engine: {e}"
                ))
            }
        };
        // A fresh secret for each engine that can require one: a key that outlived its engine
        // (read from a file of the old generation, say) opens nothing.
        let key = match profile.engine.key_passing(&params).takes_key() {
            true => match self.key_folder.issue(gen) {
                Ok(key) => Some(key),
                Err(e) => return Err(e.to_string()),
            },
            false => None,
        };
        let given = key.as_ref().map(EngineKey::given);
        let launch = profile
            .engine
            .launch(&params, "127.0.0.1", port, given.as_ref());
        // Every process of this engine carries the mark, whatever it starts: a next dsv4d
        // ends what is left of it only by the mark (see `crate::lifecycle::leftover`).
        let tag = match leftover::new_tag() {
            Ok(tag) => tag,
            Err(e) => return Err(format!("cannot make the engine's process mark: {e}")),
        };
        // The key, when the engine takes it from its environment, comes after the profile's
        // `env`: nothing there can replace it.
        let env: Vec<(std::ffi::OsString, std::ffi::OsString)> = profile
            .env
            .iter()
            .map(|(k, v)| (k.into(), v.into()))
            .chain(launch.env)
            .collect();
        // The engine's key never shows in its output lines, nor do the API keys.
        let secret = given.map(|k| k.secret).filter(|s| !s.is_empty());
        let spec = SpawnSpec {
            program: profile.command.clone(),
            args: launch.args,
            env,
            tail_lines: TAIL_LINES,
            also: Some(self.log.clone()),
            redact: self.redact.with_engine_key(secret),
            mark: Some(tag.clone()),
        };
        // The argv as any local user sees it in /proc; a key in it (`key_arg`) is not shown
        // in the log all the same.
        let shown: Vec<_> = spec
            .args
            .iter()
            .map(
                |a| match secret.is_some_and(|s| a.as_encoded_bytes() == s.as_bytes()) {
                    true => "<engine key>".into(),
                    false => a.to_string_lossy(),
                },
            )
            .collect();
        tracing::info!(
            profile = profile_name,
            "starting engine: {} {}",
            spec.program.display(),
            shown.join(" ")
        );
        Ok(Prepared {
            params,
            port,
            key,
            tag,
            spec,
        })
    }

    /// The memory as read just before the step that spawns (see `handle`), logged; the wait
    /// for the next spawn told; the KV checkpoint folder made (llama-server saves only into a
    /// folder that exists).
    fn before_spawn(
        &mut self,
        profile: &crate::config::Profile,
    ) -> dsv4_client::telemetry::MemoryFigures {
        let before = self.memory_read;
        if let Some(next) = self.next_spawned.take() {
            next.send_replace(true);
        }
        match before.available {
            Some(bytes) => tracing::info!(
                "memory available before the start: {}",
                dsv4_client::units::format_gib(bytes)
            ),
            None => tracing::debug!(
                "memory available before the start: unknown (no {})",
                self.sysroot.path(crate::host::hw::meminfo::PATH).display()
            ),
        }
        if let Some(kv) = &profile.kv_checkpoint {
            if let Err(e) = crate::kv::store::Store::new(&kv.dir).ensure() {
                tracing::warn!(
                    "cannot create the KV checkpoint folder {}: {e}; saves will fail",
                    kv.dir.display()
                );
            }
        }
        before
    }

    /// How the engine of `profile` is stopped, and its KV steps (none while its checkpoints
    /// are suspended), told to the rules.
    fn set_rules(
        &mut self,
        profile_name: &str,
        profile: &crate::config::Profile,
        params: &dsv4_engine::EngineParams,
    ) {
        let stop = profile.engine.stop(params);
        self.machine.set_interrupt_grace(stop.interrupt_grace);
        self.machine.set_stop_grace(stop.grace);
        self.machine.set_kv_steps(
            profile
                .kv_checkpoint
                .as_ref()
                .filter(|_| self.kv_suspended.as_deref() != Some(profile_name))
                .map(|kv| KvSteps {
                    save_timeout: kv.save_timeout,
                    restore_timeout: kv.restore_timeout,
                }),
        );
    }

    /// Tells the requests waiting that `profile_name` loads, with what its last loads took;
    /// the load's start (a start that moved to another port loads since its first spawn).
    pub(super) fn publish_loading(
        &self,
        profile_name: &str,
        port_tries: u32,
        waiting_for: Option<String>,
    ) -> Instant {
        // A start that moved to another port, or whose workers were (or are being) held
        // first, counts from its beginning.
        let since = match self.loading.borrow().as_ref() {
            Some(l) if l.profile == profile_name && (port_tries > 0 || l.waiting_for.is_some()) => {
                l.since
            }
            _ => Instant::now(),
        };
        let book = crate::host::load_times::read(&self.config.supervisor.state_dir);
        let class = self.model_cache.map(|c| c.class);
        self.loading
            .send_replace(Some(crate::lifecycle::loading::Loading {
                profile: profile_name.to_string(),
                since,
                about: crate::host::load_times::estimate(&book, profile_name, class),
                past: crate::host::load_times::range(&book, profile_name, class),
                waiting_for,
            }));
        since
    }

    /// Tells the actor when the engine of `gen` exits, however it exits.
    fn watch_exit(&self, gen: Gen, mut exit: tokio::sync::watch::Receiver<Option<ExitReport>>) {
        let internal = self.internal.clone();
        tokio::spawn(async move {
            let report = match exit.wait_for(Option::is_some).await {
                Ok(r) => r.clone(),
                Err(_) => None,
            };
            let report = report.unwrap_or(ExitReport {
                code: None,
                signal: None,
            });
            let _ = internal.send(Internal::Exited {
                gen,
                report,
                port: PortLook::NotYet,
            });
        });
    }
}

/// What an engine is spawned with, made ready by [`Actor::prepare`].
struct Prepared<'p> {
    params: std::borrow::Cow<'p, dsv4_engine::EngineParams>,
    port: u16,
    key: Option<EngineKey>,
    tag: String,
    spec: SpawnSpec,
}

/// A loopback port that was free a moment ago. Engines cannot take an open socket (llama-server
/// binds its own), so the port is handed over by number. Another process can take it first:
/// the readiness probe checks that the listener is the engine's, and the start goes on with
/// another port (see `Internal::PortTaken`).
pub(super) fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(l.local_addr()?.port())
}

/// What the page cache holds of `profile`'s model now (its size and resident bytes, and the
/// class of a load from there); `None` for a profile with no model file, or one that cannot
/// be read (the spawn says why).
fn model_cache(profile: &crate::config::Profile) -> Option<dsv4_client::ModelCache> {
    let model = profile.params.model.as_deref()?;
    let r = match crate::host::pagecache::residency(model) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!("cannot tell how much of {} is cached: {e}", model.display());
            return None;
        }
    };
    let cache = dsv4_client::ModelCache {
        resident_bytes: r.resident,
        total_bytes: r.size,
        class: dsv4_client::CacheClass::of(r.percent()),
        at: dsv4_client::clock::unix_now(),
    };
    tracing::info!(
        profile = profile.name,
        "model in the page cache: {:.0}% of {} ({} load)",
        r.percent(),
        dsv4_client::units::format_gib(r.size),
        cache.class.as_str()
    );
    Some(cache)
}
