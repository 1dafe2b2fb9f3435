//! Table tests and proptest invariants for the lifecycle rules.

use super::*;
use dsv4_client::telemetry::GpuMemory;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const S: Duration = Duration::from_secs(1);
/// `memory.return_timeout` in the machines that wait for it.
const RETURN: Duration = Duration::from_secs(30);

fn limits() -> Limits {
    Limits {
        start_timeout: 600 * S,
        idle_timeout: 900 * S,
        stop_timeout: 120 * S,
        max_waiting: 3,
    }
}

fn fail(msg: &str) -> EngineFailure {
    EngineFailure {
        summary: msg.into(),
        tail: vec!["last line".into()],
    }
}

struct T {
    m: Machine,
    t0: Instant,
    now: Instant,
}

impl T {
    fn new() -> Self {
        let t0 = Instant::now();
        T {
            m: Machine::new("320k".into(), limits(), t0),
            t0,
            now: t0,
        }
    }
    fn at(&mut self, secs: u64) -> &mut Self {
        self.now = self.t0 + Duration::from_secs(secs);
        self
    }
    fn ev(&mut self, e: Event) -> Vec<Effect> {
        self.m.step(e, self.now)
    }
    fn state(&self) -> State {
        self.m.state()
    }
    /// A machine that waits for memory to come back, whose engine stopped at 5 s.
    fn stopped_at_5_while_memory_returns() -> T {
        let mut t = T::new();
        t.m.set_memory_return(RETURN);
        t.ready_with(&[]);
        t.ev(Event::Stop { now: false });
        t.at(5).ev(Event::Exited {
            gen: 1,
            failure: fail("gone"),
            spawned: true,
        });
        t
    }
    /// Drives a fresh machine to Ready with one lease per waiter given.
    fn ready_with(&mut self, waiters: &[WaiterId]) {
        for w in waiters {
            self.ev(Event::Acquire { waiter: *w });
        }
        if waiters.is_empty() {
            self.ev(Event::Start);
        }
        self.ev(Event::Ready { gen: 1 });
        if matches!(self.m.phase(), Phase::Restoring { .. }) {
            self.ev(Event::KvRestored { gen: 1 });
        }
        assert_eq!(self.state(), State::Ready);
    }
}

fn spawn(gen: Gen, profile: &str) -> Effect {
    Effect::Spawn {
        gen,
        profile: profile.into(),
    }
}
fn grant(gen: Gen, w: &[WaiterId]) -> Effect {
    Effect::Grant {
        gen,
        waiters: w.to_vec(),
    }
}
fn term(gen: Gen) -> Effect {
    Effect::Signal {
        gen,
        sig: Sig::Term,
    }
}

#[test]
fn first_request_spawns_once_and_all_waiters_are_granted() {
    let mut t = T::new();
    assert_eq!(t.ev(Event::Acquire { waiter: 1 }), vec![spawn(1, "320k")]);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![]);
    assert_eq!(t.ev(Event::Acquire { waiter: 3 }), vec![]);
    assert_eq!(t.state(), State::Starting);
    assert_eq!(t.ev(Event::Ready { gen: 1 }), vec![grant(1, &[1, 2, 3])]);
    assert_eq!(t.m.leases(), 3);
    assert_eq!(t.ev(Event::Acquire { waiter: 4 }), vec![grant(1, &[4])]);
}

#[test]
fn queue_beyond_max_waiting_is_refused() {
    let mut t = T::new();
    for w in 1..=3 {
        t.ev(Event::Acquire { waiter: w });
    }
    let fx = t.ev(Event::Acquire { waiter: 4 });
    assert_eq!(
        fx,
        vec![Effect::Refuse {
            waiters: vec![4],
            why: Refusal::QueueFull { max_waiting: 3 }
        }]
    );
    // a waiter that went away frees its place
    t.ev(Event::Cancel { waiter: 2 });
    assert_eq!(t.ev(Event::Acquire { waiter: 5 }), vec![]);
    assert_eq!(t.ev(Event::Ready { gen: 1 }), vec![grant(1, &[1, 3, 5])]);
}

#[test]
fn idle_counts_from_the_last_release_not_from_the_request() {
    let mut t = T::new();
    t.ready_with(&[1]);
    // the request runs for longer than idle_timeout: nothing happens
    assert_eq!(t.at(2000).ev(Event::Tick), vec![]);
    assert_eq!(t.m.idle_deadline(), None);
    t.at(2000).ev(Event::Release { gen: 1 });
    assert_eq!(t.m.idle_deadline(), Some(t.t0 + 2900 * S));
    assert_eq!(t.at(2899).ev(Event::Tick), vec![]);
    assert_eq!(t.at(2900).ev(Event::Tick), vec![term(1)]);
    assert_eq!(t.state(), State::Stopping);
    assert_eq!(
        t.at(2901).ev(Event::Exited {
            gen: 1,
            failure: fail("exit code 0"),
            spawned: true,
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Stopped);
    // the next request starts a new generation
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![spawn(2, "320k")]);
}

#[test]
fn a_request_during_stopping_waits_and_starts_the_next_engine() {
    let mut t = T::new();
    t.ready_with(&[]);
    t.at(900).ev(Event::Tick);
    assert_eq!(t.state(), State::Stopping);
    assert_eq!(t.ev(Event::Acquire { waiter: 7 }), vec![]);
    assert_eq!(
        t.ev(Event::Exited {
            gen: 1,
            failure: fail("exit code 0"),
            spawned: true,
        }),
        vec![spawn(2, "320k")]
    );
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![grant(2, &[7])]);
}

#[test]
fn stopping_escalates_to_interrupt_then_kill() {
    let mut t = T::new();
    t.m.set_interrupt_grace(Some(5 * S));
    t.ready_with(&[]);
    assert_eq!(t.ev(Event::Stop { now: false }), vec![term(1)]);
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 5 * S));
    assert_eq!(
        t.at(5).ev(Event::Tick),
        vec![Effect::Signal {
            gen: 1,
            sig: Sig::Int
        }]
    );
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 120 * S));
    assert_eq!(
        t.at(120).ev(Event::Tick),
        vec![Effect::Signal {
            gen: 1,
            sig: Sig::Kill
        }]
    );
    assert_eq!(t.m.next_deadline(), None);
    assert_eq!(t.at(200).ev(Event::Tick), vec![]);
}

#[test]
fn without_interrupt_grace_only_kill_after_the_whole_stop_timeout() {
    let mut t = T::new();
    t.ready_with(&[]);
    t.ev(Event::Stop { now: false });
    assert_eq!(t.at(119).ev(Event::Tick), vec![]);
    assert_eq!(
        t.at(120).ev(Event::Tick),
        vec![Effect::Signal {
            gen: 1,
            sig: Sig::Kill
        }]
    );
}

#[test]
fn stop_drains_in_flight_requests_first() {
    let mut t = T::new();
    t.ready_with(&[1, 2]);
    assert_eq!(t.ev(Event::Stop { now: false }), vec![]);
    assert_eq!(t.state(), State::Draining);
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![]);
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![term(1)]);
}

#[test]
fn stop_now_does_not_wait_for_leases() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert_eq!(t.ev(Event::Stop { now: true }), vec![term(1)]);
}

