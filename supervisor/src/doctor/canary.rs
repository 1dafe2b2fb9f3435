//! Each profile's correctness canary: its last check against the reference, and whether the
//! engine changed since the canary last ran (`state_dir/canary/`, its `checks/`, and
//! `state_dir/identity.json`).

use dsv4_client::identity::{EngineIdentity, IdentityStatus};
use dsv4_client::validate::{CanaryCheck, CanaryRun, CanaryState};
use dsv4_engine::ValidationApi;

use super::Check;
use crate::config::Config;

const ID: &str = "canary";

/// One check per profile with a recorded canary (a profile's first validation records it).
pub fn checks(config: &Config) -> Vec<Check> {
    let dir = &config.supervisor.state_dir;
    let identities = crate::host::identity::load(dir);
    let kept = crate::validate::checks::kept_in(dir);
    config
        .profiles
        .values()
        .filter(|p| !matches!(p.engine.describe().validation, ValidationApi::Lends))
        .filter_map(|p| {
            let reference = crate::validate::canary_reference(dir, &p.name)?;
            let last = kept.iter().find(|c| c.profile == p.name);
            let now = identities.get(&p.name);
            Some(judge(&p.name, &reference, last, now))
        })
        .collect()
}

/// The check of `profile` by its canary's `reference`, its `last` check, and the identity
/// of its engine at its last start (`now`).
fn judge(
    profile: &str,
    reference: &CanaryRun,
    last: Option<&CanaryCheck>,
    now: Option<&EngineIdentity>,
) -> Check {
    let drift = last
        .filter(|c| c.state == CanaryState::Drifted)
        .and_then(|c| c.result.as_ref())
        .and_then(|r| r.drift.as_ref().map(|d| (r, d)));
    if let Some((result, d)) = drift {
        return Check::fail(
            ID,
            format!(
                "the last canary, on {}, drifted from its reference ({}): {d}",
                result.run.engine, reference.engine
            ),
            format!(
                "if the change is meant (a new model, a fixed engine), record the new \
                 reference: dsv4ctl canary accept {profile} (or run it again and record it: \
                 dsv4ctl validate --profile {profile} --canary --record); if not, go back to \
                 the engine and model of the reference ({}) and run dsv4ctl validate \
                 --profile {profile} --canary",
                reference.engine
            ),
        )
        .profile(profile);
    }
    let started = now.map(|identity| IdentityStatus {
        profile: profile.to_string(),
        identity: identity.clone(),
        first: false,
        changed: Vec::new(),
    });
    let changed = started
        .and_then(|s| crate::validate::checks::due(reference, last, &s))
        .unwrap_or_default();
    if !changed.is_empty() {
        return Check::warn(
            ID,
            format!(
                "the engine changed since the canary last ran: {}",
                changed.join("; ")
            ),
            format!(
                "dsv4d runs it once the engine is idle after its next start; or now: dsv4ctl \
                 validate --profile {profile} --canary"
            ),
        )
        .profile(profile);
    }
    let found = match last.and_then(|c| c.result.as_ref().map(|r| (c.state, r))) {
        Some((CanaryState::Passed, r)) => {
            format!("the last canary matched its reference ({})", r.run.engine)
        }
        _ => format!("the canary's reference is recorded ({})", reference.engine),
    };
    Check::ok(ID, found).profile(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::checks::tests::identity;
    use dsv4_client::doctor::Verdict;
    use dsv4_client::validate::{CanaryResult, Drift};

    #[test]
    fn each_canary_state_has_its_verdict_and_fix() {
        let reference = CanaryRun {
            engine: "llama-server 1".into(),
            identity: Some(identity("1")),
            ..CanaryRun::default()
        };
        let check = |state, drift: Option<Drift>| CanaryCheck {
            profile: "320k".into(),
            state,
            since: 1.0,
            changed: Vec::new(),
            result: Some(CanaryResult {
                run: reference.clone(),
                drift,
                ..CanaryResult::default()
            }),
            error: None,
            held: false,
        };
        let passed = check(CanaryState::Passed, None);
        let drifted = check(
            CanaryState::Drifted,
            Some(Drift {
                prompt: 1,
                position: 3,
                ..Drift::default()
            }),
        );
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
        assert!(fix.contains("dsv4ctl canary accept 320k"), "{fix}");
        let moved = judge("320k", &reference, Some(&passed), Some(&two));
        assert_eq!(moved.verdict, Verdict::Warn, "{moved:?}");
        assert!(
            moved.found.contains("llama-server 1 -> llama-server 2"),
            "{moved:?}"
        );
    }
}
