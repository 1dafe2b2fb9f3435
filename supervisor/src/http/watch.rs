//! The engine's answer, read once: each chunk goes through the one [`Reader`], and each event
//! it reads goes to small observers with one job each:
//!
//! - the statistics ([`Count`]): the figures of the answer's final events;
//! - the request's flight: the prefill's progress ([`Progress`]) and the tokens (the events
//!   the API's row counts as content, [`Spec::is_token`]);
//! - the end of the answer: whether its API's last event ([`Spec::is_end`]) has gone by, and
//!   whether the last event was it (a stream that only the connection's close ends);
//! - what goes to the client: progress events dsv4d asked for are taken out, and an opening
//!   of dsv4d's own ([`Opening`]) changes the engine's.
//!
//! A plain (JSON) answer goes to the same statistics as one event: its body (its last
//! [`JSON_MAX`] bytes).
//!
//! While something may be taken out or changed, only whole events go out: an event whose end
//! has not come is held until it does (up to [`HOLD_MAX`]; past that, everything passes as
//! it comes and nothing more is changed). Otherwise each chunk passes as it came, not copied.
//!
//! Owns: [`Watch`] and [`Fed`]. Pure: no I/O; the clock only through [`Count`]. The body that
//! uses it is [`crate::http::answer::EngineStream`].

use std::ops::Range;

use bytes::{Bytes, BytesMut};
use dsv4_engine::Prefill;

use crate::http::events::{Event, Place, Reader};
use crate::http::opening::{Opening, Rewrite};
use crate::http::progress::Progress;
use crate::http::protocol::Spec;
use crate::observe::stats::Count;

/// The most of one event held back while it is read whole.
pub const HOLD_MAX: usize = 64 << 10;
/// The most of a plain answer kept for its figures (its end, where they are).
pub const JSON_MAX: usize = 256 << 10;

/// What a chunk of the answer gave.
#[derive(Debug, Default)]
pub struct Fed {
    /// What goes on to the client now (empty while an event is held whole).
    pub out: Bytes,
    /// The answer's content events that ended in it.
    pub tokens: u64,
    /// The latest progress of the prefill told in it.
    pub prefill: Option<Prefill>,
    /// The API's last event went by in it.
    pub ended: bool,
}

/// One answer's reader and observers (see the module docs).
pub struct Watch {
    spec: &'static Spec,
    /// An event stream's reader; `None` for a plain answer.
    reader: Option<Reader>,
    count: Option<Count>,
    progress: Option<Progress>,
    opening: Option<Opening>,
    /// The API's last event has gone by, and whether the last event was it.
    ended: bool,
    last_end: bool,
    /// Bytes read but not yet out (while events are held whole): the stream's last ones.
    held: BytesMut,
    /// A plain answer's last bytes, for its figures: its last frame as it came (most answers
    /// are one frame: nothing is copied), and before it, copied, what the bound leaves room
    /// for.
    body: Vec<u8>,
    last: Bytes,
    /// What the events of the chunk being read change.
    cuts: Vec<(Range<u64>, Rewrite)>,
    /// Given up on holding events whole (one grew past [`HOLD_MAX`]).
    blind: bool,
    /// Where the stream the client got stands.
    place: Place,
}

impl Watch {
    /// For an answer of the API `spec`: an event stream (`sse`) or not, its figures counted
    /// by `count`, its prefill's progress read (and taken out) by `progress`.
    pub fn new(
        spec: &'static Spec,
        sse: bool,
        count: Option<Count>,
        progress: Option<Progress>,
    ) -> Watch {
        Watch {
            spec,
            reader: sse.then(Reader::new),
            count,
            progress: progress.filter(|_| sse),
            opening: None,
            ended: false,
            last_end: false,
            held: BytesMut::new(),
            body: Vec::new(),
            last: Bytes::new(),
            cuts: Vec::new(),
            blind: false,
            place: Place::Between,
        }
    }

    /// The stream's opening of dsv4d's own, from now on read against the engine's events.
    pub fn adopt(&mut self, opening: Opening) {
        self.opening = Some(opening);
    }

    /// The stream's opening, for a keep-alive.
    pub fn opening(&mut self) -> Option<&mut Opening> {
        self.opening.as_mut()
    }