#[test]
fn profile_switch_drains_then_restarts_with_the_new_profile() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert_eq!(
        t.ev(Event::SetProfile {
            profile: "64k".into()
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Draining);
    // requests arriving during the drain wait for the new engine
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![]);
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![term(1)]);
    assert_eq!(
        t.ev(Event::Exited {
            gen: 1,
            failure: fail("exit code 0"),
            spawned: true,
        }),
        vec![spawn(2, "64k")]
    );
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![grant(2, &[2])]);
    assert_eq!(t.m.profile(), "64k");
}

#[test]
fn switching_back_during_the_drain_keeps_the_engine() {
    let mut t = T::new();
    t.ready_with(&[1]);
    t.ev(Event::SetProfile {
        profile: "64k".into(),
    });
    t.ev(Event::Acquire { waiter: 2 });
    assert_eq!(
        t.ev(Event::SetProfile {
            profile: "320k".into()
        }),
        vec![grant(1, &[2])]
    );
    assert_eq!(t.state(), State::Ready);
    assert_eq!(t.m.leases(), 2);
}

#[test]
fn set_profile_while_stopped_applies_at_next_start() {
    let mut t = T::new();
    assert_eq!(
        t.ev(Event::SetProfile {
            profile: "64k".into()
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.ev(Event::Start), vec![spawn(1, "64k")]);
}

#[test]
fn same_profile_is_a_no_op() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert_eq!(
        t.ev(Event::SetProfile {
            profile: "320k".into()
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Ready);
}

#[test]
fn an_engine_that_dies_twice_while_serving_with_nothing_served_backs_off() {
    let mut t = T::new();
    // Generation 1 serves, then dies: that alone is no crash loop, the waiting retry starts a
    // fresh engine at once.
    t.ready_with(&[1]);
    t.ev(Event::Served { gen: 1 });
    t.ev(Event::Release { gen: 1 });
    let fx = t.at(11).ev(Event::Exited {
        gen: 1,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        t.at(12).ev(Event::Acquire { waiter: 2 }),
        vec![spawn(2, "320k")]
    );
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![grant(2, &[2])]);
    assert_eq!(t.m.failures(), 0);
    // Generation 2 dies on the retried request, within ten minutes, with nothing delivered
    // since the first death: it backs off like a failed start.
    let fx = t.at(20).ev(Event::Exited {
        gen: 2,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(t.state(), State::Backoff);
    assert_eq!(t.m.failures(), 1);
    // A request in the backoff is refused without a spawn, and hears why.
    let fx = t.at(20).ev(Event::Acquire { waiter: 3 });
    let [Effect::Refuse {
        waiters,
        why: Refusal::Backoff { retry_after, last },
    }] = fx.as_slice()
    else {
        panic!("{fx:?}");
    };
    assert_eq!(waiters, &vec![3]);
    assert_eq!(*retry_after, BACKOFF_BASE);
    let summary = &last.as_ref().unwrap().summary;
    assert!(
        summary.starts_with("killed by SIGKILL; it died twice within 10m"),
        "{summary}"
    );
    // After it, the next try; a ready engine does not clear the count, a served answer does.
    t.at(22).ev(Event::Tick);
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.ev(Event::Acquire { waiter: 4 }), vec![spawn(3, "320k")]);
    t.ev(Event::Ready { gen: 3 });
    assert_eq!(t.m.failures(), 1);
    t.at(23).ev(Event::Exited {
        gen: 3,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    assert_eq!(t.state(), State::Backoff);
    assert_eq!(t.m.failures(), 2, "the backoff doubles");
    assert_eq!(
        t.m.phase(),
        &Phase::Backoff {
            until: t.t0 + 25 * S
        }
    );
    t.at(40).ev(Event::Tick);
    t.ev(Event::Acquire { waiter: 5 });
    t.ev(Event::Ready { gen: 4 });
    t.ev(Event::Served { gen: 4 });
    assert_eq!(t.m.failures(), 0);
    t.ev(Event::Release { gen: 4 });
    let fx = t.at(51).ev(Event::Exited {
        gen: 4,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(
        t.state(),
        State::Stopped,
        "served in between: no crash loop"
    );
}

#[test]
fn deaths_further_apart_than_the_window_are_no_crash_loop() {
    let mut t = T::new();
    t.ready_with(&[1]);
    t.ev(Event::Exited {
        gen: 1,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    t.at(1).ev(Event::Acquire { waiter: 2 });
    t.ev(Event::Ready { gen: 2 });
    let later = CRASH_WINDOW.as_secs() + 2;
    let fx = t.at(later).ev(Event::Exited {
        gen: 2,
        failure: fail("killed by SIGKILL"),
        spawned: true,
    });
    assert_eq!(fx, vec![]);
    assert_eq!(t.state(), State::Stopped);
}

#[test]
fn exit_before_ready_refuses_waiters_and_backs_off() {
    let mut t = T::new();
    t.ev(Event::Acquire { waiter: 1 });
    t.ev(Event::Acquire { waiter: 2 });
    let f = fail("exit code 1");
    let fx = t.ev(Event::Exited {
        gen: 1,
        failure: f.clone(),
        spawned: true,
    });
    assert_eq!(
        fx,
        vec![Effect::Refuse {
            waiters: vec![1, 2],
            why: Refusal::StartFailed(f.clone())
        }]
    );
    assert_eq!(t.state(), State::Backoff);
    assert_eq!(t.m.last_failure(), Some(&f));
    // during backoff requests are refused with the last failure and a retry delay
    let fx = t.at(0).ev(Event::Acquire { waiter: 3 });
    assert_eq!(
        fx,
        vec![Effect::Refuse {
            waiters: vec![3],
            why: Refusal::Backoff {
                retry_after: S,
                last: Some(f.clone())
            }
        }]
    );
    // after the backoff the next request tries again
    t.at(1).ev(Event::Tick);
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.ev(Event::Acquire { waiter: 4 }), vec![spawn(2, "320k")]);
    // a second failure doubles the delay
    t.ev(Event::Exited {
        gen: 2,
        failure: f.clone(),
        spawned: true,
    });
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 3 * S));
    // success resets the count
    t.at(3).ev(Event::Tick);
    t.ev(Event::Acquire { waiter: 5 });
    t.ev(Event::Ready { gen: 3 });
    assert_eq!(t.m.failures(), 0);
    assert_eq!(t.m.last_failure(), None);
}

#[test]
fn start_timeout_refuses_with_504_kind_then_kills_and_backs_off() {
    let mut t = T::new();
    t.ev(Event::Acquire { waiter: 1 });
    assert_eq!(t.at(599).ev(Event::Tick), vec![]);
    let fx = t.at(600).ev(Event::Tick);
    assert_eq!(
        fx,
        vec![
            Effect::Refuse {
                waiters: vec![1],
                why: Refusal::StartTimeout {
                    timeout: 600 * S,
                    tail: vec![]
                }
            },
            term(1)
        ]
    );
    // requests while the hung engine is being stopped are refused, not queued
    let fx = t.ev(Event::Acquire { waiter: 2 });
    assert!(
        matches!(
            &fx[..],
            [Effect::Refuse {
                why: Refusal::Backoff { .. },
                ..
            }]
        ),
        "{fx:?}"
    );
    t.at(601).ev(Event::Exited {
        gen: 1,
        failure: fail("killed by SIGTERM"),
        spawned: true,
    });
    assert_eq!(t.state(), State::Backoff);
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 602 * S));
}

#[test]
fn explicit_start_skips_the_backoff() {
    let mut t = T::new();
    t.ev(Event::Start);
    t.ev(Event::Exited {
        gen: 1,
        failure: fail("exit code 1"),
        spawned: true,
    });
    assert_eq!(t.state(), State::Backoff);
    assert_eq!(t.ev(Event::Start), vec![spawn(2, "320k")]);
}

#[test]
fn crash_while_ready_goes_to_stopped_and_restarts_on_demand() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert_eq!(
        t.ev(Event::Exited {
            gen: 1,
            failure: fail("killed by SIGSEGV"),
            spawned: true,
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.m.leases(), 0);
    assert_eq!(
        t.m.last_failure().map(|f| f.summary.as_str()),
        Some("killed by SIGSEGV")
    );
    // the old lease's release is harmless
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![]);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![spawn(2, "320k")]);
}

#[test]
fn stale_events_of_an_old_generation_are_ignored() {
    let mut t = T::new();
    t.ready_with(&[]);
    t.ev(Event::Stop { now: false });
    t.ev(Event::Exited {
        gen: 1,
        failure: fail("exit code 0"),
        spawned: true,
    });
    t.ev(Event::Start);
    assert_eq!(t.ev(Event::Ready { gen: 1 }), vec![]);
    assert_eq!(
        t.ev(Event::Exited {
            gen: 1,
            failure: fail("late"),
            spawned: true,
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Starting);
}

#[test]
fn stop_while_starting_cancels_the_waiters() {
    let mut t = T::new();
    t.ev(Event::Acquire { waiter: 1 });
    let fx = t.ev(Event::Stop { now: false });
    assert_eq!(
        fx,
        vec![
            Effect::Refuse {
                waiters: vec![1],
                why: Refusal::StartCancelled
            },
            term(1)
        ]
    );
}

#[test]
fn shutdown_drains_bounded_by_stop_timeout_then_exits() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert_eq!(t.ev(Event::Shutdown), vec![]);
    assert_eq!(t.state(), State::Draining);
    // new requests are refused
    let fx = t.ev(Event::Acquire { waiter: 2 });
    assert_eq!(
        fx,
        vec![Effect::Refuse {
            waiters: vec![2],
            why: Refusal::ShuttingDown
        }]
    );
    // the lease is not released in time: forced
    assert_eq!(t.at(120).ev(Event::Tick), vec![term(1)]);
    assert_eq!(
        t.at(121).ev(Event::Exited {
            gen: 1,
            failure: fail("exit code 0"),
            spawned: true,
        }),
        vec![Effect::Exit]
    );
}

#[test]
fn shutdown_when_stopped_exits_at_once() {
    let mut t = T::new();
    assert_eq!(t.ev(Event::Shutdown), vec![Effect::Exit]);
    assert_eq!(t.ev(Event::Start), vec![]);
}

#[test]
fn shutdown_while_starting_refuses_waiters_and_stops() {
    let mut t = T::new();
    t.ev(Event::Acquire { waiter: 1 });
    let fx = t.ev(Event::Shutdown);
    assert_eq!(
        fx,
        vec![
            Effect::Refuse {
                waiters: vec![1],
                why: Refusal::ShuttingDown
            },
            term(1)
        ]
    );
    assert_eq!(
        t.ev(Event::Exited {
            gen: 1,
            failure: fail("exit code 0"),
            spawned: true,
        }),
        vec![Effect::Exit]
    );
}

#[test]
fn start_during_a_pending_stop_calls_it_off() {
    let mut t = T::new();
    t.ready_with(&[1]);
    t.ev(Event::Stop { now: false });
    assert_eq!(t.state(), State::Draining);
    assert_eq!(t.ev(Event::Start), vec![]);
    assert_eq!(t.state(), State::Ready);
    assert_eq!(t.m.leases(), 1);
}

// ---- memory admission ----------------------------------------------------------------------

const GIB: u64 = 1 << 30;

/// A 320K-shaped start (87.82 GiB planned, 8 GiB reserve) that fits, or does not.
fn memory(fits: bool) -> MemoryCheck {
    MemoryCheck {
        planned: Some(88 * GIB),
        estimated: false,
        reserve: 8 * GIB,
        now: MemoryFigures {
            available: Some(if fits { 118 * GIB } else { 52 * GIB }),
            gpu: GpuMemory {
                gtt_used: Some(GIB),
                gtt_total: Some(112 * GIB),
                vram_used: Some(GIB / 4),
                vram_total: Some(GIB / 2),
            },
        },
    }
}

#[test]
fn admission_weighs_available_memory_the_reserve_and_gtt() {
    let check = |available: Option<u64>, gtt_used: Option<u64>, planned: Option<u64>| {
        MemoryCheck {
            planned,
            estimated: false,
            reserve: 8 * GIB,
            now: MemoryFigures {
                available,
                gpu: GpuMemory {
                    gtt_used,
                    gtt_total: gtt_used.map(|_| 112 * GIB),
                    ..GpuMemory::default()
                },
            },
        }
        .shortfall()
        .map(|s| s.gpu.is_some())
    };
    let p = Some(88 * GIB);
    // (available, gtt used, planned) -> None: admitted; Some(gtt?): refused, for GTT or not
    for (available, gtt, planned, want) in [
        (Some(118 * GIB), Some(GIB), p, None),
        // Exactly the reserve left.
        (Some(96 * GIB), Some(GIB), p, None),
        (Some(95 * GIB), Some(GIB), p, Some(false)),
        (Some(52 * GIB), Some(GIB), p, Some(false)),
        (Some(10 * GIB), None, p, Some(false)),
        // Enough RAM, but the GTT is taken (another process holds it).
        (Some(118 * GIB), Some(40 * GIB), p, Some(true)),
        // No figures: nothing to refuse on.
        (None, None, p, None),
        (None, Some(40 * GIB), p, Some(true)),
        // No planned_memory: never refused.
        (Some(GIB), Some(111 * GIB), None, None),
    ] {
        assert_eq!(
            check(available, gtt, planned),
            want,
            "{available:?} {gtt:?} {planned:?}"
        );
    }
    let short = memory(false).shortfall().unwrap();
    assert_eq!(
        short.describe("320k"),
        "not enough memory to start profile 320k: it needs 88.0 GiB (planned_memory), \
         52.0 GiB is available, and memory.reserve keeps 8.0 GiB free"
    );
    let mut gtt = memory(true);
    gtt.now.gpu.gtt_used = Some(82 * GIB);
    assert_eq!(
        gtt.shortfall().unwrap().describe("320k"),
        "not enough GPU memory to start profile 320k: it needs 88.0 GiB (planned_memory), \
         and the GPU has 30.0 GiB of GTT free of 112.0 GiB"
    );
}

#[test]
fn with_a_large_vram_carve_out_admission_counts_vram_not_gtt() {
    // 96 GiB of VRAM set in the BIOS: 32 GiB of system RAM left, 16 GiB of GTT.
    let carve_out = |vram_used: u64, available: u64| MemoryCheck {
        planned: Some(88 * GIB),
        estimated: false,
        reserve: 8 * GIB,
        now: MemoryFigures {
            available: Some(available * GIB),
            gpu: GpuMemory {
                gtt_used: Some(GIB / 2),
                gtt_total: Some(16 * GIB),
                vram_used: Some(vram_used * GIB),
                vram_total: Some(96 * GIB),
            },
        },
    };
    assert_eq!(carve_out(1, 25).now.gpu.pool(), Some(MemoryPool::Vram));
    assert_eq!(memory(true).now.gpu.pool(), Some(MemoryPool::Gtt));
    // The model goes to VRAM: 95 GiB free there; system RAM is not charged with it.
    assert_eq!(carve_out(1, 25).shortfall(), None);
    // Another process holds VRAM.
    let short = carve_out(20, 25).shortfall().unwrap();
    assert_eq!(short.gpu, Some((MemoryPool::Vram, 76 * GIB, 96 * GIB)));
    assert_eq!(
        short.describe("320k"),
        "not enough GPU memory to start profile 320k: it needs 88.0 GiB (planned_memory), \
         and the GPU has 76.0 GiB of VRAM free of 96.0 GiB"
    );
    // System RAM below the reserve already.
    let short = carve_out(1, 6).shortfall().unwrap();
    assert_eq!(short.gpu, None);
    assert_eq!(
        short.describe("320k"),
        "not enough memory to start profile 320k: its 88.0 GiB (planned_memory) go to VRAM, \
         but 6.0 GiB of system memory is available, and memory.reserve keeps 8.0 GiB free"
    );
}

#[test]
fn a_start_that_does_not_fit_is_refused_not_failed_and_the_next_request_tries_again() {
    let mut t = T::new();
    t.m.set_memory(memory(false));
    let short = memory(false).shortfall().unwrap();
    let fx = t.ev(Event::Acquire { waiter: 1 });
    assert_eq!(
        fx,
        vec![
            Effect::NotAdmitted {
                profile: "320k".into(),
                short
            },
            Effect::Refuse {
                waiters: vec![1],
                why: Refusal::NotEnoughMemory {
                    profile: "320k".into(),
                    short
                },
            },
        ]
    );
    // Not a failure: no backoff, nothing counted.
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.m.failures(), 0);
    // A Start (D-Bus) is refused the same way, with no waiter to tell.
    let fx = t.ev(Event::Start);
    assert!(
        matches!(fx.as_slice(), [Effect::NotAdmitted { .. }]),
        "{fx:?}"
    );
    // Memory freed: the next request starts the engine.
    t.m.set_memory(memory(true));
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![spawn(1, "320k")]);
    assert_eq!(t.state(), State::Starting);
}

#[test]
fn a_restart_after_a_profile_switch_is_admitted_on_the_figures_after_the_old_engine() {
    let mut t = T::new();
    t.ready_with(&[]);
    t.ev(Event::SetProfile {
        profile: "64k".into(),
    });
    t.ev(Event::Acquire { waiter: 7 });
    // The old engine is gone, but its memory is still held: refused, nothing spawned.
    t.m.set_memory(memory(false));
    let fx = t.ev(Event::Exited {
        gen: 1,
        failure: fail("gone"),
        spawned: true,
    });
    assert!(
        fx.iter().all(|e| !matches!(e, Effect::Spawn { .. })),
        "{fx:?}"
    );
    assert!(fx.contains(&Effect::Refuse {
        waiters: vec![7],
        why: Refusal::NotEnoughMemory {
            profile: "64k".into(),
            short: memory(false).shortfall().unwrap()
        }
    }));
    assert_eq!(t.state(), State::Stopped);
}

#[test]
fn after_an_exit_a_start_waits_for_the_memory_to_come_back() {
    let mut t = T::new();
    t.m.set_memory_return(RETURN);
    t.ready_with(&[]);
    t.ev(Event::SetProfile {
        profile: "64k".into(),
    });
    t.ev(Event::Acquire { waiter: 7 });
    // At the exit the old engine's GTT is still counted: the start waits, nothing refused.
    t.m.set_memory(memory(false));
    let fx = t.at(10).ev(Event::Exited {
        gen: 1,
        failure: fail("gone"),
        spawned: true,
    });
    assert_eq!(fx, vec![]);
    assert!(t.m.held_for_memory());
    assert_eq!(t.state(), State::Starting);
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 40 * S));
    // More requests queue behind it.
    assert_eq!(t.at(11).ev(Event::Acquire { waiter: 8 }), vec![]);
    assert_eq!(t.at(11).ev(Event::Tick), vec![]);
    // Back 2 s after the exit: the start goes ahead on the figures of then.
    t.m.set_memory(memory(true));
    assert_eq!(t.at(12).ev(Event::MemorySettled), vec![spawn(2, "64k")]);
    assert!(!t.m.held_for_memory());
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![grant(2, &[7, 8])]);
}

