//! Request statistics: what the engine reports about each request, kept per request and
//! summed, with token-weighted prefill and decode rates.
//!
//! Owns: the records and totals, and [`Count`] (the observer of one answer's events). Must
//! not: delay or alter a response; the answer's reader hands [`Count`] its events (see
//! `crate::http::watch`) and the figures are read once the body ended.
//!
//! Where the figures are, by the API the request spoke ([`ApiProtocol`], from its path):
//! llama-server's `timings` (prompt, cached and generated tokens, prefill and decode times)
//! wherever present, in any shape; else the answer's `usage`, read as its API defines it:
//! OpenAI's `prompt_tokens` (cached ones included, in `prompt_tokens_details.cached_tokens`)
//! and `completion_tokens`; Responses' `input_tokens` (cached ones included, in
//! `input_tokens_details.cached_tokens`) and `output_tokens`, in a stream those of its
//! `response.completed` event; Anthropic's `input_tokens` (cache reads and writes excluded),
//! `cache_creation_input_tokens`, `cache_read_input_tokens` and `output_tokens`, in a stream
//! `message_start`'s usage with `message_delta`'s output count. With `usage` alone, the
//! times of a stream are dsv4d's clock: from the request's sending to the first event of its
//! answer (not a comment line) is the prefill, the rest the decode; a plain answer comes
//! whole, so its tokens count but it has no times and no rates.
//!
//! Weighted rates are how one would compute them by hand over many requests: total tokens
//! over total time, so a long request counts for what it is (a mean of per-request rates
//! would let a 10-token reply weigh as much as a 40K-token one); requests without times
//! count for tokens, not for rates. Prefill is also given over requests with at least
//! [`LONG_PROMPT`] new prompt tokens, where the figure means something (a short prompt's
//! prefill is dominated by fixed costs).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
// The document types are the client's own: what the daemon serves is by construction what
// `dsv4ctl` and other clients parse.
use dsv4_client::telemetry::Resources;
pub use dsv4_client::ApiProtocol;
pub use dsv4_client::{RequestRecord as Record, Requests as Report, Totals as Summary};
use serde::Deserialize;

/// New (uncached) prompt tokens from which a request counts for the long-prompt prefill rate.
pub const LONG_PROMPT: u64 = 1024;
/// Records kept for inspection.
const KEEP: usize = 1000;

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

/// Where a request's prefill and decode times came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Times {
    /// llama-server's `timings`.
    Engine { prompt_ms: f64, decode_ms: f64 },
    /// dsv4d's clock: sent to the first event, then to the end.
    Clock { prompt_ms: f64, decode_ms: f64 },
    /// A plain answer without `timings`: it came whole.
    Unknown,
}

impl Times {
    fn ms(self) -> Option<(f64, f64)> {
        match self {
            Times::Engine {
                prompt_ms,
                decode_ms,
            }
            | Times::Clock {
                prompt_ms,
                decode_ms,
            } => Some((prompt_ms, decode_ms)),
            Times::Unknown => None,
        }
    }
}

/// What an answer told of its request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    pub protocol: ApiProtocol,
    /// New prompt tokens: those the engine computed.
    pub prompt_n: u64,
    /// Prompt tokens taken from the cache.
    pub cache_n: u64,
    pub predicted_n: u64,
    pub times: Times,
}

impl Figures {
    fn timed(protocol: ApiProtocol, t: &Timings) -> Figures {
        Figures {
            protocol,
            prompt_n: t.prompt_n,
            cache_n: t.cache_n,
            predicted_n: t.predicted_n,
            times: Times::Engine {
                prompt_ms: t.prompt_ms,
                decode_ms: t.predicted_ms,
            },
        }
    }
}

impl From<Timings> for Figures {
    /// An OpenAI answer's `timings`.
    fn from(t: Timings) -> Figures {
        Figures::timed(ApiProtocol::OpenAi, &t)
    }
}

