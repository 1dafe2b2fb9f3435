//! A start whose profile has workers: every worker box held first, then the engine spawned
//! with their relays; a worker that goes away ends the engine, named in its exit.

use std::sync::Arc;

use super::engine::failed_start;
use super::messages::Internal;
use super::Actor;
use crate::lifecycle::state::{Event, Gen};
use crate::lifecycle::workers::{self, Holds};

/// The workers of the start of `gen` being held.
pub(super) struct Holding {
    gen: Gen,
    profile: String,
    /// The task that holds them, until they are.
    task: Option<tokio::task::JoinHandle<()>>,
    /// Held, waiting for the spawn that takes them.
    held: Option<Holds>,
}

impl Drop for Holding {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// What the start of an engine with workers has, at its spawn.
pub(super) enum Workers {
    /// None to hold: spawn.
    None,
    /// Held: spawn with these.
    Held(Holds),
    /// Being held: the spawn comes when they are.
    Waiting,
}

impl Actor {
    /// The workers of the start of `gen` of `profile`: held already, or now being held.
    pub(super) fn workers_for(&mut self, gen: Gen, profile: &crate::config::Profile) -> Workers {
        if profile.workers.is_empty() {
            return Workers::None;
        }
        if let Some(h) = self.holding.as_mut().filter(|h| h.gen == gen) {
            return match h.held.take() {
                Some(holds) => {
                    self.holding = None;
                    Workers::Held(holds)
                }
                None => Workers::Waiting,
            };
        }
        let boxes: Vec<&str> = profile.workers.iter().map(|w| w.host()).collect();
        tracing::info!(
            profile = profile.name,
            "holding the profile's workers before its engine starts: {}",
            boxes.join(", ")
        );
        self.publish_loading(&profile.name, 0, Some("holding its workers".to_string()));
        let internal = self.internal.clone();
        let told = self.internal.clone();
        let lost = self.internal.clone();
        let list = profile.workers.clone();
        let book = self.worker_book.clone();
        let alerts = self.alerts.clone();
        let task = tokio::spawn(async move {
            let progress: workers::Progress = Arc::new(move |what: &str| {
                let what = what.to_string();
                let _ = told.send(Internal::Holding { gen, what });
            });
            let lost: workers::Lost = Arc::new(move |why: String| {
                let _ = lost.send(Internal::WorkerLost { gen, why });
            });
            let holds = workers::hold(&list, progress, lost, book, alerts).await;
            let _ = internal.send(Internal::Held { gen, holds });
        });
        self.holding = Some(Holding {
            gen,
            profile: profile.name.clone(),
            task: Some(task),
            held: None,
        });
        Workers::Waiting
    }

    /// Keeps `holds` for the next spawn of `gen` (its engine is started again on another
    /// port).
    pub(super) fn keep_holds(&mut self, gen: Gen, profile: &str, holds: Holds) {
        self.holding = Some(Holding {
            gen,
            profile: profile.to_string(),
            task: None,
            held: Some(holds),
        });
    }

    /// The workers of `gen` are held (the engine spawns now), or one could not be (the
    /// start fails with the reason).
    pub(super) fn workers_held(&mut self, gen: Gen, holds: Result<Holds, String>) -> Option<Event> {
        let h = self.holding.as_mut().filter(|h| h.gen == gen)?;
        match holds {
            Ok(holds) => {
                h.held = Some(holds);
                let profile = h.profile.clone();
                self.spawn_engine(gen, &profile)
            }
            Err(summary) => {
                self.holding = None;
                failed_start(gen, summary)
            }
        }
    }

    /// The start of `gen` is stopped while its workers are held: they are let go, and the
    /// start ends as an engine's exit would.
    pub(super) fn stop_holding(&mut self, gen: Gen) -> Option<Event> {
        self.holding.take_if(|h| h.gen == gen)?;
        failed_start(gen, "stopped while its workers were being held".to_string())
    }

    /// What the start of `gen` waits for, for the requests that wait for it.
    pub(super) fn holding_says(&mut self, gen: Gen, what: String) {
        if let Some(profile) = self
            .holding
            .as_ref()
            .filter(|h| h.gen == gen)
            .map(|h| h.profile.clone())
        {
            self.publish_loading(&profile, 0, Some(what));
        }
    }

    /// A worker of the engine of `gen` went away: the engine cannot go on without it, so it
    /// is ended, and its exit says why.
    pub(super) fn worker_lost(&mut self, gen: Gen, why: String) {
        let Some(e) = self.engine.as_mut().filter(|e| e.shared.gen == gen) else {
            return;
        };
        tracing::error!(pid = e.shared.pid, "{why}: ending the engine");
        // Its answers in flight break now: their error events quote this.
        e.shared
            .output
            .push(format!("dsv4d: {why}: the engine is ended").into());
        e.lost.get_or_insert(why);
        e.child.signal(nix::sys::signal::Signal::SIGKILL);
    }
}