    /// Whether the answer is an event stream.
    pub fn is_stream(&self) -> bool {
        self.reader.is_some()
    }

    /// Where the stream the client got stands.
    pub fn place(&self) -> Place {
        self.place
    }

    /// Whether the API's last event has gone by.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Whether the last event read was the API's last one.
    pub fn ended_with_its_last_event(&self) -> bool {
        self.last_end
    }

    /// The statistics' observer, once the answer is complete.
    pub fn take_count(&mut self) -> Option<Count> {
        if self.reader.is_none() {
            if let Some(c) = self.count.as_mut() {
                match self.body.is_empty() {
                    true => c.event(b"", &self.last),
                    false => {
                        self.body.extend_from_slice(&self.last);
                        keep_tail(&mut self.body, &[], JSON_MAX);
                        c.event(b"", &self.body)
                    }
                }
            }
        }
        self.count.take()
    }

    /// A plain answer's frame, kept for its figures (its last [`JSON_MAX`] bytes).
    fn keep(&mut self, chunk: &Bytes) {
        let earlier = std::mem::replace(&mut self.last, chunk.clone());
        keep_tail(
            &mut self.body,
            &earlier,
            JSON_MAX.saturating_sub(chunk.len()),
        );
    }

    /// Whether events are held whole now, to be taken out or changed.
    fn rewriting(&self) -> bool {
        let changes = self.progress.as_ref().is_some_and(Progress::strips)
            || self.opening.as_ref().is_some_and(|o| !o.passing());
        !self.held.is_empty() || (!self.blind && changes)
    }

    /// The next chunk of the answer.
    pub fn feed(&mut self, chunk: Bytes) -> Fed {
        let mut fed = Fed::default();
        if self.reader.is_none() {
            if self.count.is_some() {
                self.keep(&chunk);
            }
            fed.out = chunk;
            return fed;
        }
        let rewriting = self.rewriting();
        self.read(Some(&chunk), &mut fed);
        if !rewriting {
            self.place = self.reader.as_ref().map_or(Place::Between, Reader::place);
            fed.out = chunk;
            return fed;
        }
        fed.out = self.assemble(Some(chunk));
        fed
    }

    /// The answer's end: an event it cut off is read as it is, and what was held goes out.
    pub fn finish(&mut self) -> Fed {
        let mut fed = Fed::default();
        if self.reader.is_none() {
            return fed;
        }
        let rewriting = self.rewriting();
        self.read(None, &mut fed);
        if rewriting {
            fed.out = self.assemble(None);
        }
        fed
    }

    /// Reads `chunk` (`None`: the stream's end), each event to the observers.
    fn read(&mut self, chunk: Option<&[u8]>, fed: &mut Fed) {
        let Some(reader) = self.reader.as_mut() else {
            return;
        };
        self.cuts.clear();
        let mut seen = Seen {
            spec: self.spec,
            count: self.count.as_mut(),
            progress: self.progress.as_ref(),
            opening: self.opening.as_mut(),
            cuts: &mut self.cuts,
            ended: &mut self.ended,
            last_end: &mut self.last_end,
            fed,
        };
        match chunk {
            Some(chunk) => reader.feed(chunk, |e| seen.event(e)),
            None => reader.finish(|e| seen.event(e)),
        }
    }

    /// What goes out of the held bytes and `chunk` (`None` at the stream's end): everything
    /// up to the event still being read, with the cuts made.
    fn assemble(&mut self, chunk: Option<Bytes>) -> Bytes {
        let reader = self.reader.as_ref().expect("only an event stream is held");
        let all = match chunk {
            Some(chunk) if self.held.is_empty() => chunk,
            Some(chunk) => {
                self.held.extend_from_slice(&chunk);
                self.held.split().freeze()
            }
            None => self.held.split().freeze(),
        };
        // What was not yet out ends where the reader is.
        let end = reader.fed();
        let from = end - all.len() as u64;
        let mut upto = reader.pending().unwrap_or(end);
        if end - upto > HOLD_MAX as u64 {
            // No event's end in sight: all of it goes, and nothing more is held.
            self.blind = true;
            upto = end;
        }
        self.place = match upto == end {
            true => reader.place(),
            false => Place::Between,
        };
        let out = match self.cuts.is_empty() {
            true => all.slice(..(upto - from) as usize),
            false => self.cut(&all, from, upto),
        };
        if upto < end {
            self.held.extend_from_slice(&all[(upto - from) as usize..]);
        }
        out
    }

