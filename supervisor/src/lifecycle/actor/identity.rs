//! The identity of each engine that becomes ready (see [`crate::host::identity`]): read on a
//! blocking thread once it serves, compared with its profile's last start, said at notice
//! when it changed, kept in `state_dir`, and shown in the status.

use dsv4_client::identity::IdentityStatus;

use super::messages::Internal;
use super::{Actor, Engine};
use crate::host::identity;
use crate::lifecycle::state::Gen;

impl Actor {
    /// Reads the identity of `e`, which has just become ready; the result comes back as
    /// [`Internal::Identified`].
    pub(super) fn identify(&self, e: &Engine) {
        let p = &e.spawned;
        let kind = p.engine.describe();
        let env: Vec<(String, String)> = p.env.clone().into_iter().collect();
        let program = crate::config::resolve_command(p);
        let models = crate::config::load_files(p);
        let output = e.shared.output.clone();
        let (gen, profile) = (e.shared.gen, p.name.clone());
        let state_dir = self.config.supervisor.state_dir.clone();
        let root = self.sysroot.clone();
        let internal = self.internal.clone();
        tokio::spawn(async move {
            let log = match kind.identify.backend {
                dsv4_engine::BackendReport::Log(read) => backend_lines(&output, read).await,
                _ => Vec::new(),
            };
            let read = tokio::task::spawn_blocking(move || {
                let started = identity::Started {
                    engine: kind.program,
                    identify: &kind.identify,
                    program,
                    models,
                    env,
                    log,
                };
                compared(&started, &root, &state_dir, profile)
            });
            if let Ok(status) = read.await {
                let status = Box::new(status);
                let _ = internal.send(Internal::Identified { gen, status });
            }
        });
    }

    /// The identity of the engine of `gen`, read: shown while that engine runs.
    pub(super) fn identified(&mut self, gen: Gen, status: Box<IdentityStatus>) {
        if self.engine.as_ref().is_some_and(|e| e.shared.gen == gen) {
            self.identity = Some(*status);
            self.publish();
        }
    }
}

/// The identity of the engine `started` describes, compared with its profile's last start,
/// said, and kept as its last.
fn compared(
    started: &identity::Started,
    root: &crate::host::sysroot::SysRoot,
    state_dir: &std::path::Path,
    profile: String,
) -> IdentityStatus {
    let mut all = identity::load(state_dir);
    let last = all.remove(&profile);
    let now = identity::read(started, root, last.as_ref());
    let changed = last
        .as_ref()
        .map(|l| identity::changes(l, &now))
        .unwrap_or_default();
    match (&last, changed.is_empty()) {
        (None, _) => tracing::info!(profile, "engine identity: {}", now.brief()),
        (Some(_), true) => tracing::debug!(profile, "engine unchanged: {}", now.brief()),
        (Some(_), false) => tracing::info!(
            target: crate::log::journal::NOTICE,
            profile,
            "engine changed: {}",
            changed.join("; ")
        ),
    }
    all.insert(profile.clone(), now.clone());
    if let Err(e) = identity::save(state_dir, &all) {
        tracing::warn!(
            "cannot keep the engine's identity in {}: {e}; the next start will not say what \
             changed",
            identity::path(state_dir).display()
        );
    }
    IdentityStatus {
        profile,
        identity: now,
        first: last.is_none(),
        changed,
    }
}

/// The engine's log up to the line that names its backend (`read`), waiting a little for
/// it: the engine wrote it before it served, and its output is read on threads of its own.
async fn backend_lines(
    output: &dsv4_engine::OutputTail,
    read: fn(&str) -> Option<String>,
) -> Vec<String> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    let (mut at, mut seen) = (0, Vec::new());
    while tokio::time::Instant::now() < deadline {
        let left = deadline - tokio::time::Instant::now();
        let (next, lines) = output.since_or_wait(at, 1024, left).await;
        seen.extend(lines);
        if seen.iter().any(|l| read(l).is_some()) {
            break;
        }
        at = next;
    }
    seen
}
