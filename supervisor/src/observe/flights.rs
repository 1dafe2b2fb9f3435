//! The requests in flight, each with where it is: waiting (for a start, a drain, a
//! validation or a place at the engine), loading, prefill (how far, as the engine tells),
//! decoding (events so far) or ending. `/status`, D-Bus, `dsv4ctl status` and `top`, the
//! dashboard and `/metrics` show them.
//!
//! Owns: the [`Flights`] register and each request's [`Flight`] record. A request's
//! [`Ticket`] is its place in the register: the proxy takes it when the request's body is
//! read, moves it along as the request goes (its lease, the engine's head, the events of
//! its stream) and drops it with the answer's body. What a record does not hold is read at
//! [`Flights::in_progress`] time, not kept up to date on the request's path: whether its
//! wait is for a load (the lifecycle's [`Loading`]) or for what else, and, for an engine
//! that tells its prefill in its output lines (ds4-server), how far the prefill has got.
//!
//! A prefill that outlasts `notify.long_request` raises an alert when it ends (decode
//! started) and when its answer ends or fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4_client::words::{Phase, WaitingFor};
use dsv4_client::{AlertKind, InProgress, PrefillProgress, State};
use dsv4_engine::{Prefill, PrefillLine, PrefillReport};
use slab::Slab;
use tokio::time::Instant;

use crate::lifecycle::alert::Alerts;
use crate::lifecycle::loading::Loading;
use crate::lifecycle::EngineRef;

/// The register of requests in flight; cheap to clone.
#[derive(Clone, Default)]
pub struct Flights {
    inner: Arc<Register>,
}

#[derive(Default)]
struct Register {
    /// The requests themselves, in one lock: a request's own updates are a few a second
    /// at most (its stream's chunks), and each is a few stores.
    flights: Mutex<Slab<Flight>>,
    /// The number the next request gets, less one.
    count: AtomicU64,
    alerts: Alerts,
    /// Told when a request begins its prefill or ends it (its first event, or its end):
    /// what [`Flights::oldest_prefill`] says may have changed. One listener (the power
    /// policy's `power.prefill`); a change while it is not waiting is kept for it.
    prefills: tokio::sync::Notify,
}

impl Register {
    fn prefills_changed(&self) {
        self.prefills.notify_one();
    }
}

/// One request in flight.
struct Flight {
    id: u64,
    /// Its target (shared with the request's: no copy), for its path.
    uri: http::Uri,
    stream: bool,
    came: Instant,
    /// A prefill longer than this raises alerts (`notify.long_request`).
    long: Option<Duration>,
    now: Now,
}

/// Where a request is, as its own path moves it.
#[derive(Default)]
struct Now {
    stage: Stage,
    /// The engine it was sent to, and its output's line count then (the lines of its
    /// prefill come after).
    engine: Option<(Arc<EngineRef>, u64)>,
    sent: Option<Instant>,
    /// The latest progress its stream told, and when it was first told.
    prefill: Option<(Prefill, Instant)>,
    /// How long its prefill took (the lease to the first event of its answer).
    prefilled: Option<Duration>,
    /// Events of the answer so far.
    tokens: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Stage {
    /// Before its lease.
    #[default]
    Waiting,
    /// With the engine, before the first event of its answer.
    Sent,
    Decoding,
    Ending,
}

/// A request's place in the register; dropping it takes the request out.
pub struct Ticket {
    key: usize,
    register: Arc<Register>,
    /// Its record's `came` and `long`, to tell without the lock that its prefill cannot
    /// have been long (nearly every request's end).
    came: Instant,
    long: Option<Duration>,
}

impl Flights {
    /// A register whose long-prefill alerts go to `alerts`.
    pub fn new(alerts: Alerts) -> Flights {
        Flights {
            inner: Arc::new(Register {
                alerts,
                ..Default::default()
            }),
        }
    }

