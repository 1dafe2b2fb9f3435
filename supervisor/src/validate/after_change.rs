//! The canary after a change. An engine becomes ready, and its identity (see
//! [`crate::host::identity`]) differs from the one its profile's canary last ran on: the
//! engine, a model, the backend, the kernel or the GPU firmware changed. dsv4d then runs the
//! canary on it by itself, once the engine has been idle for [`QUIET`]: users first. A request
//! that comes while a canary prompt runs ends that prompt at once (the engine is let go), and
//! the canary goes on from it at the next quiet moment. Its result is kept as the profile's
//! last check (see [`super::checks`]): a drift is said at notice in the journal and raised as
//! an alert (a desktop notification), and shown in the status and the dashboard.
//!
//! Owns: the task that watches the engines' starts and runs the canary after a change.
//! Must not: run before or between a user's requests, or while a validation holds the engine
//! (which runs a canary of its own).

use std::time::Duration;

use dsv4_client::identity::IdentityStatus;
use dsv4_client::validate::{CanaryCheck, CanaryPrompt, CanaryResult, CanaryRun, CanaryState};
use dsv4_client::State;

use super::canary;
use super::checks::{due, state_of};
use super::measure::Api;
use super::Validator;

/// How long the engine must have been idle (no request in flight or waiting) before the
/// canary runs: an agent's next request often follows its last answer within a second or two.
pub const QUIET: Duration = Duration::from_secs(3);

/// Why a canary after a change did not run to its end.
enum Stop {
    /// The engine it was due on is no longer ready (stopped, restarted, switched): it stays
    /// due, and runs after the next start.
    Gone,
    /// It failed on the engine: said, and run again after the next start.
    Failed(String),
}

impl Validator {
    /// Watches each engine that becomes ready, and runs the canary on it when its identity
    /// changed; until the lifecycle goes.
    pub async fn canary_after_changes(self) {
        let mut status = self.0.lifecycle.watch_status();
        let mut seen = None;
        loop {
            let ready = status.wait_for(|s| {
                s.state == State::Ready && s.identity.is_some() && s.generation != seen
            });
            let (gen, identity) = match ready.await {
                Ok(s) => (s.generation, s.identity.clone()),
                Err(_) => return,
            };
            seen = gen;
            let (Some(gen), Some(identity)) = (gen, identity) else {
                continue;
            };
            if self.running() {
                continue;
            }
            let state_dir = self.0.config.borrow().supervisor.state_dir.clone();
            let reference = canary::reference(&state_dir, &identity.profile);
            let last = self.0.checks.kept(&identity.profile);
            let Some(reference) = reference else { continue };
            if let Some(changed) = due(&reference, last.as_ref(), &identity) {
                self.check_after_change(gen, &identity, changed, &reference)
                    .await;
            }
        }
    }

    /// The canary on the engine of `gen`, whose identity `identity` changed (`changed`)
    /// since its profile's canary last ran, compared with `reference` and kept.
    async fn check_after_change(
        &self,
        gen: u64,
        identity: &IdentityStatus,
        changed: Vec<String>,
        reference: &CanaryRun,
    ) {
        let profile = identity.profile.as_str();
        tracing::info!(
            profile,
            "the canary is due (the engine changed: {}); it runs once no request is in flight",
            changed.join("; ")
        );
        let live = |state, error| CanaryCheck {
            profile: profile.to_string(),
            state,
            since: dsv4_client::clock::unix_now(),
            changed: changed.clone(),
            result: None,
            error,
            held: false,
        };
        self.0.checks.live(live(CanaryState::Waiting, None));
        let kind = self.0.config.borrow().profile(profile).map(|p| p.engine);
        let Some(api) = kind.and_then(Api::of) else {
            self.0.checks.forget_live(profile);
            return;
        };
        let shown = |s| self.0.checks.live(live(s, None));
        let (prompts, began) = match self.run_when_idle(gen, api, &shown).await {
            Ok(done) => done,
            Err(Stop::Gone) => {
                tracing::info!(
                    profile,
                    "the engine went before its canary ran; it runs after the next start"
                );
                self.0.checks.forget_live(profile);
                return;
            }
            Err(Stop::Failed(why)) => {
                tracing::warn!(
                    profile,
                    "the canary after the change failed: {why}; it runs again after the next start"
                );
                self.0.checks.live(live(CanaryState::Failed, Some(why)));
                return;
            }
        };
        let run = CanaryRun {
            prompts,
            engine: identity.identity.brief(),
            identity: Some(identity.identity.clone()),
            at: began,
        };
        let result = CanaryResult {
            drift: canary::drift(reference, &run, canary::TOLERANCE),
            run,
            recorded: false,
            reference_engine: reference.engine.clone(),
            reference_at: reference.at,
            tolerance: canary::TOLERANCE,
        };
        let check = CanaryCheck {
            state: state_of(&result),
            result: Some(result),
            ..live(CanaryState::Passed, None)
        };
        self.say_check(&check);
        self.0.checks.keep(check);
    }

