//! What the actor uses from the rest of the daemon.

use crate::host::sysroot::SysRoot;
use crate::lifecycle::alert::Alerts;
use crate::lifecycle::engine_key::KeyFolder;

/// The keys taken out of every engine's output lines, as the daemon names its type.
pub use dsv4_engine::Redactor;

/// What the actor uses from the rest of the daemon.
#[derive(Debug, Clone, Default)]
pub struct Services {
    /// Gets an alert when an engine dies while it serves.
    pub alerts: Alerts,
    /// Where the host's memory figures are read before each start.
    pub sysroot: SysRoot,
    /// Where each engine's key is written; `None`: `engine-keys` below `state_dir`.
    pub key_folder: Option<KeyFolder>,
    /// A validation matrix cell's arguments, added at each spawn of its profile's engine.
    pub trial: crate::lifecycle::trial::Trial,
    /// The keys taken out of every engine's output lines (each engine's own added to them).
    pub redact: Redactor,
}