    /// Registers a request for `uri` that came at `came`, its body read.
    pub fn enter(
        &self,
        uri: &http::Uri,
        stream: bool,
        long: Option<Duration>,
        came: Instant,
    ) -> Ticket {
        let id = self.inner.count.fetch_add(1, Ordering::Relaxed) + 1;
        // The request's span carries its number (see `crate::log::journal`).
        if crate::log::journal::enabled() {
            tracing::Span::current().record("request_id", id);
        }
        let flight = Flight {
            id,
            uri: uri.clone(),
            stream,
            came,
            long,
            now: Now::default(),
        };
        let key = lock(&self.inner.flights).insert(flight);
        Ticket {
            key,
            register: self.inner.clone(),
            came,
            long,
        }
    }

    /// When the request longest in its prefill (with the engine, before the first event of
    /// its answer) was sent; `None` when none is.
    pub fn oldest_prefill(&self) -> Option<Instant> {
        lock(&self.inner.flights)
            .iter()
            .filter(|(_, f)| f.now.stage == Stage::Sent)
            .filter_map(|(_, f)| f.now.sent)
            .min()
    }

    /// Ready once [`Flights::oldest_prefill`] may have changed since the last time it was
    /// (for one listener).
    pub async fn prefills_changed(&self) {
        self.inner.prefills.notified().await
    }

    /// The requests in flight, oldest first, as the status shows them. `loading` is the
    /// engine that loads, `state` the lifecycle's, `validating` whether a validation holds
    /// the engine.
    pub fn in_progress(
        &self,
        loading: Option<&Loading>,
        state: State,
        validating: bool,
    ) -> Vec<InProgress> {
        let flights = lock(&self.inner.flights);
        let mut flights: Vec<&Flight> = flights.iter().map(|(_, f)| f).collect();
        flights.sort_by_key(|f| f.id);
        let at = Instant::now();
        let waiting = Waiting {
            loading,
            state,
            validating,
        };
        // An engine that tells its prefill in its output serves one prompt at a time: its
        // lines are about the oldest request it holds.
        let mut lines_read: Vec<u32> = Vec::new();
        flights
            .iter()
            .map(|f| {
                let now = &f.now;
                let mut shown = f.shown(now, at, &waiting);
                if let (Stage::Sent, Some((engine, mark))) = (now.stage, &now.engine) {
                    if let PrefillReport::Lines(read) = engine.kind.prefill {
                        if !lines_read.contains(&engine.pid) {
                            lines_read.push(engine.pid);
                            prefill_from_lines(&mut shown, engine, *mark, read);
                        }
                    }
                }
                shown
            })
            .collect()
    }
}

/// What a waiting request may be waiting for, read once for all of them.
struct Waiting<'a> {
    loading: Option<&'a Loading>,
    state: State,
    validating: bool,
}

impl Flight {
    fn shown(&self, now: &Now, at: Instant, waiting: &Waiting) -> InProgress {
        let mut shown = InProgress {
            id: self.id,
            path: self.uri.path().to_string(),
            stream: self.stream,
            profile: now.engine.as_ref().map(|(e, _)| e.profile.clone()),
            age_s: round(at.saturating_duration_since(self.came).as_secs_f64()),
            phase: Phase::Waiting,
            waiting_for: None,
            loading_s: None,
            loading_about_s: None,
            prefill: None,
            tokens: now.tokens,
        };
        match now.stage {
            Stage::Waiting => match waiting.loading {
                Some(l) if !waiting.validating => {
                    shown.phase = Phase::Loading;
                    shown.profile = Some(l.profile.clone());
                    shown.loading_s =
                        Some(round(at.saturating_duration_since(l.since).as_secs_f64()));
                    shown.loading_about_s = l.about.map(|d| round(d.as_secs_f64()));
                }
                _ => {
                    shown.waiting_for = Some(match waiting.state {
                        _ if waiting.validating => WaitingFor::Validation,
                        State::Ready => WaitingFor::Turn,
                        State::Draining | State::Stopping => WaitingFor::Drain,
                        _ => WaitingFor::Start,
                    })
                }
            },
            Stage::Sent => {
                shown.phase = Phase::Prefill;
                shown.prefill = now.prefill.map(|(p, first)| progress(p, first, at));
            }
            Stage::Decoding => shown.phase = Phase::Decoding,
            Stage::Ending => shown.phase = Phase::Ending,
        }
        shown
    }
}