#[test]
fn a_start_that_failed_before_its_spawn_leaves_no_memory_to_wait_for() {
    for spawned in [false, true] {
        let mut t = T::new();
        t.m.set_memory_return(RETURN);
        t.ev(Event::Acquire { waiter: 1 });
        // Its workers could not be held (or, for the other row, its engine died at once).
        t.at(1).ev(Event::Exited {
            gen: 1,
            failure: fail("worker box 10.77.0.2: refused the hold"),
            spawned,
        });
        assert_eq!(t.state(), State::Backoff);
        let until = t.m.next_deadline().unwrap();
        t.now = until;
        t.ev(Event::Tick);
        let fx = t.ev(Event::Acquire { waiter: 2 });
        if spawned {
            assert_eq!(fx, vec![], "an engine ran: its memory is waited for");
            assert!(t.m.held_for_memory());
        } else {
            assert_eq!(
                fx,
                vec![spawn(2, "320k")],
                "nothing ran: nothing to wait for"
            );
            assert!(!t.m.held_for_memory());
        }
    }
}

#[test]
fn a_start_held_for_memory_goes_ahead_at_the_bound_and_a_stop_cancels_it() {
    // Never reported back: at memory.return_timeout the start is admitted on what is there.
    let mut t = T::stopped_at_5_while_memory_returns();
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.at(6).ev(Event::Acquire { waiter: 1 }), vec![]);
    assert_eq!(t.state(), State::Starting);
    t.m.set_memory(memory(false));
    assert_eq!(t.at(34).ev(Event::Tick), vec![]);
    let fx = t.at(35).ev(Event::Tick);
    assert!(
        matches!(
            fx.as_slice(),
            [Effect::NotAdmitted { .. }, Effect::Refuse { .. }]
        ),
        "{fx:?}"
    );
    assert_eq!(t.state(), State::Stopped);
    // Once settled, a start is at once.
    t.m.set_memory(memory(true));
    assert_eq!(
        t.at(36).ev(Event::Acquire { waiter: 2 }),
        vec![spawn(2, "320k")]
    );

    // A stop while the start is held calls it off.
    let mut t = T::stopped_at_5_while_memory_returns();
    t.at(6).ev(Event::Acquire { waiter: 1 });
    assert_eq!(
        t.at(7).ev(Event::Stop { now: false }),
        vec![Effect::Refuse {
            waiters: vec![1],
            why: Refusal::StartCancelled
        }]
    );
    assert_eq!(t.state(), State::Stopped);
    assert_eq!(t.at(8).ev(Event::MemorySettled), vec![]);
}

