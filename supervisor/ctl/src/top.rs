//! `dsv4ctl top`: a live view of the engine and the host.
//!
//! Owns: the terminal while it runs (raw mode and the alternate screen, both given back on
//! every way out), and the samples it has fetched. The daemon's ring buffer feeds it: the
//! last ten minutes at once (`History()`), then each new sample as it comes (`History()`
//! from the last one's time, every second), and `Status()` for the engine's state and the
//! requests. Must not: change anything in the daemon. When standard output is not a
//! terminal it prints a plain line per sample instead, until interrupted.

use std::collections::VecDeque;
use std::io::Write;
use std::time::Duration;

use dsv4_client::telemetry::{Sample, Sensor};
use dsv4_client::units::gib;
use dsv4_client::Status;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Sparkline};

use crate::bus::Daemon;
use crate::error::Failure;
use crate::render;

/// How far back the view reaches when it opens.
const WINDOW: f64 = 600.0;
/// The most samples kept (ten minutes at 1 s).
const KEPT: usize = 600;
/// How often new samples are fetched.
const POLL: Duration = Duration::from_secs(1);
/// The requests in flight listed in the header, at most (then how many more).
const FLIGHTS_SHOWN: usize = 5;

/// The samples seen, oldest first.
#[derive(Default)]
pub struct Series {
    samples: VecDeque<Sample>,
}

impl Series {
    pub fn extend(&mut self, new: Vec<Sample>) {
        for s in new {
            if self.samples.back().is_some_and(|last| s.at <= last.at) {
                continue;
            }
            if self.samples.len() == KEPT {
                self.samples.pop_front();
            }
            self.samples.push_back(s);
        }
    }

    /// Where the next `History()` starts: just after the newest sample.
    pub fn since(&self, now: f64) -> f64 {
        self.samples
            .back()
            .map(|s| s.at + 1e-6)
            .unwrap_or(now - WINDOW)
    }

    pub fn latest(&self) -> Option<&Sample> {
        self.samples.back()
    }

    fn values(&self, f: impl Fn(&Sample) -> Option<f64>) -> Vec<Option<f64>> {
        self.samples.iter().map(f).collect()
    }
}

/// Bars for a sparkline: each value placed between the window's least and greatest (so a
/// small change in a large figure, GTT moving by 0.1 GiB out of 81, still shows), 1 to 100;
/// a missing value is 0 (no bar). A flat series sits at the middle.
pub fn bars(values: &[Option<f64>]) -> Vec<u64> {
    let known = values.iter().flatten().copied();
    let (lo, hi) = known.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    values
        .iter()
        .map(|v| match v {
            None => 0,
            Some(_) if hi - lo < 1e-9 => 50,
            Some(v) => 1 + ((v - lo) / (hi - lo) * 99.0).round() as u64,
        })
        .collect()
}

/// `cur (min .. max)` over the window, with `unit` and `digits` decimals.
fn range(values: &[Option<f64>], unit: &str, digits: usize) -> String {
    let known: Vec<f64> = values.iter().flatten().copied().collect();
    let (Some(cur), false) = (values.last().copied().flatten(), known.is_empty()) else {
        return "-".to_string();
    };
    let lo = known.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = known.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{cur:.digits$} {unit} ({lo:.digits$} .. {hi:.digits$})")
}

