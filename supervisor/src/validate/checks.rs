//! Each profile's last correctness canary (a validation's, or the one dsv4d ran after the
//! engine changed), the one due or running, what `canary.hold` refuses, and `dsv4ctl canary
//! accept`.
//!
//! Owns: `state_dir/canary/checks/<profile>.json` (the last canary that ran to its end, with
//! its run, so that an accepted drift becomes the reference without the engine), and in
//! memory the check due, running or failed, which the next start runs again.
//! Must not: run the canary (see [`super::after_change`] and the validation).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use dsv4_client::identity::IdentityStatus;
use dsv4_client::validate::{CanaryCheck, CanaryResult, CanaryRun, CanaryState};
use tokio::sync::watch;

use super::canary;

#[derive(Default)]
struct Entry {
    /// The last check that ran to its end, as kept on disk.
    kept: Option<CanaryCheck>,
    /// One due, running, or failed since.
    live: Option<CanaryCheck>,
}

/// The checks; cheap to clone.
#[derive(Clone)]
pub struct Checks {
    entries: Arc<Mutex<BTreeMap<String, Entry>>>,
    state_dir: PathBuf,
    moved: watch::Sender<u64>,
}

impl Checks {
    /// The checks kept in `state_dir`.
    pub fn load(state_dir: &Path) -> Checks {
        let mut entries = BTreeMap::new();
        for check in kept_in(state_dir) {
            let entry = Entry {
                kept: Some(check.clone()),
                live: None,
            };
            entries.insert(check.profile, entry);
        }
        Checks {
            entries: Arc::new(Mutex::new(entries)),
            state_dir: state_dir.to_path_buf(),
            moved: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        // Nothing under the lock panics half-way.
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes when a check moved.
    pub fn watch(&self) -> watch::Receiver<u64> {
        self.moved.subscribe()
    }

    /// Each profile's check as the status shows it (without the runs' tokens), `hold` being
    /// `canary.hold`.
    pub fn shown(&self, hold: bool) -> Vec<CanaryCheck> {
        self.lock()
            .values()
            .filter_map(|e| e.live.as_ref().or(e.kept.as_ref()))
            .map(|c| brief(c, hold))
            .collect()
    }

    /// The last check of `profile` that ran to its end.
    pub fn kept(&self, profile: &str) -> Option<CanaryCheck> {
        self.lock().get(profile).and_then(|e| e.kept.clone())
    }

    /// Shows `check` (due, running or failed) until the next.
    pub fn live(&self, check: CanaryCheck) {
        let profile = check.profile.clone();
        self.lock().entry(profile).or_default().live = Some(check);
        self.moved.send_modify(|n| *n += 1);
    }

    /// Forgets the live check of `profile` (its engine went before it could run).
    pub fn forget_live(&self, profile: &str) {
        if let Some(e) = self.lock().get_mut(profile) {
            e.live = None;
        }
        self.moved.send_modify(|n| *n += 1);
    }

    /// Keeps `check`, which ran to its end, as its profile's last (in memory when it cannot
    /// be written, which is said).
    pub fn keep(&self, check: CanaryCheck) {
        let file = checks_dir(&self.state_dir).join(format!("{}.json", check.profile));
        if let Err(e) = crate::host::state_file::write_json(&file, &check) {
            tracing::warn!("cannot keep the canary's check in {}: {e}", file.display());
        }
        let mut entries = self.lock();
        let entry = entries.entry(check.profile.clone()).or_default();
        entry.live = None;
        entry.kept = Some(check);
        drop(entries);
        self.moved.send_modify(|n| *n += 1);
    }

    /// Keeps a validation's canary of `profile`.
    pub fn validated(&self, profile: &str, result: &CanaryResult) {
        let check = CanaryCheck {
            profile: profile.to_string(),
            state: state_of(result),
            since: dsv4_client::clock::unix_now(),
            changed: Vec::new(),
            result: Some(result.clone()),
            error: None,
            held: false,
        };
        self.keep(check);
    }

    /// What refuses requests to `profile` while `canary.hold` (`hold`) is on: its drift.
    pub fn held(&self, profile: &str, hold: bool) -> Option<String> {
        if !hold {
            return None;
        }
        let entries = self.lock();
        let check = entries.get(profile)?.kept.as_ref()?;
        let result = check.result.as_ref()?;
        let drift = result
            .drift
            .as_ref()
            .filter(|_| check.state == CanaryState::Drifted)?;
        Some(format!(
            "profile {profile} is held (canary.hold): its answers changed since {}: {drift} \
             (the reference: {}); if the change is meant, record it with `dsv4ctl canary \
             accept {profile}`; if not, go back to the engine and model of the reference and \
             run `dsv4ctl validate --profile {profile} --canary`",
            shown_engine(&result.run.engine),
            shown_engine(&result.reference_engine),
        ))
    }

    /// Records the drifted run of `profile` as its reference (`dsv4ctl canary accept`); what
    /// was done, or why not.
    pub fn accept(&self, profile: &str) -> Result<String, String> {
        let Some(mut check) = self.kept(profile) else {
            return Err(format!(
                "profile {profile} has no canary that ran; nothing to accept"
            ));
        };
        let run = match (&check.state, &check.result) {
            (CanaryState::Drifted, Some(r)) => &r.run,
            (state, _) => {
                return Err(format!(
                    "the last canary of profile {profile} {}; only a drift is accepted",
                    match state {
                        CanaryState::Passed => "matched its reference",
                        CanaryState::Recorded => "is its reference already",
                        _ => "did not run to its end",
                    }
                ))
            }
        };
        canary::record(&self.state_dir, profile, run).map_err(|e| {
            format!(
                "cannot record the canary's reference in {}: {e}",
                self.state_dir.display()
            )
        })?;
        let engine = shown_engine(&run.engine).to_string();
        if let Some(r) = check.result.as_mut() {
            r.recorded = true;
        }
        check.state = CanaryState::Recorded;
        check.since = dsv4_client::clock::unix_now();
        self.keep(check);
        Ok(format!(
            "the canary of profile {profile} on {engine} is its reference now"
        ))
    }
}

/// The state a canary `result` leaves its profile in.
pub fn state_of(result: &CanaryResult) -> CanaryState {
    match (result.recorded, &result.drift) {
        (true, _) => CanaryState::Recorded,
        (false, Some(_)) => CanaryState::Drifted,
        (false, None) => CanaryState::Passed,
    }
}

/// `check` as the status shows it: without its run's tokens and identity (kilobytes a
/// profile, on every status), `held` while `hold` (`canary.hold`) is on and it drifted.
fn brief(check: &CanaryCheck, hold: bool) -> CanaryCheck {
    let result = check.result.as_ref().map(|r| CanaryResult {
        run: CanaryRun {
            prompts: Vec::new(),
            engine: r.run.engine.clone(),
            identity: None,
            at: r.run.at,
        },
        reference_engine: r.reference_engine.clone(),
        drift: r.drift.clone(),
        ..*r
    });
    CanaryCheck {
        profile: check.profile.clone(),
        state: check.state,
        since: check.since,
        changed: check.changed.clone(),
        result,
        error: check.error.clone(),
        held: hold && check.state == CanaryState::Drifted,
    }
}

fn shown_engine(engine: &str) -> &str {
    match engine {
        "" => "an engine not identified",
        e => e,
    }
}

/// Whether the canary is due on an engine whose identity at its start is `now`: what
/// changed since the canary last ran to its end (`last`), else since the `reference` was
/// recorded. None when nothing changed. (Without a reference nothing is due: there is
/// nothing to compare with; the callers have none to pass.)
pub fn due(
    reference: &CanaryRun,
    last: Option<&CanaryCheck>,
    now: &IdentityStatus,
) -> Option<Vec<String>> {
    let last_identity = last
        .and_then(|c| c.result.as_ref())
        .and_then(|r| r.run.identity.as_ref());
    let changed = match last_identity.or(reference.identity.as_ref()) {
        Some(then) => crate::host::identity::changes(then, &now.identity),
        // A reference without an identity: only a change since the last start says.
        None => now.changed.clone(),
    };
    (!changed.is_empty()).then_some(changed)
}

fn checks_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("canary").join("checks")
}

/// The checks kept in `state_dir`; one that cannot be read is said and left out.
pub fn kept_in(state_dir: &Path) -> Vec<CanaryCheck> {
    let dir = checks_dir(state_dir);
    let Ok(read) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<CanaryCheck> = read
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| {
            let text = crate::host::regular::read_state(&p)?;
            serde_json::from_str(&text)
                .map_err(|e| tracing::warn!("{}: {e}; that canary check is ignored", p.display()))
                .ok()
        })
        .collect();
    out.sort_by(|a, b| a.profile.cmp(&b.profile));
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use dsv4_client::identity::EngineIdentity;
    use dsv4_client::validate::Drift;

