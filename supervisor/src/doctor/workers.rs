//! The worker boxes of each profile that spans several (`workers:`), checked from the
//! coordinator: reachable, its key accepted, the profile one that box can lend now, the same
//! dsv4 on both sides, and that box's own doctor. Each worker answers a `check` on its peers
//! port (`crate::lifecycle::peer_wire`); a sleeping box is not woken.

use super::Check;
use crate::config::{Config, Worker};
use crate::lifecycle::peer_wire::{Checked, DoctorSummary};
use crate::lifecycle::workers::{self, CheckFailed};

/// Every worker of every profile, checked (all at once).
pub async fn checks(config: &Config) -> Vec<Check> {
    let asks: Vec<(&str, &Worker)> = config
        .profiles
        .values()
        .flat_map(|p| p.workers.iter().map(move |w| (p.name.as_str(), w)))
        .collect();
    let answers = futures_util::future::join_all(asks.iter().map(|(_, w)| workers::check(w))).await;
    asks.iter()
        .zip(answers)
        .flat_map(|((profile, w), answer)| {
            worker_checks(w, answer)
                .into_iter()
                .map(|c| c.profile(*profile))
        })
        .collect()
}

/// The checks of worker `w`, from its answer.
fn worker_checks(w: &Worker, answer: Result<Checked, CheckFailed>) -> Vec<Check> {
    let host = w.host();
    let key_fix = format!(
        "put the line of {} into the peers.keys_file of {host} (or the key of that file here)",
        w.key_file.display()
    );
    let answers = || {
        Check::ok(
            "workers.reach",
            format!("worker box {host} answers at {}", w.at),
        )
    };
    let checked = match answer {
        Ok(c) => c,
        Err(CheckFailed::Reach(why)) => {
            let wake = if w.wake.is_some() {
                " (a request would wake it: `wake` is set)"
            } else {
                ""
            };
            return vec![Check::fail(
                "workers.reach",
                format!("worker box {host}: {why}{wake}"),
                format!(
                    "on {host}: systemctl enable --now dsv4.socket 'dsv4-peers@{0}.socket', \
                     with peers.keys_file set; here, if dsv4d runs in the shipped sandbox: \
                     systemctl enable --now 'dsv4-link@{0}.socket'",
                    workers::unit_escaped(&w.at)
                ),
            )];
        }
        Err(CheckFailed::Key(why)) => {
            return vec![Check::fail(
                "workers.key",
                format!("worker box {host}: {why}"),
                format!(
                    "write that box's key into {} (mode 600, owned by dsv4)",
                    w.key_file.display()
                ),
            )];
        }
        Err(CheckFailed::Refused(why)) => {
            return vec![
                answers(),
                Check::fail("workers.key", format!("worker box {host}: {why}"), key_fix),
            ];
        }
        Err(CheckFailed::Answer(why)) => {
            return vec![
                answers(),
                // It answered, but not a check's answer: another dsv4, or not dsv4 at all.
                Check::fail(
                    "workers.version",
                    format!("worker box {host}: {why}"),
                    format!(
                        "install the same dsv4 on every box, and check that {} is {host}'s \
                         peers port",
                        w.at
                    ),
                ),
            ];
        }
    };
    vec![
        answers(),
        Check::ok(
            "workers.key",
            format!(
                "worker box {host} accepts the key of {}",
                w.key_file.display()
            ),
        ),
        lends(w, &checked),
        version(host, &checked.version),
        own_doctor(host, &checked.doctor),
    ]
}

fn lends(w: &Worker, c: &Checked) -> Check {
    let host = w.host();
    match &c.not_lendable {
        None => Check::ok(
            "workers.profile",
            format!(
                "worker box {host} lends profile {} (its active profile; an engine that lends \
                 its devices)",
                w.profile
            ),
        ),
        Some(why) if c.active != w.profile => Check::warn(
            "workers.profile",
            format!("worker box {host}: {why}"),
            format!("on {host}: dsv4ctl profile {}", w.profile),
        ),
        Some(why) => Check::fail(
            "workers.profile",
            format!("worker box {host}: {why}"),
            format!(
                "on {host}: make profile {} run rpc-server (engine: rpc-server)",
                w.profile
            ),
        ),
    }
}

