//! The monitor: samples the host every `monitor.interval` while an engine exists and every
//! `monitor.idle_interval` while none does, keeps the last hour of samples, and publishes the
//! latest.
//!
//! Owns: the [`Sampler`] and the ring of samples. Must not: act on what it sees (policies
//! read the samples and decide), or sample more often than asked: a change of the engine's
//! state or process takes a sample at once, other status changes (each request moves the
//! in-flight count) do not. Must not read sysfs on the runtime's thread either: the SMU can
//! stall a `gpu_metrics` read, and that thread carries every stream. The sampler lives on
//! its own thread; a read that does not return delays the next sample, nothing else.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4_client::telemetry::{Resources, Sample, Sensor};
use tokio::sync::{oneshot, watch};

use crate::config::Config;
use crate::host::hw::Sampler;
use crate::lifecycle::Status;

/// How far back the ring reaches.
pub const SPAN: Duration = Duration::from_secs(3600);
/// The most samples kept, whatever the interval (a day at `idle_interval` would be fewer).
const MAX_SAMPLES: usize = 3700;

/// The monitor's output: the latest sample and the ring. Cheap to clone.
#[derive(Clone)]
pub struct Telemetry {
    latest: watch::Receiver<Option<Arc<Sample>>>,
    ring: Arc<Mutex<VecDeque<Arc<Sample>>>>,
}

impl Telemetry {
    /// A monitor that never samples: for tests and `--bus none` helpers that need a handle.
    pub fn none() -> Telemetry {
        let (_, latest) = watch::channel(None);
        Telemetry {
            latest,
            ring: Arc::default(),
        }
    }

    pub fn latest(&self) -> Option<Arc<Sample>> {
        self.latest.borrow().clone()
    }

    /// Follows the latest sample.
    pub fn watch(&self) -> watch::Receiver<Option<Arc<Sample>>> {
        self.latest.clone()
    }

    /// The samples taken at or after `since` (unix s), oldest first, at most `max` (the
    /// newest ones).
    pub fn history(&self, since: f64, max: usize) -> Vec<Arc<Sample>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let from = ring.partition_point(|s| s.at < since);
        let from = from.max(ring.len().saturating_sub(max));
        ring.range(from..).cloned().collect()
    }

    /// At most `max` samples taken after `after` and no later than `until` (unix s), oldest
    /// first: a page of the ring, for who reads it a piece at a time (the dashboard's
    /// `hello`) rather than holding all of it at once. The next page starts after the last
    /// sample of this one.
    pub fn page(&self, after: f64, until: f64, max: usize) -> Vec<Arc<Sample>> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let from = ring.partition_point(|s| s.at <= after);
        let to = ring.partition_point(|s| s.at <= until).max(from);
        ring.range(from..to).take(max).cloned().collect()
    }

    /// What the span from `from` to `to` (unix s) cost, from the samples in it; a span
    /// shorter than one interval uses the sample just before its end.
    pub fn resources(&self, from: f64, to: f64) -> Resources {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let start = ring.partition_point(|s| s.at < from);
        let end = ring.partition_point(|s| s.at <= to);
        // A request shorter than the interval: the sample of its time.
        let picked = match start < end {
            true => start..end,
            false => end.saturating_sub(1)..end,
        };
        let before = start.checked_sub(1).and_then(|i| ring.get(i));
        summarize(ring.range(picked).map(|s| &**s), before)
    }
}

/// The mean, to a thousandth (the sensors' own resolution: millidegrees, milliwatts): a
/// figure that held still reads as it was, whatever the number of samples (six readings of
/// 69.6 W sum to a mean of 69.60000000000001 otherwise).
fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values.fold((0.0, 0u32), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| (sum / f64::from(n) * 1000.0).round() / 1000.0)
}

