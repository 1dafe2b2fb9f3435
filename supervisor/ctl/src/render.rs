//! Text for people: durations, rates, the status table and the profiles table. Pure
//! functions of their inputs (the current time is a parameter), so they are unit-tested.

use std::time::Duration;

use dsv4_client::duration::{brief, brief_secs};
use dsv4_client::kv::{KvCheckpoint, KvProfile, KvStep};
use dsv4_client::telemetry::{Memory, Sample, Sensor};
use dsv4_client::units::thousands;
use dsv4_client::validate::{Cell, Comparison, Matrix, ValidationResult};
use dsv4_client::words::{GpuLevel, Phase, ThermalLevel, WaitingFor};
use dsv4_client::{
    EngineStatus, InProgress, PowerStatus, ProfileInfo, RequestRecord, Status, ThermalStatus,
    Totals,
};

/// The boxes this one's engine spans: its workers (`10.77.0.2 rpc serving for 5m, loaded in
/// 1.2s`), and the coordinators that hold this box (`held by 10.77.0.1 (rpc) for 5m`).
fn box_rows(rows: &mut Vec<(&str, String)>, doc: &Status, now: f64) {
    let workers: Vec<String> = doc
        .workers
        .iter()
        .map(|w| {
            let mut line = format!(
                "{} {} {} for {}",
                w.host,
                w.profile,
                w.state,
                brief_secs(now - w.since)
            );
            if let Some(s) = w.load_seconds {
                line += &format!(", loaded in {}", brief_secs(s));
            }
            if let Some(e) = &w.error {
                line += &format!(": {e}");
            }
            if let Some(said) = box_said(w.telemetry.as_ref(), w.thermal.as_ref()) {
                line += &format!("\n  {said}");
            }
            line
        })
        .collect();
    if !workers.is_empty() {
        rows.push(("workers", workers.join("\n")));
    }
    let holds: Vec<String> = doc
        .holds
        .iter()
        .map(|h| {
            format!(
                "{} ({}) for {}",
                h.from,
                h.profile,
                brief_secs(now - h.since)
            )
        })
        .collect();
    if !holds.is_empty() {
        rows.push(("held by", holds.join("\n")));
    }
}

