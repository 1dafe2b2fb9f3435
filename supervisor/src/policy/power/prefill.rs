//! `power.prefill`: another CPU profile while a request is long in its prefill.
//!
//! A prefill is compute-bound where decode is bandwidth-bound: on Strix Halo prompt
//! processing ran 29% faster on performance than on the quiet profile, with generation
//! unchanged. So the CPU stays on `power.cpu` (power-saver) for decode and for short
//! prompts, and goes to `power.prefill` once a request has been with the engine for
//! `power.prefill_after` without the first event of its answer; back to `power.cpu` when no
//! request is.
//!
//! Owns: the decision ([`due`]) and the switch, through whichever method the engine's start
//! chose. With power-profiles-daemon the new profile is held before the old hold is
//! released (where both are held power-saver wins, so there is no moment on the user's own
//! profile); with cpufreq the policies dsv4d set are set again, and what they are set to is
//! saved, so that the stop gives the user's settings back as ever. Must not: switch what the
//! user chose by hand (a released hold stays released, a policy changed by hand is left).

use std::time::Duration;

use dsv4_client::AlertKind;
use tokio::time::Instant;

use super::{cpufreq, Method, Task, HOLD_APP, PREFILL_REASON};
use crate::config::CpuPolicy;

/// Whether `power.prefill`'s profile is due at `now`: the request longest in its prefill
/// (sent at `oldest`) has been for `after` or longer. When not yet, when to look again.
pub fn due(oldest: Option<Instant>, after: Duration, now: Instant) -> (bool, Option<Instant>) {
    match oldest {
        None => (false, None),
        Some(sent) if now.saturating_duration_since(sent) >= after => (true, None),
        Some(sent) => (false, Some(sent + after)),
    }
}

/// power-profiles-daemon's name for `cpu`, where it has one.
pub(super) fn ppd_profile(cpu: CpuPolicy) -> Option<&'static str> {
    match cpu {
        CpuPolicy::PowerSaver => Some("power-saver"),
        CpuPolicy::Performance => Some("performance"),
        CpuPolicy::Balanced | CpuPolicy::Keep => None,
    }
}

/// What the power policy does with the requests' prefills now.
pub(super) enum Prefills {
    /// Nothing: no engine with `power.prefill`, or a method that cannot switch, or a hold
    /// the user released.
    Ignored,
    /// Follows them, and looks again at `recheck` if no request's prefill begins or ends
    /// before.
    Followed { recheck: Option<Instant> },
}

impl Task {
    /// Follows the requests' prefills (see the module's text).
    pub(super) async fn follow_prefill(&mut self) -> Prefills {
        let Some(applied) = self.applied.as_ref() else {
            return Prefills::Ignored;
        };
        let Some(prefill) = applied.wanted.prefill else {
            return Prefills::Ignored;
        };
        if applied.released_by_user || applied.method == Method::None {
            return Prefills::Ignored;
        }
        let oldest = self.parts.flights.oldest_prefill();
        let (now_due, recheck) = due(oldest, applied.wanted.prefill_after, Instant::now());
        if now_due != applied.prefill {
            let (to, why) = if now_due {
                let after = dsv4_client::duration::format(applied.wanted.prefill_after);
                (
                    prefill,
                    format!("a request has been in its prefill for {after}"),
                )
            } else {
                (
                    applied.wanted.cpu,
                    "no request is long in its prefill".into(),
                )
            };
            self.switch_cpu(to, now_due, &why).await;
        }
        Prefills::Followed { recheck }
    }

    /// The CPU on `to` (`prefill`: as `power.prefill`), through the method in force.
    async fn switch_cpu(&mut self, to: CpuPolicy, prefill: bool, why: &str) {
        let Some(method) = self.applied.as_ref().map(|a| a.method) else {
            return;
        };
        tracing::info!("power: {why}: the CPU on {}", to.as_str());
        let done = match method {
            Method::Ppd => self.switch_hold(to, prefill).await,
            Method::Cpufreq => self.switch_cpufreq(to).await,
            Method::None => false,
        };
        if let Some(applied) = self.applied.as_mut() {
            // Tried once per change of phase: a switch that failed is not tried again at
            // every wake-up.
            applied.prefill = prefill;
        }
        if done {
            self.update(|s| s.prefill = prefill);
        }
    }