    /// `all` (from `from` in the stream) up to `upto`, with the cuts made.
    fn cut(&self, all: &Bytes, from: u64, upto: u64) -> Bytes {
        let at = |offset: u64| (offset.clamp(from, upto) - from) as usize;
        let mut out = BytesMut::with_capacity(all.len());
        let mut pos = from;
        for (span, rewrite) in &self.cuts {
            out.extend_from_slice(&all[at(pos)..at(span.start)]);
            let raw = &all[at(span.start)..at(span.end)];
            match rewrite {
                Rewrite::Keep => out.extend_from_slice(raw),
                Rewrite::Drop => {}
                Rewrite::Replace(with) => out.extend_from_slice(with),
                Rewrite::SwapId => match &self.opening {
                    Some(o) => out.extend_from_slice(&o.swap_id(raw)),
                    None => out.extend_from_slice(raw),
                },
            }
            pos = span.end.max(pos);
        }
        out.extend_from_slice(&all[at(pos)..at(upto)]);
        out.freeze()
    }
}

/// `buf` with `more` after it, of which only the last `max` bytes are kept.
fn keep_tail(buf: &mut Vec<u8>, more: &[u8], max: usize) {
    if more.len() >= max {
        buf.clear();
        buf.extend_from_slice(&more[more.len() - max..]);
        return;
    }
    let over = (buf.len() + more.len()).saturating_sub(max);
    buf.drain(..over);
    buf.extend_from_slice(more);
}

/// The observers, borrowed for one chunk's events.
struct Seen<'a> {
    spec: &'static Spec,
    count: Option<&'a mut Count>,
    progress: Option<&'a Progress>,
    opening: Option<&'a mut Opening>,
    cuts: &'a mut Vec<(Range<u64>, Rewrite)>,
    ended: &'a mut bool,
    last_end: &'a mut bool,
    fed: &'a mut Fed,
}