fn version(host: &str, theirs: &str) -> Check {
    let ours = env!("CARGO_PKG_VERSION");
    if theirs == ours {
        Check::ok(
            "workers.version",
            format!(
                "dsv4 {ours} here and on {host}; the engines' own protocol versions are \
                 checked by llama.cpp when they connect (a mismatch fails the start with \
                 `RPC server version mismatch` in the engine's lines)"
            ),
        )
    } else {
        Check::warn(
            "workers.version",
            format!("dsv4 {ours} here, {theirs} on {host}"),
            "install the same dsv4 package on every box",
        )
    }
}

fn own_doctor(host: &str, doctor: &Result<DoctorSummary, String>) -> Check {
    let fix = format!("run `dsv4ctl doctor` on {host}");
    match doctor {
        Err(why) => Check::warn("workers.doctor", format!("worker box {host}: {why}"), fix),
        Ok(d) if !d.fail.is_empty() => Check::fail(
            "workers.doctor",
            format!(
                "worker box {host}'s own doctor: {} failed: {}",
                d.fail.len(),
                d.fail.join("; ")
            ),
            fix,
        ),
        Ok(d) if !d.warn.is_empty() => Check::warn(
            "workers.doctor",
            format!(
                "worker box {host}'s own doctor: {} ok, {} warnings: {}",
                d.ok,
                d.warn.len(),
                d.warn.join("; ")
            ),
            fix,
        ),
        Ok(d) => Check::ok(
            "workers.doctor",
            format!(
                "worker box {host}'s own doctor: {} ok, nothing failed",
                d.ok
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> Worker {
        Worker {
            at: "10.77.0.2:8090".into(),
            profile: "rpc".into(),
            key_file: "/etc/dsv4/worker-keys/box2".into(),
            wake: None,
        }
    }

    fn verdicts(checks: &[Check]) -> Vec<(String, super::super::Verdict)> {
        checks.iter().map(|c| (c.id.clone(), c.verdict)).collect()
    }

    #[test]
    fn each_way_a_worker_stands_is_its_own_verdict() {
        use super::super::Verdict::*;
        let w = worker();
        let down = worker_checks(&w, Err(CheckFailed::Reach("cannot connect".into())));
        assert_eq!(verdicts(&down), [("workers.reach".into(), Fail)]);
        assert!(down[0]
            .fix
            .as_deref()
            .unwrap()
            .contains("'dsv4-peers@10.77.0.2:8090.socket'"));
        let refused = worker_checks(&w, Err(CheckFailed::Refused("the key is not one".into())));
        assert_eq!(
            verdicts(&refused),
            [("workers.reach".into(), Ok), ("workers.key".into(), Fail)]
        );
        let good = Checked {
            version: env!("CARGO_PKG_VERSION").into(),
            active: "rpc".into(),
            not_lendable: None,
            doctor: std::result::Result::Ok(DoctorSummary {
                ok: 20,
                warn: vec![],
                fail: vec![],
            }),
        };
        let all = worker_checks(&w, std::result::Result::Ok(good.clone()));
        assert!(all.iter().all(|c| c.verdict == Ok), "{all:?}");
        let elsewhere = Checked {
            active: "64k".into(),
            not_lendable: Some("profile `rpc` is not this box's active profile".into()),
            version: "0.0.1".into(),
            doctor: std::result::Result::Ok(DoctorSummary {
                ok: 3,
                warn: vec![],
                fail: vec!["files.command [rpc]: no such file".into()],
            }),
        };
        let checks = worker_checks(&w, std::result::Result::Ok(elsewhere));
        let by_id = |id: &str| checks.iter().find(|c| c.id == id).unwrap();
        assert_eq!(by_id("workers.profile").verdict, Warn);
        assert_eq!(
            by_id("workers.profile").fix.as_deref(),
            Some("on 10.77.0.2: dsv4ctl profile rpc")
        );
        assert_eq!(by_id("workers.version").verdict, Warn);
        assert_eq!(by_id("workers.doctor").verdict, Fail);
        assert!(by_id("workers.doctor")
            .found
            .contains("files.command [rpc]"));
    }
}