/// The header: the engine, the requests and the memory, in a few lines.
pub fn header(status: &Status, latest: Option<&Sample>, now: f64) -> Vec<String> {
    let e = &status.engine;
    let mut lines = vec![format!(
        "dsv4  {}  profile {}  in flight {}  waiting {}{}",
        e.state,
        e.engine_profile.as_deref().unwrap_or(&e.profile),
        e.in_flight,
        e.waiting,
        e.engine_pid
            .map(|p| format!("  engine pid {p}"))
            .unwrap_or_default()
    )];
    if let Some(c) = &e.model_cache {
        lines.push(format!(
            "model    {}",
            crate::render::model_cache(c, e.load_seconds)
        ));
    }
    if !status.workers.is_empty() {
        let workers: Vec<String> = status
            .workers
            .iter()
            .map(|w| format!("{} {}", w.host, w.state))
            .collect();
        lines.push(format!("workers  {}", workers.join(", ")));
    }
    if !status.holds.is_empty() {
        let holds: Vec<String> = status
            .holds
            .iter()
            .map(|h| format!("{} ({})", h.from, h.profile))
            .collect();
        lines.push(format!("held by  {}", holds.join(", ")));
    }
    let flights = &status.in_progress;
    lines.extend(
        flights
            .iter()
            .take(FLIGHTS_SHOWN)
            .map(|r| format!("  {}", render::in_progress_line(r))),
    );
    if flights.len() > FLIGHTS_SHOWN {
        lines.push(format!(
            "  and {} more in flight",
            flights.len() - FLIGHTS_SHOWN
        ));
    }
    lines.extend(requests_lines(status, now));
    if let Some(s) = latest {
        let memory = s
            .memory
            .as_ref()
            .map_or_else(|| "-".to_string(), render::memory);
        let memory = format!("memory {memory}");
        let pressure = s
            .pressure
            .map(|p| format!("  pressure {:.2}%", p.some_avg10))
            .unwrap_or_default();
        lines.push(format!("{memory}{pressure}"));
        let t = &s.throttle;
        let throttle = if !t.supported {
            "throttling not reported".to_string()
        } else if t.active {
            let kinds: Vec<&str> = t.kinds.iter().map(|k| k.as_str()).collect();
            format!("THROTTLING ({})", kinds.join(", "))
        } else {
            "not throttling".to_string()
        };
        let age = dsv4_client::duration::brief_secs(now - s.at);
        lines.push(format!("{throttle}  (sample {age} old)"));
    } else {
        lines.push("no sample yet".to_string());
    }
    lines
}

/// The requests by API (those that had any), and the last request with its API: `requests
/// openai 9 decode 13.35 tok/s, anthropic 2 decode ~10.00 tok/s` and `last  anthropic
/// /v1/messages  12 prompt + 8 generated tokens, decode ~10.00 tok/s  (10s ago)`; none before
/// the first request. `~`: a rate dsv4d's clock timed (the foot of the view says so).
pub fn requests_lines(status: &Status, now: f64) -> Vec<String> {
    let r = &status.requests;
    let mut lines = Vec::new();
    if !r.by_protocol.is_empty() {
        let apis: Vec<String> = r
            .by_protocol
            .iter()
            .map(|(p, t)| {
                let decode = t
                    .decode_tok_s
                    .map(|d| {
                        format!(
                            " decode {}",
                            render::marked_rate(d, t.clock_timed_requests > 0)
                        )
                    })
                    .unwrap_or_default();
                format!("{p} {}{decode}", t.requests)
            })
            .collect();
        lines.push(format!("requests {}", apis.join(", ")));
    }
    if let Some(last) = r.recent.last() {
        let decode = last
            .decode_tok_s
            .map(|d| format!(", decode {}", render::marked_rate(d, last.clock_times)))
            .unwrap_or_default();
        lines.push(format!(
            "last  {} {}  {} prompt + {} generated tokens{decode}  ({} ago)",
            last.protocol,
            last.path,
            last.prompt_tokens,
            last.generated_tokens,
            dsv4_client::duration::brief_secs(now - last.at)
        ));
    }
    lines
}

