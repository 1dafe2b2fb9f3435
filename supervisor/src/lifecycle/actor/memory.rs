//! The memory an engine leaves behind: waiting for it to come back after an exit.

use std::time::Duration;

use dsv4_client::telemetry::MemoryFigures;
use dsv4_client::AlertKind;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::host::prewarm;
use crate::host::sysroot::SysRoot;
use crate::lifecycle::alert::Alerts;

/// The least time between two alerts for starts refused for memory.
pub(super) const NOT_ADMITTED_GAP: Duration = Duration::from_secs(60);

/// How far below its level before the start available memory may stay, and how far above
/// GTT use, once the engine has stopped: the rest of the machine moves meanwhile.
pub(super) const MEMORY_RETURN_MARGIN: u64 = 2 << 30;

/// After an engine has exited: waits (up to `within`) for available memory and GTT to come
/// back to where they were before it started, and raises an alert if they do not (ROCm has
/// been seen to keep GTT after its process exited).
///
/// The next start waits for GTT, or VRAM where the model lives in a large carve-out (amdgpu
/// frees it some time after the exit): `settled` is called once it is back, or at once where
/// the GPU reports none, or when the alert is raised. Available memory moves with the rest of
/// the machine as well, so it only ever raises the alert, and its check ends, silently, when `next` says a next engine is
/// spawned: that engine's allocations are never counted as this one's.
pub(super) async fn memory_comes_back<F: FnOnce() + Send + 'static>(
    sysroot: SysRoot,
    before: MemoryFigures,
    profile: String,
    within: Duration,
    alerts: Alerts,
    settled: F,
    mut next: watch::Receiver<bool>,
) {
    let gib = dsv4_client::units::gib;
    let started = Instant::now();
    let mut settled = Some(settled);
    let tell = |settled: &mut Option<F>| {
        if let Some(settled) = settled.take() {
            settled();
        }
    };
    loop {
        let now = memory_now_off_thread(&sysroot).await;
        if *next.borrow() {
            tracing::debug!(
                "the next engine is starting: the last one's memory is not looked at any more"
            );
            return;
        }
        let available_back = match (before.available, now.available) {
            (Some(b), Some(n)) => n + MEMORY_RETURN_MARGIN >= b,
            _ => true,
        };
        // GTT, or VRAM where the model lives in a large carve-out.
        let gpu_back = match (before.gpu.pool_used(), now.gpu.pool_used()) {
            (Some(b), Some(n)) => n <= b + MEMORY_RETURN_MARGIN,
            _ => true,
        };
        if gpu_back {
            tell(&mut settled);
        }
        if available_back && gpu_back {
            tracing::debug!(
                "the engine's memory came back within {}",
                dsv4_client::duration::brief(started.elapsed())
            );
            return;
        }
        // The last look is taken before `within` has passed: a start that waits for this
        // (no longer than `within`) never overlaps it.
        if started.elapsed() + MEMORY_LOOK_EVERY >= within {
            let mut parts = Vec::new();
            if let (false, Some(b), Some(n)) =
                (gpu_back, before.gpu.pool_used(), now.gpu.pool_used())
            {
                let pool = before.gpu.pool().map_or("GPU memory", |p| p.name());
                parts.push(format!(
                    "{pool} in use is {:.1} GiB, {:.1} GiB before it started",
                    gib(n),
                    gib(b)
                ));
            }
            if let (false, Some(b), Some(n)) = (available_back, before.available, now.available) {
                parts.push(format!(
                    "available memory is {:.1} GiB, {:.1} GiB before it started",
                    gib(n),
                    gib(b)
                ));
            }
            let message = format!(
                "the memory of the engine (profile {profile}) did not come back within {} of \
                 its stop: {}; a process may still hold it (ROCm has kept GTT after exit \
                 before), and the next start may be refused",
                crate::config::format_duration(within),
                parts.join("; ")
            );
            tracing::warn!("{message}");
            alerts.raise(AlertKind::Memory, message);
            tell(&mut settled);
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(MEMORY_LOOK_EVERY) => {}
            _ = next.changed() => {}
        }
    }
}

/// How often [`memory_comes_back`] looks.
pub(super) const MEMORY_LOOK_EVERY: Duration = Duration::from_millis(250);

/// [`crate::host::hw::memory_now`] on a blocking worker: sysfs reads may stall (the SMU), and the
/// runtime's one thread carries every stream.
pub(super) async fn memory_now_off_thread(sysroot: &SysRoot) -> MemoryFigures {
    let root = sysroot.clone();
    tokio::task::spawn_blocking(move || crate::host::hw::memory_now(&root))
        .await
        .unwrap_or_default()
}

/// A model to read back into the page cache once its engine's memory is back
/// (`engine.prewarm`, see [`crate::host::prewarm`]).
pub(super) struct Prewarm {
    pub files: Vec<std::path::PathBuf>,
    pub sysroot: SysRoot,
    pub reserve: u64,
    pub profile: String,
}

impl Prewarm {
    /// Reads on a thread of its own at idle I/O priority, until it is done or `next` says the
    /// next engine is starting; nothing when it already is.
    pub(super) fn start(self, next: watch::Receiver<bool>) {
        if *next.borrow() {
            return;
        }
        let spawned = std::thread::Builder::new()
            .name("dsv4-prewarm".into())
            .spawn(move || {
                if let Err(e) = prewarm::idle_io_priority() {
                    tracing::debug!("prewarm: the idle I/O class was refused: {e}");
                }
                let profile = self.profile;
                tracing::info!(
                    profile,
                    "prewarm: reading the model's files back into the page cache"
                );
                let started = || *next.borrow();
                let r = prewarm::run(&self.files, &self.sysroot, self.reserve, &started);
                match r.ended {
                    prewarm::Ended::Failed(_) => tracing::warn!(profile, "prewarm: {}", r.said()),
                    _ => tracing::info!(profile, "prewarm: {}", r.said()),
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("prewarm: cannot start its thread: {e}");
        }
    }
}