/// Running sums over the requests of one profile, or of all.
#[derive(Debug, Clone, Default, PartialEq)]
struct Sums {
    pub requests: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generated_tokens: u64,
    /// The tokens of the requests with times, which the rates are of.
    pub timed_prompt_tokens: u64,
    pub timed_generated_tokens: u64,
    pub prompt_ms: f64,
    pub decode_ms: f64,
    pub long_prompt_requests: u64,
    pub long_prompt_tokens: u64,
    pub long_prompt_ms: f64,
    pub clock_timed_requests: u64,
}

impl Sums {
    fn add(&mut self, f: &Figures) {
        self.requests += 1;
        self.prompt_tokens += f.prompt_n;
        self.cached_tokens += f.cache_n;
        self.generated_tokens += f.predicted_n;
        let Some((prompt_ms, decode_ms)) = f.times.ms() else {
            return;
        };
        if matches!(f.times, Times::Clock { .. }) {
            self.clock_timed_requests += 1;
        }
        self.timed_prompt_tokens += f.prompt_n;
        self.timed_generated_tokens += f.predicted_n;
        self.prompt_ms += prompt_ms;
        self.decode_ms += decode_ms;
        if f.prompt_n >= LONG_PROMPT {
            self.long_prompt_requests += 1;
            self.long_prompt_tokens += f.prompt_n;
            self.long_prompt_ms += prompt_ms;
        }
    }