// ---- heat ------------------------------------------------------------------------------------

fn hot() -> Refusal {
    Refusal::TooHot {
        message: "edge 96.0 C".into(),
    }
}

fn heat(drain: Option<Duration>) -> Event {
    Event::Heat {
        message: "edge 96.0 C".into(),
        drain,
    }
}

#[test]
fn when_too_hot_an_idle_engine_stops_and_nothing_starts_until_cooled() {
    let mut t = T::new();
    t.ready_with(&[]);
    assert_eq!(t.ev(heat(None)), vec![term(1)]);
    assert_eq!(
        t.ev(Event::Acquire { waiter: 5 }),
        vec![Effect::Refuse {
            waiters: vec![5],
            why: hot()
        }]
    );
    t.ev(Event::Exited {
        gen: 1,
        failure: fail("gone"),
        spawned: true,
    });
    assert_eq!(t.state(), State::Stopped);
    // Neither a request nor Start starts it while hot.
    assert!(t.ev(Event::Start).is_empty());
    assert!(matches!(
        t.ev(Event::Acquire { waiter: 6 }).as_slice(),
        [Effect::Refuse { .. }]
    ));
    t.ev(Event::Cooled);
    assert_eq!(t.ev(Event::Acquire { waiter: 7 }), vec![spawn(2, "320k")]);
}

