//! Request statistics: what the engine reports about each request (llama-server's `timings`),
//! kept per request and summed, with token-weighted prefill and decode rates.
//!
//! Owns: the records and totals. Must not: delay or alter a response; the proxy hands it a
//! copy of the response's last bytes ([`Tap`]) and the figures are read once the body ended.
//!
//! Weighted rates are how one would compute them by hand over many requests: total tokens
//! over total time, so a long request counts for what it is (a mean of per-request rates
//! would let a 10-token reply weigh as much as a 40K-token one). Prefill is also given over
//! requests with at least [`LONG_PROMPT`] new prompt tokens, where the figure means
//! something (a short prompt's prefill is dominated by fixed costs).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
// The document types are the client's own: what the daemon serves is by construction what
// `dsv4ctl` and other clients parse.
use dsv4_client::telemetry::Resources;
pub use dsv4_client::{RequestRecord as Record, Requests as Report, Totals as Summary};
use serde::Deserialize;

/// New (uncached) prompt tokens from which a request counts for the long-prompt prefill rate.
pub const LONG_PROMPT: u64 = 1024;
/// Records kept for inspection.
const KEEP: usize = 1000;
/// Bytes of a response's end kept to find its `timings`: an event stream carries them in
/// its last events; a JSON body anywhere, so more of it is kept.
const TAIL_SSE: usize = 16 * 1024;
const TAIL_JSON: usize = 256 * 1024;

/// llama-server's per-request `timings` (the fields used here).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Timings {
    #[serde(default)]
    pub cache_n: u64,
    pub prompt_n: u64,
    pub prompt_ms: f64,
    pub predicted_n: u64,
    pub predicted_ms: f64,
}

/// Running sums over the requests of one profile, or of all.
#[derive(Debug, Clone, Default, PartialEq)]
struct Sums {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    pub prompt_ms: f64,
    pub decode_ms: f64,
    pub long_prompt_requests: u64,
    pub long_prompt_tokens: u64,
    pub long_prompt_ms: f64,
}

impl Sums {
    fn add(&mut self, t: &Timings) {
        self.requests += 1;
        self.prompt_tokens += t.prompt_n;
        self.cached_tokens += t.cache_n;
        self.generated_tokens += t.predicted_n;
        self.prompt_ms += t.prompt_ms;
        self.decode_ms += t.predicted_ms;
        if t.prompt_n >= LONG_PROMPT {
            self.long_prompt_requests += 1;
            self.long_prompt_tokens += t.prompt_n;
            self.long_prompt_ms += t.prompt_ms;
        }
    }

    pub fn summary(&self) -> Summary {
        Summary {
            requests: self.requests,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            generated_tokens: self.generated_tokens,
            decode_tok_s: rate(self.generated_tokens, self.decode_ms),
            prefill_tok_s: rate(self.prompt_tokens, self.prompt_ms),
            long_prompt_requests: self.long_prompt_requests,
            long_prompt_prefill_tok_s: rate(self.long_prompt_tokens, self.long_prompt_ms),
        }
    }
}

fn rate(tokens: u64, ms: f64) -> Option<f64> {
    (tokens > 0 && ms > 0.0).then(|| tokens as f64 * 1000.0 / ms)
}

#[derive(Debug, Default)]
struct Inner {
    all: Sums,
    by_profile: BTreeMap<String, Sums>,
    records: VecDeque<Record>,
}

/// The statistics, shared by the proxy (which adds) and the status endpoint (which reads).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    inner: Arc<Mutex<Inner>>,
}

impl Stats {
    /// Records a finished request; `resources`: what its span cost, from the monitor.
    pub fn record(
        &self,
        profile: &str,
        path: &str,
        t: &Timings,
        wall_ms: f64,
        resources: Option<Resources>,
    ) {
        let at = dsv4_client::clock::unix_now();
        let record = Record {
            profile: profile.to_string(),
            path: path.to_string(),
            at,
            prompt_tokens: t.prompt_n,
            cached_tokens: t.cache_n,
            generated_tokens: t.predicted_n,
            prefill_tok_s: rate(t.prompt_n, t.prompt_ms),
            decode_tok_s: rate(t.predicted_n, t.predicted_ms),
            prompt_ms: t.prompt_ms,
            decode_ms: t.predicted_ms,
            wall_ms,
            resources,
        };
        tracing::debug!(
            profile,
            path,
            prompt_tokens = t.prompt_n,
            cached_tokens = t.cache_n,
            generated_tokens = t.predicted_n,
            prefill_tok_s = record.prefill_tok_s.unwrap_or(0.0),
            decode_tok_s = record.decode_tok_s.unwrap_or(0.0),
            wall_ms,
            "request done"
        );
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.all.add(t);
        g.by_profile.entry(profile.to_string()).or_default().add(t);
        if g.records.len() == KEEP {
            g.records.pop_front();
        }
        g.records.push_back(record);
    }