/// The per-request figures over `samples` (in order); `before` is the sample before the
/// first, which dates the first one's interval.
fn summarize<'a>(
    samples: impl Iterator<Item = &'a Sample> + Clone,
    before: Option<&Arc<Sample>>,
) -> Resources {
    let mut throttle_seconds = 0.0;
    let mut prev_at = before.map(|b| b.at);
    for s in samples.clone() {
        if s.throttle.active {
            if let Some(p) = prev_at {
                throttle_seconds += (s.at - p).max(0.0);
            }
        }
        prev_at = Some(s.at);
    }
    Resources {
        samples: samples.clone().count() as u32,
        edge_mean_c: mean(
            samples
                .clone()
                .filter_map(|s| s.temperatures.get(Sensor::Edge)),
        ),
        edge_max_c: samples
            .clone()
            .filter_map(|s| s.temperatures.get(Sensor::Edge))
            .reduce(f64::max),
        soc_power_mean_w: mean(samples.clone().filter_map(|s| s.power.soc)),
        gtt_peak_bytes: samples
            .clone()
            .filter_map(|s| s.gpu.as_ref()?.memory.gtt_used)
            .max(),
        available_min_bytes: samples.filter_map(|s| Some(s.memory?.available)).min(),
        throttle_seconds,
    }
}

use dsv4_client::clock::unix_now;

/// How long a sample may take before the log says that a hardware read hangs.
const STALLED: Duration = Duration::from_secs(5);

/// The [`Sampler`] on a thread of its own, taking one sample per request.
struct Worker {
    requests: std::sync::mpsc::Sender<(Option<u32>, oneshot::Sender<Sample>)>,
}

impl Worker {
    fn start(mut sampler: Sampler) -> std::io::Result<Worker> {
        let (requests, asked) =
            std::sync::mpsc::channel::<(Option<u32>, oneshot::Sender<Sample>)>();
        std::thread::Builder::new()
            .name("dsv4-sampler".into())
            .spawn(move || {
                for (pid, reply) in asked {
                    let _ = reply.send(sampler.sample(pid, unix_now()));
                }
            })?;
        Ok(Worker { requests })
    }

    /// One sample of the engine process `pid`; `None` when the thread is gone.
    async fn sample(&self, pid: Option<u32>) -> Option<Sample> {
        let (reply, answer) = oneshot::channel();
        self.requests.send((pid, reply)).ok()?;
        let mut answer = std::pin::pin!(answer);
        tokio::select! {
            s = &mut answer => return s.ok(),
            _ = tokio::time::sleep(STALLED) => {}
        }
        tracing::warn!(
            "a hardware read has not returned for {} (the GPU firmware can stall gpu_metrics): \
             telemetry waits for it; serving goes on",
            dsv4_client::duration::format(STALLED)
        );
        let s = answer.await.ok();
        tracing::info!("the hardware read returned: telemetry goes on");
        s
    }
}

/// Starts the monitor on the current runtime; it runs for the daemon's life.
pub fn spawn(
    sampler: Sampler,
    config: watch::Receiver<Arc<Config>>,
    lifecycle: watch::Receiver<Status>,
) -> Telemetry {
    let (tx, latest) = watch::channel(None);
    let telemetry = Telemetry {
        latest,
        ring: Arc::default(),
    };
    tokio::spawn(run(sampler, config, lifecycle, tx, telemetry.ring.clone()));
    telemetry
}