#[test]
fn stop_when_idle_lets_in_flight_requests_finish_and_refuses_new_ones() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert!(t.ev(heat(None)).is_empty());
    assert_eq!(t.state(), State::Draining);
    // Waiting a day changes nothing: no deadline.
    t.at(86_400);
    assert!(t.ev(Event::Tick).is_empty());
    assert!(matches!(
        t.ev(Event::Acquire { waiter: 2 }).as_slice(),
        [Effect::Refuse {
            why: Refusal::TooHot { .. },
            ..
        }]
    ));
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![term(1)]);
}

#[test]
fn cooling_down_during_the_heats_drain_calls_it_off() {
    let mut t = T::new();
    t.ready_with(&[1]);
    t.ev(heat(None));
    assert_eq!(t.state(), State::Draining);
    assert!(t.ev(Event::Cooled).is_empty());
    assert_eq!(t.state(), State::Ready);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![grant(1, &[2])]);
    // The in-flight request ends: nothing stops.
    assert!(t.ev(Event::Release { gen: 1 }).is_empty());
    assert_eq!(t.state(), State::Ready);
}

#[test]
fn stop_drains_with_a_bound_then_cuts_in_flight_requests() {
    let mut t = T::new();
    t.ready_with(&[1]);
    assert!(t.ev(heat(Some(10 * S))).is_empty());
    t.at(9);
    assert!(t.ev(Event::Tick).is_empty());
    t.at(10);
    assert_eq!(t.ev(Event::Tick), vec![term(1)]);
}

#[test]
fn heat_while_starting_cancels_the_start_and_refuses_its_waiters() {
    let mut t = T::new();
    t.ev(Event::Acquire { waiter: 1 });
    let fx = t.ev(heat(None));
    assert_eq!(
        fx,
        vec![
            Effect::Refuse {
                waiters: vec![1],
                why: hot()
            },
            term(1)
        ]
    );
}

// ---- KV checkpoint steps ------------------------------------------------------------------

/// A machine whose engines have KV checkpoints: saves bounded by 30 s, restores by 45 s.
fn kv_t() -> T {
    let mut t = T::new();
    t.m.set_kv_steps(Some(KvSteps {
        save_timeout: 30 * S,
        restore_timeout: 45 * S,
    }));
    t
}
fn restore(gen: Gen, profile: &str) -> Effect {
    Effect::RestoreKv {
        gen,
        profile: profile.into(),
    }
}
fn save(gen: Gen, profile: &str) -> Effect {
    Effect::SaveKv {
        gen,
        profile: profile.into(),
    }
}
fn exited(gen: Gen) -> Event {
    Event::Exited {
        gen,
        failure: fail("exit code 0"),
        spawned: true,
    }
}

#[test]
fn the_restore_comes_after_ready_and_before_the_first_grant() {
    let mut t = kv_t();
    assert_eq!(t.ev(Event::Acquire { waiter: 1 }), vec![spawn(1, "320k")]);
    assert_eq!(t.ev(Event::Ready { gen: 1 }), vec![restore(1, "320k")]);
    // Still a start to clients; a request arriving now waits with the first.
    assert_eq!(t.state(), State::Starting);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![]);
    assert_eq!(t.m.failures(), 0);
    // A report of another generation changes nothing.
    assert_eq!(t.ev(Event::KvRestored { gen: 7 }), vec![]);
    assert_eq!(
        t.at(3).ev(Event::KvRestored { gen: 1 }),
        vec![grant(1, &[1, 2])]
    );
    assert_eq!(t.state(), State::Ready);
    // Idle time counts from the end of the requests, after the restore.
    t.ev(Event::Release { gen: 1 });
    t.ev(Event::Release { gen: 1 });
    assert_eq!(t.m.idle_deadline(), Some(t.t0 + 903 * S));
}

#[test]
fn a_restore_past_its_timeout_serves_with_a_cold_cache() {
    let mut t = kv_t();
    t.ev(Event::Acquire { waiter: 1 });
    t.ev(Event::Ready { gen: 1 });
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 45 * S));
    assert_eq!(t.at(44).ev(Event::Tick), vec![]);
    assert_eq!(t.at(45).ev(Event::Tick), vec![grant(1, &[1])]);
    // The late report is harmless.
    assert_eq!(t.at(50).ev(Event::KvRestored { gen: 1 }), vec![]);
    assert_eq!(t.m.leases(), 1);
}

#[test]
fn an_idle_stop_saves_before_the_signal_and_the_save_is_bounded() {
    let mut t = kv_t();
    t.ready_with(&[]);
    assert_eq!(t.at(900).ev(Event::Tick), vec![save(1, "320k")]);
    assert_eq!(t.state(), State::Stopping);
    assert_eq!(t.m.next_deadline(), Some(t.t0 + 930 * S));
    assert_eq!(t.at(910).ev(Event::KvSaved { gen: 1 }), vec![term(1)]);
    assert_eq!(t.at(911).ev(exited(1)), vec![]);
    assert_eq!(t.state(), State::Stopped);

    // The next engine: a save that never reports is cut off by save_timeout.
    let mut t = kv_t();
    t.ready_with(&[]);
    assert_eq!(t.at(900).ev(Event::Tick), vec![save(1, "320k")]);
    assert_eq!(t.at(929).ev(Event::Tick), vec![]);
    assert_eq!(t.at(930).ev(Event::Tick), vec![term(1)]);
    // ... and the stop escalates as every stop does.
    let kill = Effect::Signal {
        gen: 1,
        sig: Sig::Kill,
    };
    assert_eq!(t.at(1050).ev(Event::Tick), vec![kill]);
    assert_eq!(t.at(1051).ev(Event::KvSaved { gen: 1 }), vec![]);
}

#[test]
fn a_stop_saves_when_no_request_runs_and_never_cuts_requests_to_save() {
    // stop with no lease: saved first, --now or not.
    for now in [false, true] {
        let mut t = kv_t();
        t.ready_with(&[]);
        assert_eq!(t.ev(Event::Stop { now }), vec![save(1, "320k")]);
    }
    // stop with a request in flight: drained, then saved.
    let mut t = kv_t();
    t.ready_with(&[1]);
    assert_eq!(t.ev(Event::Stop { now: false }), vec![]);
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![save(1, "320k")]);
    // --now with a request in flight cuts it: no save of a cache in the middle of work.
    let mut t = kv_t();
    t.ready_with(&[1]);
    assert_eq!(t.ev(Event::Stop { now: true }), vec![term(1)]);
    // During the save, --now signals at once.
    let mut t = kv_t();
    t.ready_with(&[]);
    t.ev(Event::Stop { now: false });
    assert_eq!(t.ev(Event::Stop { now: true }), vec![term(1)]);
}

