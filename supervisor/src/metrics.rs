//! `GET /metrics`: the supervisor's own figures in the Prometheus text format.
//!
//! Owns: the metric names and their rendering. Must not: reach the engine; a scraper
//! polling every few seconds must neither start an idle engine nor keep it running.
//! (Hardware telemetry joins these once the monitor exists.)

use std::fmt::Write;

use dsv4_client::State;

use crate::lifecycle::Status;
use crate::stats::Report;

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Label values are profile names (letters, digits, `.`, `_`, `-`), but escape anyway.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub fn render(status: &Status, requests: &Report) -> String {
    let mut o = String::with_capacity(2048);
    family(
        &mut o,
        "dsv4_engine_state",
        "gauge",
        "Engine lifecycle state: 1 for the current one.",
    );
    for s in State::ALL {
        let _ = writeln!(
            o,
            "dsv4_engine_state{{state=\"{s}\"}} {}",
            u8::from(status.state == s)
        );
    }
    family(
        &mut o,
        "dsv4_active_profile",
        "gauge",
        "The active profile: 1 for it.",
    );
    let _ = writeln!(
        o,
        "dsv4_active_profile{{profile=\"{}\"}} 1",
        label(&status.profile)
    );
    family(
        &mut o,
        "dsv4_in_flight_requests",
        "gauge",
        "Requests holding a lease on the engine.",
    );
    let _ = writeln!(o, "dsv4_in_flight_requests {}", status.in_flight);
    family(
        &mut o,
        "dsv4_waiting_requests",
        "gauge",
        "Requests waiting for the engine to be ready.",
    );
    let _ = writeln!(o, "dsv4_waiting_requests {}", status.waiting);
    family(
        &mut o,
        "dsv4_start_failures",
        "gauge",
        "Consecutive failed engine starts.",
    );
    let _ = writeln!(o, "dsv4_start_failures {}", status.failures);
    family(
        &mut o,
        "dsv4_engine_generation",
        "gauge",
        "Engines started since the daemon started.",
    );
    let _ = writeln!(
        o,
        "dsv4_engine_generation {}",
        status.generation.unwrap_or(0)
    );

    let counters = [
        (
            "dsv4_requests_total",
            "Finished requests with engine timings.",
            0,
        ),
        (
            "dsv4_prompt_tokens_total",
            "New (uncached) prompt tokens.",
            1,
        ),
        (
            "dsv4_cached_prompt_tokens_total",
            "Prompt tokens served from the engine's cache.",
            2,
        ),
        ("dsv4_generated_tokens_total", "Generated tokens.", 3),
    ];
    for (name, help, which) in counters {
        family(&mut o, name, "counter", help);
        for (profile, t) in &requests.by_profile {
            let v = [
                t.requests,
                t.prompt_tokens,
                t.cached_tokens,
                t.generated_tokens,
            ][which];
            let _ = writeln!(o, "{name}{{profile=\"{}\"}} {v}", label(profile));
        }
    }
    let rates = [
        (
            "dsv4_decode_tokens_per_second",
            "Token-weighted decode rate over all requests.",
        ),
        (
            "dsv4_prefill_tokens_per_second",
            "Token-weighted prefill rate over all requests.",
        ),
        (
            "dsv4_long_prompt_prefill_tokens_per_second",
            "Token-weighted prefill rate, prompts of 1024+ new tokens.",
        ),
    ];
    for (i, (name, help)) in rates.into_iter().enumerate() {
        family(&mut o, name, "gauge", help);
        for (profile, t) in &requests.by_profile {
            let v = [t.decode_tok_s, t.prefill_tok_s, t.long_prompt_prefill_tok_s][i];
            if let Some(v) = v {
                let _ = writeln!(o, "{name}{{profile=\"{}\"}} {v}", label(profile));
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{Stats, Timings};

    #[test]
    fn renders_state_and_per_profile_counters() {
        let stats = Stats::default();
        let t = Timings {
            cache_n: 5,
            prompt_n: 2000,
            prompt_ms: 10_000.0,
            predicted_n: 100,
            predicted_ms: 10_000.0,
        };
        stats.record("320k", "/v1/chat/completions", &t, 20_000.0);
        let mut status = Status::stopped("320k");
        status.state = State::Ready;
        status.engine_profile = Some("320k".into());
        status.engine_pid = Some(7);
        status.generation = Some(2);
        status.in_flight = 1;
        let text = render(&status, &stats.report(0));
        for line in [
            "dsv4_engine_state{state=\"ready\"} 1",
            "dsv4_engine_state{state=\"stopped\"} 0",
            "dsv4_in_flight_requests 1",
            "dsv4_engine_generation 2",
            "dsv4_requests_total{profile=\"320k\"} 1",
            "dsv4_prompt_tokens_total{profile=\"320k\"} 2000",
            "dsv4_cached_prompt_tokens_total{profile=\"320k\"} 5",
            "dsv4_generated_tokens_total{profile=\"320k\"} 100",
            "dsv4_decode_tokens_per_second{profile=\"320k\"} 10",
            "dsv4_long_prompt_prefill_tokens_per_second{profile=\"320k\"} 200",
            "# TYPE dsv4_generated_tokens_total counter",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