impl Seen<'_> {
    fn event(&mut self, e: &Event) {
        if e.is_comment() {
            return;
        }
        let token = self.spec.is_token(e);
        // A progress event carries no text: an event with text is never looked at as one
        // (nor taken out with its text).
        if let Some(p) = self.progress.filter(|_| !token) {
            if let Some(prefill) = p.read(e.data) {
                self.fed.prefill = Some(prefill);
                if p.strips() {
                    self.cuts.push((e.span.clone(), Rewrite::Drop));
                }
                return;
            }
        }
        if let Some(c) = self.count.as_deref_mut() {
            match self.spec.carries_figures(e) {
                true => c.event(e.kind(), e.data),
                false => c.came(),
            }
        }
        let end = self.spec.is_end(e);
        *self.last_end = end;
        if end {
            *self.ended = true;
            self.fed.ended = true;
        }
        if token {
            self.fed.tokens += 1;
        }
        if let Some(o) = self.opening.as_deref_mut().filter(|o| !o.passing()) {
            match o.engine_event(e.kind(), e.data) {
                Rewrite::Keep => {}
                rewrite => self.cuts.push((e.span.clone(), rewrite)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::protocol::{Api, ApiProtocol};
    use dsv4_engine::kinds::llama_server::prompt_progress;

    /// What a watch gave for `chunks`: the bytes out, the tokens, the latest progress done,
    /// whether the end went by and whether the last event was it.
    #[derive(Debug, PartialEq)]
    struct Run {
        out: String,
        tokens: u64,
        latest: Option<u64>,
        ended: bool,
        last_end: bool,
    }

    fn run(protocol: ApiProtocol, progress: Option<bool>, chunks: &[&[u8]]) -> Run {
        let progress =
            progress.map(|strip| Progress::new("prompt_progress", prompt_progress, strip));
        let mut w = Watch::new(protocol.spec(), true, None, progress);
        let (mut out, mut tokens, mut latest) = (Vec::new(), 0, None);
        let mut take = |fed: Fed| {
            out.extend_from_slice(&fed.out);
            tokens += fed.tokens;
            latest = fed.prefill.map(|p| p.done).or(latest);
        };
        for c in chunks {
            take(w.feed(Bytes::copy_from_slice(c)));
        }
        take(w.finish());
        Run {
            out: String::from_utf8(out).unwrap(),
            tokens,
            latest,
            ended: w.ended(),
            last_end: w.ended_with_its_last_event(),
        }
    }

    fn progress_event(processed: u64) -> String {
        format!(
            "data: {{\"choices\":[{{\"finish_reason\":null,\"index\":0,\"delta\":{{\"role\":\
             \"assistant\",\"content\":null}}}}],\"object\":\"chat.completion.chunk\",\
             \"prompt_progress\":{{\"total\":100,\"cache\":0,\"processed\":{processed},\
             \"time_ms\":{processed}}}}}\n\n"
        )
    }

    const TOKEN: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    #[test]
    fn progress_events_are_read_and_taken_out_when_dsv4d_asked() {
        let answer = format!("{TOKEN}{TOKEN}{DONE}");
        let all = format!("{}{}{answer}", progress_event(50), progress_event(100));
        let want = |out: &str| Run {
            out: out.into(),
            tokens: 2,
            latest: Some(100),
            ended: true,
            last_end: true,
        };
        // Cut anywhere, in pieces of any size, and each piece its own chunk.
        for size in [1, 2, 7, 33, 200, all.len()] {
            let cut: Vec<&[u8]> = all.as_bytes().chunks(size).collect();
            assert_eq!(
                run(ApiProtocol::OpenAi, Some(true), &cut),
                want(&answer),
                "{size}"
            );
            // Asked by the client: read, and passed byte for byte.
            assert_eq!(
                run(ApiProtocol::OpenAi, Some(false), &cut),
                want(&all),
                "{size}"
            );
        }
    }

    #[test]
    fn an_event_with_text_is_a_token_and_never_taken_out_as_progress() {
        // The model's text, or a field beside it, may name the engine's progress key: the
        // event is the answer's, read as a token and passed whole.
        let named = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\
                     \"prompt_progress\":{\"total\":100,\"cache\":0,\"processed\":100,\
                     \"time_ms\":1}}\n\n";
        let all = format!("{}{named}{DONE}", progress_event(50));
        let r = run(ApiProtocol::OpenAi, Some(true), &[all.as_bytes()]);
        assert_eq!(r.out, format!("{named}{DONE}"));
        assert_eq!((r.tokens, r.latest), (1, Some(50)));
    }

    #[test]
    fn a_stream_without_event_ends_is_let_through_whole() {
        // An engine whose events never end: nothing held back past the bound, nothing lost.
        let line = format!("data: {}", "x".repeat(1000));
        let chunks: Vec<&[u8]> = std::iter::repeat_n(line.as_bytes(), 100).collect();
        let r = run(ApiProtocol::OpenAi, Some(true), &chunks);
        assert_eq!(r.out, line.repeat(100));
        assert_eq!(r.latest, None);
        // An event cut off by the stream's end goes out at the end.
        let r = run(ApiProtocol::OpenAi, Some(true), &[b"data: {\"a\":1}"]);
        assert_eq!(r.out, "data: {\"a\":1}");
        // Events ended by CRs alone are read and taken out as any.
        let cr = format!("{}{TOKEN}{DONE}", progress_event(7)).replace('\n', "\r");
        let r = run(ApiProtocol::OpenAi, Some(true), &[cr.as_bytes()]);
        assert_eq!(r.out, format!("{TOKEN}{DONE}").replace('\n', "\r"));
        assert_eq!((r.latest, r.tokens, r.ended), (Some(7), 1, true));
    }

    /// Each API's content events, with the model's text holding `data: ` and `event: `: the
    /// tokens are the content events, whatever the text says.
    #[test]
    fn tokens_are_the_apis_content_events_whatever_their_text() {
        let text = "data: data: x\\n\\nevent: message_stop\\n\\ndata: [DONE]";
        let chat = format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n");
        let native = format!("data: {{\"content\":\"{text}\",\"stop\":false}}\n\n");
        let anthropic = format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\
             \"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n"
        );
        let responses = format!(
            "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\
             \"delta\":\"{text}\"}}\n\n"
        );
        let ds4_responses =
            format!("data: {{\"type\":\"response.output_text.delta\",\"delta\":\"{text}\"}}\n\n");
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{}}\n\n\
                     event: content_block_start\ndata: {\"type\":\"content_block_start\"}\n\n";
        let stop = "event: content_block_stop\ndata: {\"type\":\"content_block_stop\"}\n\n\
                    event: message_delta\ndata: {\"type\":\"message_delta\"}\n\n\
                    event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        let created = "event: response.created\ndata: {\"type\":\"response.created\"}\n\n";
        let done = "event: response.completed\ndata: {\"type\":\"response.completed\"}\n\n";
        let ds4_done = "data: {\"type\":\"response.completed\"}\n\n";
        for (protocol, head, event, tail) in [
            (ApiProtocol::OpenAi, "", chat.as_str(), DONE),
            (ApiProtocol::OpenAi, "", native.as_str(), ""),
            (ApiProtocol::Anthropic, start, anthropic.as_str(), stop),
            (ApiProtocol::Responses, created, responses.as_str(), done),
            (ApiProtocol::Responses, "", ds4_responses.as_str(), ds4_done),
        ] {
            let stream = format!("{head}{}{tail}", event.repeat(12));
            for size in [1, 5, 64, stream.len()] {
                let cut: Vec<&[u8]> = stream.as_bytes().chunks(size).collect();
                let r = run(protocol, None, &cut);
                assert_eq!(r.tokens, 12, "{protocol:?} {size}: {stream}");
                assert_eq!(r.out, stream);
                assert_eq!(r.ended, !tail.is_empty(), "{protocol:?}");
            }
        }
    }

    #[test]
    fn a_stream_ended_only_when_its_last_event_is_its_protocols_end() {
        use ApiProtocol::*;
        let chat = &b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n"[..];
        let anthropic_delta = &b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n"[..];
        let anthropic_stop = &b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"[..];
        let responses_delta =
            &b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n"[..];
        let llama_done = &b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"output\":[]}}\n\n"[..];
        let ds4_done =
            &b"data: {\"type\":\"response.completed\",\"sequence_number\":9,\"response\":{}}\n\n"[..];
        let ds4_failed = &b"data: {\"type\":\"response.failed\",\"sequence_number\":9}\n\n"[..];
        let incomplete = &b"event: response.incomplete\r\ndata: {}\r\n\r\n"[..];
        for (protocol, stream, ended) in [
            (OpenAi, vec![chat, b"data: [DONE]\n\n"], true),
            (OpenAi, vec![chat, b"data: [DONE]"], true),
            (OpenAi, vec![chat], false),
            (OpenAi, vec![], false),
            (OpenAi, vec![b"data: [DONE]\n\n", chat], false),
            (OpenAi, vec![chat, b"data: [DONE]\n\n", b": bye\n\n"], true),
            (OpenAi, vec![chat, b"data: [DONE]\r\n\r\n"], true),
            (
                OpenAi,
                vec![b"data: {\"text\":\"say data: [DONE] now\"}\n\n"],
                false,
            ),
            (Anthropic, vec![anthropic_delta, anthropic_stop], true),
            (Anthropic, vec![anthropic_delta], false),
            (Anthropic, vec![anthropic_stop, anthropic_delta], false),
            (
                Anthropic,
                vec![b"data: {\"type\":\"message_stop\"}\n\n"],
                true,
            ),
            (
                Anthropic,
                vec![b"data: {\"text\":\"event: message_stop\"}\r\n\r\n"],
                false,
            ),
            (Anthropic, vec![chat, b"data: [DONE]\n\n"], false),
            (Responses, vec![responses_delta, llama_done], true),
            (Responses, vec![responses_delta, ds4_done], true),
            (Responses, vec![responses_delta, ds4_failed], true),
            (Responses, vec![responses_delta, incomplete], true),
            (Responses, vec![responses_delta], false),
            (Responses, vec![llama_done, responses_delta], false),
            (Responses, vec![b"event: error\ndata: {}\n\n"], false),
        ] {
            let whole: Vec<u8> = stream.concat();
            assert_eq!(
                run(protocol, None, &stream).last_end,
                ended,
                "{protocol:?} {:?}",
                String::from_utf8_lossy(&whole)
            );
            // Split anywhere, and byte by byte.
            for cut in 0..=whole.len() {
                let two = run(protocol, None, &[&whole[..cut], &whole[cut..]]);
                assert_eq!(two.last_end, ended, "{protocol:?} cut at {cut}");
            }
            let ones: Vec<&[u8]> = whole.chunks(1).collect();
            assert_eq!(run(protocol, None, &ones).last_end, ended);
        }
    }

    #[test]
    fn a_plain_answer_is_one_event_of_its_last_bytes() {
        let timings = |n: u64| {
            format!("\"timings\":{{\"prompt_n\":{n},\"prompt_ms\":1,\"predicted_n\":1,\"predicted_ms\":1}}")
        };
        let count = || {
            Count::new(
                dsv4_client::ApiProtocol::OpenAi,
                Some("application/json"),
                tokio::time::Instant::now(),
            )
        };
        let mut w = Watch::new(ApiProtocol::OpenAi.spec(), false, count(), None);
        let third = vec![b' '; JSON_MAX / 3];
        for frame in [
            &third[..],
            &third,
            &third,
            timings(2).as_bytes(),
            &third,
            &third,
        ] {
            let out = w.feed(Bytes::copy_from_slice(frame)).out;
            assert_eq!(out, frame, "a plain answer passes as it is");
            assert!(w.body.len() + w.last.len() <= JSON_MAX.max(w.last.len()));
        }
        assert_eq!(
            w.take_count().and_then(|c| c.figures()).map(|f| f.prompt_n),
            Some(2)
        );
        // Past the bound, the figures are older than what is kept.
        let mut w = Watch::new(ApiProtocol::OpenAi.spec(), false, count(), None);
        for frame in [timings(3).as_bytes(), &vec![b' '; JSON_MAX]] {
            w.feed(Bytes::copy_from_slice(frame));
        }
        assert_eq!(w.take_count().and_then(|c| c.figures()), None);
    }

    /// The recorded streams of the real engines (`tests/fixtures/streams/record`): each
    /// file's engine, API and bytes.
    fn recorded() -> Vec<(String, ApiProtocol, Vec<u8>)> {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/streams");
        let mut all = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "sse") {
                continue;
            }
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            let protocol = match name.rsplit('-').next().unwrap() {
                "chat" | "completions" | "completion" => ApiProtocol::OpenAi,
                "messages" => ApiProtocol::Anthropic,
                "responses" => ApiProtocol::Responses,
                other => panic!("{name}: no API named {other}"),
            };
            all.push((name, protocol, std::fs::read(&path).unwrap()));
        }
        all.sort_by(|a, b| a.0.cmp(&b.0));
        // llama-server (as its kind and the generic kind start it) on five paths, ds4-server
        // on four.
        assert_eq!(
            all.len(),
            14,
            "{:?}",
            all.iter().map(|a| &a.0).collect::<Vec<_>>()
        );
        all
    }

    /// The events of `stream` as a reference reader sees them (the recordings end their lines
    /// with LF: split at blank lines), each with its kind and data, comments left out.
    fn reference(stream: &[u8]) -> Vec<(String, String)> {
        let text = String::from_utf8(stream.to_vec()).unwrap();
        assert!(!text.contains('\r'));
        text.split("\n\n")
            .filter(|e| !e.is_empty())
            .filter_map(|e| {
                let mut name = String::new();
                let mut data: Vec<&str> = Vec::new();
                for line in e.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        name = v.trim_start().into();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.strip_prefix(' ').unwrap_or(v));
                    }
                }
                if data.is_empty() && name.is_empty() {
                    return None;
                }
                let data = data.join("\n");
                if name.is_empty() {
                    let v: Option<serde_json::Value> = serde_json::from_str(&data).ok();
                    name = v
                        .and_then(|v| v["type"].as_str().map(String::from))
                        .unwrap_or_default();
                }
                Some((name, data))
            })
            .collect()
    }

    /// The events a reader sees of `pieces`, each with its kind and data.
    fn read(pieces: &[&[u8]]) -> Vec<(String, String)> {
        let mut r = Reader::new();
        let mut got = Vec::new();
        let mut each = |e: &Event| {
            if !e.is_comment() {
                let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
                got.push((text(e.kind()), text(e.data)));
            }
        };
        for p in pieces {
            r.feed(p, &mut each);
        }
        r.finish(&mut each);
        got
    }

    /// Whether an OpenAI chunk or a llama-server native event, read as JSON, carries text
    /// the model generated: the reference the byte search is held to.
    fn generated_text(data: &str) -> bool {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            return false;
        };
        let text = |v: &serde_json::Value| v.as_str().is_some_and(|t| !t.is_empty());
        let choice = |c: &serde_json::Value| {
            let d = &c["delta"];
            let calls = d["tool_calls"].as_array().into_iter().flatten();
            text(&d["content"])
                || text(&d["reasoning_content"])
                || text(&c["text"])
                || calls.into_iter().any(|t| text(&t["function"]["arguments"]))
        };
        let choices = v["choices"].as_array().into_iter().flatten();
        text(&v["content"]) || choices.into_iter().any(choice)
    }

    #[test]
    fn every_split_of_the_real_engines_streams_reads_the_same_events() {
        for (name, protocol, stream) in recorded() {
            let want = reference(&stream);
            assert!(want.len() >= 5, "{name}: {want:?}");
            // The tokens, as the reference reader tells them: content events of the API.
            let content = |(kind, data): &(String, String)| match protocol {
                ApiProtocol::OpenAi => generated_text(data),
                ApiProtocol::Anthropic => kind == "content_block_delta",
                ApiProtocol::Responses => kind.ends_with(".delta"),
            };
            let tokens = want.iter().filter(|e| content(e)).count() as u64;
            assert!(tokens >= 1, "{name}");
            let progress = want
                .iter()
                .filter(|(_, d)| d.contains("\"prompt_progress\""))
                .count();
            assert_eq!(
                progress > 0,
                name.starts_with("llama-server-") && protocol == ApiProtocol::OpenAi,
                "{name}"
            );
            let ends = !name.ends_with("-completion");
            for cut in 0..=stream.len() {
                let pieces = [&stream[..cut], &stream[cut..]];
                assert_eq!(read(&pieces), want, "{name} cut at {cut}");
                // Read by a watch (the client's own progress events left in): byte for byte.
                let r = run(protocol, Some(false), &pieces);
                assert_eq!(r.out.as_bytes(), &stream[..], "{name} cut at {cut}");
                assert_eq!(r.tokens, tokens, "{name} cut at {cut}");
                assert_eq!((r.ended, r.last_end), (ends, ends), "{name} cut at {cut}");
                // dsv4d's own progress events taken out: the same stream without them.
                let stripped = run(protocol, Some(true), &pieces);
                let left = reference(stripped.out.as_bytes());
                let kept: Vec<_> = want
                    .iter()
                    .filter(|(_, d)| !d.contains("\"prompt_progress\""))
                    .cloned()
                    .collect();
                assert_eq!(left, kept, "{name} cut at {cut}");
                assert_eq!(stripped.tokens, tokens);
            }
            let ones: Vec<&[u8]> = stream.chunks(1).collect();
            assert_eq!(read(&ones), want, "{name} byte by byte");
            assert_eq!(
                run(protocol, Some(false), &ones).out.as_bytes(),
                &stream[..]
            );
        }
    }

    #[test]
    fn every_split_of_the_real_engines_streams_follows_dsv4ds_opening_alike() {
        for (name, protocol, stream) in recorded() {
            if protocol == ApiProtocol::OpenAi {
                continue;
            }
            let open = |pieces: &[&[u8]]| {
                let mut w = Watch::new(protocol.spec(), true, None, None);
                w.adopt(crate::http::opening::tests::opening_of(protocol));
                let mut out = w.opening().unwrap().keepalive().to_vec();
                for p in pieces {
                    out.extend_from_slice(&w.feed(Bytes::copy_from_slice(p)).out);
                }
                out.extend_from_slice(&w.finish().out);
                reference(&out)
            };
            let whole = open(&[&stream]);
            // One opening: dsv4d's, and the engine's made to follow it.
            let first = match protocol {
                ApiProtocol::Anthropic => "message_start",
                _ => "response.created",
            };
            assert_eq!(
                whole.iter().filter(|(k, _)| k == first).count(),
                1,
                "{name}: {whole:?}"
            );
            for cut in 0..=stream.len() {
                assert_eq!(
                    open(&[&stream[..cut], &stream[cut..]]),
                    whole,
                    "{name} cut at {cut}"
                );
            }
        }
    }
}