#[test]
fn a_start_that_never_served_stops_without_a_save() {
    // Stopped while loading, and while restoring: no save, the waiters are told.
    for restoring in [false, true] {
        let mut t = kv_t();
        t.ev(Event::Acquire { waiter: 1 });
        if restoring {
            t.ev(Event::Ready { gen: 1 });
        }
        assert_eq!(
            t.ev(Event::Stop { now: false }),
            vec![
                Effect::Refuse {
                    waiters: vec![1],
                    why: Refusal::StartCancelled
                },
                term(1)
            ],
            "restoring: {restoring}"
        );
    }
}

#[test]
fn a_profile_switch_saves_the_old_engine_and_restores_into_the_new() {
    let mut t = kv_t();
    t.ready_with(&[1]);
    assert_eq!(
        t.ev(Event::SetProfile {
            profile: "64k".into()
        }),
        vec![]
    );
    assert_eq!(t.state(), State::Draining);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![]);
    assert_eq!(t.ev(Event::Release { gen: 1 }), vec![save(1, "320k")]);
    assert_eq!(t.ev(Event::KvSaved { gen: 1 }), vec![term(1)]);
    assert_eq!(t.ev(exited(1)), vec![spawn(2, "64k")]);
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![restore(2, "64k")]);
    assert_eq!(t.ev(Event::KvRestored { gen: 2 }), vec![grant(2, &[2])]);
}

#[test]
fn switching_back_during_the_save_keeps_the_engine() {
    let mut t = kv_t();
    t.ready_with(&[]);
    let to = |p: &str| Event::SetProfile { profile: p.into() };
    assert_eq!(t.ev(to("64k")), vec![save(1, "320k")]);
    assert_eq!(t.ev(Event::Acquire { waiter: 1 }), vec![]);
    assert_eq!(t.ev(to("320k")), vec![grant(1, &[1])]);
    assert_eq!(t.state(), State::Ready);
    // The save's report after that changes nothing.
    assert_eq!(t.ev(Event::KvSaved { gen: 1 }), vec![]);
    assert_eq!(t.state(), State::Ready);
}

#[test]
fn a_request_during_the_idle_stops_save_calls_the_stop_off() {
    let mut t = kv_t();
    t.ready_with(&[]);
    assert_eq!(t.at(900).ev(Event::Tick), vec![save(1, "320k")]);
    assert_eq!(t.ev(Event::Acquire { waiter: 1 }), vec![]);
    assert_eq!(t.ev(Event::Acquire { waiter: 2 }), vec![]);
    // The save ends and the same engine serves them: no signal, no reload.
    assert_eq!(
        t.at(902).ev(Event::KvSaved { gen: 1 }),
        vec![grant(1, &[1, 2])]
    );
    assert_eq!(t.state(), State::Ready);
    // Idle time counts from their end.
    t.at(903).ev(Event::Release { gen: 1 });
    t.at(904).ev(Event::Release { gen: 1 });
    assert_eq!(t.m.idle_deadline(), Some(t.t0 + 1804 * S));
    // A save that runs out its time ends the same way.
    assert_eq!(t.at(1804).ev(Event::Tick), vec![save(1, "320k")]);
    assert_eq!(t.ev(Event::Start), vec![]);
    assert_eq!(t.at(1834).ev(Event::Tick), vec![]);
    assert_eq!(t.state(), State::Ready);
}

#[test]
fn a_stop_asked_after_the_call_off_stands() {
    let mut t = kv_t();
    t.ready_with(&[]);
    t.at(900).ev(Event::Tick);
    assert_eq!(t.ev(Event::Acquire { waiter: 1 }), vec![]);
    assert_eq!(t.ev(Event::Stop { now: false }), vec![]);
    assert_eq!(t.ev(Event::KvSaved { gen: 1 }), vec![term(1)]);
    // The request still waiting starts the next engine, which gets back what was saved.
    assert_eq!(t.ev(exited(1)), vec![spawn(2, "320k")]);
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![restore(2, "320k")]);
}

#[test]
fn shutdown_saves_then_exits() {
    let mut t = kv_t();
    t.ready_with(&[]);
    assert_eq!(t.ev(Event::Shutdown), vec![save(1, "320k")]);
    assert_eq!(t.ev(Event::KvSaved { gen: 1 }), vec![term(1)]);
    assert_eq!(t.ev(exited(1)), vec![Effect::Exit]);
    // A shutdown that comes during an idle stop's save exits after it.
    let mut t = kv_t();
    t.ready_with(&[]);
    t.at(900).ev(Event::Tick);
    assert_eq!(t.ev(Event::Shutdown), vec![]);
    assert_eq!(t.ev(Event::KvSaved { gen: 1 }), vec![term(1)]);
    assert_eq!(t.ev(exited(1)), vec![Effect::Exit]);
}

#[test]
fn an_engine_that_dies_on_its_restore_is_started_again_for_the_waiters() {
    let mut t = kv_t();
    t.ev(Event::Acquire { waiter: 1 });
    t.ev(Event::Ready { gen: 1 });
    assert_eq!(t.ev(exited(1)), vec![spawn(2, "320k")]);
    assert_eq!(
        t.m.failures(),
        0,
        "the engine was ready: not a failed start"
    );
    assert_eq!(t.ev(Event::Ready { gen: 2 }), vec![restore(2, "320k")]);
    assert_eq!(t.ev(Event::KvRestored { gen: 2 }), vec![grant(2, &[1])]);
}

// ---- proptest invariants -----------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Acquire,
    /// A request takes a lease through the gate when it is open, else asks as `Acquire`.
    GateAcquire,
    Cancel(usize),
    /// A lease ends; its response went out whole (`true`) or not.
    Release(usize, bool),
    Ready,
    Exit,
    Advance(u64),
    Start,
    Stop(bool),
    Profile(bool),
    /// The memory a start would need fits (`true`) or not.
    Memory(bool),
    /// Too hot (with a drain bound, or none), or cooled.
    Heat(Option<u64>),
    Cooled,
    Shutdown,
    /// The KV restore or save asked for is over.
    KvDone,
    /// The last engine's memory came back.
    Settled,
}

fn op(forcing: bool) -> impl Strategy<Value = Op> {
    let mut ops = vec![
        (4, Just(Op::Acquire).boxed()),
        (4, Just(Op::GateAcquire).boxed()),
        (2, (0usize..64).prop_map(Op::Cancel).boxed()),
        (
            5,
            (0usize..64, any::<bool>())
                .prop_map(|(i, served)| Op::Release(i, served))
                .boxed(),
        ),
        (3, Just(Op::Ready).boxed()),
        (1, Just(Op::Exit).boxed()),
        (3, (0u64..1500).prop_map(Op::Advance).boxed()),
        (1, Just(Op::Start).boxed()),
        (1, Just(Op::Stop(false)).boxed()),
        (2, any::<bool>().prop_map(Op::Profile).boxed()),
        (2, any::<bool>().prop_map(Op::Memory).boxed()),
        (1, proptest::option::of(0u64..60).prop_map(Op::Heat).boxed()),
        (1, Just(Op::Cooled).boxed()),
        (2, Just(Op::KvDone).boxed()),
        (2, Just(Op::Settled).boxed()),
    ];
    if forcing {
        ops.push((1, Just(Op::Stop(true)).boxed()));
        ops.push((1, Just(Op::Shutdown).boxed()));
    }
    proptest::strategy::Union::new_weighted(ops)
}

/// The gate as the actor keeps it: open on the ready engine `gen` while the rules grant at
/// once, closed (its figures told as one `Passed`) before any event reaches them.
struct GateModel {
    gen: Gen,
    epoch: u64,
    held: u32,
    idle_from: Option<Instant>,
    served: bool,
}