/// A prefill's progress with its rate and the time left at that rate: the engine's own
/// seconds when it tells them, else those since its first report.
fn progress(p: Prefill, first: Instant, at: Instant) -> PrefillProgress {
    let seconds = p
        .seconds
        .unwrap_or_else(|| at.saturating_duration_since(first).as_secs_f64());
    let rate = (seconds > 0.0 && p.done > 0).then(|| p.done as f64 / seconds);
    PrefillProgress {
        done: p.done,
        total: p.total,
        cached: p.cached,
        rate: rate.map(round),
        left_s: rate.map(|r| round(p.total.saturating_sub(p.done) as f64 / r)),
    }
}

/// How far `shown`'s prefill has got, from the lines `engine` wrote since `mark`.
fn prefill_from_lines(
    shown: &mut InProgress,
    engine: &EngineRef,
    mark: u64,
    read: fn(&str) -> Option<PrefillLine>,
) {
    let (_, lines) = engine.output.since(mark, 256);
    let Some(latest) = lines.iter().rev().find_map(|l| read(l)) else {
        return;
    };
    let at = Instant::now();
    shown.prefill = match latest {
        PrefillLine::Started { total, cached } => Some(PrefillProgress {
            done: 0,
            total,
            cached,
            rate: None,
            left_s: None,
        }),
        PrefillLine::Progress(p) => Some(progress(p, at, at)),
        // Its prompt is read; the first token is on its way.
        PrefillLine::Done { .. } => {
            shown.phase = Phase::Decoding;
            None
        }
    };
}

impl Ticket {
    /// Runs `f` on the request's record; what it returns, an alert to raise once the
    /// register is let go. A request that began or ended its prefill says so.
    fn with(&self, f: impl FnOnce(&mut Flight) -> Option<String>) {
        let (alert, prefill_changed) = match lock(&self.register.flights).get_mut(self.key) {
            Some(flight) => {
                let was = flight.now.stage == Stage::Sent;
                let alert = f(flight);
                (alert, was != (flight.now.stage == Stage::Sent))
            }
            None => (None, false),
        };
        if prefill_changed {
            self.register.prefills_changed();
        }
        if let Some(message) = alert {
            self.register.alerts.raise(AlertKind::Request, message);
        }
    }

    /// Sent to `engine`, now: returned, for the statistics' clock.
    pub fn sent(&self, engine: &Arc<EngineRef>) -> Instant {
        // Only an engine that tells its prefill in its lines needs to know where they start.
        let mark = match engine.kind.prefill {
            PrefillReport::Lines(_) => engine.output.written(),
            _ => 0,
        };
        let at = Instant::now();
        self.with(|f| {
            f.now.stage = Stage::Sent;
            f.now.engine = Some((engine.clone(), mark));
            f.now.sent = Some(at);
            None
        });
        at
    }

    /// The engine's stream told how far the prefill has got.
    pub fn prefill(&self, p: Prefill) {
        self.with(|f| {
            let first = f.now.prefill.map_or_else(Instant::now, |(_, first)| first);
            f.now.prefill = Some((p, first));
            None
        });
    }

    /// `events` more events of the answer came (the first ends the prefill).
    pub fn tokens(&self, events: u64) {
        self.with(|f| {
            let now = &mut f.now;
            now.tokens += events;
            if now.stage != Stage::Sent {
                return None;
            }
            now.stage = Stage::Decoding;
            let took = now.sent.map(|s| s.elapsed()).unwrap_or_default();
            now.prefilled = Some(took);
            f.long.filter(|long| took >= *long)?;
            Some(format!(
                "{} done in {}, decode started",
                describe_prefill(prefill_tokens(now)),
                dsv4_client::duration::brief(took)
            ))
        });
    }

