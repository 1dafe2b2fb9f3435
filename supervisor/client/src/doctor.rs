//! `dsv4ctl doctor`'s findings: one [`Check`] per promise the machine must keep.
//!
//! `dsv4d --doctor` makes the checks that need the daemon's own code (its configuration
//! loader, its admission rules, its sysfs readers), as the service user inside the service's
//! sandbox when `dsv4ctl doctor` runs it there, and prints them as JSON; `dsv4ctl` adds its
//! own (the daemon over D-Bus, the caller's groups) and prints them all. Owns: the shape of a
//! finding and its verdict. Must not: make a check (the daemon's `doctor` module does).

use serde::{Deserialize, Serialize};

/// How a check came out, from best to worst; a run fails when one check failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The promise holds.
    Ok,
    /// It could not be looked at here (no such hardware, no permission to read the journal):
    /// `found` says why. Not a failure.
    Skip,
    /// It holds, but something is known to go wrong with what was found.
    Warn,
    /// It does not hold: the engine would not start, or would fail once started.
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Skip => "skip",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// A change the doctor can make itself with `--fix`: a systemd drop-in for the service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropIn {
    /// The unit it is for: `dsv4.service`.
    pub unit: String,
    /// Its file name in the unit's `.d` folder: `50-doctor-paths.conf`.
    pub name: String,
    /// Its whole text.
    pub text: String,
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// A stable name, `group.what`: `files.model`, `memory.fit`, `power.ppd_amdgpu_dpm`.
    pub id: String,
    /// The profile it is about, for a check made once per profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    pub verdict: Verdict,
    /// What was found, with its figures: one line.
    pub found: String,
    /// For a warning or a failure: what to do (the command, the kernel parameter, the
    /// drop-in), exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// Where the advice comes from, when it is other people's finding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The fix `dsv4ctl doctor --fix` may write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_in: Option<DropIn>,
}

impl Check {
    pub fn new(id: impl Into<String>, verdict: Verdict, found: impl Into<String>) -> Check {
        Check {
            id: id.into(),
            profile: None,
            verdict,
            found: found.into(),
            fix: None,
            source: None,
            drop_in: None,
        }
    }

    pub fn ok(id: impl Into<String>, found: impl Into<String>) -> Check {
        Check::new(id, Verdict::Ok, found)
    }

    pub fn skip(id: impl Into<String>, found: impl Into<String>) -> Check {
        Check::new(id, Verdict::Skip, found)
    }

    pub fn warn(id: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(id, Verdict::Warn, found).fix(fix)
    }

    pub fn fail(id: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(id, Verdict::Fail, found).fix(fix)
    }

    pub fn fix(mut self, fix: impl Into<String>) -> Check {
        self.fix = Some(fix.into());
        self
    }

    pub fn profile(mut self, profile: impl Into<String>) -> Check {
        self.profile = Some(profile.into());
        self
    }

    pub fn source(mut self, source: impl Into<String>) -> Check {
        self.source = Some(source.into());
        self
    }

    pub fn drop_in(mut self, drop_in: DropIn) -> Check {
        self.drop_in = Some(drop_in);
        self
    }
}

/// The worst verdict of `checks` (`Ok` for none).
pub fn worst(checks: &[Check]) -> Verdict {
    checks
        .iter()
        .map(|c| c.verdict)
        .max()
        .unwrap_or(Verdict::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_order_and_round_trip() {
        let checks = vec![
            Check::ok("a.b", "fine"),
            Check::warn("a.c", "hm", "do this").source("someone"),
        ];
        assert_eq!(worst(&checks), Verdict::Warn);
        assert_eq!(worst(&[]), Verdict::Ok);
        let json = serde_json::to_string(&checks).unwrap();
        assert!(json.contains(r#""verdict":"warn""#), "{json}");
        assert!(!json.contains("drop_in"), "{json}");
        let back: Vec<Check> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, checks);
        assert!(Verdict::Fail > Verdict::Warn && Verdict::Warn > Verdict::Skip);
    }
}