/// A model of the world around the machine: the child process, the leases, the waiters.
struct World {
    m: Machine,
    now: Instant,
    child: Option<Gen>,
    leases: Vec<Gen>,
    /// For each lease in `leases`, the gate's epoch it was taken in, if it was.
    via_gate: Vec<Option<u64>>,
    gate: Option<GateModel>,
    epochs: u64,
    /// When a lease last ended, by either way.
    last_release: Option<Instant>,
    next_waiter: WaiterId,
    pending: BTreeSet<WaiterId>,
    answered: BTreeMap<WaiterId, u32>,
    exited: bool,
    /// The KV step asked of the child and not yet reported: a restore (`true`) or a save.
    kv_asked: Option<(Gen, bool)>,
    /// When the last child exited, while its memory is not reported back.
    unsettled_since: Option<Instant>,
}

impl World {
    fn new() -> Self {
        let now = Instant::now();
        let mut m = Machine::new("a".into(), limits(), now);
        m.set_interrupt_grace(Some(5 * S));
        m.set_kv_steps(Some(KvSteps {
            save_timeout: 30 * S,
            restore_timeout: 45 * S,
        }));
        m.set_memory_return(RETURN);
        World {
            m,
            now,
            child: None,
            leases: vec![],
            via_gate: vec![],
            gate: None,
            epochs: 0,
            last_release: None,
            next_waiter: 1,
            pending: BTreeSet::new(),
            answered: BTreeMap::new(),
            exited: false,
            kv_asked: None,
            unsettled_since: None,
        }
    }

    /// Closes the gate, telling the rules what it did (nothing else may come of it), as the
    /// actor does before each event; its leases count with the rules' from now on.
    fn close_gate(&mut self) -> Result<(), TestCaseError> {
        let Some(g) = self.gate.take() else {
            return Ok(());
        };
        for via in &mut self.via_gate {
            if *via == Some(g.epoch) {
                *via = None;
            }
        }
        let fx = self.m.step(
            Event::Passed {
                gen: g.gen,
                held: g.held,
                idle_from: g.idle_from,
                served: g.served,
            },
            self.now,
        );
        prop_assert!(fx.is_empty(), "the gate's report asked for {fx:?}");
        Ok(())
    }

    /// Opens the gate when the rules would grant a lease at once, as the actor does after
    /// each event.
    fn open_gate(&mut self) {
        if let Some(gen) = self.m.grants_at_once() {
            self.epochs += 1;
            self.gate = Some(GateModel {
                gen,
                epoch: self.epochs,
                held: 0,
                idle_from: None,
                served: false,
            });
        }
    }

    fn apply(&mut self, e: Event) -> Result<(), TestCaseError> {
        self.close_gate()?;
        self.apply_to_rules(e)?;
        self.open_gate();
        Ok(())
    }

    fn apply_to_rules(&mut self, e: Event) -> Result<(), TestCaseError> {
        let forced = matches!(e, Event::Stop { now: true } | Event::Tick | Event::Shutdown);
        match &e {
            Event::Exited {
                gen, spawned: true, ..
            } if self.m.phase().gen() == Some(*gen) => {
                self.unsettled_since = Some(self.now);
            }
            Event::MemorySettled => self.unsettled_since = None,
            _ => {}
        }
        let was_starting = matches!(self.m.phase(), Phase::Starting { .. });
        let idle_check = matches!(e, Event::Tick) && matches!(self.m.phase(), Phase::Ready { .. });
        let effects = self.m.step(e, self.now);
        if idle_check && !matches!(self.m.phase(), Phase::Ready { .. }) && self.m.hot().is_none() {
            // Stopped for idleness: a full idle_timeout after the last lease ended.
            let idle = limits().idle_timeout;
            prop_assert!(
                self.last_release.is_none_or(|t| self.now >= t + idle),
                "stopped for idleness {:?} after the last lease ended",
                self.now - self.last_release.unwrap()
            );
        }
        let leases_after = self.m.leases();
        for fx in effects {
            match fx {
                Effect::Spawn { gen, .. } => {
                    prop_assert!(
                        self.child.is_none(),
                        "spawn of {gen} while {:?} lives",
                        self.child
                    );
                    prop_assert!(
                        self.unsettled_since.is_none_or(|t| self.now >= t + RETURN),
                        "spawn of {gen} while the last engine's memory was coming back"
                    );
                    self.unsettled_since = None;
                    self.child = Some(gen);
                }
                Effect::Signal { gen, sig } => {
                    prop_assert_eq!(Some(gen), self.child, "signal to a child that is not there");
                    if sig == Sig::Term && !forced && !was_starting {
                        prop_assert_eq!(leases_after, 0, "stop while leases are held");
                        prop_assert!(
                            self.leases.iter().all(|g| *g != gen),
                            "stop while leases are held"
                        );
                    }
                }
                Effect::Grant { gen, waiters } => {
                    prop_assert_eq!(Some(gen), self.child);
                    prop_assert!(
                        matches!(self.m.phase(), Phase::Ready { .. }),
                        "grant outside ready"
                    );
                    for w in waiters {
                        self.answer(w)?;
                        self.leases.push(gen);
                        self.via_gate.push(None);
                    }
                }
                Effect::Refuse { waiters, .. } => {
                    for w in waiters {
                        self.answer(w)?;
                    }
                }
                Effect::NotAdmitted { .. } => {
                    prop_assert!(self.child.is_none(), "refused a start beside a child");
                    prop_assert!(
                        matches!(self.m.phase(), Phase::Stopped),
                        "not admitted, not stopped"
                    );
                }
                Effect::RestoreKv { gen, .. } => {
                    prop_assert_eq!(Some(gen), self.child, "restore into a child not there");
                    prop_assert_eq!(leases_after, 0, "restore while requests are served");
                    self.kv_asked = Some((gen, true));
                }
                Effect::SaveKv { gen, .. } => {
                    prop_assert_eq!(Some(gen), self.child, "save of a child not there");
                    // The save happens once no lease is held, and before the signal.
                    prop_assert_eq!(leases_after, 0, "save while a lease is held");
                    prop_assert!(
                        self.leases.iter().all(|g| *g != gen),
                        "save while a lease is held"
                    );
                    self.kv_asked = Some((gen, false));
                }
                Effect::Exit => {
                    prop_assert!(self.child.is_none(), "exit with a live child");
                    prop_assert!(!self.exited, "exit twice");
                    self.exited = true;
                }
            }
        }
        prop_assert!(self.m.waiting() <= limits().max_waiting);
        if let Phase::Ready { gen, .. } = self.m.phase() {
            // The rules count every lease on their engine but those the open gate holds.
            let held = (self.leases.iter().zip(&self.via_gate))
                .filter(|(g, via)| *g == gen && via.is_none())
                .count() as u32;
            prop_assert_eq!(held, self.m.leases(), "lease count drifted");
        }
        Ok(())
    }

    fn answer(&mut self, w: WaiterId) -> Result<(), TestCaseError> {
        prop_assert!(
            self.pending.remove(&w),
            "waiter {w} answered but was not waiting"
        );
        *self.answered.entry(w).or_default() += 1;
        Ok(())
    }

