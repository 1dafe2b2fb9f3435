//! Each profile's correctness canary: its last run against the reference, and whether the
//! engine changed since the reference was recorded (`state_dir/canary/`, the validations
//! kept in `state_dir/validations/`, and `state_dir/identity.json`).

use dsv4_client::identity::EngineIdentity;
use dsv4_client::validate::{CanaryResult, CanaryRun};
use dsv4_engine::ValidationApi;

use super::Check;
use crate::config::Config;

const ID: &str = "canary";

/// One check per profile with a recorded canary (a profile's first validation records it).
pub fn checks(config: &Config) -> Vec<Check> {
    let dir = &config.supervisor.state_dir;
    let identities = crate::host::identity::load(dir);
    config
        .profiles
        .values()
        .filter(|p| !matches!(p.engine.describe().validation, ValidationApi::Lends))
        .filter_map(|p| {
            let reference = crate::validate::canary_reference(dir, &p.name)?;
            let last = crate::validate::saved_in(dir, Some(&p.name))
                .into_iter()
                .find_map(|r| r.canary);
            let now = identities.get(&p.name);
            Some(judge(&p.name, &reference, last.as_ref(), now))
        })
        .collect()
}

/// The check of `profile` by its canary's `reference`, its `last` run, and the identity of
/// its engine at its last start (`now`).
fn judge(
    profile: &str,
    reference: &CanaryRun,
    last: Option<&CanaryResult>,
    now: Option<&EngineIdentity>,
) -> Check {
    if let Some(d) = last.and_then(|l| l.drift.as_ref()) {
        return Check::fail(
            ID,
            format!(
                "the last canary drifted from its reference ({}): {d}",
                reference.engine
            ),
            format!(
                "if the change is meant (a new model, a fixed engine), record the new \
                 reference: dsv4ctl validate --profile {profile} --canary --record; if not, go \
                 back to the engine and model of the reference ({})",
                reference.engine
            ),
        )
        .profile(profile);
    }
    let changed = match (&reference.identity, now) {
        (Some(then), Some(now)) => crate::host::identity::changes(then, now),
        _ => Vec::new(),
    };
    if !changed.is_empty() {
        return Check::warn(
            ID,
            format!(
                "the engine changed since the canary's reference was recorded: {}",
                changed.join("; ")
            ),
            format!("run the canary on it: dsv4ctl validate --profile {profile} --canary"),
        )
        .profile(profile);
    }
    let found = match last {
        Some(l) if !l.recorded => {
            format!("the last canary matched its reference ({})", l.run.engine)
        }
        _ => format!("the canary's reference is recorded ({})", reference.engine),
    };
    Check::ok(ID, found).profile(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_client::doctor::Verdict;
    use dsv4_client::validate::Drift;

    fn identity(version: &str) -> EngineIdentity {
        EngineIdentity {
            engine: "llama-server".into(),
            version: Some(version.into()),
            ..EngineIdentity::default()
        }
    }

    #[test]
    fn each_canary_state_has_its_verdict_and_fix() {
        let reference = CanaryRun {
            engine: "llama-server 1".into(),
            identity: Some(identity("1")),
            ..CanaryRun::default()
        };
        let passed = CanaryResult {
            run: reference.clone(),
            ..CanaryResult::default()
        };
        let drifted = CanaryResult {
            drift: Some(Drift {
                prompt: 1,
                position: 3,
                ..Drift::default()
            }),
            ..passed.clone()
        };
        let (one, two) = (identity("1"), identity("2"));
        let recorded = judge("320k", &reference, None, Some(&one));
        assert_eq!(recorded.verdict, Verdict::Ok, "{recorded:?}");
        let ok = judge("320k", &reference, Some(&passed), Some(&one));
        assert_eq!(ok.verdict, Verdict::Ok, "{ok:?}");
        assert!(ok.found.contains("matched its reference"), "{ok:?}");
        let bad = judge("320k", &reference, Some(&drifted), Some(&one));
        assert_eq!(bad.verdict, Verdict::Fail, "{bad:?}");
        assert!(bad.found.contains("token 3"), "{bad:?}");
        let fix = bad.fix.unwrap_or_default();
        assert!(fix.contains("--profile 320k --canary --record"), "{fix}");
        let moved = judge("320k", &reference, Some(&passed), Some(&two));
        assert_eq!(moved.verdict, Verdict::Warn, "{moved:?}");
        assert!(
            moved.found.contains("llama-server 1 -> llama-server 2"),
            "{moved:?}"
        );
    }
}