    /// The answer is complete, or nearly: on its way to the client.
    pub fn ending(&self) {
        self.with(|f| {
            f.now.stage = Stage::Ending;
            None
        });
    }

    /// The answer ended (`failed`: with this error). A request whose prefill was long says so.
    pub fn ended(&self, failed: Option<&str>) {
        // A prefill is no longer than the request's whole time.
        if self.long.is_none_or(|long| self.came.elapsed() < long) {
            return;
        }
        self.with(|f| {
            let long = f.long?;
            let now = &f.now;
            let took = f.came.elapsed();
            let long_prefill = match now.prefilled {
                Some(p) => p >= long,
                // Never got past its prefill: long if its time with the engine was.
                None => now.sent.is_some_and(|s| s.elapsed() >= long),
            };
            if !long_prefill {
                return None;
            }
            let what = describe_prefill(prefill_tokens(now));
            let took = dsv4_client::duration::brief(took);
            Some(match failed {
                Some(why) => format!("request {} ({what}) failed after {took}: {why}", f.id),
                None => format!(
                    "request {} ({what}) answered in {took}, {} events",
                    f.id, now.tokens
                ),
            })
        });
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let gone = lock(&self.register.flights).try_remove(self.key);
        if gone.is_some_and(|f| f.now.stage == Stage::Sent) {
            self.register.prefills_changed();
        }
    }
}

/// The prompt tokens of a request's prefill, as far as its engine told them: in its stream,
/// or in its output lines.
fn prefill_tokens(now: &Now) -> Option<u64> {
    if let Some((p, _)) = now.prefill {
        return Some(p.total + p.cached);
    }
    let (engine, mark) = now.engine.as_ref()?;
    let PrefillReport::Lines(read) = engine.kind.prefill else {
        return None;
    };
    let (_, lines) = engine.output.since(*mark, 256);
    lines.iter().find_map(|l| match read(l) {
        Some(PrefillLine::Started { total, cached }) => Some(total + cached),
        _ => None,
    })
}

/// `262,144-token prefill`, or `prefill` when the engine did not tell its size.
fn describe_prefill(tokens: Option<u64>) -> String {
    match tokens {
        Some(n) => format!("{}-token prefill", dsv4_client::units::thousands(n)),
        None => "prefill".to_string(),
    }
}