    pub fn summary(&self) -> Summary {
        Summary {
            requests: self.requests,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            generated_tokens: self.generated_tokens,
            decode_tok_s: rate(self.timed_generated_tokens, self.decode_ms),
            prefill_tok_s: rate(self.timed_prompt_tokens, self.prompt_ms),
            long_prompt_requests: self.long_prompt_requests,
            long_prompt_prefill_tok_s: rate(self.long_prompt_tokens, self.long_prompt_ms),
            clock_timed_requests: self.clock_timed_requests,
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
    /// In the order of [`ApiProtocol::ALL`].
    by_protocol: [Sums; 3],
    records: VecDeque<Record>,
}

fn protocol_index(p: ApiProtocol) -> usize {
    match p {
        ApiProtocol::OpenAi => 0,
        ApiProtocol::Anthropic => 1,
        ApiProtocol::Responses => 2,
    }
}

/// The statistics, shared by the proxy (which adds) and the status endpoint (which reads).
#[derive(Debug, Clone, Default)]
pub struct Stats {
    inner: Arc<Mutex<Inner>>,
}

impl Stats {
    /// Records a finished request (its [`Figures`], or an OpenAI answer's [`Timings`]);
    /// `resources`: what its span cost, from the monitor.
    pub fn record<F: Into<Figures> + Copy>(
        &self,
        profile: impl Into<String>,
        path: impl Into<String>,
        figures: &F,
        wall_ms: f64,
        resources: Option<Resources>,
    ) {
        let f: Figures = (*figures).into();
        let at = dsv4_client::clock::unix_now();
        // Owned: the proxy hands over its copies.
        let (profile, path) = (profile.into(), path.into());
        let (prompt_ms, decode_ms) = f.times.ms().unwrap_or((0.0, 0.0));
        let timed = f.times.ms().is_some();
        let record = Record {
            profile,
            path,
            protocol: f.protocol,
            at,
            prompt_tokens: f.prompt_n,
            cached_tokens: f.cache_n,
            generated_tokens: f.predicted_n,
            prefill_tok_s: rate(f.prompt_n, prompt_ms).filter(|_| timed),
            decode_tok_s: rate(f.predicted_n, decode_ms).filter(|_| timed),
            prompt_ms,
            decode_ms,
            wall_ms,
            clock_times: matches!(f.times, Times::Clock { .. }),
            resources,
        };
        tracing::debug!(
            profile = record.profile,
            path = record.path,
            protocol = f.protocol.as_str(),
            prompt_tokens = f.prompt_n,
            cached_tokens = f.cache_n,
            generated_tokens = f.predicted_n,
            prefill_tok_s = record.prefill_tok_s.unwrap_or(0.0),
            decode_tok_s = record.decode_tok_s.unwrap_or(0.0),
            clock_times = record.clock_times,
            wall_ms,
            "request done"
        );
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.all.add(&f);
        g.by_protocol[protocol_index(f.protocol)].add(&f);
        // The profile's name is copied only the first time it is seen.
        match g.by_profile.get_mut(&record.profile) {
            Some(sums) => sums.add(&f),
            None => {
                let mut sums = Sums::default();
                sums.add(&f);
                g.by_profile.insert(record.profile.clone(), sums);
            }
        }
        if g.records.len() == KEEP {
            g.records.pop_front();
        }
        g.records.push_back(record);
    }

    /// Totals, per-profile and per-protocol totals, and the last `recent` records.
    pub fn report(&self, recent: usize) -> Report {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        Report {
            all: g.all.summary(),
            by_profile: g
                .by_profile
                .iter()
                .map(|(k, v)| (k.clone(), v.summary()))
                .collect(),
            // The protocols that had requests.
            by_protocol: ApiProtocol::ALL
                .into_iter()
                .map(|p| (p, &g.by_protocol[protocol_index(p)]))
                .filter(|(_, sums)| sums.requests > 0)
                .map(|(p, sums)| (p, sums.summary()))
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

/// How many of the last events that may carry figures are kept. An answer's `timings` and
/// `usage` are in its final events: llama-server's last chunk (then its `[DONE]`), an
/// OpenAI-style usage chunk after the last choice, Anthropic's `message_delta`, Responses'
/// `response.completed`. Keeping the data of the last few, and reading them once the answer
/// ended, costs a copy per event where searching every event for both keys cost two
/// searches (callgrind, streamed chats through dsv4d: the searches were 8% of an event's
/// instructions).
const TAIL: usize = 3;

/// The statistics' observer of one answer: handed each of its events (a plain answer is one
/// event: its body), it keeps the data of the last [`TAIL`] that may carry figures, when the
/// first event came, and of an Anthropic stream the `usage` of its `message_start`. The
/// figures are read from those once the answer ended ([`Count::figures`]).
#[derive(Debug)]
pub struct Count {
    protocol: ApiProtocol,
    /// An event stream: when the request was sent, and when its first event came.
    stream: Option<(Instant, Option<Instant>)>,
    /// An Anthropic stream's opening usage, once seen.
    start: Option<Usage>,
    /// The data of the last events that may carry figures, a ring: `next` is the oldest.
    tail: [Vec<u8>; TAIL],
    next: usize,
}

impl Count {
    /// For the answer to a request of `protocol` (its `usage` shape: the protocol table's,
    /// `crate::http::protocol`) sent at `sent`, or none when the answer's content type
    /// cannot carry figures.
    pub fn new(protocol: ApiProtocol, content_type: Option<&str>, sent: Instant) -> Option<Count> {
        let ct = content_type?;
        let is = |prefix: &str| {
            ct.get(..prefix.len())
                .is_some_and(|p| p.eq_ignore_ascii_case(prefix))
        };
        let stream = match (is("text/event-stream"), is("application/json")) {
            (true, _) => Some((sent, None)),
            (false, true) => None,
            (false, false) => return None,
        };
        Some(Count {
            protocol,
            stream,
            start: None,
            tail: Default::default(),
            next: 0,
        })
    }

    /// An event of the answer came (not a comment): the first marks the prefill's end.
    pub fn came(&mut self) {
        if let Some((_, first @ None)) = &mut self.stream {
            *first = Some(Instant::now());
        }
    }

    /// An event of the answer that may carry its figures (its API's row says which): its
    /// kind and its data. (A plain answer's body is one such event.)
    pub fn event(&mut self, kind: &[u8], data: &[u8]) {
        self.came();
        if self.protocol == ApiProtocol::Anthropic
            && kind == b"message_start"
            && self.start.is_none()
        {
            self.start = find_usage(data);
        }
        let kept = &mut self.tail[self.next];
        kept.clear();
        kept.extend_from_slice(data);
        self.next = (self.next + 1) % TAIL;
    }

    /// The kept events' data, the newest first.
    fn newest_first(&self) -> impl Iterator<Item = &[u8]> {
        (1..=TAIL).map(move |back| self.tail[(self.next + TAIL - back) % TAIL].as_slice())
    }

    /// The request's figures, read at the answer's end: its last complete `timings`, else
    /// its `usage` as its protocol has it.
    pub fn figures(&self) -> Option<Figures> {
        if let Some(t) = self.newest_first().find_map(find_timings) {
            return Some(Figures::timed(self.protocol, &t));
        }
        let usage = self.newest_first().find_map(find_usage);
        let (prompt_n, cache_n, predicted_n) = counts(self.protocol, usage, self.start)?;
        let times = match self.stream {
            Some((sent, Some(first))) => Times::Clock {
                prompt_ms: ms(first - sent),
                decode_ms: ms(first.elapsed()),
            },
            _ => Times::Unknown,
        };
        Some(Figures {
            protocol: self.protocol,
            prompt_n,
            cache_n,
            predicted_n,
            times,
        })
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A `usage` object in any of the three APIs' shapes (the fields used here).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
struct Usage {
    // OpenAI chat and completions.
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    // Anthropic and Responses.
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    // Responses.
    input_tokens_details: Option<Details>,
    // Anthropic.
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// New prompt, cached prompt and generated tokens, as `protocol` gives them in `usage`
/// (`start`: an Anthropic stream's opening usage, for what its closing one leaves out).
fn counts(
    protocol: ApiProtocol,
    usage: Option<Usage>,
    start: Option<Usage>,
) -> Option<(u64, u64, u64)> {
    let cached = |d: Option<Details>| d.and_then(|d| d.cached_tokens).unwrap_or(0);
    match protocol {
        ApiProtocol::OpenAi => {
            let u = usage?;
            let cached = cached(u.prompt_tokens_details);
            Some((
                u.prompt_tokens?.saturating_sub(cached),
                cached,
                u.completion_tokens?,
            ))
        }
        ApiProtocol::Responses => {
            let u = usage?;
            let cached = cached(u.input_tokens_details);
            Some((
                u.input_tokens?.saturating_sub(cached),
                cached,
                u.output_tokens?,
            ))
        }
        ApiProtocol::Anthropic => {
            // The closing usage's fields, else the opening one's (`message_delta` may carry
            // the output count alone).
            let (last, first) = (usage.or(start)?, start.unwrap_or_default());
            let input = last.input_tokens.or(first.input_tokens)?;
            let written = last
                .cache_creation_input_tokens
                .or(first.cache_creation_input_tokens)
                .unwrap_or(0);
            let read = last
                .cache_read_input_tokens
                .or(first.cache_read_input_tokens)
                .unwrap_or(0);
            Some((input + written, read, last.output_tokens?))
        }
    }
}

/// The last `"usage"` key followed by a complete object that reads as [`Usage`]. Read once
/// an answer without `timings` ended.
fn find_usage(buf: &[u8]) -> Option<Usage> {
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"usage\""));
    last_object(buf, &FINDER)
}

/// Finds the last `"timings"` key followed by a complete JSON object, and parses it.
pub fn find_timings(buf: &[u8]) -> Option<Timings> {
    // Built once: the forward finder is vectorized, and an answer holds the key once or twice.
    // (The reverse search and a byte-by-byte object scan took 9,500 of the ~107,000
    // instructions a small proxied request cost, callgrind.)
    static FINDER: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"timings\""));
    last_object(buf, &FINDER)
}

/// The last object in `buf` right after the key `key` finds that reads as a `T`. What
/// follows it is not looked at: serde_json reads one value from the slice. (On llama-server's
/// `timings`, 311 ns a read in a release build, against 260 for the reader of its own this
/// replaced: 0.05 us of a request's ~130 us of CPU.)
fn last_object<T: serde::de::DeserializeOwned>(
    buf: &[u8],
    key: &memchr::memmem::Finder<'_>,
) -> Option<T> {
    let mut end = buf.len();
    while let Some(at) = key.find_iter(&buf[..end]).last() {
        let object = value_after_key(&buf[at + key.needle().len()..])
            .filter(|v| v.starts_with(b"{"))
            .and_then(|v| serde_json::Deserializer::from_slice(v).into_iter().next());
        if let Some(Ok(t)) = object {
            return Some(t);
        }
        end = at;
    }
    None
}

/// What follows a JSON key (`rest` starts right after its closing quote): the bytes of its
/// value, from the first past the colon and JSON's blanks; `None` where no colon comes.
pub fn value_after_key(rest: &[u8]) -> Option<&[u8]> {
    let blank = |c: &u8| matches!(c, b' ' | b'\t' | b'\n' | b'\r');
    let skip = |b: &'_ [u8]| b.iter().position(|c| !blank(c)).unwrap_or(b.len());
    let rest = rest[skip(rest)..].strip_prefix(b":")?;
    Some(&rest[skip(rest)..])
}

#[cfg(test)]
mod tests {
    /// The `usage` shape of a request to `path`, as the protocol table gives it.
    fn api(path: &str) -> ApiProtocol {
        crate::http::protocol::Route::of(path).map_or(ApiProtocol::OpenAi, |r| r.protocol)
    }

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
    fn the_value_after_a_key_is_past_its_colon_and_json_blanks_only() {
        for (rest, value) in [
            (&b":1}"[..], Some(&b"1}"[..])),
            (b" \t\r\n: \n{\"a\":2}", Some(b"{\"a\":2}")),
            (b":", Some(b"")),
            // Not a key: no colon after it.
            (b",\"x\":1", None),
            (b"", None),
            // A form feed is not JSON's blank.
            (b"\x0c:1", None),
        ] {
            assert_eq!(
                value_after_key(rest),
                value,
                "{}",
                String::from_utf8_lossy(rest)
            );
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
        let fields = r#""prompt_n":1,"prompt_ms":1,"predicted_n":1,"predicted_ms":1"#;
        // Members before the fields, and what follows the key: whole, the object is read.
        for (after_key, member) in [
            (":", r#""s":"}{""#),
            (" :\n ", r#""n":{"m":{}}"#),
            (":", r#""s":"a\"}""#),
            (":", r#""s":"a\\""#),
            (":", r#""l":[{"x":"]"}]"#),
        ] {
            let whole = format!("\"timings\"{after_key}{{{member},{fields}}} tail");
            assert!(find_timings(whole.as_bytes()).is_some(), "{whole}");
            // Cut anywhere inside the object, it is not.
            let object_end = whole.len() - " tail".len();
            for cut in "\"timings\"".len()..object_end {
                let part = &whole.as_bytes()[..cut];
                assert_eq!(
                    find_timings(part),
                    None,
                    "{}",
                    String::from_utf8_lossy(part)
                );
            }
        }
        for odd in [": [1]", "", ":: {}", ": \"{\""] {
            let text = format!("\"timings\"{odd}");
            assert_eq!(find_timings(text.as_bytes()), None, "{text}");
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

    /// Feeds `frames` (an answer of `content_type` to a request to `path`) to a count, as
    /// the answer's reader hands them over (`crate::http::watch`): a stream event by event,
    /// a plain answer as one event.
    fn tapped(path: &str, content_type: &str, frames: &[&str]) -> Option<Figures> {
        let mut count = Count::new(api(path), Some(content_type), Instant::now()).unwrap();
        if !content_type.starts_with("text/event-stream") {
            count.event(b"", frames.concat().as_bytes());
            return count.figures();
        }
        // As the watch does: the figures read from the events the API's row names.
        use crate::http::protocol::Api;
        let spec = api(path).spec();
        let mut reader = crate::http::events::Reader::new();
        let mut each = |e: &crate::http::events::Event| match e.is_comment() {
            true => {}
            false if spec.carries_figures(e) => count.event(e.kind(), e.data),
            false => count.came(),
        };
        for f in frames {
            reader.feed(f.as_bytes(), &mut each);
        }
        reader.finish(&mut each);
        count.figures()
    }

    #[test]
    fn a_count_is_only_for_answers_that_can_carry_figures() {
        assert!(Count::new(api("/v1/messages"), Some("text/plain"), Instant::now()).is_none());
        assert!(Count::new(api("/v1/messages"), None, Instant::now()).is_none());
        assert!(Count::new(api("/completion"), Some("Application/JSON"), Instant::now()).is_some());
    }

    fn counted(f: Option<Figures>) -> Option<(ApiProtocol, u64, u64, u64)> {
        f.map(|f| (f.protocol, f.prompt_n, f.cache_n, f.predicted_n))
    }

    /// Each API's answers, plain and streamed, as llama-server and ds4-server write them
    /// (captured from both): the counts are read from `usage` where there are no `timings`.
    #[test]
    fn every_protocols_usage_is_read_as_it_defines_it() {
        use ApiProtocol::*;
        const JSON: &str = "application/json";
        const SSE: &str = "text/event-stream";
        type Case<'a> = (
            &'a str,
            &'a str,
            &'a [&'a str],
            (ApiProtocol, u64, u64, u64),
        );
        let cases: [Case; 8] = [
            // llama-server's Anthropic answer: input_tokens leaves the cache reads out.
            (
                "/v1/messages",
                JSON,
                &[r#"{"id":"x","type":"message","content":[{"type":"text","text":"\"usage\": {"}],"stop_reason":"max_tokens","usage":{"cache_read_input_tokens":24,"input_tokens":1,"output_tokens":8}}"#],
                (Anthropic, 1, 24, 8),
            ),
            // ds4-server's: cache writes are new tokens too.
            (
                "/v1/messages",
                JSON,
                &[r#"{"type":"message","usage":{"input_tokens":3,"output_tokens":5,"cache_read_input_tokens":7,"cache_creation_input_tokens":10}}"#],
                (Anthropic, 13, 7, 5),
            ),
            // A stream: message_start's input counts, message_delta's output count, each in
            // its own frame.
            (
                "/v1/messages",
                SSE,
                &[
                    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"content\":[],\"usage\":{\"cache_read_input_tokens\":24,\"input_tokens\":1,\"output_tokens\":0}}}\n\n",
                    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n",
                    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"output_tokens\":8}}\n\n",
                    "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
                ],
                (Anthropic, 1, 24, 8),
            ),
            // Responses: input_tokens includes the cached ones.
            (
                "/v1/responses",
                JSON,
                &[r#"{"object":"response","output":[],"status":"completed","usage":{"input_tokens":25,"output_tokens":8,"total_tokens":33,"input_tokens_details":{"cached_tokens":24}}}"#],
                (Responses, 1, 24, 8),
            ),
            // ds4-server's stream: response.completed's usage.
            (
                "/v1/responses",
                SSE,
                &[
                    "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"status\":\"in_progress\"}}\n\n",
                    "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\"}\n\n",
                    "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":30,\"input_tokens_details\":{\"cached_tokens\":20,\"cache_write_tokens\":10},\"output_tokens\":4,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":34}}}\n\n",
                ],
                (Responses, 10, 20, 4),
            ),
            // llama-server's stream: its timings beside the usage win.
            (
                "/v1/responses",
                SSE,
                &["event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":8,\"input_tokens_details\":{\"cached_tokens\":24}}},\"timings\":{\"cache_n\":24,\"prompt_n\":1,\"prompt_ms\":0.258,\"predicted_n\":8,\"predicted_ms\":0.903}}\n\n"],
                (Responses, 1, 24, 8),
            ),
            // OpenAI's usage without timings (ds4-server), cached tokens included.
            (
                "/v1/chat/completions",
                JSON,
                &[r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":8,"cache_write_tokens":4}}}"#],
                (OpenAi, 4, 8, 3),
            ),
            (
                "/v1/chat/completions",
                SSE,
                &[
                    ": prefill\n\n",
                    "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
                    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
                ],
                (OpenAi, 5, 0, 1),
            ),
        ];
        for (path, ct, frames, want) in cases {
            let got = tapped(path, ct, frames);
            assert_eq!(counted(got), Some(want), "{path} {frames:?}");
            let f = got.unwrap();
            // Timings give the times; else a stream has the clock's, a plain answer none.
            let engine = frames.iter().any(|f| f.contains("timings"));
            match f.times {
                Times::Engine { .. } => assert!(engine),
                Times::Clock {
                    prompt_ms,
                    decode_ms,
                } => {
                    assert!(!engine && ct == SSE);
                    assert!(prompt_ms >= 0.0 && decode_ms >= 0.0);
                }
                Times::Unknown => assert!(!engine && ct == JSON),
            }
        }
    }

    #[test]
    fn answers_without_counts_are_not_counted() {
        for (path, body) in [
            // count_tokens: no generation.
            ("/v1/messages/count_tokens", r#"{"input_tokens":25}"#),
            // Embeddings: no completion tokens.
            (
                "/v1/embeddings",
                r#"{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}"#,
            ),
            // Another API's usage on an OpenAI path.
            (
                "/v1/chat/completions",
                r#"{"usage":{"input_tokens":4,"output_tokens":1}}"#,
            ),
            ("/v1/responses", r#"{"usage":{"prompt_tokens":4}}"#),
            ("/v1/messages", r#"{"usage":{"output_tokens":4}}"#),
            (
                "/v1/messages",
                r#"{"usage":{"input_tokens":"4","output_tokens":4}}"#,
            ),
            (
                "/v1/responses",
                r#"{"usage":{"input_tokens":4,"output_tokens":"#,
            ),
        ] {
            assert_eq!(
                tapped(path, "application/json", &[body]),
                None,
                "{path} {body}"
            );
        }
    }

    #[test]
    fn the_clock_splits_a_stream_at_its_first_event() {
        let sent = Instant::now();
        let mut count = Count::new(api("/v1/messages"), Some("text/event-stream"), sent).unwrap();
        assert_eq!(count.stream, Some((sent, None)));
        count.event(
            b"message_start",
            br#"{"type":"message_start","message":{"usage":{"input_tokens":9,"output_tokens":1}}}"#,
        );
        let first = count
            .stream
            .and_then(|(_, f)| f)
            .expect("the first event's time");
        assert!(first >= sent);
        assert_eq!(count.start.and_then(|u| u.input_tokens), Some(9));
        // Many events later, the opening's counts are still known.
        for _ in 0..1000 {
            count.event(b"content_block_delta", br#"{"delta":{"text":"x"}}"#);
        }
        count.event(
            b"message_delta",
            br#"{"type":"message_delta","usage":{"output_tokens":40}}"#,
        );
        let f = count.figures().unwrap();
        assert_eq!((f.prompt_n, f.cache_n, f.predicted_n), (9, 0, 40));
        let Times::Clock {
            prompt_ms,
            decode_ms,
        } = f.times
        else {
            panic!("{:?}", f.times)
        };
        assert_eq!(prompt_ms, ms(first - sent));
        assert!(decode_ms >= 0.0);
    }

    #[test]
    fn untimed_requests_count_for_tokens_not_for_rates() {
        let s = Stats::default();
        s.record(
            "a",
            "/v1/chat/completions",
            &t(100, 1000.0, 10, 1000.0),
            1.0,
            None,
        );
        let plain = Figures {
            protocol: ApiProtocol::Anthropic,
            prompt_n: 5000,
            cache_n: 7,
            predicted_n: 500,
            times: Times::Unknown,
        };
        s.record("a", "/v1/messages", &plain, 1.0, None);
        let clocked = Figures {
            protocol: ApiProtocol::Responses,
            prompt_n: 2000,
            cache_n: 0,
            predicted_n: 20,
            times: Times::Clock {
                prompt_ms: 1000.0,
                decode_ms: 2000.0,
            },
        };
        s.record("a", "/v1/responses", &clocked, 1.0, None);
        let r = s.report(10);
        assert_eq!(r.all.requests, 3);
        assert_eq!(r.all.prompt_tokens, 7100);
        assert_eq!(r.all.cached_tokens, 7);
        assert_eq!(r.all.generated_tokens, 530);
        // (100 + 2000) tokens over 2 s; (10 + 20) over 3 s; the plain answer in neither.
        assert_eq!(r.all.prefill_tok_s, Some(1050.0));
        assert_eq!(r.all.decode_tok_s, Some(10.0));
        assert_eq!(r.all.long_prompt_requests, 1);
        assert_eq!(r.all.long_prompt_prefill_tok_s, Some(2000.0));
        let names: Vec<&str> = r.by_protocol.keys().map(|p| p.as_str()).collect();
        assert_eq!(names, ["openai", "anthropic", "responses"]);
        let anthropic = &r.by_protocol[&ApiProtocol::Anthropic];
        assert_eq!((anthropic.requests, anthropic.prompt_tokens), (1, 5000));
        assert_eq!(anthropic.prefill_tok_s, None);
        assert_eq!(
            r.by_protocol[&ApiProtocol::Responses].decode_tok_s,
            Some(10.0)
        );
        // The clock's times are told apart, in each total they are part of.
        assert_eq!(r.all.clock_timed_requests, 1);
        assert_eq!(
            r.by_protocol[&ApiProtocol::Responses].clock_timed_requests,
            1
        );
        assert_eq!(r.by_protocol[&ApiProtocol::OpenAi].clock_timed_requests, 0);
        assert_eq!(anthropic.clock_timed_requests, 0);
        let [openai, messages, responses] = &r.recent[..] else {
            panic!("{:?}", r.recent)
        };
        assert_eq!(
            (openai.protocol, openai.clock_times, openai.decode_tok_s),
            (ApiProtocol::OpenAi, false, Some(10.0))
        );
        assert_eq!(
            (
                messages.protocol,
                messages.prompt_ms,
                messages.prefill_tok_s
            ),
            (ApiProtocol::Anthropic, 0.0, None)
        );
        assert!(responses.clock_times);
        // Only the protocols that had requests are listed.
        let s = Stats::default();
        s.record("a", "/v1/responses", &clocked, 1.0, None);
        assert_eq!(s.report(1).by_protocol.len(), 1);
    }

    #[test]
    fn a_record_from_an_older_daemon_is_an_openai_one() {
        let old = r#"{"profile":"p","path":"/completion","at":1.0,"prompt_tokens":1,
            "cached_tokens":0,"generated_tokens":1,"prefill_tok_s":null,"decode_tok_s":null,
            "prompt_ms":1.0,"decode_ms":1.0,"wall_ms":2.0}"#;
        let r: Record = serde_json::from_str(old).unwrap();
        assert_eq!((r.protocol, r.clock_times), (ApiProtocol::OpenAi, false));
        let old = r#"{"requests":0,"prompt_tokens":0,"cached_tokens":0,"generated_tokens":0,
            "decode_tok_s":null,"prefill_tok_s":null,"long_prompt_requests":0,
            "long_prompt_prefill_tok_s":null,"by_profile":{},"recent":[]}"#;
        let r: Report = serde_json::from_str(old).unwrap();
        assert!(r.by_protocol.is_empty());
        assert_eq!(r.all.clock_timed_requests, 0);
        assert_eq!(
            serde_json::to_value(Stats::default().report(0)).unwrap()["by_protocol"],
            serde_json::json!({})
        );
    }
}