    /// Totals, per-profile totals, and the last `recent` records.
    pub fn report(&self, recent: usize) -> Report {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Report {
            all: g.all.summary(),
            by_profile: g
                .by_profile
                .iter()
                .map(|(k, v)| (k.clone(), v.summary()))
                .collect(),
            recent: g
                .records
                .iter()
                .skip(g.records.len().saturating_sub(recent))
                .cloned()
                .collect(),
        }
    }
}

/// A copy of the last bytes of a response, to read its `timings` once it has ended.
#[derive(Debug)]
pub struct Tap {
    cap: usize,
    buf: Vec<u8>,
}

impl Tap {
    /// A tap for a response of this content type, or none when it cannot carry timings.
    pub fn for_content_type(content_type: Option<&str>) -> Option<Tap> {
        let ct = content_type?.to_ascii_lowercase();
        let cap = if ct.starts_with("text/event-stream") {
            TAIL_SSE
        } else if ct.starts_with("application/json") {
            TAIL_JSON
        } else {
            return None;
        };
        Some(Tap {
            cap,
            buf: Vec::new(),
        })
    }

    pub fn push(&mut self, data: &Bytes) {
        if data.len() >= self.cap {
            self.buf.clear();
            self.buf.extend_from_slice(&data[data.len() - self.cap..]);
            return;
        }
        let over = (self.buf.len() + data.len()).saturating_sub(self.cap);
        if over > 0 {
            self.buf.drain(..over);
        }
        self.buf.extend_from_slice(data);
    }

    /// The last complete `"timings": {...}` object in what was kept.
    pub fn timings(&self) -> Option<Timings> {
        find_timings(&self.buf)
    }
}

/// Finds the last `"timings"` key followed by a complete JSON object, and parses it.
pub fn find_timings(buf: &[u8]) -> Option<Timings> {
    const KEY: &[u8] = b"\"timings\"";
    // Built once: the forward finder is vectorized, and an answer holds the key once or twice.
    // (The reverse search and a byte-by-byte object scan took 9,500 of the ~107,000
    // instructions a small proxied request cost, callgrind.)
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(KEY));
    let mut end = buf.len();
    while let Some(at) = FINDER.find_iter(&buf[..end]).last() {
        if let Some(obj) = object_after(&buf[at + KEY.len()..]) {
            if let Ok(t) = serde_json::from_slice::<Timings>(obj) {
                return Some(t);
            }
        }
        end = at;
    }
    None
}