fn round(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_engine::{EngineKind, OutputTail};

    fn uri(path: &str) -> http::Uri {
        path.parse().unwrap()
    }

    fn engine(kind: EngineKind) -> Arc<EngineRef> {
        let addr = ([127, 0, 0, 1], 9).into();
        Arc::new(EngineRef {
            gen: 1,
            profile: "320k".into(),
            pid: 4242,
            upstream: addr,
            connections: crate::lifecycle::upstream::Upstream::new(addr, None),
            output: OutputTail::new(64),
            exit: tokio::sync::watch::channel(None).1,
            kind: kind.describe(),
        })
    }

    fn one(flights: &Flights, loading: Option<&Loading>, state: State, val: bool) -> InProgress {
        let mut all = flights.in_progress(loading, state, val);
        assert_eq!(all.len(), 1);
        all.remove(0)
    }

    #[tokio::test]
    async fn a_waiting_request_says_what_it_waits_for() {
        let flights = Flights::default();
        let _t = flights.enter(&uri("/v1/chat/completions"), true, None, Instant::now());
        let loading = Loading {
            profile: "64k".into(),
            since: Instant::now() - Duration::from_secs(23),
            about: Some(Duration::from_secs(54)),
            past: None,
            waiting_for: None,
        };
        let shown = one(&flights, Some(&loading), State::Starting, false);
        assert_eq!(
            (shown.phase, shown.profile.as_deref(), shown.loading_about_s),
            (Phase::Loading, Some("64k"), Some(54.0))
        );
        assert!(shown.loading_s.is_some_and(|s| (23.0..30.0).contains(&s)));
        for (loading, state, validating, want) in [
            (None, State::Stopped, false, WaitingFor::Start),
            (None, State::Backoff, false, WaitingFor::Start),
            (None, State::Draining, false, WaitingFor::Drain),
            (None, State::Stopping, false, WaitingFor::Drain),
            (None, State::Ready, false, WaitingFor::Turn),
            (None, State::Ready, true, WaitingFor::Validation),
            // A validation's own engine loading: the request waits for the validation.
            (
                Some(&loading),
                State::Starting,
                true,
                WaitingFor::Validation,
            ),
        ] {
            let shown = one(&flights, loading, state, validating);
            assert_eq!(shown.phase, Phase::Waiting);
            assert_eq!(shown.waiting_for, Some(want), "{state:?} {validating}");
        }
    }

    #[tokio::test]
    async fn a_prefill_that_begins_or_ends_is_told_even_to_a_listener_not_yet_waiting() {
        use futures_util::FutureExt;
        let flights = Flights::default();
        let told = |f: &Flights| f.prefills_changed().now_or_never().is_some();
        let t = flights.enter(&uri("/v1/chat/completions"), true, None, Instant::now());
        assert!(
            !told(&flights),
            "a request waiting for the engine is in no prefill"
        );
        t.sent(&engine(EngineKind::LlamaServer));
        assert!(told(&flights));
        assert!(!told(&flights), "told once per change");
        t.tokens(1);
        assert!(told(&flights), "the first token ends the prefill");
        let later = flights.enter(&uri("/v1/completions"), false, None, Instant::now());
        later.sent(&engine(EngineKind::LlamaServer));
        drop(later);
        assert!(told(&flights), "a request gone in its prefill ends it");
        assert!(!told(&flights));
    }

    #[tokio::test]
    async fn a_request_moves_through_its_phases_and_leaves() {
        let flights = Flights::default();
        let t = flights.enter(&uri("/v1/chat/completions"), true, None, Instant::now());
        let later = flights.enter(&uri("/v1/completions"), false, None, Instant::now());
        t.sent(&engine(EngineKind::LlamaServer));
        let shown = |f: &Flights| f.in_progress(None, State::Ready, false);
        let first = &shown(&flights)[0];
        assert_eq!(
            (first.id, first.phase, first.prefill.clone()),
            (1, Phase::Prefill, None)
        );
        assert_eq!(first.profile.as_deref(), Some("320k"));
        t.prefill(Prefill {
            done: 1000,
            total: 4000,
            cached: 96,
            seconds: Some(2.0),
        });
        let p = shown(&flights)[0].prefill.clone().unwrap();
        assert_eq!(
            (p.done, p.total, p.cached, p.rate, p.left_s),
            (1000, 4000, 96, Some(500.0), Some(6.0))
        );
        t.tokens(1);
        t.tokens(2);
        let first = &shown(&flights)[0];
        assert_eq!((first.phase, first.tokens), (Phase::Decoding, 3));
        t.ending();
        assert_eq!(shown(&flights)[0].phase, Phase::Ending);
        drop(t);
        let left = shown(&flights);
        assert_eq!(left.len(), 1);
        assert_eq!((left[0].id, left[0].path.as_str()), (2, "/v1/completions"));
        drop(later);
        assert!(shown(&flights).is_empty());
    }

    #[tokio::test]
    async fn an_engine_that_logs_its_prefill_shows_it_on_its_oldest_request() {
        let flights = Flights::default();
        let ds4 = engine(EngineKind::Ds4);
        ds4.output
            .push("an earlier request's line: ds4-server: chat ctx=0..9:9 prompt start".into());
        let (a, b) = (
            flights.enter(&uri("/v1/chat/completions"), true, None, Instant::now()),
            flights.enter(&uri("/v1/chat/completions"), false, None, Instant::now()),
        );
        a.sent(&ds4);
        b.sent(&ds4);
        let shown = |f: &Flights| f.in_progress(None, State::Ready, false);
        // Nothing logged since it was sent: no figures yet.
        assert_eq!(shown(&flights)[0].prefill, None);
        ds4.output
            .push("1204 20:13:20 ds4-server: chat ctx=100..612:512 prompt start".into());
        let p = shown(&flights)[0].prefill.clone().unwrap();
        assert_eq!((p.done, p.total, p.cached, p.rate), (0, 512, 100, None));
        ds4.output.push(
            "1204 20:13:28 ds4-server: chat ctx=100..612:512 prefill chunk 256/512 (50.0%) \
             chunk=30.00 t/s avg=32.00 t/s 8.000s"
                .into(),
        );
        let all = shown(&flights);
        let p = all[0].prefill.clone().unwrap();
        assert_eq!((p.done, p.rate, p.left_s), (256, Some(32.0), Some(8.0)));
        // The engine serves one prompt at a time: the next request waits in it, with no figures.
        assert_eq!(
            (all[1].phase, all[1].prefill.clone()),
            (Phase::Prefill, None)
        );
        ds4.output
            .push("1204 20:13:36 ds4-server: chat ctx=100..612:512 prompt done 16.000s".into());
        assert_eq!(shown(&flights)[0].phase, Phase::Decoding);
    }

    /// `message` is `before`, a time in the project's duration grammar, then `after`.
    fn assert_timed(message: &str, before: &str, after: &str) {
        let time = message
            .strip_prefix(before)
            .and_then(|m| m.strip_suffix(after))
            .unwrap_or_else(|| panic!("{message:?} is not {before:?} TIME {after:?}"));
        assert!(
            dsv4_client::duration::parse(time).is_ok(),
            "{time:?} in {message:?}"
        );
    }

    #[tokio::test]
    async fn a_long_prefill_is_told_when_it_ends_and_when_its_answer_does() {
        let alerts = Alerts::default();
        let mut heard = alerts.subscribe();
        let flights = Flights::new(alerts);
        // Any prefill is long at a threshold of zero; none is without one.
        let quiet = flights.enter(&uri("/v1/chat/completions"), true, None, Instant::now());
        quiet.sent(&engine(EngineKind::LlamaServer));
        quiet.tokens(1);
        quiet.ended(None);
        let t = flights.enter(
            &uri("/v1/chat/completions"),
            true,
            Some(Duration::ZERO),
            Instant::now(),
        );
        t.sent(&engine(EngineKind::LlamaServer));
        t.prefill(Prefill {
            done: 262_000,
            total: 262_000,
            cached: 144,
            seconds: None,
        });
        t.tokens(1);
        t.tokens(1);
        let a = heard.try_recv().unwrap();
        assert_eq!(a.kind, AlertKind::Request);
        assert_timed(
            &a.message,
            "262,144-token prefill done in ",
            ", decode started",
        );
        t.ended(None);
        let a = heard.try_recv().unwrap();
        assert_timed(
            &a.message,
            "request 2 (262,144-token prefill) answered in ",
            ", 2 events",
        );
        let failed = flights.enter(
            &uri("/v1/chat/completions"),
            false,
            Some(Duration::ZERO),
            Instant::now(),
        );
        failed.sent(&engine(EngineKind::Ds4));
        failed.ended(Some(
            "the engine exited while handling the request (exit code 1)",
        ));
        let a = heard.try_recv().unwrap();
        assert_timed(
            &a.message,
            "request 3 (prefill) failed after ",
            ": the engine exited while handling the request (exit code 1)",
        );
        assert!(heard.try_recv().is_err());
    }
}
