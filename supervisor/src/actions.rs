//! What an operator may do to the daemon: start, stop, stop now, switch the profile, drop KV
//! checkpoints, run or cancel a validation. One path for every way in: the D-Bus methods
//! (`dsv4ctl`) and the dashboard's actions (`POST /ui/actions/...`) both call these, so the
//! checks, the order of steps and the log line are the same whoever asks.
//!
//! Owns: the action's checks that do not depend on who asks (a known profile, no KV step
//! under way), its log line, and the kinds of failure each face turns into its own error.
//! Must not: decide who may ask (D-Bus checks the caller's user and group, HTTP the admin key
//! and the page's origin).

use dsv4_client::validate::ValidateRequest;

use crate::kv::DropError;
use crate::lifecycle::{ControlError, Handle, Refused};
use crate::validate::Validator;

/// Why an action did not happen.
#[derive(Debug)]
pub enum ActionError {
    /// From the lifecycle: an unknown profile, a profile that could not be kept, shutting
    /// down.
    Control(ControlError),
    /// The engine could not be started or waited for.
    Refused(Refused),
    /// Not now: something under way must end first (a KV step, a validation).
    Busy(String),
    /// The request itself is wrong (a validation's runs out of range, say).
    Invalid(String),
    /// What it names is not there (no KV checkpoint matches).
    NotFound(String),
    /// It was tried and failed.
    Failed(String),
}

impl std::fmt::Display for ActionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActionError::Control(e) => write!(f, "{e}"),
            ActionError::Refused(r) => write!(f, "{}", r.message()),
            ActionError::Busy(m)
            | ActionError::Invalid(m)
            | ActionError::NotFound(m)
            | ActionError::Failed(m) => f.write_str(m),
        }
    }
}

impl From<ControlError> for ActionError {
    fn from(e: ControlError) -> ActionError {
        ActionError::Control(e)
    }
}

impl From<Refused> for ActionError {
    fn from(r: Refused) -> ActionError {
        ActionError::Refused(r)
    }
}

/// The actions, on the daemon's lifecycle and validator.
#[derive(Clone)]
pub struct Actions {
    lifecycle: Handle,
    validator: Validator,
}

impl Actions {
    pub fn new(lifecycle: Handle, validator: Validator) -> Actions {
        Actions {
            lifecycle,
            validator,
        }
    }

    /// Starts the engine (of the active profile) without waiting for it.
    pub async fn start(&self, by: &str) -> Result<(), ActionError> {
        tracing::info!("start, asked by {by}");
        Ok(self.lifecycle.start().await?)
    }

    /// Starts the engine and waits until it serves; the profile it serves.
    pub async fn start_and_wait(&self, by: &str) -> Result<String, ActionError> {
        tracing::info!("start (and wait), asked by {by}");
        let lease = self.lifecycle.start_and_acquire().await?;
        Ok(lease.engine.profile.clone())
    }

    /// Stops the engine once the requests in flight are done, or at once with `now`.
    pub async fn stop(&self, now: bool, by: &str) -> Result<(), ActionError> {
        match now {
            true => tracing::info!("stop now, asked by {by}"),
            false => tracing::info!("stop, asked by {by}"),
        }
        Ok(self.lifecycle.stop(now).await?)
    }

    /// Makes `name` the active profile; a running engine is drained and restarted with it.
    pub async fn set_profile(&self, name: &str, by: &str) -> Result<(), ActionError> {
        tracing::info!("profile {name:?}, asked by {by}");
        Ok(self.lifecycle.set_profile(name).await?)
    }

    /// Removes the KV checkpoints `what` names (`all`, a profile, an id): the ids removed.
    /// Refused while the engine saves or restores one.
    pub async fn drop_kv(&self, what: &str, by: &str) -> Result<Vec<String>, ActionError> {
        if let Some(step) = self.lifecycle.with_status(|s| s.kv_step) {
            return Err(ActionError::Busy(format!(
                "the engine is {step} its KV checkpoint: try again once it is done"
            )));
        }
        tracing::info!("drop KV checkpoints {what:?}, asked by {by}");
        self.lifecycle
            .kv()
            .drop_matching(what)
            .await
            .map_err(|e| match e {
                DropError::NoWhat => ActionError::Invalid(e.to_string()),
                DropError::NoMatch(m) => ActionError::NotFound(m),
                DropError::Failed(m) => ActionError::Failed(m),
            })
    }

    /// Starts a validation run: the profile it validates, at once (it runs on).
    pub fn validate(&self, req: ValidateRequest, by: &str) -> Result<String, ActionError> {
        match &req.profile {
            Some(p) => tracing::info!("validation of {p:?}, asked by {by}"),
            None => tracing::info!("validation of the validation profile, asked by {by}"),
        }
        self.validator.start(req).map_err(|e| match e {
            crate::validate::StartError::Running => ActionError::Busy(e.to_string()),
            crate::validate::StartError::UnknownProfile { name, known } => {
                ActionError::Control(ControlError::UnknownProfile { name, known })
            }
            crate::validate::StartError::Invalid(m) => ActionError::Invalid(m),
        })
    }

    /// Records the drifted canary of `profile` as its reference (`dsv4ctl canary accept`):
    /// what was done. A held profile serves again.
    pub fn accept_canary(&self, profile: &str, by: &str) -> Result<String, ActionError> {
        let done = self
            .validator
            .checks()
            .accept(profile)
            .map_err(ActionError::Invalid)?;
        tracing::info!(target: crate::log::journal::NOTICE, profile, "{done}, accepted by {by}");
        Ok(done)
    }

    /// Ends the running validation (it switches back); `false` when none runs.
    pub fn cancel_validation(&self, by: &str) -> bool {
        let cancelled = self.validator.cancel();
        if cancelled {
            tracing::info!("validation cancelled, asked by {by}");
        }
        cancelled
    }
}