/// What a worker box said of itself, in one line: its model's memory, temperatures, power
/// and a thermal level above normal (`GTT 40.0 GiB of 96.0 GiB, edge 61.0 C, SoC 85.0 W`).
pub fn box_said(sample: Option<&Sample>, thermal: Option<&ThermalStatus>) -> Option<String> {
    let mut parts = Vec::new();
    if let Some(h) = sample {
        let pool = h.gpu.as_ref().and_then(|g| g.memory.pool_figures());
        if let Some((p, Some(used), total)) = pool {
            let of = total.map(|t| format!(" of {}", gib(t))).unwrap_or_default();
            parts.push(format!("{} {}{of}", p.name(), gib(used)));
        }
        parts.extend(Sensor::watched().filter_map(|s| {
            Some(format!(
                "{} {}",
                s.about().shown,
                celsius(h.temperatures.get(s)?)
            ))
        }));
        if let Some(soc) = h.power.soc {
            parts.push(format!("SoC {soc:.1} W"));
        }
        if h.throttle.active {
            parts.push("throttling".to_string());
        }
    }
    if let Some(t) = thermal.filter(|t| t.level != ThermalLevel::Normal) {
        parts.push(format!("thermal {}", t.level.as_str()));
    }
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// A rate with four significant digits: `13.35`, `122.7`, `1234`, `0.512`.
pub fn rate(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Parses `--timeout`: the project's one duration grammar (`90s`, `500ms`, `15m`, `1h30m`,
/// `1.5s`, `2d`), and a bare number as seconds, as `sleep` and `timeout` take it.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    dsv4_client::duration::parse_or_seconds(s).map_err(|e| e.to_string())
}

/// The status as a short table. `now` is the Unix time in seconds.
pub fn status_table(doc: &Status, now: f64) -> String {
    let mut rows: Vec<(&str, String)> = Vec::new();
    engine_rows(&mut rows, doc, now);
    box_rows(&mut rows, doc, now);
    let t = &doc.requests.all;
    rows.push((
        "requests",
        format!(
            "{} (prompt tokens {}, cached {}, generated {})",
            t.requests, t.prompt_tokens, t.cached_tokens, t.generated_tokens
        ),
    ));
    rows.push(("decode", decode(t)));
    rows.push(("prefill", prefill(t)));
    let apis: Vec<String> = doc
        .requests
        .by_protocol
        .iter()
        .map(|(p, t)| api_totals(p.as_str(), t))
        .collect();
    if !apis.is_empty() {
        rows.push(("by API", apis.join("\n")));
    }
    match &doc.telemetry {
        Some(sample) => hardware_rows(&mut rows, sample, now),
        None => rows.push(("hardware", "- (no sample yet)".into())),
    }
    if let Some(t) = &doc.thermal {
        rows.push(("thermal", thermal(t, now)));
    }
    if let Some(p) = &doc.power {
        power_rows(&mut rows, p);
    }
    if let Some(kv) = &doc.kv {
        for p in &kv.profiles {
            rows.push(("kv checkpoint", kv_line(p, now)));
        }
    }
    let recent: Vec<String> = doc
        .requests
        .recent
        .iter()
        .rev()
        .take(3)
        .map(|r| request_line(r, now))
        .collect();
    if !recent.is_empty() {
        rows.push(("last requests", recent.join("\n")));
    }
    if rows.iter().any(|(_, v)| v.contains(CLOCK)) {
        rows.push((CLOCK, CLOCK_MEANS.into()));
    }
    table(&rows)
}

/// The engine's rows of the status table: its state, profile, process, the requests in
/// flight and waiting, the idle stop and the last error.
fn engine_rows(rows: &mut Vec<(&str, String)>, doc: &Status, now: f64) {
    let s = &doc.engine;
    let state = if s.failures > 0 {
        let starts = if s.failures == 1 { "start" } else { "starts" };
        format!("{} ({} failed {starts} in a row)", s.state, s.failures)
    } else {
        s.state.to_string()
    };
    let state = match s.kv_step {
        Some(step) => format!("{state} ({step} the KV checkpoint)"),
        None => state,
    };
    rows.push(("state", state));
    let profile = match s.engine_profile.as_deref() {
        Some(engine) if engine != s.profile => {
            format!("{} (the running engine: {engine})", s.profile)
        }
        _ => s.profile.clone(),
    };
    let profile = if s.restart_pending {
        format!("{profile} (its settings changed: they apply when the engine next starts)")
    } else {
        profile
    };
    rows.push(("profile", profile));
    rows.push((
        "engine pid",
        s.engine_pid
            .filter(|p| *p != 0)
            .map_or_else(dash, |p| p.to_string()),
    ));
    rows.push((
        "uptime",
        s.ready_since
            .filter(|t| *t > 0.0)
            .map_or_else(dash, |t| brief_secs(now - t)),
    ));
    if let Some(key) = &s.engine_key {
        rows.push(("engine key", key.clone()));
    }
    if let Some(c) = &s.model_cache {
        rows.push(("model cache", model_cache(c, s.load_seconds)));
    }
    if let Some(i) = &s.identity {
        rows.push(("engine", identity(i)));
    }
    if !doc.canary.is_empty() {
        let lines = canary_lines(&doc.canary);
        rows.push(("canary", lines.trim_end().to_string()));
    }
    rows.push(("in flight", s.in_flight.to_string()));
    rows.push(("waiting", s.waiting.to_string()));
    if !doc.in_progress.is_empty() {
        let lines: Vec<String> = doc.in_progress.iter().map(in_progress_line).collect();
        rows.push(("in progress", lines.join("\n")));
    }
    rows.push((
        "idle stop",
        s.idle_deadline
            .filter(|t| *t > 0.0)
            .map_or_else(dash, |t| format!("stops in {}", brief_secs(t - now))),
    ));
    rows.push((
        "last error",
        s.last_error
            .as_deref()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map_or_else(dash, str::to_string),
    ));
}

/// Each profile's last canary, one a line: `320k  drifted on llama-server b6922: ...`.
pub fn canary_lines(checks: &[dsv4_client::validate::CanaryCheck]) -> String {
    if checks.is_empty() {
        return "no canary has run: a profile's first validation records its reference\n".into();
    }
    let width = checks.iter().map(|c| c.profile.len()).max().unwrap_or(0);
    checks
        .iter()
        .map(|c| format!("{:width$}  {}\n", c.profile, c.line()))
        .collect()
}

/// The engine's identity at its start and what changed since its profile's last one:
/// `llama-server 8123 (0c1e570) (ROCm), kernel 6.18.4; changed since the last start: ...`.
pub fn identity(i: &dsv4_client::identity::IdentityStatus) -> String {
    let mut out = i.identity.brief();
    if let Some(k) = &i.identity.kernel {
        out.push_str(&format!(", kernel {k}"));
    }
    match (i.first, i.changed.is_empty()) {
        (true, _) => out.push_str("; its profile's first start recorded"),
        (false, true) => out.push_str("; unchanged since the last start"),
        (false, false) => {
            out.push_str("\nchanged since the last start:");
            for c in &i.changed {
                out.push_str(&format!("\n  {c}"));
            }
        }
    }
    out
}

/// What the page cache held of the model at the start, and how long that load took: `97%
/// of 80.0 GiB in the page cache at the start: a warm load, 12s`.
pub fn model_cache(c: &dsv4_client::ModelCache, load_seconds: Option<f64>) -> String {
    let took = load_seconds.map_or(String::new(), |s| format!(", {}", brief_secs(s)));
    format!(
        "{:.0}% of {} in the page cache at the start: a {} load{took}",
        c.percent(),
        dsv4_client::units::format_gib(c.total_bytes),
        c.class.as_str()
    )
}

/// The mark of a rate timed by dsv4d's clock, and what it means (the status table's legend).
pub const CLOCK: &str = "~";
pub const CLOCK_MEANS: &str =
    "a rate timed by dsv4d's clock: the engine's answer had no timings (Anthropic Messages, \
     OpenAI Responses)";

/// `rate` tok/s, marked when dsv4d's clock timed it (or some of the requests it is over).
pub fn marked_rate(rate_tok_s: f64, clock: bool) -> String {
    let mark = if clock { CLOCK } else { "" };
    format!("{mark}{} tok/s", rate(rate_tok_s))
}

/// One API's totals: `anthropic 2 (prompt tokens 100, cached 6, generated 40), decode
/// ~10.00 tok/s, prefill ~40.00 tok/s`.
pub fn api_totals(api: &str, t: &Totals) -> String {
    let clock = t.clock_timed_requests > 0;
    let mut s = format!(
        "{api} {} (prompt tokens {}, cached {}, generated {})",
        t.requests, t.prompt_tokens, t.cached_tokens, t.generated_tokens
    );
    if let Some(d) = t.decode_tok_s {
        s.push_str(&format!(", decode {}", marked_rate(d, clock)));
    }
    if let Some(p) = t.prefill_tok_s {
        s.push_str(&format!(", prefill {}", marked_rate(p, clock)));
    }
    s
}

use dsv4_client::units::format_gib as gib;

fn celsius(v: f64) -> String {
    format!("{v:.1} C")
}

/// Available memory of the total, and swap in use.
pub fn memory(m: &Memory) -> String {
    format!(
        "{} available of {}; swap {} used",
        gib(m.available),
        gib(m.total),
        gib(m.swap_used())
    )
}

/// The latest sample's rows: what the user measured by hand, each `-` when not measured.
fn hardware_rows(rows: &mut Vec<(&str, String)>, h: &Sample, now: f64) {
    rows.push(("memory", h.memory.as_ref().map_or_else(dash, memory)));
    // The pool the model lives in: GTT, or VRAM with a large carve-out.
    let pool = h
        .gpu
        .as_ref()
        .and_then(|g| Some((g, g.memory.pool_figures()?)));
    let label = pool.map_or("GTT", |(_, (p, _, _))| p.name());
    let figures = pool.and_then(|(g, (_, used, total))| match (used, total) {
        (Some(u), Some(t)) => Some(format!("{} of {} ({})", gib(u), gib(t), g.card)),
        (Some(u), None) => Some(format!("{} ({})", gib(u), g.card)),
        _ => None,
    });
    rows.push((label, figures.unwrap_or_else(dash)));
    // The sensors the thermal rules watch.
    let temps: Vec<String> = Sensor::watched()
        .filter_map(|s| {
            let c = h.temperatures.get(s)?;
            Some(format!("{} {}", s.about().shown, celsius(c)))
        })
        .collect();
    rows.push((
        "temperature",
        if temps.is_empty() {
            dash()
        } else {
            temps.join(", ")
        },
    ));
    let power = match (h.power.soc, h.power.socket) {
        (Some(soc), Some(socket)) => format!("SoC {soc:.1} W (socket {socket:.1} W)"),
        (Some(soc), None) => format!("SoC {soc:.1} W"),
        (None, Some(socket)) => format!("socket {socket:.1} W"),
        (None, None) => dash(),
    };
    rows.push(("power", power));
    let busy = h.gpu.as_ref().and_then(|g| g.busy_percent);
    rows.push(("GPU busy", busy.map_or_else(dash, |b| format!("{b:.0}%"))));
    rows.push((
        "mem pressure",
        h.pressure.map_or_else(dash, |p| {
            format!(
                "some {:.2}%, full {:.2}% (last 10s)",
                p.some_avg10, p.full_avg10
            )
        }),
    ));
    let th = &h.throttle;
    let throttling = if !th.supported {
        "- (not reported by this machine)".to_string()
    } else if th.active {
        let kinds: Vec<&str> = th.kinds.iter().map(|k| k.as_str()).collect();
        let since = th
            .since
            .map(|s| format!(" for {}", brief_secs(now - s)))
            .unwrap_or_default();
        format!("yes ({}){since}", kinds.join(", "))
    } else {
        "no".to_string()
    };
    let total = th.seconds.total();
    let throttling = if th.supported && total > 0.0 {
        format!("{throttling}; {} in all", brief_secs(total))
    } else {
        throttling
    };
    rows.push(("throttling", throttling));
}

/// The thermal level, the sensors above normal with their peaks, and what is done about it.
fn thermal(t: &ThermalStatus, now: f64) -> String {
    let hot: Vec<String> = t
        .sensors
        .iter()
        .filter(|s| s.level != ThermalLevel::Normal)
        .map(|s| {
            let peak = s
                .peak
                .map(|p| format!(", peak {p:.1} C"))
                .unwrap_or_default();
            let since = s
                .since
                .map(|at| format!(" for {}", brief_secs(now - at)))
                .unwrap_or_default();
            format!("{} {}{since}{peak}", s.sensor, s.level)
        })
        .collect();
    let mut text = if hot.is_empty() {
        t.level.to_string()
    } else {
        format!("{} ({})", t.level, hot.join("; "))
    };
    if let Some(a) = &t.action {
        text.push_str(&format!("; {a}"));
    }
    text
}

/// What the power policy did: the method, the CPU's profile (or why none), the GPU level,
/// and SoC power now against before the engine started.
fn power_rows(rows: &mut Vec<(&str, String)>, p: &PowerStatus) {
    let Some(method) = p.method else {
        rows.push((
            "power policy",
            "- (decided at the first engine start)".into(),
        ));
        return;
    };
    let mut cpu = p
        .cpu
        .clone()
        .unwrap_or_else(|| "nothing applied now".into());
    if p.prefill {
        cpu.push_str(" (power.prefill, for a long prefill)");
    }
    if let Some(note) = &p.cpu_note {
        cpu.push_str(&format!("; {note}"));
    }
    rows.push(("power policy", format!("{method} ({}): {cpu}", p.why)));
    let mut gpu = p.gpu_level.as_ref().map_or_else(dash, GpuLevel::to_string);
    if let Some(note) = &p.gpu_note {
        gpu.push_str(&format!(" ({note})"));
    }
    rows.push(("GPU level", gpu));
    if let (Some(before), Some(now)) = (p.soc_watts_before, p.soc_watts_now) {
        rows.push((
            "SoC power",
            format!("{now:.1} W now, {before:.1} W before the engine started"),
        ));
    }
}

/// One request, with what its span cost.
fn request_line(r: &RequestRecord, now: f64) -> String {
    let mut s = format!(
        "{} ago {} {} {}: {} prompt + {} generated tokens in {}",
        brief_secs(now - r.at),
        r.profile,
        r.protocol,
        r.path,
        r.prompt_tokens,
        r.generated_tokens,
        brief_secs(r.wall_ms.max(0.0) / 1000.0)
    );
    if let Some(d) = r.decode_tok_s {
        s.push_str(&format!(", decode {}", marked_rate(d, r.clock_times)));
    }
    if let Some(res) = &r.resources {
        if let (Some(mean), Some(max)) = (res.edge_mean_c, res.edge_max_c) {
            s.push_str(&format!(", edge {mean:.1}/{max:.1} C"));
        }
        if let Some(w) = res.soc_power_mean_w {
            s.push_str(&format!(", SoC {w:.1} W"));
        }
        if let Some(g) = res.gtt_peak_bytes {
            s.push_str(&format!(", GTT peak {}", gib(g)));
        }
        if res.throttle_seconds > 0.0 {
            s.push_str(&format!(", throttled {}", brief_secs(res.throttle_seconds)));
        }
    }
    s
}

/// One request in flight and where it is: `#7 /v1/chat/completions  prefill 4,096 / 262,144
/// tokens (1.6%), 122.7 tok/s, about 35m left  (1m1s)`, the last figure its age.
pub fn in_progress_line(r: &InProgress) -> String {
    let seconds = brief_secs;
    let what = match r.phase {
        Phase::Waiting => match r.waiting_for {
            Some(WaitingFor::Start) => "waiting for a start".to_string(),
            Some(WaitingFor::Drain) => "waiting for a drain".to_string(),
            Some(WaitingFor::Validation) => "waiting for a validation".to_string(),
            Some(WaitingFor::Turn) => "waiting for its turn".to_string(),
            None => "waiting".to_string(),
        },
        Phase::Loading => {
            let mut s = match &r.profile {
                Some(p) => format!("loading {p}"),
                None => "loading".to_string(),
            };
            if let Some(at) = r.loading_s {
                s.push_str(&format!(": {}", seconds(at)));
                if let Some(about) = r.loading_about_s {
                    s.push_str(&format!(" of about {}", seconds(about)));
                }
            }
            s
        }
        Phase::Prefill => match &r.prefill {
            Some(p) => {
                let mut s = format!(
                    "prefill {} / {} tokens",
                    thousands(p.done),
                    thousands(p.total)
                );
                if p.total > 0 {
                    let pct = p.done as f64 * 100.0 / p.total as f64;
                    s.push_str(&format!(" ({pct:.1}%)"));
                }
                if p.cached > 0 {
                    s.push_str(&format!(", {} cached", thousands(p.cached)));
                }
                if let Some(r) = p.rate {
                    s.push_str(&format!(", {} tok/s", rate(r)));
                }
                if let Some(left) = p.left_s {
                    s.push_str(&format!(", about {} left", about(left)));
                }
                s
            }
            None => "prefill".to_string(),
        },
        Phase::Decoding | Phase::Ending => {
            let name = r.phase.as_str();
            match r.tokens {
                0 => name.to_string(),
                1 => format!("{name}, 1 token"),
                n => format!("{name}, {} tokens", thousands(n)),
            }
        }
    };
    format!("#{} {}  {what}  ({})", r.id, r.path, seconds(r.age_s))
}

/// A time left, to the second below a minute and to the minute above.
fn about(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    let s = if s < 60 { s } else { (s + 30) / 60 * 60 };
    brief(Duration::from_secs(s))
}

fn decode(t: &Totals) -> String {
    t.decode_tok_s
        .map_or_else(dash, |r| marked_rate(r, t.clock_timed_requests > 0))
}

/// The prefill rate over prompts of at least 1K new tokens (the figure that tells how fast
/// a long prompt goes), and the rate over all prompts.
fn prefill(t: &Totals) -> String {
    let clock = t.clock_timed_requests > 0;
    let all = t.prefill_tok_s.map(|r| marked_rate(r, clock));
    match (t.long_prompt_prefill_tok_s, t.long_prompt_requests) {
        (Some(long), n) if n > 0 => {
            let requests = if n == 1 { "request" } else { "requests" };
            let mut s = format!(
                "{} (prompts >= 1K tokens: {n} {requests})",
                marked_rate(long, clock)
            );
            if let Some(all) = all {
                s.push_str(&format!("; {all} over all prompts"));
            }
            s
        }
        _ => match all {
            Some(all) => format!("{all} (all prompts; none >= 1K tokens yet)"),
            None => dash(),
        },
    }
}

fn dash() -> String {
    "-".to_string()
}

/// Two columns, the first padded; continuation lines of a value are indented under it.
fn table(rows: &[(&str, String)]) -> String {
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in rows {
        let mut lines = v.lines();
        out.push_str(&format!(
            "{k:<width$}  {}\n",
            lines.next().unwrap_or_default()
        ));
        for l in lines {
            out.push_str(&format!("{:width$}  {l}\n", ""));
        }
    }
    out
}

/// The profiles as a table, `*` marking the active one.
use dsv4_client::units::format_size as size;

/// A save or restore: what it did, how much and how long.
fn kv_step(step: &KvStep, now: f64) -> String {
    let mut s = step.result.clone();
    if step.tokens > 0 {
        s.push_str(&format!(" {} tokens, {}", step.tokens, size(step.bytes)));
    }
    s.push_str(&format!(
        " in {}, {} ago",
        brief_secs(step.seconds),
        brief_secs(now - step.at)
    ));
    if let Some(reason) = &step.reason {
        s.push_str(&format!(" (reason: {reason})"));
    }
    if let Some(c) = &step.check {
        let verdict = if c.missed { "MISSED: " } else { "" };
        s.push_str(&format!(
            "; {verdict}the next request reused {} of the {} tokens it shared with it",
            c.reused, c.shared
        ));
    }
    s
}

/// One profile's checkpoint, last save and last restore, for the status table.
fn kv_line(p: &KvProfile, now: f64) -> String {
    let held = match &p.checkpoint {
        Some(c) => format!(
            "{}: {} tokens, {}, saved {} ago",
            p.profile,
            c.tokens,
            size(c.bytes),
            brief_secs(now - c.saved_at)
        ),
        None => match &p.engine_keeps {
            Some(own) => format!("{}: {own}, {} in {}", p.profile, size(p.dir_bytes), p.dir),
            None => format!("{}: none", p.profile),
        },
    };
    let mut lines = vec![held];
    if let Some(step) = &p.last_save {
        lines.push(format!("  last save: {}", kv_step(step, now)));
    }
    if let Some(step) = &p.last_restore {
        lines.push(format!("  last restore: {}", kv_step(step, now)));
    }
    lines.join("\n")
}

/// `dsv4ctl validate`: test, mean, sample SD, runs; then what the host did in each.
pub fn validation_table(r: &ValidationResult) -> String {
    let mut out = format!(
        "profile {} (engine build {}, kernel {})\n",
        r.profile,
        if r.engine_build.is_empty() {
            "?"
        } else {
            &r.engine_build
        },
        if r.kernel.is_empty() { "?" } else { &r.kernel }
    );
    out.push_str(&format!(
        "{:<14} {:>12} {:>10} {:>5}  {}\n",
        "test", "mean", "sample SD", "runs", "unit"
    ));
    for t in &r.tests {
        out.push_str(&format!(
            "{:<14} {:>12.3} {:>10.3} {:>5}  {}\n",
            t.name,
            t.mean,
            t.sd,
            t.runs.len(),
            t.unit
        ));
    }
    if let Some(l) = &r.load {
        out.push_str(&load_lines(l));
    }
    if let Some(c) = &r.canary {
        out.push_str(&canary_line(c));
    }
    for t in &r.tests {
        let m = &t.telemetry;
        let mut parts = Vec::new();
        if let (Some(mean), Some(max)) = (m.edge_mean_c, m.edge_max_c) {
            parts.push(format!("edge {mean:.1}/{max:.1} C"));
        }
        if let Some(w) = m.soc_power_mean_w {
            match m.soc_power_source {
                Some(source) => parts.push(format!("SoC {w:.1} W ({})", source.file())),
                None => parts.push(format!("SoC {w:.1} W")),
            }
        }
        if let Some(j) = m.joules_per_token {
            parts.push(format!("{j:.2} J/token"));
        }
        if let (Some(a), Some(b)) = (m.gtt_before_bytes, m.gtt_after_bytes) {
            parts.push(format!("GTT {} -> {}", gib(a), gib(b)));
        }
        if let (Some(a), Some(b)) = (m.available_before_bytes, m.available_after_bytes) {
            parts.push(format!("available {} -> {}", gib(a), gib(b)));
        }
        parts.push(format!("throttled {}", brief_secs(m.throttle_seconds)));
        if let Some(s) = m.swap_used_bytes {
            parts.push(format!("swap {}", size(s)));
        }
        out.push_str(&format!("  {}: {}\n", t.name, parts.join(", ")));
    }
    out
}

/// `dsv4ctl validate --compare`: each test against the earlier run.
pub fn comparison_table(earlier: &ValidationResult, c: &[Comparison]) -> String {
    let mut out = format!(
        "compared with the run of {} (engine build {}):\n",
        earlier.profile,
        build(earlier)
    );
    for c in c {
        out.push_str(&comparison_line(c));
    }
    out
}

/// One test against the earlier run: before, now, the change, and whether it is slower
/// beyond the noise.
fn comparison_line(c: &Comparison) -> String {
    format!(
        "{:<14} {:>12.3} -> {:>12.3} {:>+7.1}%  {}\n",
        c.name,
        c.before,
        c.now,
        c.change_pct,
        if c.flagged {
            format!("SLOWER beyond the noise ({:.3})", c.threshold)
        } else {
            "ok".to_string()
        }
    )
}

/// The engine build of `r`, or `?`.
fn build(r: &ValidationResult) -> &str {
    match r.engine_build.is_empty() {
        true => "?",
        false => &r.engine_build,
    }
}

/// `dsv4ctl validate --matrix`: a row per cell, the cells' settings, the verdict and the
/// change it suggests.
pub fn matrix_table(r: &ValidationResult, m: &Matrix) -> String {
    let mut out = format!(
        "matrix of profile {}: {} of {} cells (engine build {}, kernel {})\n",
        r.profile,
        m.cells.len(),
        m.planned,
        build(r),
        if r.kernel.is_empty() { "?" } else { &r.kernel }
    );
    if m.pauses > 0 {
        out.push_str(&format!(
            "paused {} time(s) to serve client requests\n",
            m.pauses
        ));
    }
    out.push_str(&format!(
        "{:<5} {:>16} {:>18} {:>27} {:>7} {:>8} {:>13} {:>7} {:>10} {:>10}\n",
        "cell",
        "decode tok/s",
        "prefill tok/s",
        "load warm/cold/stop/prewarm",
        "SoC W",
        "J/token",
        "prefill J/tok",
        "peak C",
        "throttled",
        "GTT peak"
    ));
    let rate = |t: Option<&dsv4_client::validate::TestResult>| match t {
        Some(t) => format!("{:.2} ± {:.2}", t.mean, t.sd),
        None => "-".into(),
    };
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let joules = |t: Option<&dsv4_client::validate::TestResult>| {
        t.and_then(|t| t.telemetry.joules_per_token)
            .map(|j| format!("{j:.3}"))
    };
    for c in &m.cells {
        let decode = c.test("decode");
        out.push_str(&format!(
            "{:<5} {:>16} {:>18} {:>27} {:>7} {:>8} {:>13} {:>7} {:>10} {:>10}\n",
            c.index,
            rate(decode),
            rate(c.test("prefill")),
            or_dash(c.load.as_ref().map(load_cell)),
            or_dash(c.host.soc_power_mean_w.map(|w| format!("{w:.1}"))),
            or_dash(joules(decode)),
            or_dash(joules(c.test("prefill"))),
            or_dash(c.host.edge_max_c.map(|t| format!("{t:.1}"))),
            brief_secs(c.host.throttle_seconds),
            or_dash(c.host.gtt_peak_bytes.map(gib)),
        ));
    }
    for c in &m.cells {
        out.push_str(&cell_settings(c));
    }
    match &m.verdict {
        Some(v) => {
            let within: Vec<String> = v.within_noise.iter().map(u32::to_string).collect();
            out.push_str(&format!(
                "verdict: cell {}: {} (cells within the noise of the fastest: {})\n",
                v.pick,
                v.reason,
                within.join(", ")
            ));
            if let Some(p) = &v.prefill {
                out.push_str(&format!("long prefills: {}\n", p.reason));
            }
        }
        None => out.push_str("verdict: none (no cell has a decode figure)\n"),
    }
    if let Some(snippet) = &m.snippet {
        out.push_str("the change for the service profile (dsv4d does not make it):\n");
        for line in snippet.lines() {
            out.push_str(&format!("  {line}\n"));
        }
    }
    out
}

/// The load test's lines of the validation table: warm and cold, then after an idle stop
/// without and with `engine.prewarm`.
fn load_lines(l: &dsv4_client::validate::LoadTest) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "load: {} with the page cache as it was ({} of {} cached), {} with the \
         model dropped from it ({} cached); the model is {}\n",
        brief_secs(l.warm_seconds),
        size(l.cached_before_warm),
        size(l.bytes),
        brief_secs(l.cold_seconds),
        size(l.cached_before_cold),
        l.method
    ));
    if let (Some(stop), Some(left)) = (l.after_stop_seconds, l.cached_after_stop) {
        out.push_str(&format!(
            "after an idle stop: {} as the engine's run left the page cache ({} \
             cached){}\n",
            brief_secs(stop),
            size(left),
            match (l.prewarmed_seconds, l.cached_after_prewarm) {
                (Some(p), Some(c)) => format!(
                    ", {} with engine.prewarm ({} read, {} cached)",
                    brief_secs(p),
                    size(l.read_back),
                    size(c)
                ),
                _ => String::new(),
            }
        ));
    }
    out
}