    /// A llama-server identity that differs from another by its version alone.
    pub(crate) fn identity(version: &str) -> EngineIdentity {
        EngineIdentity {
            engine: "llama-server".into(),
            version: Some(version.into()),
            ..EngineIdentity::default()
        }
    }

    fn run_on(version: Option<&str>) -> CanaryRun {
        CanaryRun {
            engine: version
                .map(|v| format!("llama-server {v}"))
                .unwrap_or_default(),
            identity: version.map(identity),
            ..CanaryRun::default()
        }
    }

    fn check(state: CanaryState, on: &str, drift: bool) -> CanaryCheck {
        CanaryCheck {
            profile: "320k".into(),
            state,
            since: 1.0,
            changed: Vec::new(),
            result: Some(CanaryResult {
                run: run_on(Some(on)),
                reference_engine: "llama-server b6801".into(),
                drift: drift.then(|| Drift {
                    prompt: 1,
                    prompt_text: "p".into(),
                    position: 3,
                    expected: "\"a\"".into(),
                    got: "\"b\"".into(),
                }),
                ..CanaryResult::default()
            }),
            error: None,
            held: false,
        }
    }

    fn started(version: &str, changed: &[&str]) -> IdentityStatus {
        IdentityStatus {
            profile: "320k".into(),
            identity: identity(version),
            first: false,
            changed: changed.iter().map(|c| c.to_string()).collect(),
        }
    }