/// `: {...}` right after a key: the object's bytes, braces included, if it is complete.
/// Jumps from one brace or quote to the next; inside a string, from one quote or backslash
/// to the next.
fn object_after(rest: &[u8]) -> Option<&[u8]> {
    let mut i = 0;
    while i < rest.len() && (rest[i].is_ascii_whitespace() || rest[i] == b':') {
        i += 1;
    }
    if rest.get(i) != Some(&b'{') {
        return None;
    }
    let start = i;
    let mut depth = 0usize;
    loop {
        let at = i + memchr::memchr3(b'"', b'{', b'}', rest.get(i..)?)?;
        match rest[at] {
            b'{' => {
                depth += 1;
                i = at + 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&rest[start..=at]);
                }
                i = at + 1;
            }
            _ => {
                // A string: to its closing quote, over escaped characters.
                let mut k = at + 1;
                loop {
                    let q = k + memchr::memchr2(b'"', b'\\', rest.get(k..)?)?;
                    if rest[q] == b'\\' {
                        k = q + 2;
                        continue;
                    }
                    i = q + 1;
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(prompt_n: u64, prompt_ms: f64, predicted_n: u64, predicted_ms: f64) -> Timings {
        Timings {
            cache_n: 0,
            prompt_n,
            prompt_ms,
            predicted_n,
            predicted_ms,
        }
    }

    #[test]
    fn rates_are_token_weighted_not_averaged() {
        let s = Stats::default();
        // 10 tokens at 100 tok/s and 1000 tokens at 10 tok/s: weighted 1010 / 100.1 s
        s.record(
            "320k",
            "/v1/chat/completions",
            &t(10, 10.0, 10, 100.0),
            1.0,
            None,
        );
        s.record(
            "320k",
            "/v1/chat/completions",
            &t(2000, 20_000.0, 1000, 100_000.0),
            1.0,
            None,
        );
        let r = s.report(10);
        assert_eq!(r.all.requests, 2);
        assert_eq!(r.all.generated_tokens, 1010);
        let decode = r.all.decode_tok_s.unwrap();
        assert!((decode - 1010.0 / 100.1).abs() < 1e-9, "{decode}");
        // only the 2000-token prompt counts for the long-prompt prefill rate
        assert_eq!(r.all.long_prompt_requests, 1);
        assert_eq!(r.all.long_prompt_prefill_tok_s, Some(100.0));
        let prefill = r.all.prefill_tok_s.unwrap();
        assert!((prefill - 2010.0 / 20.01).abs() < 1e-9, "{prefill}");
        assert_eq!(r.by_profile["320k"], r.all);
        assert_eq!(r.recent.len(), 2);
        assert_eq!(r.recent[1].decode_tok_s, Some(10.0));
    }

    #[test]
    fn no_requests_no_rates() {
        let r = Stats::default().report(5);
        assert_eq!(r.all.decode_tok_s, None);
        assert_eq!(r.all.long_prompt_prefill_tok_s, None);
        assert!(r.recent.is_empty());
    }

    #[test]
    fn timings_from_the_last_sse_chunk() {
        let sse = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\"timings\\\": {\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],",
            "\"timings\":{\"cache_n\":3,\"prompt_n\":12,\"prompt_ms\":4.5,\"prompt_per_second\":2666.6,",
            "\"predicted_n\":8,\"predicted_ms\":0.5,\"predicted_per_second\":16000.0}}\n\n",
            "data: [DONE]\n\n"
        );
        let got = find_timings(sse.as_bytes()).unwrap();
        assert_eq!(
            got,
            Timings {
                cache_n: 3,
                prompt_n: 12,
                prompt_ms: 4.5,
                predicted_n: 8,
                predicted_ms: 0.5
            }
        );
    }

    #[test]
    fn a_cut_or_missing_object_gives_none() {
        assert_eq!(
            find_timings(b"{\"timings\":{\"prompt_n\":1,\"prompt_ms\""),
            None
        );
        assert_eq!(find_timings(b"{\"content\":\"timings\"}"), None);
        assert_eq!(find_timings(b""), None);
    }

    #[test]
    fn the_object_ends_at_its_own_brace_past_strings_escapes_and_nesting() {
        let cases: &[(&str, Option<&str>)] = &[
            (": {}", Some("{}")),
            (" :\n {\"a\":1} tail", Some("{\"a\":1}")),
            (
                ":{\"s\":\"}{\",\"n\":{\"m\":{}}} x",
                Some("{\"s\":\"}{\",\"n\":{\"m\":{}}}"),
            ),
            (":{\"s\":\"a\\\"}\"} x", Some("{\"s\":\"a\\\"}\"}")),
            (":{\"s\":\"a\\\\\"} x", Some("{\"s\":\"a\\\\\"}")),
            (":{\"s\":\"open", None),
            (":{\"s\":\"ends in a backslash\\", None),
            (":{\"n\":{}", None),
            (": [1]", None),
            ("", None),
        ];
        for (rest, want) in cases {
            let got = object_after(rest.as_bytes()).map(|o| std::str::from_utf8(o).unwrap());
            assert_eq!(got, *want, "after {rest:?}");
        }
    }

    #[test]
    fn the_last_complete_timings_wins_and_a_broken_one_is_passed_over() {
        let t = |n: u64| {
            format!("\"timings\":{{\"prompt_n\":{n},\"prompt_ms\":1,\"predicted_n\":1,\"predicted_ms\":1}}")
        };
        let two = format!("{{{},\"x\":{{{}}}}}", t(1), t(2));
        assert_eq!(find_timings(two.as_bytes()).map(|t| t.prompt_n), Some(2));
        let cut = format!("{{{},\"timings\":{{\"prompt_n\":3", t(1));
        assert_eq!(find_timings(cut.as_bytes()).map(|t| t.prompt_n), Some(1));
        let wrong = format!("{{{},\"timings\":{{\"prompt_n\":\"many\"}}}}", t(4));
        assert_eq!(find_timings(wrong.as_bytes()).map(|t| t.prompt_n), Some(4));
    }

    #[test]
    fn the_tap_keeps_only_the_tail() {
        let mut tap = Tap::for_content_type(Some("text/event-stream; charset=utf-8")).unwrap();
        let filler = Bytes::from(vec![b'x'; TAIL_SSE]);
        tap.push(&Bytes::from_static(
            b"{\"timings\":{\"prompt_n\":1,\"prompt_ms\":1,\"predicted_n\":1,\"predicted_ms\":1}}",
        ));
        assert!(tap.timings().is_some());
        tap.push(&filler);
        assert_eq!(tap.buf.len(), TAIL_SSE);
        assert!(tap.timings().is_none(), "old bytes were not dropped");
        assert!(Tap::for_content_type(Some("text/plain")).is_none());
        assert!(Tap::for_content_type(None).is_none());
    }
}