    /// Holds `to`'s profile, then releases the hold it replaces.
    async fn switch_hold(&mut self, to: CpuPolicy, prefill: bool) -> bool {
        let Some(ppd) = self.applied.as_ref().and_then(|a| a.ppd.clone()) else {
            return false;
        };
        let (reason, phase) = match prefill {
            true => (PREFILL_REASON, "a long prefill"),
            false => (super::HOLD_REASON, "the rest of the run"),
        };
        let new = match ppd_profile(to) {
            Some(profile) => match ppd.hold(profile, reason, HOLD_APP).await {
                Ok(cookie) => Some(cookie),
                Err(e) => {
                    let message = format!(
                        "power: cannot hold {profile} through {} for {phase}: {e}",
                        ppd.service
                    );
                    tracing::warn!("{message}");
                    self.parts.alerts.raise(AlertKind::Power, message);
                    return false;
                }
            },
            None => None,
        };
        let old = self
            .applied
            .as_mut()
            .and_then(|a| std::mem::replace(&mut a.hold, new));
        if let Some(cookie) = old {
            if let Err(e) = ppd.release(cookie).await {
                tracing::warn!("power: releasing the hold on {}: {e}", ppd.service);
            }
        }
        self.update(|s| {
            s.cpu = new.map(|_| format!("{} held through {}", to.as_str(), ppd.service));
            s.held = new.is_some();
        });
        true
    }

    /// Sets the policies dsv4d set for the engine to `to`'s governor and EPP (those changed
    /// by hand meanwhile are left), and saves what they are now set to.
    async fn switch_cpufreq(&mut self, to: CpuPolicy) -> bool {
        let Some((governor, epp)) = cpufreq::target(to) else {
            return false;
        };
        let now = cpufreq::read(&self.parts.sysroot);
        let Some(applied) = self.applied.as_mut() else {
            return false;
        };
        let set: Vec<cpufreq::PolicySettings> = applied
            .restore
            .cpufreq_set
            .iter()
            .filter(|s| now.contains(s))
            .map(|s| cpufreq::PolicySettings {
                policy: s.policy.clone(),
                governor: governor.to_string(),
                epp: s.epp.as_ref().map(|_| epp.to_string()),
            })
            .collect();
        for s in applied.restore.cpufreq_set.iter_mut() {
            if let Some(new) = set.iter().find(|n| n.policy == s.policy) {
                *s = new.clone();
            }
        }
        if let Err(e) = applied.restore.save(&applied.state_dir) {
            tracing::warn!("power: cannot write {}: {e}", super::RESTORE_FILE);
        }
        self.set_cpufreq(&set, to, None).await;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_after_the_oldest_prefill_has_lasted_prefill_after() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (oldest sent, after, now, due, look again at)
        let cases = [
            (None, s(30), t0 + s(100), false, None),
            (Some(t0), s(30), t0, false, Some(t0 + s(30))),
            (Some(t0), s(30), t0 + s(29), false, Some(t0 + s(30))),
            (Some(t0), s(30), t0 + s(30), true, None),
            (Some(t0), s(30), t0 + s(3600), true, None),
            (Some(t0), s(0), t0, true, None),
            // A clock read before the request was sent (another thread's).
            (Some(t0 + s(5)), s(30), t0, false, Some(t0 + s(35))),
        ];
        for (i, (oldest, after, now, want, again)) in cases.into_iter().enumerate() {
            assert_eq!(due(oldest, after, now), (want, again), "case {i}");
        }
    }

    #[test]
    fn ppd_holds_only_power_saver_and_performance() {
        assert_eq!(ppd_profile(CpuPolicy::PowerSaver), Some("power-saver"));
        assert_eq!(ppd_profile(CpuPolicy::Performance), Some("performance"));
        assert_eq!(ppd_profile(CpuPolicy::Balanced), None);
        assert_eq!(ppd_profile(CpuPolicy::Keep), None);
    }
}