/// The canary of a validation: recorded, as its reference, or where it drifted.
fn canary_line(c: &dsv4_client::validate::CanaryResult) -> String {
    let prompts = c.run.prompts.len();
    match (&c.drift, c.recorded) {
        (_, true) => format!("canary: {prompts} prompts, recorded as the profile's reference\n"),
        (None, false) => format!(
            "canary: {prompts} prompts as the reference of {} (log-probabilities within {})\n",
            if c.reference_engine.is_empty() {
                "an earlier run"
            } else {
                &c.reference_engine
            },
            c.tolerance
        ),
        (Some(d), false) => format!("canary: DRIFT: {d}\n"),
    }
}

/// A cell's load times: warm, cold, after an idle stop, and the same with `engine.prewarm`
/// (`-` for a figure a result of an older daemon does not have).
fn load_cell(l: &dsv4_client::validate::LoadTest) -> String {
    let or_dash = |s: Option<f64>| s.map_or_else(|| "-".to_string(), brief_secs);
    format!(
        "{}/{}/{}/{}",
        brief_secs(l.warm_seconds),
        brief_secs(l.cold_seconds),
        or_dash(l.after_stop_seconds),
        or_dash(l.prewarmed_seconds)
    )
}

/// A matrix cell's settings as the table's notes give them, with what was applied and why
/// it failed.
fn cell_settings(c: &Cell) -> String {
    let mut out = String::new();
    let mut applied = Vec::new();
    if let Some(cpu) = &c.applied_cpu {
        applied.push(format!("CPU: {cpu}"));
    }
    if let Some(gpu) = &c.applied_gpu {
        applied.push(format!("GPU level {gpu}"));
    }
    if let Some(l) = &c.load {
        applied.push(l.method.clone());
    }
    out.push_str(&format!("  {}: {}", c.index, c.settings.label()));
    if !applied.is_empty() {
        out.push_str(&format!(" ({})", applied.join("; ")));
    }
    out.push('\n');
    if let Some(why) = &c.error {
        out.push_str(&format!("     failed: {why}\n"));
    }
    out
}