    /// The canary's prompts on the engine of `gen`, each run while no user's request is in
    /// flight or waiting (`shown` tells each move between waiting and running), and when they
    /// began to run (Unix time, s).
    async fn run_when_idle(
        &self,
        gen: u64,
        api: Api,
        shown: &(dyn Fn(CanaryState) + Sync),
    ) -> Result<(Vec<CanaryPrompt>, f64), Stop> {
        let (mut done, mut began) = (Vec::new(), None);
        'quiet: loop {
            self.quiet(gen).await?;
            let lease = self.0.lifecycle.acquire().await.map_err(|_| Stop::Gone)?;
            if lease.engine.gen != gen {
                return Err(Stop::Gone);
            }
            shown(CanaryState::Running);
            began.get_or_insert_with(dsv4_client::clock::unix_now);
            while let Some(prompt) = canary::PROMPTS.get(done.len()) {
                tokio::select! {
                    r = canary::prompt(api, &lease.engine, prompt) => match r {
                        Ok(p) => done.push(p),
                        Err(_) if !self.serves(gen) => return Err(Stop::Gone),
                        Err(why) => return Err(Stop::Failed(why)),
                    },
                    () = self.user_came(gen) => {
                        tracing::debug!("a request came: the canary waits for the next quiet");
                        drop(lease);
                        shown(CanaryState::Waiting);
                        continue 'quiet;
                    }
                }
            }
            return Ok((done, began.unwrap_or_default()));
        }
    }

    /// Whether the engine of `gen` is the ready one.
    fn serves(&self, gen: u64) -> bool {
        self.0.lifecycle.with_status(|s| ready(s, gen))
    }

    /// Resolves once the engine of `gen` has had no request in flight or waiting, and no
    /// validation, for [`QUIET`]; `Gone` once it is no longer the ready engine.
    async fn quiet(&self, gen: u64) -> Result<(), Stop> {
        let mut engine = Engine::new(&self.0.lifecycle);
        loop {
            let idle = match engine.look(gen, 0) {
                Look::Gone => return Err(Stop::Gone),
                Look::Busy => false,
                Look::Idle => !self.running(),
            };
            tokio::select! {
                () = tokio::time::sleep(QUIET), if idle => return Ok(()),
                moved = engine.moved() => if !moved { return Err(Stop::Gone) },
            }
        }
    }

    /// Resolves when a request came (one more lease than the canary's own, or one waiting),
    /// a validation began, or the engine of `gen` is no longer the ready one.
    async fn user_came(&self, gen: u64) {
        let mut engine = Engine::new(&self.0.lifecycle);
        while engine.look(gen, 1) == Look::Idle && !self.running() {
            if !engine.moved().await {
                return;
            }
        }
    }

    /// Says a check's result: a drift at notice, and as an alert.
    fn say_check(&self, check: &CanaryCheck) {
        let profile = check.profile.as_str();
        let Some(result) = &check.result else { return };
        let Some(drift) = &result.drift else {
            tracing::info!(
                profile,
                "the canary after the change: as its reference ({})",
                result.reference_engine
            );
            return;
        };
        let held = match self.0.config.borrow().supervisor.canary.hold {
            true => format!("; requests to it are refused until `dsv4ctl canary accept {profile}`"),
            false => String::new(),
        };
        let message = format!(
            "{profile}: answers changed since {}: {drift} (the reference: {}){held}",
            result.run.engine, result.reference_engine
        );
        tracing::info!(target: crate::log::journal::NOTICE, profile, "{message}");
        self.0
            .lifecycle
            .alerts()
            .raise(dsv4_client::AlertKind::Canary, message);
    }
}

/// Whether `s` has the engine of `gen` ready.
fn ready(s: &dsv4_client::EngineStatus, gen: u64) -> bool {
    s.state == State::Ready && s.generation == Some(gen)
}

/// The lifecycle's status and its per-request figures, watched by the canary.
struct Engine {
    status: tokio::sync::watch::Receiver<dsv4_client::EngineStatus>,
    figures: crate::lifecycle::gate::FiguresWatch,
}

/// What the canary sees of the engine it waits on.
#[derive(Debug, PartialEq)]
enum Look {
    /// It is no longer the ready engine.
    Gone,
    /// A request is in flight or waiting.
    Busy,
    Idle,
}

impl Engine {
    fn new(lifecycle: &crate::lifecycle::Handle) -> Engine {
        Engine {
            status: lifecycle.watch_status(),
            figures: lifecycle.watch_figures(),
        }
    }

    /// The engine of `gen` as it stands, the canary holding `own` leases on it; taking note,
    /// so that a later move is told. Read in place: the status is not copied.
    fn look(&mut self, gen: u64, own: u32) -> Look {
        self.figures.borrow_and_update();
        let s = self.status.borrow_and_update();
        if !ready(&s, gen) {
            Look::Gone
        } else if s.in_flight > own || s.waiting > 0 {
            Look::Busy
        } else {
            Look::Idle
        }
    }

    /// Resolves when the status or the figures moved; `false` once the lifecycle is gone.
    async fn moved(&mut self) -> bool {
        tokio::select! {
            r = self.status.changed() => r.is_ok(),
            r = self.figures.changed() => r.is_ok(),
        }
    }
}