/// One plain line for a sample, for a pipe or a log.
pub fn plain(status: &Status, s: &Sample) -> String {
    let secs = s.at.max(0.0) as u64 % 86_400;
    let time = format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60);
    let opt = |v: Option<f64>, unit: &str, digits: usize| {
        v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$} {unit}"))
    };
    let gpu = s.gpu.as_ref();
    let gtt = match gpu.and_then(|g| Some((g.memory.gtt_used?, g.memory.gtt_total?))) {
        Some((u, t)) => format!("{:.1}/{:.1} GiB", gib(u), gib(t)),
        None => "-".to_string(),
    };
    let throttling = match (s.throttle.supported, s.throttle.active) {
        (false, _) => "-",
        (true, true) => "yes",
        (true, false) => "no",
    };
    format!(
        "{time} UTC  {}  GTT {gtt}  available {}  edge {}  Tctl {}  SoC {}  busy {}  throttling {throttling}",
        status.engine.state,
        s.memory
            .map_or_else(|| "-".to_string(), |m| format!("{:.1} GiB", gib(m.available))),
        opt(s.temperatures.get(Sensor::Edge), "C", 1),
        opt(s.temperatures.get(Sensor::Tctl), "C", 1),
        opt(s.power.soc, "W", 1),
        opt(gpu.and_then(|g| g.busy_percent), "%", 0),
    )
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub async fn run(daemon: &Daemon) -> Result<(), Failure> {
    use std::io::IsTerminal;
    let mut series = Series::default();
    series.extend(daemon.history(now() - WINDOW, KEPT as u32).await?);
    if !std::io::stdout().is_terminal() {
        return plain_lines(daemon, series).await;
    }
    let mut terminal = ratatui::try_init()
        .map_err(|e| Failure::Failed(format!("cannot take over the terminal: {e}")))?;
    let result = view(daemon, &mut series, &mut terminal).await;
    ratatui::restore();
    result
}

async fn plain_lines(daemon: &Daemon, mut series: Series) -> Result<(), Failure> {
    let mut shown = 0.0;
    loop {
        let status = daemon.status().await?;
        let mut out = std::io::stdout().lock();
        let fresh: Vec<&Sample> = series.samples.iter().filter(|s| s.at > shown).collect();
        for s in fresh {
            if writeln!(out, "{}", plain(&status, s)).is_err() {
                // The reader went away (a closed pipe): that is the end.
                return Ok(());
            }
            shown = s.at;
        }
        let _ = out.flush();
        drop(out);
        tokio::time::sleep(POLL).await;
        series.extend(daemon.history(series.since(now()), KEPT as u32).await?);
    }
}

async fn view(
    daemon: &Daemon,
    series: &mut Series,
    terminal: &mut ratatui::DefaultTerminal,
) -> Result<(), Failure> {
    let mut next_poll = tokio::time::Instant::now();
    let mut status = daemon.status().await?;
    loop {
        if tokio::time::Instant::now() >= next_poll {
            status = daemon.status().await?;
            series.extend(daemon.history(series.since(now()), KEPT as u32).await?);
            next_poll = tokio::time::Instant::now() + POLL;
            draw(terminal, &status, series)?;
        }
        // Keys, for at most a tenth of a second; then the loop looks at the clock again.
        let key = tokio::task::spawn_blocking(|| -> std::io::Result<Option<Event>> {
            if event::poll(Duration::from_millis(100))? {
                Ok(Some(event::read()?))
            } else {
                Ok(None)
            }
        })
        .await
        .map_err(|e| Failure::Failed(format!("reading the keyboard: {e}")))?
        .map_err(|e| Failure::Failed(format!("reading the keyboard: {e}")))?;
        match key {
            Some(Event::Key(k)) if k.kind == KeyEventKind::Press => {
                let ctrl_c =
                    k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                if matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c {
                    return Ok(());
                }
            }
            Some(Event::Resize(..)) => draw(terminal, &status, series)?,
            _ => {}
        }
    }
}

/// The foot of the view: how to quit, and what `~` means when a rate above has it.
fn foot_text(head: &[String]) -> String {
    if head.iter().any(|l| l.contains(render::CLOCK)) {
        format!("q quits   {} {}", render::CLOCK, render::CLOCK_MEANS)
    } else {
        "q quits".to_string()
    }
}

