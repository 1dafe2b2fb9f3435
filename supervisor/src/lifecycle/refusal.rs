//! What a refused request is told, in words: one place for the text, whichever way it goes
//! out (an HTTP error answer, a validation run's failure, a D-Bus error).

use super::state::{EngineFailure, Refusal};

/// Appends the engine's last lines to a message.
pub fn with_tail(message: String, tail: &[String]) -> String {
    if tail.is_empty() {
        return message;
    }
    format!(
        "{message}; engine output (last {} lines):\n{}",
        tail.len(),
        tail.join("\n")
    )
}

fn failure_text(f: &EngineFailure) -> String {
    with_tail(f.summary.clone(), &f.tail)
}

impl Refusal {
    /// The sentence the client gets, naming the setting or the cause, with the engine's last
    /// lines where they tell why.
    pub fn message(&self) -> String {
        match self {
            Refusal::QueueFull { max_waiting } => format!(
                "{max_waiting} requests already wait for the engine to start (engine.max_waiting)"
            ),
            Refusal::StartFailed(f) => format!("engine failed to start: {}", failure_text(f)),
            Refusal::StartTimeout { timeout, tail } => with_tail(
                format!(
                    "engine was not ready within engine.start_timeout ({})",
                    crate::config::format_duration(*timeout)
                ),
                tail,
            ),
            Refusal::Backoff { retry_after, last } => {
                let why = last
                    .as_ref()
                    .map(failure_text)
                    .unwrap_or_else(|| "unknown".into());
                format!(
                    "engine start is backing off after a failure; next try in {}s; last failure: {why}",
                    retry_after.as_secs_f64().ceil()
                )
            }
            Refusal::StartCancelled => {
                "the engine start this request waited for was cancelled by a stop request".into()
            }
            Refusal::NotEnoughMemory { profile, short } => format!(
                "{}; nothing was started, and the next request tries again",
                short.describe(profile)
            ),
            Refusal::TooHot { message } => format!(
                "the machine is too hot to run the engine ({message}); requests are served \
                 again once it has cooled down (thermal.on_critical)"
            ),
            Refusal::ShuttingDown => "the supervisor is shutting down".into(),
        }
    }
}