    #[test]
    fn the_canary_is_due_when_the_engine_changed_since_it_last_ran() {
        let b1 = run_on(Some("b1"));
        let bare = run_on(None);
        let passed_b2 = check(CanaryState::Passed, "b2", false);
        let drifted_b2 = check(CanaryState::Drifted, "b2", true);
        type Row<'a> = (&'a CanaryRun, Option<&'a CanaryCheck>, IdentityStatus, bool);
        let rows: Vec<Row> = vec![
            // Against the reference, when the canary never ran since.
            (&b1, None, started("b1", &[]), false),
            (&b1, None, started("b2", &[]), true),
            // Against the last check: it ran on b2 already, passed or drifted.
            (&b1, Some(&passed_b2), started("b2", &[]), false),
            (&b1, Some(&drifted_b2), started("b2", &[]), false),
            (&b1, Some(&passed_b2), started("b3", &[]), true),
            // A reference without an identity: the change since the last start says.
            (&bare, None, started("b2", &[]), false),
            (&bare, None, started("b2", &["b1 -> b2"]), true),
        ];
        for (i, (reference, last, now, want)) in rows.into_iter().enumerate() {
            let got = due(reference, last, &now);
            assert_eq!(got.is_some(), want, "row {i}: {got:?}");
        }
        let said = due(&b1, None, &started("b2", &[])).unwrap();
        assert_eq!(said, vec!["llama-server b1 -> llama-server b2"]);
    }

    #[test]
    fn a_drift_holds_its_profile_until_accepted_and_only_a_drift_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let checks = Checks::load(dir.path());
        assert_eq!(checks.held("320k", true), None);
        let e = checks.accept("320k").unwrap_err();
        assert!(e.contains("has no canary that ran"), "{e}");

        checks.keep(check(CanaryState::Passed, "b2", false));
        assert_eq!(checks.held("320k", true), None);
        let e = checks.accept("320k").unwrap_err();
        assert!(e.contains("matched its reference"), "{e}");

        checks.keep(check(CanaryState::Drifted, "b2", true));
        assert_eq!(checks.held("320k", false), None, "hold off");
        let why = checks.held("320k", true).unwrap();
        assert!(
            why.contains("since llama-server b2: canary drift at prompt 1"),
            "{why}"
        );
        assert!(why.contains("dsv4ctl canary accept 320k"), "{why}");
        assert!(checks.shown(true)[0].held);
        assert!(!checks.shown(false)[0].held);
        // Kept across a restart.
        let again = Checks::load(dir.path());
        assert!(again.held("320k", true).is_some());

        let said = checks.accept("320k").unwrap();
        assert!(
            said.contains("on llama-server b2 is its reference now"),
            "{said}"
        );
        assert_eq!(checks.held("320k", true), None);
        let reference = canary::reference(dir.path(), "320k").unwrap();
        assert_eq!(reference.engine, "llama-server b2");
        assert_eq!(
            Checks::load(dir.path()).kept("320k").unwrap().state,
            CanaryState::Recorded
        );
        let e = checks.accept("320k").unwrap_err();
        assert!(e.contains("is its reference already"), "{e}");
    }

    #[test]
    fn a_live_check_is_shown_over_the_kept_one_and_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let checks = Checks::load(dir.path());
        checks.keep(check(CanaryState::Passed, "b2", false));
        let mut waiting = check(CanaryState::Waiting, "b3", false);
        waiting.result = None;
        waiting.changed = vec!["llama-server b2 -> llama-server b3".into()];
        checks.live(waiting);
        assert_eq!(checks.shown(false)[0].state, CanaryState::Waiting);
        assert_eq!(checks.kept("320k").unwrap().state, CanaryState::Passed);
        checks.forget_live("320k");
        assert_eq!(checks.shown(false)[0].state, CanaryState::Passed);
        let kept = kept_in(dir.path());
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].state, CanaryState::Passed);
    }
}