async fn run(
    sampler: Sampler,
    config: watch::Receiver<Arc<Config>>,
    mut lifecycle: watch::Receiver<Status>,
    tx: watch::Sender<Option<Arc<Sample>>>,
    ring: Arc<Mutex<VecDeque<Arc<Sample>>>>,
) {
    let worker = match Worker::start(sampler) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!("cannot start the sampler's thread: {e}; no telemetry");
            return;
        }
    };
    loop {
        let (engine, pid) = {
            let s = lifecycle.borrow_and_update();
            (s.state.has_engine(), s.engine_pid)
        };
        let Some(sample) = worker.sample(pid).await else {
            tracing::error!("the sampler's thread is gone; no telemetry from now on");
            return;
        };
        let sample = Arc::new(sample);
        {
            let mut ring = ring.lock().unwrap_or_else(|p| p.into_inner());
            let oldest = sample.at - SPAN.as_secs_f64();
            while ring
                .front()
                .is_some_and(|s| s.at < oldest || ring.len() >= MAX_SAMPLES)
            {
                ring.pop_front();
            }
            ring.push_back(sample.clone());
        }
        tx.send_replace(Some(sample));
        let interval = {
            let m = &config.borrow().supervisor.monitor;
            if engine {
                m.interval
            } else {
                m.idle_interval
            }
        };
        let next = tokio::time::Instant::now() + interval;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                changed = lifecycle.changed() => {
                    if changed.is_err() {
                        // The lifecycle is gone: the daemon is ending.
                        return;
                    }
                    let s = lifecycle.borrow();
                    if s.state.has_engine() != engine || s.engine_pid != pid {
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_client::telemetry::{Gpu, GpuMemory, Memory, Throttle};

    fn sample(at: f64, edge: f64, gtt: u64, active: bool) -> Arc<Sample> {
        Arc::new(Sample {
            at,
            memory: Some(Memory {
                total: 100,
                available: 100 - gtt,
                swap_total: 0,
                swap_free: 0,
            }),
            gpu: Some(Gpu {
                memory: GpuMemory {
                    gtt_used: Some(gtt),
                    ..GpuMemory::default()
                },
                ..Gpu::default()
            }),
            temperatures: [(Sensor::Edge, edge)].into_iter().collect(),
            throttle: Throttle {
                active,
                ..Throttle::default()
            },
            ..Sample::default()
        })
    }

    fn telemetry(samples: Vec<Arc<Sample>>) -> Telemetry {
        let t = Telemetry::none();
        t.ring.lock().unwrap().extend(samples);
        t
    }

    /// A figure that held still has that figure as its mean, however many samples it has.
    #[test]
    fn a_steady_figure_is_its_own_mean() {
        for n in 1..=64 {
            assert_eq!(
                mean(std::iter::repeat_n(69.6, n)),
                Some(69.6),
                "{n} samples"
            );
            assert_eq!(
                mean(std::iter::repeat_n(73.25, n)),
                Some(73.25),
                "{n} samples"
            );
        }
        assert_eq!(mean([70.0, 71.0, 71.0].into_iter()), Some(70.667));
        assert_eq!(mean(std::iter::empty()), None);
    }

    #[test]
    fn a_span_is_summarized_from_its_samples() {
        let t = telemetry(vec![
            sample(10.0, 50.0, 10, false),
            sample(11.0, 70.0, 30, true),
            sample(12.0, 80.0, 40, true),
            sample(13.0, 60.0, 20, false),
        ]);
        let r = t.resources(10.5, 13.0);
        assert_eq!(r.samples, 3);
        assert_eq!(r.edge_mean_c, Some(70.0));
        assert_eq!(r.edge_max_c, Some(80.0));
        assert_eq!(r.gtt_peak_bytes, Some(40));
        assert_eq!(r.available_min_bytes, Some(60));
        // The intervals 10-11 and 11-12 were throttled.
        assert_eq!(r.throttle_seconds, 2.0);
        // Shorter than an interval: the sample just before its end.
        let r = t.resources(12.2, 12.4);
        assert_eq!((r.samples, r.edge_max_c), (1, Some(80.0)));
        // Before any sample: nothing.
        assert_eq!(t.resources(1.0, 2.0), Resources::default());
    }

    #[test]
    fn history_is_oldest_first_and_bounded() {
        let t = telemetry(
            (0..10)
                .map(|i| sample(f64::from(i), 1.0, 1, false))
                .collect(),
        );
        let at = |v: Vec<Arc<Sample>>| v.iter().map(|s| s.at).collect::<Vec<_>>();
        assert_eq!(at(t.history(7.0, 100)), [7.0, 8.0, 9.0]);
        assert_eq!(at(t.history(0.0, 2)), [8.0, 9.0]);
        assert!(t.history(20.0, 100).is_empty());
    }

    #[test]
    fn pages_follow_each_other_without_overlap_up_to_their_end() {
        let t = telemetry(
            (0..10)
                .map(|i| sample(f64::from(i), 1.0, 1, false))
                .collect(),
        );
        let at = |v: Vec<Arc<Sample>>| v.iter().map(|s| s.at).collect::<Vec<_>>();
        for (after, until, max, want) in [
            (-1.0, 9.0, 3, &[0.0, 1.0, 2.0][..]),
            (2.0, 9.0, 3, &[3.0, 4.0, 5.0]),
            (2.5, 4.0, 3, &[3.0, 4.0]),
            (7.0, 100.0, 5, &[8.0, 9.0]),
            (9.0, 100.0, 5, &[]),
            (5.0, 3.0, 5, &[]),
            (-1.0, 9.0, 0, &[]),
        ] {
            assert_eq!(at(t.page(after, until, max)), want, "{after} {until} {max}");
        }
    }
}
