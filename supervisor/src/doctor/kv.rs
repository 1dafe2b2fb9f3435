//! Whether each profile's KV checkpoint restores are used: the checks the daemon made of its
//! last restores (`state_dir/kv-restore-checks.json`, [`crate::kv::checks`]). A profile whose
//! restores keep missing pays a save at every stop and gets nothing back at the next start.

use dsv4_engine::KvKeeping;

use super::Check;
use crate::config::Config;
use crate::kv::checks;

/// Misses in a row that make a pattern, not an accident.
const KEEP_MISSING: usize = 2;

/// One check per profile that keeps checkpoints through the engine's slots.
pub fn checks(config: &Config) -> Vec<Check> {
    let kept = checks::read(&config.supervisor.state_dir);
    config
        .profiles
        .values()
        .filter(|p| p.kv_checkpoint.is_some() && matches!(p.engine.describe().kv, KvKeeping::Slots))
        .map(|p| judge(&p.name, kept.get(&p.name).map_or(&[][..], Vec::as_slice)))
        .collect()
}

/// The check of `profile` by its kept `checks` (oldest first).
fn judge(profile: &str, checks: &[dsv4_client::kv::RestoreCheck]) -> Check {
    let id = "kv.restore";
    let Some(last) = checks.last() else {
        return Check::skip(
            id,
            "no restore has been checked yet: the first request that shares a restored \
             conversation's tokens checks it",
        )
        .profile(profile);
    };
    let missed = checks::misses_in_a_row(checks);
    if missed < KEEP_MISSING {
        let found = format!(
            "the last restore checked: the next request reused {} of the {} tokens it shared \
             with it{}",
            last.reused,
            last.shared,
            if last.missed { " (a miss)" } else { "" }
        );
        return Check::ok(id, found).profile(profile);
    }
    Check::warn(
        id,
        format!(
            "the last {missed} restores did nothing: the next request reused {} of the {} \
             tokens it shared with the last one, so every prefill after an idle stop runs \
             again, and each stop's save buys nothing",
            last.reused, last.shared
        ),
        format!(
            "llama-server's slot restore does this on SWA and hybrid models and on some dense \
             ones: try a newer llama-server build; until one works, remove kv_checkpoint from \
             profile {profile} (its saves cost time at every stop)"
        ),
    )
    .source("llama.cpp issues #25913, #28194 and #26676")
    .profile(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_client::doctor::Verdict;
    use dsv4_client::kv::RestoreCheck;

    fn check(missed: bool) -> RestoreCheck {
        RestoreCheck {
            at: 1.0,
            reused: if missed { 14 } else { 99_000 },
            shared: 100_000,
            missed,
        }
    }

    #[test]
    fn restores_that_keep_missing_are_a_warning_with_the_way_out() {
        let rows: &[(&[bool], Verdict)] = &[
            (&[], Verdict::Skip),
            (&[false], Verdict::Ok),
            (&[true], Verdict::Ok),
            (&[true, false], Verdict::Ok),
            (&[false, true, true], Verdict::Warn),
            (&[true, true, true], Verdict::Warn),
        ];
        for (missed, want) in rows {
            let kept: Vec<_> = missed.iter().map(|m| check(*m)).collect();
            let c = judge("320k", &kept);
            assert_eq!(c.verdict, *want, "{missed:?}: {c:?}");
            assert_eq!(c.profile.as_deref(), Some("320k"));
        }
        let c = judge("320k", &[check(true), check(true), check(true)]);
        assert!(
            c.found.starts_with("the last 3 restores did nothing"),
            "{}",
            c.found
        );
        assert!(c.found.contains("reused 14 of the 100000"), "{}", c.found);
        assert!(c
            .fix
            .unwrap()
            .contains("remove kv_checkpoint from profile 320k"));
    }
}