/// `dsv4ctl validate --matrix --compare`: each cell against the same settings' cell of the
/// earlier matrix.
pub fn matrix_comparison(earlier: &ValidationResult, c: &[(&Cell, Vec<Comparison>)]) -> String {
    let mut out = format!(
        "compared cell by cell with the matrix of {} (engine build {}):\n",
        earlier.profile,
        build(earlier)
    );
    if c.is_empty() {
        out.push_str("  no cell of this run has the settings of one of that run\n");
    }
    for (cell, comparisons) in c {
        for c in comparisons {
            out.push_str(&format!("{:<5} {}", cell.index, comparison_line(c)));
        }
    }
    out
}

/// `dsv4ctl kv list`.
pub fn kv_table(list: &[KvCheckpoint], now: f64) -> String {
    if list.is_empty() {
        return "no KV checkpoints\n".into();
    }
    let mut out = String::new();
    for c in list {
        let slots: Vec<String> = c.slots.iter().map(u32::to_string).collect();
        out.push_str(&format!(
            "{}  {}  {} tokens  {}  saved {} ago  slots {}  build {}\n",
            c.id,
            c.profile,
            c.tokens,
            size(c.bytes),
            brief_secs(now - c.saved_at),
            slots.join(","),
            c.build
        ));
        if let Some(why) = &c.aside {
            out.push_str(&format!("    set aside: {why}\n"));
        }
    }
    out
}