fn draw(
    terminal: &mut ratatui::DefaultTerminal,
    status: &Status,
    series: &Series,
) -> Result<(), Failure> {
    let gtt = series.values(|s| s.gpu.as_ref()?.memory.gtt_used.map(gib));
    let edge = series.values(|s| s.temperatures.get(Sensor::Edge));
    let tctl = series.values(|s| s.temperatures.get(Sensor::Tctl));
    let power = series.values(|s| s.power.soc.or(s.power.socket));
    let decode: Vec<Option<f64>> = status
        .requests
        .recent
        .iter()
        .map(|r| r.decode_tok_s)
        .collect();
    let head = header(status, series.latest(), now());
    let gtt_total = series
        .latest()
        .and_then(|s| s.gpu.as_ref()?.memory.gtt_total)
        .map(|t| format!(" of {:.1} GiB", gib(t)))
        .unwrap_or_default();
    let charts = [
        (
            format!("GTT used {}{gtt_total}", range(&gtt, "GiB", 1)),
            bars(&gtt),
            Color::Cyan,
        ),
        (
            format!(
                "edge {}   Tctl {}",
                range(&edge, "C", 1),
                range(&tctl, "C", 1)
            ),
            bars(&edge),
            Color::Red,
        ),
        (
            format!("SoC power {}", range(&power, "W", 1)),
            bars(&power),
            Color::Yellow,
        ),
        (
            format!(
                "decode tok/s, the last requests: {}",
                range(&decode, "tok/s", 2)
            ),
            bars(&decode),
            Color::Green,
        ),
    ];
    terminal
        .draw(|frame| {
            let [top, rest, foot] = Layout::vertical([
                Constraint::Length(head.len() as u16 + 2),
                Constraint::Min(8),
                Constraint::Length(1),
            ])
            .areas(frame.area());
            let lines: Vec<Line> = head.iter().map(|l| Line::from(l.as_str())).collect();
            frame.render_widget(
                Paragraph::new(lines)
                    .block(Block::default().borders(Borders::ALL).title(" dsv4 top ")),
                top,
            );
            let areas = Layout::vertical([Constraint::Ratio(1, 4); 4]).split(rest);
            for ((title, data, color), area) in charts.iter().zip(areas.iter()) {
                let width = area.width.saturating_sub(2) as usize;
                // The newest samples that fit, right-aligned.
                let skip = data.len().saturating_sub(width);
                let spark = Sparkline::default()
                    .block(
                        Block::default()
                            .borders(Borders::ALL)
                            .title(format!(" {title} ")),
                    )
                    .data(data[skip..].iter().copied())
                    .max(100)
                    .style(Style::default().fg(*color));
                frame.render_widget(spark, *area);
            }
            frame.render_widget(Paragraph::new(foot_text(&head)), foot);
        })
        .map_err(|e| Failure::Failed(format!("drawing: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_use_the_window_range() {
        assert_eq!(
            bars(&[Some(80.0), Some(81.0), None, Some(80.5)]),
            [1, 100, 0, 51]
        );
        assert_eq!(bars(&[Some(5.0), Some(5.0)]), [50, 50]);
        assert!(bars(&[]).is_empty());
        assert_eq!(
            range(&[Some(1.0), Some(3.0), Some(2.0)], "W", 1),
            "2.0 W (1.0 .. 3.0)"
        );
        assert_eq!(range(&[Some(1.0), None], "W", 1), "-");
    }

    #[test]
    fn the_header_names_the_boxes_the_engine_spans() {
        let mut s = Status::stopped("tiny");
        assert!(!header(&s, None, 0.0)
            .iter()
            .any(|l| l.starts_with("workers")));
        let worker = |host: &str, state: &str| dsv4_client::WorkerStatus {
            host: host.into(),
            at: format!("{host}:8090"),
            profile: "rpc".into(),
            state: state.into(),
            since: 0.0,
            load_seconds: None,
            error: None,
            telemetry: None,
            thermal: None,
        };
        s.workers = vec![
            worker("10.77.0.2", "serving"),
            worker("10.77.0.3", "waking"),
        ];
        s.holds = vec![dsv4_client::Hold {
            from: "10.77.0.9".into(),
            profile: "rpc".into(),
            since: 0.0,
        }];
        let head = header(&s, None, 0.0);
        assert_eq!(head[1], "workers  10.77.0.2 serving, 10.77.0.3 waking");
        assert_eq!(head[2], "held by  10.77.0.9 (rpc)");
    }

    #[test]
    fn the_header_lists_the_requests_in_flight() {
        use dsv4_client::words::Phase;
        use dsv4_client::{InProgress, PrefillProgress};
        let flight = |id| InProgress {
            id,
            path: "/v1/chat/completions".into(),
            stream: true,
            profile: Some("16k".into()),
            age_s: 3.0,
            phase: Phase::Prefill,
            waiting_for: None,
            loading_s: None,
            loading_about_s: None,
            prefill: Some(PrefillProgress {
                done: 2048,
                total: 8192,
                cached: 0,
                rate: Some(1024.0),
                left_s: Some(6.0),
            }),
            tokens: 0,
        };
        let mut status = Status::stopped("16k");
        assert_eq!(header(&status, None, 0.0).len(), 2);
        status.in_progress = vec![flight(3)];
        assert_eq!(
            header(&status, None, 0.0)[1],
            "  #3 /v1/chat/completions  prefill 2,048 / 8,192 tokens (25.0%), 1024 tok/s, \
             about 6s left  (3s)"
        );
        status.in_progress = (1..=7).map(flight).collect();
        let head = header(&status, None, 0.0);
        assert_eq!(head.len(), 1 + FLIGHTS_SHOWN + 1 + 1, "{head:?}");
        assert_eq!(head[FLIGHTS_SHOWN + 1], "  and 2 more in flight");
    }

    #[test]
    fn the_header_gives_the_requests_by_api_and_the_last_one_with_its_api() {
        use dsv4_client::{ApiProtocol, RequestRecord, Totals};
        let mut status = Status::stopped("16k");
        // No request yet: no line of them.
        assert!(requests_lines(&status, 0.0).is_empty());
        let totals = |requests, clock_timed_requests, decode_tok_s| Totals {
            requests,
            decode_tok_s,
            clock_timed_requests,
            ..Totals::default()
        };
        status.requests.by_protocol = [
            (ApiProtocol::OpenAi, totals(9, 0, Some(13.3512))),
            (ApiProtocol::Anthropic, totals(2, 1, Some(10.0))),
            (ApiProtocol::Responses, totals(1, 0, None)),
        ]
        .into_iter()
        .collect();
        status.requests.recent.push(RequestRecord {
            profile: "16k".into(),
            path: "/v1/messages".into(),
            protocol: ApiProtocol::Anthropic,
            at: 990.0,
            prompt_tokens: 12,
            cached_tokens: 0,
            generated_tokens: 8,
            prefill_tok_s: Some(40.0),
            decode_tok_s: Some(10.0),
            prompt_ms: 300.0,
            decode_ms: 800.0,
            wall_ms: 1100.0,
            clock_times: true,
            resources: None,
        });
        let head = header(&status, None, 1000.0);
        assert_eq!(
            head[1..3],
            [
                "requests openai 9 decode 13.35 tok/s, anthropic 2 decode ~10.00 tok/s, \
                 responses 1",
                "last  anthropic /v1/messages  12 prompt + 8 generated tokens, decode \
                 ~10.00 tok/s  (10s ago)",
            ],
            "{head:?}"
        );
        assert!(foot_text(&head).contains("~ a rate timed by dsv4d's clock"));
        status.requests.recent[0].clock_times = false;
        status.requests.by_protocol.remove(&ApiProtocol::Anthropic);
        let head = header(&status, None, 1000.0);
        assert_eq!(foot_text(&head), "q quits", "{head:?}");
    }

    #[test]
    fn a_series_keeps_new_samples_in_order() {
        let s = |at: f64| Sample {
            at,
            ..Sample::default()
        };
        let mut series = Series::default();
        assert_eq!(series.since(1000.0), 1000.0 - WINDOW);
        series.extend(vec![s(1.0), s(2.0)]);
        // A sample seen already, or older, is not taken twice.
        series.extend(vec![s(2.0), s(1.5), s(3.0)]);
        let at: Vec<f64> = series.samples.iter().map(|s| s.at).collect();
        assert_eq!(at, [1.0, 2.0, 3.0]);
        assert!(series.since(0.0) > 3.0);
        series.extend((4..700).map(|i| s(f64::from(i))).collect());
        assert_eq!(series.samples.len(), KEPT);
    }
}
