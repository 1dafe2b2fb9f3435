//! The settings one cell of a validation matrix runs the engine with: arguments added after
//! the profile's own, and the CPU power profile and GPU level in place of `power:`'s.
//!
//! Owns: nothing but the one slot. The validator sets it before it restarts the engine for a
//! cell and clears it before the service profile runs again; the actor reads it at each
//! spawn, the power policy at each engine's start. It lives in memory only: a daemon that
//! restarts runs every engine as configured.

use std::sync::{Arc, Mutex};

use crate::config::{CpuPolicy, GpuPolicy, PowerSettings};

/// A cell's settings, for engines of `profile`.
#[derive(Debug, Clone, PartialEq)]
pub struct TrialSettings {
    pub profile: String,
    pub cpu: Option<CpuPolicy>,
    pub gpu: Option<GpuPolicy>,
    pub args: Vec<String>,
}

/// The slot; cheap to clone, all clones the same slot.
#[derive(Debug, Clone, Default)]
pub struct Trial(Arc<Mutex<Option<TrialSettings>>>);

impl Trial {
    pub fn set(&self, settings: Option<TrialSettings>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = settings;
    }

    pub fn get(&self) -> Option<TrialSettings> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// What an engine of `profile` adds after the profile's `extra_args`.
    pub fn args_for(&self, profile: &str) -> Vec<String> {
        self.get()
            .filter(|t| t.profile == profile)
            .map(|t| t.args)
            .unwrap_or_default()
    }

    /// The power settings for an engine of `profile`: `configured`, with the cell's CPU
    /// profile and GPU level where it has them.
    pub fn power_for(&self, profile: Option<&str>, configured: &PowerSettings) -> PowerSettings {
        let mut power = configured.clone();
        if let Some(t) = self.get().filter(|t| Some(t.profile.as_str()) == profile) {
            power.cpu = t.cpu.unwrap_or(power.cpu);
            power.gpu = t.gpu.unwrap_or(power.gpu);
            // A cell measures its one CPU profile throughout.
            power.prefill = None;
        }
        power
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cell_changes_only_engines_of_its_profile() {
        let trial = Trial::default();
        let configured = PowerSettings::default();
        assert!(trial.args_for("64k").is_empty());
        assert_eq!(trial.power_for(Some("64k"), &configured), configured);
        trial.clone().set(Some(TrialSettings {
            profile: "64k".into(),
            cpu: Some(CpuPolicy::Performance),
            gpu: None,
            args: vec!["-ub".into(), "2048".into()],
        }));
        assert_eq!(trial.args_for("64k"), ["-ub", "2048"]);
        assert!(trial.args_for("320k").is_empty());
        let p = trial.power_for(Some("64k"), &configured);
        assert_eq!(p.cpu, CpuPolicy::Performance);
        assert_eq!(p.gpu, configured.gpu, "no gpu axis: as configured");
        assert_eq!(trial.power_for(Some("320k"), &configured), configured);
        assert_eq!(trial.power_for(None, &configured), configured);
        trial.set(None);
        assert!(trial.args_for("64k").is_empty());
    }
}