pub fn profiles_table(profiles: &[ProfileInfo]) -> String {
    let mut rows: Vec<[String; 5]> = vec![[
        String::new(),
        "NAME".into(),
        "ENGINE".into(),
        "CONTEXT".into(),
        "DESCRIPTION".into(),
    ]];
    for p in profiles {
        rows.push([
            if p.active { "*" } else { "" }.to_string(),
            p.name.clone(),
            p.engine.clone(),
            p.context.map_or_else(dash, |c| c.to_string()),
            p.description
                .as_deref()
                .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|d| !d.is_empty())
                .unwrap_or_else(dash),
        ]);
    }
    let mut widths = [0usize; 5];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(widths).enumerate() {
            if i == 0 {
                line.push_str(&format!("{c:<w$} "));
            } else if i + 1 == r.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$}  "));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// What `dsv4ctl profile` prints: the active profile, and the running engine's if another.
pub fn active_profile(s: &EngineStatus) -> String {
    match s.engine_profile.as_deref() {
        Some(engine) if !engine.is_empty() && engine != s.profile => {
            format!("{} (the running engine still uses {engine})", s.profile)
        }
        _ => s.profile.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_client::words::{KvActivity, PowerMethod};
    use dsv4_client::{Requests, State};

    #[test]
    fn rates_have_four_significant_digits() {
        assert_eq!(rate(13.3512), "13.35");
        assert_eq!(rate(122.66), "122.7");
        assert_eq!(rate(1234.4), "1234");
        assert_eq!(rate(0.5123), "0.512");
        assert_eq!(rate(5.0), "5.000");
    }

    #[test]
    fn timeouts_parse() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m5s"), Ok(Duration::from_secs(125)));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("-1").is_err());
        // The same grammar as the configuration files.
        assert_eq!(parse_duration("5 m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_duration("30m1h").is_err());
    }

    fn status() -> Status {
        Status {
            engine: EngineStatus {
                state: State::Ready,
                profile: "320k".into(),
                engine_profile: Some("320k".into()),
                engine_pid: Some(4242),
                generation: Some(3),
                in_flight: 1,
                waiting: 0,
                idle_deadline: Some(1_000_890.4),
                ready_since: Some(999_808.0),
                load_seconds: Some(54.2),
                failures: 0,
                last_error: None,
                restart_pending: false,
                engine_key: Some("per-generation secret".into()),
                kv_step: None,
                model_cache: None,
                identity: None,
            },
            requests: Requests {
                all: Totals {
                    requests: 12,
                    prompt_tokens: 34_567,
                    cached_tokens: 1200,
                    generated_tokens: 4567,
                    decode_tok_s: Some(13.3512),
                    prefill_tok_s: Some(98.2),
                    long_prompt_requests: 3,
                    long_prompt_prefill_tok_s: Some(122.66),
                    clock_timed_requests: 0,
                },
                by_profile: Default::default(),
                by_protocol: Default::default(),
                recent: Vec::new(),
            },
            telemetry: None,
            power: None,
            limits: None,
            in_progress: Vec::new(),
            holds: Vec::new(),
            workers: Vec::new(),
            canary: Vec::new(),
            thermal: None,
            kv: None,
        }
    }

    /// What the line says of an engine's own checkpoints is what the daemon published, not
    /// something decided here by the engine's name.
    #[test]
    fn an_engines_own_checkpoints_are_shown_as_the_daemon_names_them() {
        let own = KvProfile {
            profile: "64k".into(),
            engine: "some-engine".into(),
            engine_keeps: Some("its own files".into()),
            dir: "/var/cache/e".into(),
            dir_bytes: 2 << 20,
            ..KvProfile::default()
        };
        assert_eq!(
            kv_line(&own, 0.0),
            "64k: its own files, 2.0 MiB in /var/cache/e"
        );
        let kept = KvProfile {
            engine_keeps: None,
            ..own
        };
        assert_eq!(kv_line(&kept, 0.0), "64k: none");
    }

    #[test]
    fn kv_checkpoints_are_shown_with_size_age_and_steps() {
        use dsv4_client::kv::{KvCheckpoint, KvProfile, KvStatus, KvStep};
        let now = 10_000.0;
        let checkpoint = KvCheckpoint {
            id: "99d90431048c6f35".into(),
            profile: "320k".into(),
            tokens: 262_144,
            bytes: 3 << 30,
            saved_at: now - 300.0,
            save_seconds: 4.2,
            slots: vec![0],
            build: "b7000-abc".into(),
            aside: None,
        };
        let mut s = status();
        s.kv = Some(KvStatus {
            profiles: vec![KvProfile {
                profile: "320k".into(),
                engine: "llama-server".into(),
                engine_keeps: None,
                dir: "/var/lib/dsv4/kv".into(),
                checkpoint: Some(checkpoint.clone()),
                dir_bytes: 3 << 30,
                last_save: Some(KvStep {
                    at: now - 300.0,
                    seconds: 4.2,
                    tokens: 262_144,
                    bytes: 3 << 30,
                    result: "saved".into(),
                    ok: true,
                    engine_said: None,
                    reason: Some("shutdown".into()),
                    check: None,
                }),
                last_restore: Some(KvStep {
                    at: now - 60.0,
                    seconds: 1.5,
                    tokens: 262_144,
                    bytes: 3 << 30,
                    result: "restored".into(),
                    ok: true,
                    check: Some(dsv4_client::kv::RestoreCheck {
                        at: now - 30.0,
                        reused: 14,
                        shared: 262_144,
                        missed: true,
                    }),
                    ..KvStep::default()
                }),
            }],
            restored_tokens_total: 0,
            restore_misses_total: 1,
        });
        let text = status_table(&s, now);
        assert!(
            text.contains("kv checkpoint  320k: 262144 tokens, 3.0 GiB, saved 5m ago"),
            "{text}"
        );
        assert!(
            text.contains(
                "last save: saved 262144 tokens, 3.0 GiB in 4.2s, 5m ago (reason: shutdown)"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "last restore: restored 262144 tokens, 3.0 GiB in 1.5s, 1m ago; MISSED: the \
                 next request reused 14 of the 262144 tokens it shared with it"
            ),
            "{text}"
        );
        let aside = KvCheckpoint {
            aside: Some("made with context per slot 65536 (now 327680)".into()),
            bytes: 5 << 20,
            ..checkpoint.clone()
        };
        let list = kv_table(&[checkpoint, aside], now);
        assert_eq!(
            list,
            "99d90431048c6f35  320k  262144 tokens  3.0 GiB  saved 5m ago  slots 0  build b7000-abc\n\
             99d90431048c6f35  320k  262144 tokens  5.0 MiB  saved 5m ago  slots 0  build b7000-abc\n    \
             set aside: made with context per slot 65536 (now 327680)\n"
        );
        assert_eq!(kv_table(&[], now), "no KV checkpoints\n");
        s.engine.state = State::Starting;
        s.engine.kv_step = Some(KvActivity::Restoring);
        let text = status_table(&s, now);
        assert!(
            text.contains("state          starting (restoring the KV checkpoint)"),
            "{text}"
        );
    }

    fn flight(phase: Phase) -> InProgress {
        InProgress {
            id: 7,
            path: "/v1/chat/completions".into(),
            stream: true,
            profile: Some("320k".into()),
            age_s: 61.4,
            phase,
            waiting_for: None,
            loading_s: None,
            loading_about_s: None,
            prefill: None,
            tokens: 0,
        }
    }

    #[test]
    fn each_phase_of_a_request_in_flight_reads_as_one_line() {
        use dsv4_client::PrefillProgress;
        let waiting = |w| InProgress {
            waiting_for: Some(w),
            profile: None,
            ..flight(Phase::Waiting)
        };
        let prefill = |done, cached, rate, left_s| InProgress {
            prefill: Some(PrefillProgress {
                done,
                total: 262_144,
                cached,
                rate,
                left_s,
            }),
            ..flight(Phase::Prefill)
        };
        let table = [
            (waiting(WaitingFor::Start), "waiting for a start"),
            (waiting(WaitingFor::Drain), "waiting for a drain"),
            (waiting(WaitingFor::Validation), "waiting for a validation"),
            (waiting(WaitingFor::Turn), "waiting for its turn"),
            (
                InProgress {
                    loading_s: Some(23.4),
                    loading_about_s: Some(54.0),
                    ..flight(Phase::Loading)
                },
                "loading 320k: 23s of about 54s",
            ),
            (
                InProgress {
                    loading_s: Some(3.0),
                    ..flight(Phase::Loading)
                },
                "loading 320k: 3s",
            ),
            (
                prefill(4096, 0, Some(122.7), Some(2103.1)),
                "prefill 4,096 / 262,144 tokens (1.6%), 122.7 tok/s, about 35m left",
            ),
            (
                prefill(261_000, 1024, Some(122.7), Some(9.3)),
                "prefill 261,000 / 262,144 tokens (99.6%), 1,024 cached, 122.7 tok/s, \
                 about 9s left",
            ),
            (
                prefill(0, 0, None, None),
                "prefill 0 / 262,144 tokens (0.0%)",
            ),
            (flight(Phase::Prefill), "prefill"),
            (
                InProgress {
                    tokens: 12,
                    ..flight(Phase::Decoding)
                },
                "decoding, 12 tokens",
            ),
            (
                InProgress {
                    tokens: 1,
                    ..flight(Phase::Decoding)
                },
                "decoding, 1 token",
            ),
            (flight(Phase::Decoding), "decoding"),
            (
                InProgress {
                    tokens: 1234,
                    ..flight(Phase::Ending)
                },
                "ending, 1,234 tokens",
            ),
        ];
        for (r, what) in table {
            assert_eq!(
                in_progress_line(&r),
                format!("#7 /v1/chat/completions  {what}  (1m1s)")
            );
        }
    }

    #[test]
    fn the_status_table_lists_the_requests_in_flight_and_nothing_when_none() {
        let mut s = status();
        assert!(!status_table(&s, 1_000_000.0).contains("in progress"));
        s.in_progress = vec![
            InProgress {
                tokens: 12,
                ..flight(Phase::Decoding)
            },
            InProgress {
                id: 8,
                age_s: 2.0,
                waiting_for: Some(WaitingFor::Turn),
                ..flight(Phase::Waiting)
            },
        ];
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(
                "waiting      0\n\
                 in progress  #7 /v1/chat/completions  decoding, 12 tokens  (1m1s)\n\
                 \x20            #8 /v1/chat/completions  waiting for its turn  (2s)\n\
                 idle stop    "
            ),
            "{table}"
        );
    }

    #[test]
    fn the_boxes_an_engine_spans_are_listed_with_their_state() {
        let mut s = status();
        assert!(!status_table(&s, 1_000_000.0).contains("workers"));
        let worker = |host: &str, state: &str| dsv4_client::WorkerStatus {
            host: host.into(),
            at: format!("{host}:8090"),
            profile: "rpc".into(),
            state: state.into(),
            since: 999_700.0,
            load_seconds: None,
            error: None,
            telemetry: None,
            thermal: None,
        };
        s.workers = vec![
            dsv4_client::WorkerStatus {
                load_seconds: Some(1.25),
                ..worker("10.77.0.2", "serving")
            },
            dsv4_client::WorkerStatus {
                error: Some("cannot connect to 10.77.0.3:8090: refused".into()),
                ..worker("10.77.0.3", "lost")
            },
        ];
        s.holds = vec![dsv4_client::Hold {
            from: "10.77.0.9".into(),
            profile: "rpc".into(),
            since: 999_940.0,
        }];
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(
                "workers     10.77.0.2 rpc serving for 5m, loaded in 1.2s\n\
                 \x20           10.77.0.3 rpc lost for 5m: cannot connect to 10.77.0.3:8090: refused\n\
                 held by     10.77.0.9 (rpc) for 1m\n"
            ),
            "{table}"
        );
    }

    #[test]
    fn a_worker_box_says_its_memory_temperatures_power_and_heat() {
        use dsv4_client::telemetry::*;
        let sample = Sample {
            at: 0.0,
            memory: None,
            pressure: None,
            gpu: Some(Gpu {
                card: "card1".into(),
                memory: GpuMemory {
                    gtt_used: Some(40 << 30),
                    gtt_total: Some(96 << 30),
                    ..GpuMemory::default()
                },
                ..Gpu::default()
            }),
            temperatures: [(Sensor::Edge, 91.0)].into_iter().collect(),
            power: PowerDraw {
                soc: Some(85.0),
                ..PowerDraw::default()
            },
            throttle: Throttle::default(),
            engine: None,
        };
        let hot = ThermalStatus {
            level: ThermalLevel::Warn,
            ..ThermalStatus::default()
        };
        let said = box_said(Some(&sample), Some(&hot)).unwrap();
        assert_eq!(
            said,
            "GTT 40.0 GiB of 96.0 GiB, edge 91.0 C, SoC 85.0 W, thermal warn"
        );
        assert_eq!(box_said(None, Some(&ThermalStatus::default())), None);
        let mut s = status();
        s.workers = vec![dsv4_client::WorkerStatus {
            host: "10.77.0.2".into(),
            at: "10.77.0.2:8090".into(),
            profile: "rpc".into(),
            state: "serving".into(),
            since: 999_700.0,
            load_seconds: None,
            error: None,
            telemetry: Some(sample),
            thermal: Some(hot),
        }];
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(&format!(
                "workers     10.77.0.2 rpc serving for 5m\n\x20             {said}\n"
            )),
            "{table}"
        );
    }

    #[test]
    fn the_model_in_the_page_cache_is_shown_with_its_load() {
        let mut s = status();
        assert!(!status_table(&s, 1_000_000.0).contains("model cache"));
        s.engine.model_cache = Some(dsv4_client::ModelCache {
            resident_bytes: 78 << 30,
            total_bytes: 80 << 30,
            class: dsv4_client::CacheClass::Warm,
            at: 999_000.0,
        });
        s.engine.load_seconds = Some(12.4);
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(
                "model cache  98% of 80.0 GiB in the page cache at the start: a warm load, 12s\n"
            ),
            "{table}"
        );
    }

    #[test]
    fn the_engines_identity_and_its_changes_are_shown() {
        let mut s = status();
        assert!(!status_table(&s, 1_000_000.0).contains("llama-server"));
        let mut i = dsv4_client::identity::IdentityStatus {
            profile: "320k".into(),
            identity: dsv4_client::identity::EngineIdentity {
                engine: "llama-server".into(),
                version: Some("8123 (0c1e570)".into()),
                backend: Some("ROCm".into()),
                kernel: Some("6.18.4".into()),
                ..Default::default()
            },
            changed: vec![],
            first: false,
        };
        s.engine.identity = Some(i.clone());
        let table = status_table(&s, 1_000_000.0);
        let want = "llama-server 8123 (0c1e570) (ROCm), kernel 6.18.4; unchanged since the last \
                    start\n";
        assert!(table.contains(want), "{table}");
        i.changed = vec!["kernel 6.18.3 -> 6.18.4".into()];
        s.engine.identity = Some(i);
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains("changed since the last start:\n")
                && table.contains("kernel 6.18.3 -> 6.18.4\n"),
            "{table}"
        );
    }

    #[test]
    fn a_pending_restart_is_shown() {
        let mut s = status();
        s.engine.restart_pending = true;
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(
                "profile     320k (its settings changed: they apply when the engine next starts)\n"
            ),
            "{table}"
        );
    }

    #[test]
    fn the_status_table() {
        let table = status_table(&status(), 1_000_000.0);
        assert_eq!(
            table,
            "\
state       ready
profile     320k
engine pid  4242
uptime      3m12s
engine key  per-generation secret
in flight   1
waiting     0
idle stop   stops in 14m50s
last error  -
requests    12 (prompt tokens 34567, cached 1200, generated 4567)
decode      13.35 tok/s
prefill     122.7 tok/s (prompts >= 1K tokens: 3 requests); 98.20 tok/s over all prompts
hardware    - (no sample yet)
"
        );
    }

    /// Each API that had requests has a line of totals, each request its API, and a rate
    /// dsv4d's clock timed is marked, the mark said in a legend.
    #[test]
    fn the_status_table_names_each_api_and_marks_the_clocks_rates() {
        use dsv4_client::ApiProtocol;
        let mut s = status();
        let totals = |requests, clock_timed_requests, decode: Option<f64>| Totals {
            requests,
            prompt_tokens: 100,
            cached_tokens: 6,
            generated_tokens: 40,
            decode_tok_s: decode,
            prefill_tok_s: decode.map(|d| d * 4.0),
            long_prompt_requests: 0,
            long_prompt_prefill_tok_s: None,
            clock_timed_requests,
        };
        s.requests.all.clock_timed_requests = 1;
        s.requests.by_protocol = [
            (ApiProtocol::OpenAi, totals(9, 0, Some(13.3512))),
            (ApiProtocol::Anthropic, totals(2, 1, Some(10.0))),
            // Plain answers without timings: tokens, no rates.
            (ApiProtocol::Responses, totals(1, 0, None)),
        ]
        .into_iter()
        .collect();
        let record = |protocol, path: &str, clock_times, decode| RequestRecord {
            profile: "320k".into(),
            path: path.into(),
            protocol,
            at: 999_990.0,
            prompt_tokens: 12,
            cached_tokens: 0,
            generated_tokens: 8,
            prefill_tok_s: decode,
            decode_tok_s: decode,
            prompt_ms: 100.0,
            decode_ms: 800.0,
            wall_ms: 900.0,
            clock_times,
            resources: None,
        };
        s.requests.recent = vec![
            record(ApiProtocol::Responses, "/v1/responses", false, None),
            record(
                ApiProtocol::OpenAi,
                "/v1/chat/completions",
                false,
                Some(9.5),
            ),
            record(ApiProtocol::Anthropic, "/v1/messages", true, Some(10.0)),
        ];
        let table = status_table(&s, 1_000_000.0);
        let tail: Vec<&str> = table.lines().skip(10).collect();
        assert_eq!(
            tail,
            [
                "decode         ~13.35 tok/s",
                "prefill        ~122.7 tok/s (prompts >= 1K tokens: 3 requests); ~98.20 tok/s \
                 over all prompts",
                "by API         openai 9 (prompt tokens 100, cached 6, generated 40), decode \
                 13.35 tok/s, prefill 53.40 tok/s",
                "               anthropic 2 (prompt tokens 100, cached 6, generated 40), decode \
                 ~10.00 tok/s, prefill ~40.00 tok/s",
                "               responses 1 (prompt tokens 100, cached 6, generated 40)",
                "hardware       - (no sample yet)",
                "last requests  10s ago 320k anthropic /v1/messages: 12 prompt + 8 generated \
                 tokens in 900ms, decode ~10.00 tok/s",
                "               10s ago 320k openai /v1/chat/completions: 12 prompt + 8 generated \
                 tokens in 900ms, decode 9.500 tok/s",
                "               10s ago 320k responses /v1/responses: 12 prompt + 8 generated \
                 tokens in 900ms",
                "~              a rate timed by dsv4d's clock: the engine's answer had no \
                 timings (Anthropic Messages, OpenAI Responses)",
            ],
            "{table}"
        );
        // Without a clock's rate, no mark and no legend.
        s.requests.all.clock_timed_requests = 0;
        s.requests.by_protocol.remove(&ApiProtocol::Anthropic);
        s.requests.recent.pop();
        let table = status_table(&s, 1_000_000.0);
        assert!(!table.contains('~'), "{table}");
        assert!(table.contains("\nby API         openai 9 "), "{table}");
    }

    #[test]
    fn the_status_table_with_the_hardware_and_the_last_requests() {
        use dsv4_client::telemetry::*;
        let mut s = status();
        s.telemetry = Some(Sample {
            at: 1_000_000.0,
            memory: Some(Memory {
                total: 124 << 30,
                available: 37 << 30,
                swap_total: 8 << 30,
                swap_free: (8 << 30) - (1 << 27),
            }),
            pressure: Some(Pressure {
                some_avg10: 1.25,
                full_avg10: 0.4,
                some_total_us: 0,
                full_total_us: 0,
            }),
            gpu: Some(Gpu {
                card: "card1".into(),
                memory: GpuMemory {
                    gtt_used: Some(81 << 30),
                    gtt_total: Some(112 << 30),
                    vram_total: Some(1 << 29),
                    ..GpuMemory::default()
                },
                pool: Some(MemoryPool::Gtt),
                busy_percent: Some(97.0),
                ..Gpu::default()
            }),
            temperatures: [(Sensor::Edge, 73.2), (Sensor::Tctl, 74.25)]
                .into_iter()
                .collect(),
            power: PowerDraw {
                soc: Some(69.6),
                socket: Some(85.0),
                ..PowerDraw::default()
            },
            throttle: Throttle {
                supported: true,
                active: true,
                kinds: vec![ThrottleKind::Thermal],
                since: Some(999_990.0),
                seconds: ThrottleSeconds {
                    thermal: 12.0,
                    ..ThrottleSeconds::default()
                },
            },
            engine: None,
        });
        s.requests.recent.push(RequestRecord {
            profile: "320k".into(),
            path: "/completion".into(),
            protocol: Default::default(),
            at: 999_700.0,
            prompt_tokens: 262_144,
            cached_tokens: 0,
            generated_tokens: 32,
            prefill_tok_s: Some(36.9),
            decode_tok_s: Some(5.3),
            prompt_ms: 7_098_500.0,
            decode_ms: 6000.0,
            wall_ms: 7_104_000.0,
            clock_times: false,
            resources: Some(Resources {
                samples: 7104,
                edge_mean_c: Some(73.2),
                edge_max_c: Some(78.5),
                soc_power_mean_w: Some(85.0),
                gtt_peak_bytes: Some(81 << 30),
                available_min_bytes: None,
                throttle_seconds: 0.0,
            }),
        });
        let table = status_table(&s, 1_000_000.0);
        let tail: Vec<&str> = table.lines().skip(12).collect();
        assert_eq!(
            tail,
            [
                "memory         37.0 GiB available of 124.0 GiB; swap 0.1 GiB used",
                "GTT            81.0 GiB of 112.0 GiB (card1)",
                "temperature    edge 73.2 C, Tctl 74.2 C",
                "power          SoC 69.6 W (socket 85.0 W)",
                "GPU busy       97%",
                "mem pressure   some 1.25%, full 0.40% (last 10s)",
                "throttling     yes (thermal) for 10s; 12s in all",
                "last requests  5m ago 320k openai /completion: 262144 prompt + 32 generated tokens in \
                 1h58m, decode 5.300 tok/s, edge 73.2/78.5 C, SoC 85.0 W, GTT peak 81.0 GiB",
            ]
        );
        // A large VRAM carve-out: the model's pool is VRAM, and that is the row.
        if let Some(g) = s.telemetry.as_mut().and_then(|t| t.gpu.as_mut()) {
            g.memory.vram_used = Some(81 << 30);
            g.memory.vram_total = Some(96 << 30);
            g.memory.gtt_total = Some(16 << 30);
            g.memory.gtt_used = Some(1 << 29);
            g.pool = Some(MemoryPool::Vram);
        }
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains("\nVRAM           81.0 GiB of 96.0 GiB (card1)\n"),
            "{table}"
        );
        s.power = Some(PowerStatus {
            method: Some(PowerMethod::Ppd),
            why: "power-profiles-daemon is on the system bus as net.hadess.PowerProfiles".into(),
            cpu: Some("power-saver held through net.hadess.PowerProfiles".into()),
            held: true,
            prefill: false,
            cpu_note: None,
            gpu_level: Some(GpuLevel::Auto),
            gpu_note: Some("set to auto (it was low)".into()),
            soc_watts_before: Some(86.6),
            soc_watts_now: Some(69.6),
        });
        s.thermal = Some(ThermalStatus {
            level: ThermalLevel::Critical,
            sensors: vec![dsv4_client::SensorThermal {
                sensor: "edge".into(),
                level: ThermalLevel::Critical,
                since: Some(999_940.0),
                peak: Some(96.5),
            }],
            throttling_since: None,
            action: Some("notify only".into()),
        });
        let table = status_table(&s, 1_000_000.0);
        assert!(
            table.contains(
                "thermal        critical (edge critical for 1m, peak 96.5 C); notify only\n"
            ),
            "{table}"
        );
        let power: Vec<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with("power policy"))
            .take(3)
            .collect();
        assert_eq!(
            power,
            [
                "power policy   ppd (power-profiles-daemon is on the system bus as \
                 net.hadess.PowerProfiles): power-saver held through net.hadess.PowerProfiles",
                "GPU level      auto (set to auto (it was low))",
                "SoC power      69.6 W now, 86.6 W before the engine started",
            ]
        );
    }

    #[test]
    fn the_status_table_when_stopped_after_failures() {
        let mut s = status();
        s.engine.state = State::Backoff;
        s.engine.profile = "64k".into();
        s.engine.engine_profile = None;
        s.engine.engine_pid = None;
        s.engine.idle_deadline = None;
        s.engine.ready_since = None;
        s.engine.in_flight = 0;
        s.engine.waiting = 2;
        s.engine.failures = 2;
        s.engine.last_error = Some("the engine exited with status 1 before it was ready".into());
        s.engine.engine_key = Some("none (ds4-server has no key option)".into());
        s.requests = Requests::default();
        let table = status_table(&s, 1_000_000.0);
        assert_eq!(
            table,
            "\
state       backoff (2 failed starts in a row)
profile     64k
engine pid  -
uptime      -
engine key  none (ds4-server has no key option)
in flight   0
waiting     2
idle stop   -
last error  the engine exited with status 1 before it was ready
requests    0 (prompt tokens 0, cached 0, generated 0)
decode      -
prefill     -
hardware    - (no sample yet)
"
        );
    }

    #[test]
    fn the_status_table_names_the_engines_profile_when_it_differs() {
        let mut s = status();
        s.engine.profile = "64k".into();
        s.requests.all.long_prompt_requests = 0;
        s.requests.all.long_prompt_prefill_tok_s = None;
        s.engine.last_error = Some("first line\nsecond line".into());
        let table = status_table(&s, 1_000_000.0);
        assert!(table.contains("profile     64k (the running engine: 320k)\n"));
        assert!(table.contains("prefill     98.20 tok/s (all prompts; none >= 1K tokens yet)\n"));
        assert!(table.contains("last error  first line\n            second line\n"));
    }

    #[test]
    fn an_overdue_deadline_counts_as_zero() {
        let table = status_table(&status(), 1_000_900.0);
        assert!(table.contains("idle stop   stops in 0s\n"));
    }

    #[test]
    fn the_profiles_table() {
        let profiles = vec![
            ProfileInfo {
                name: "320k".into(),
                description: Some("service: the full context".into()),
                engine: "llama-server".into(),
                context: Some(327_680),
                active: true,
            },
            ProfileInfo {
                name: "64k".into(),
                description: None,
                engine: "ds4".into(),
                context: None,
                active: false,
            },
        ];
        assert_eq!(
            profiles_table(&profiles),
            "  NAME  ENGINE        CONTEXT  DESCRIPTION
* 320k  llama-server  327680   service: the full context
  64k   ds4           -        -
"
        );
    }

    #[test]
    fn the_active_profile() {
        let mut s = status();
        assert_eq!(active_profile(&s.engine), "320k");
        s.engine.engine_profile = Some("64k".into());
        assert_eq!(
            active_profile(&s.engine),
            "320k (the running engine still uses 64k)"
        );
    }
}