    fn run(&mut self, o: Op) -> Result<(), TestCaseError> {
        match o {
            Op::Acquire => {
                let w = self.next_waiter;
                self.next_waiter += 1;
                self.pending.insert(w);
                self.apply(Event::Acquire { waiter: w })
            }
            Op::GateAcquire => match &mut self.gate {
                Some(g) => {
                    g.held += 1;
                    self.leases.push(g.gen);
                    self.via_gate.push(Some(g.epoch));
                    Ok(())
                }
                None => self.run(Op::Acquire),
            },
            Op::Cancel(i) => {
                if let Some(w) = self
                    .pending
                    .iter()
                    .nth(i % self.pending.len().max(1))
                    .copied()
                {
                    self.pending.remove(&w);
                    self.answered.insert(w, 1);
                    self.apply(Event::Cancel { waiter: w })?;
                }
                Ok(())
            }
            Op::Release(i, served) => {
                if !self.leases.is_empty() {
                    self.release(i % self.leases.len(), served)?;
                }
                Ok(())
            }
            Op::Ready => match self.child {
                Some(gen) => self.apply(Event::Ready { gen }),
                None => Ok(()),
            },
            Op::Exit => match self.child.take() {
                Some(gen) => {
                    // Its connections fail; their leases end after its exit is told.
                    let mut at = 0;
                    while at < self.leases.len() {
                        if self.leases[at] == gen {
                            self.leases.remove(at);
                            self.via_gate.remove(at);
                        } else {
                            at += 1;
                        }
                    }
                    self.apply(Event::Exited {
                        gen,
                        failure: fail("gone"),
                        spawned: true,
                    })
                }
                None => Ok(()),
            },
            Op::Advance(secs) => {
                self.now += Duration::from_secs(secs);
                self.apply(Event::Tick)
            }
            Op::Start => self.apply(Event::Start),
            Op::Stop(now) => self.apply(Event::Stop { now }),
            Op::Profile(b) => self.apply(Event::SetProfile {
                profile: if b { "a" } else { "b" }.into(),
            }),
            Op::Memory(fits) => {
                self.m.set_memory(memory(fits));
                Ok(())
            }
            Op::Heat(drain) => self.apply(heat(drain.map(Duration::from_secs))),
            Op::Cooled => self.apply(Event::Cooled),
            Op::Shutdown => self.apply(Event::Shutdown),
            Op::Settled => self.apply(Event::MemorySettled),
            Op::KvDone => match self.kv_asked.take() {
                Some((gen, true)) => self.apply(Event::KvRestored { gen }),
                Some((gen, false)) => self.apply(Event::KvSaved { gen }),
                None => Ok(()),
            },
        }
    }

    /// The lease at `at` ends: given back to the gate it came through if that is still
    /// open, else told to the rules (after `Served` when its response went out whole).
    fn release(&mut self, at: usize, served: bool) -> Result<(), TestCaseError> {
        let (gen, via) = (self.leases[at], self.via_gate[at]);
        self.last_release = Some(self.now);
        if let Some(g) = self.gate.as_mut().filter(|g| via == Some(g.epoch)) {
            g.held -= 1;
            g.served |= served;
            if g.held == 0 {
                g.idle_from = Some(self.now);
            }
            self.leases.remove(at);
            self.via_gate.remove(at);
            return Ok(());
        }
        if served {
            // Told while the lease is still held, as the proxy does.
            self.apply(Event::Served { gen })?;
        }
        self.leases.remove(at);
        self.via_gate.remove(at);
        self.apply(Event::Release { gen })
    }

    /// Lets the world settle: engines become ready or exit when signalled, leases end,
    /// time passes. Afterwards no waiter may be left unanswered.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..50 {
            while !self.leases.is_empty() {
                self.release(self.leases.len() - 1, false)?;
            }
            match (self.m.phase().clone(), self.child) {
                (Phase::Starting { .. }, Some(gen)) => self.apply(Event::Ready { gen })?,
                (Phase::Restoring { .. } | Phase::Saving { .. }, Some(_)) => {
                    self.run(Op::KvDone)?
                }
                (Phase::Stopping { .. }, Some(gen)) => {
                    self.child = None;
                    self.apply(Event::Exited {
                        gen,
                        failure: fail("gone"),
                        spawned: true,
                    })?;
                }
                _ => {
                    self.now += Duration::from_secs(2000);
                    self.apply(Event::Tick)?;
                }
            }
        }
        prop_assert!(
            self.pending.is_empty(),
            "waiters never answered: {:?} in {:?}",
            self.pending,
            self.m.phase()
        );
        prop_assert!(
            self.answered.values().all(|n| *n == 1),
            "a waiter was answered twice"
        );
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// At most one child; every waiter answered exactly once; lease counts stay true.
    #[test]
    fn invariants_hold_under_any_event_order(ops in proptest::collection::vec(op(true), 1..80)) {
        let mut w = World::new();
        for o in ops {
            w.run(o)?;
        }
        w.settle()?;
    }

    /// Without forcing events (stop --now, shutdown), no engine is ever stopped while a
    /// lease on it is held (checked in `apply`).
    #[test]
    fn no_stop_while_a_lease_is_held(ops in proptest::collection::vec(op(false), 1..80)) {
        let mut w = World::new();
        for o in ops {
            w.run(o)?;
        }
        w.settle()?;
    }
}

/// Leases the gate gave and got back push the idle stop as leases from the rules do: the
/// engine stops a whole idle_timeout after the last one ended, not after it became ready.
#[test]
fn leases_through_the_gate_count_for_idleness() {
    let mut w = World::new();
    for op in [Op::Acquire, Op::Ready, Op::KvDone, Op::Release(0, true)] {
        w.run(op).unwrap();
    }
    assert!(w.gate.is_some(), "the gate opens on the ready engine");
    w.run(Op::Advance(600)).unwrap();
    w.run(Op::GateAcquire).unwrap();
    assert_eq!(w.via_gate, [w.gate.as_ref().map(|g| g.epoch)]);
    w.run(Op::Release(0, true)).unwrap();
    // 1,100 s after ready, 500 s after the gate's lease ended: it serves on.
    w.run(Op::Advance(500)).unwrap();
    assert!(
        matches!(w.m.phase(), Phase::Ready { .. }),
        "{:?}",
        w.m.phase()
    );
    w.run(Op::Advance(400)).unwrap();
    assert!(
        matches!(w.m.phase(), Phase::Saving { .. }),
        "{:?}",
        w.m.phase()
    );
}

#[test]
fn the_margin_is_the_tighter_side_of_the_rule_and_none_when_it_does_not_fit() {
    // 88 GiB planned, 8 GiB reserve: 118 available leaves 22 of RAM; GTT 112 - 1 - 88 = 23.
    assert_eq!(memory(true).margin(), Some(22 * GIB));
    assert_eq!(memory(false).margin(), None);
    // A smaller GTT is the tighter side.
    let mut gtt = memory(true);
    gtt.now.gpu.gtt_total = Some(100 * GIB);
    assert_eq!(gtt.margin(), Some(11 * GIB));
    // In a VRAM carve-out, RAM is not charged: 40 available less the reserve is 32, and
    // VRAM 96 - 1 - 88 = 7.
    let vram = MemoryCheck {
        planned: Some(88 * GIB),
        estimated: false,
        reserve: 8 * GIB,
        now: MemoryFigures {
            available: Some(40 * GIB),
            gpu: GpuMemory {
                gtt_used: Some(GIB / 2),
                gtt_total: Some(16 * GIB),
                vram_used: Some(GIB),
                vram_total: Some(96 * GIB),
            },
        },
    };
    assert_eq!(vram.margin(), Some(7 * GIB));
    // Nothing known, nothing said.
    let unknown = MemoryCheck {
        planned: None,
        ..memory(true)
    };
    assert_eq!(unknown.margin(), None);
}
