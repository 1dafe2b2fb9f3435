//! A prefill's progress, read from the engine's own event stream (llama-server's
//! `prompt_progress` objects, which it sends when the request asks with
//! `"return_progress": true`), and taken out of what the client gets unless the client asked
//! for them itself; and the events of an answer, counted.
//!
//! Owns: [`ask`] (the request body with the engine's own field that asks for progress put
//! in) and [`Progress`] (the reader and stripper over a stream's chunks). Pure: no I/O. The
//! body that uses them is [`crate::http::answer::EngineStream`].
//!
//! Everything but the progress events passes byte for byte. While it strips, events go out
//! whole: the part of a chunk after its last event's end is held until the rest of that
//! event comes (an engine writes each event in one piece, so nearly never).

use bytes::{Bytes, BytesMut};
use dsv4_engine::Prefill;
use memchr::memmem::Finder;

/// The request `body` with `"field":true` put last in its top-level object; `None` when the
/// body does not parse as a JSON object (left to the engine to refuse, with its own error
/// positions), or when its top level names `field` already, written plainly or escaped (the
/// client asked, or declined, itself). Put at the end, so that every byte the client wrote
/// keeps its place.
pub fn ask(body: &[u8], field: &str) -> Option<Bytes> {
    let keys: std::collections::HashMap<String, serde::de::IgnoredAny> =
        serde_json::from_slice(body).ok()?;
    if keys.contains_key(field) {
        return None;
    }
    // It parsed as an object: its last byte other than blanks is the closing brace.
    let close = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    let comma = if keys.is_empty() { "" } else { "," };
    let added = format!("{comma}\"{field}\":true");
    let mut out = Vec::with_capacity(body.len() + added.len());
    out.extend_from_slice(&body[..close]);
    out.extend_from_slice(added.as_bytes());
    out.extend_from_slice(&body[close..]);
    Some(Bytes::from(out))
}

/// The most held back while waiting for an event's end; past it, the stream passes as it
/// comes and nothing more is taken out (an engine that ends its events otherwise than
/// with a blank line of LFs).
const CARRY_MAX: usize = 64 << 10;

/// A stream's progress events, read (and taken out, when dsv4d asked for them).
pub struct Progress {
    read: fn(&[u8]) -> Option<Prefill>,
    field: Finder<'static>,
    /// Take the progress events out (dsv4d asked for them, not the client).
    strip: bool,
    /// The start of an event whose end has not come yet.
    carry: BytesMut,
}

/// What a chunk of the stream gave.
#[derive(Debug, Default, PartialEq)]
pub struct Fed {
    /// What goes on to the client (nothing when the chunk was all progress, or part of one
    /// event).
    pub out: Option<Bytes>,
    /// The latest progress told.
    pub latest: Option<Prefill>,
    /// The answer's own events that ended in it (`[DONE]` and progress events not counted).
    pub events: u64,
}

impl Progress {
    /// A reader of the events whose data has the key `field`, read with `read`.
    pub fn new(field: &str, read: fn(&[u8]) -> Option<Prefill>, strip: bool) -> Self {
        Progress {
            read,
            field: Finder::new(format!("\"{field}\"").as_bytes()).into_owned(),
            strip,
            carry: BytesMut::new(),
        }
    }

    /// The next chunk of the stream.
    pub fn feed(&mut self, chunk: Bytes) -> Fed {
        if !self.strip {
            // Passed as it is; its events read as they end.
            let mut fed = Fed::default();
            let whole = self.complete(chunk.clone());
            for event in events(&whole) {
                self.look(event, &mut fed);
            }
            fed.out = Some(chunk);
            return fed;
        }
        if self.carry.len() + chunk.len() > CARRY_MAX && !has_end(&chunk) {
            // No event's end in sight: let it all through, and stop taking anything out.
            self.strip = false;
            let mut held = std::mem::take(&mut self.carry);
            held.extend_from_slice(&chunk);
            return Fed {
                out: Some(held.freeze()),
                ..Fed::default()
            };
        }
        let whole = self.complete(chunk);
        let mut fed = Fed::default();
        if whole.is_empty() {
            return fed;
        }
        if self.field.find(&whole).is_none() {
            fed.events = events(&whole).filter(|e| is_answer(e)).count() as u64;
            fed.out = Some(whole);
            return fed;
        }
        let mut kept = BytesMut::with_capacity(whole.len());
        for event in events(&whole) {
            if !self.look(event, &mut fed) {
                kept.extend_from_slice(event);
            }
        }
        fed.out = (!kept.is_empty()).then(|| kept.freeze());
        fed
    }

    /// What is held back at the stream's end (an event its engine never ended).
    pub fn rest(&mut self) -> Option<Bytes> {
        (self.strip && !self.carry.is_empty()).then(|| std::mem::take(&mut self.carry).freeze())
    }

    /// Reads one whole event into `fed`; whether it was a progress event.
    fn look(&self, event: &[u8], fed: &mut Fed) -> bool {
        if self.field.find(event).is_some() {
            if let Some(p) = (self.read)(event) {
                fed.latest = Some(p);
                return true;
            }
        }
        if is_answer(event) {
            fed.events += 1;
        }
        false
    }

    /// The whole events of what was held and `chunk`; what follows the last one's end is
    /// held for the next chunk.
    fn complete(&mut self, chunk: Bytes) -> Bytes {
        let data = if self.carry.is_empty() {
            chunk
        } else {
            self.carry.extend_from_slice(&chunk);
            std::mem::take(&mut self.carry).freeze()
        };
        let end = memchr::memmem::rfind(&data, b"\n\n").map_or(0, |at| at + 2);
        if end < data.len() {
            self.carry.extend_from_slice(&data[end..]);
        }
        data.slice(..end)
    }
}

fn has_end(chunk: &[u8]) -> bool {
    memchr::memmem::find(chunk, b"\n\n").is_some()
}

/// The events of `whole` (which ends with an event's end), each with its blank line.
fn events(whole: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= whole.len() {
            return None;
        }
        let end = memchr::memmem::find(&whole[at..], b"\n\n").map_or(whole.len(), |e| at + e + 2);
        let event = &whole[at..end];
        at = end;
        Some(event)
    })
}

/// Whether an event is one of the answer's own: one with data, not the `[DONE]` that ends it.
fn is_answer(event: &[u8]) -> bool {
    let data = event
        .split(|&b| b == b'\n')
        .find_map(|line| line.strip_prefix(b"data:"));
    data.is_some_and(|d| d.trim_ascii() != b"[DONE]")
}

/// The answer's own events in a chunk of a stream not otherwise read: the `data:` lines that
/// begin in it (`[DONE]` left out). A line begins at the chunk's start only when
/// `line_start` says the chunk before ended a line; elsewhere after a line end. So the
/// model's own text (`"data: x"` within an event's JSON, where no line ends) is not counted.
pub fn count_events(chunk: &[u8], line_start: bool) -> u64 {
    static DATA: std::sync::LazyLock<Finder<'static>> =
        std::sync::LazyLock::new(|| Finder::new(b"data: "));
    let begins = |at: usize| match at {
        0 => line_start,
        at => matches!(chunk[at - 1], b'\n' | b'\r'),
    };
    DATA.find_iter(chunk)
        .filter(|&at| begins(at) && !chunk[at + 6..].starts_with(b"[DONE]"))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsv4_engine::kinds::llama_server::prompt_progress;

    #[test]
    fn the_engines_field_is_put_last_unless_the_top_level_names_it() {
        let asked = |body: &str| ask(body.as_bytes(), "return_progress").map(|b| b.to_vec());
        let s = |t: &str| Some(t.as_bytes().to_vec());
        assert_eq!(
            asked(r#"{"stream":true,"messages":[]}"#),
            s(r#"{"stream":true,"messages":[],"return_progress":true}"#)
        );
        assert_eq!(
            asked(" \n{ \"stream\": true }\n"),
            s(" \n{ \"stream\": true ,\"return_progress\":true}\n")
        );
        assert_eq!(asked("{}"), s(r#"{"return_progress":true}"#));
        assert_eq!(asked("{ }"), s(r#"{ "return_progress":true}"#));
        // The client's own choice stands, either way, written plainly or escaped.
        assert_eq!(asked(r#"{"return_progress":false,"stream":true}"#), None);
        assert_eq!(asked(r#"{"stream":true,"return_progress":true}"#), None);
        assert_eq!(
            asked(r#"{"return\u005fprogress":true,"stream":true}"#),
            None
        );
        // The name deeper down, or in the text, is not the client's choice.
        assert_eq!(
            asked(r#"{"messages":[{"content":"\"return_progress\""}],"x":{"return_progress":1}}"#),
            s(
                r#"{"messages":[{"content":"\"return_progress\""}],"x":{"return_progress":1},"return_progress":true}"#
            )
        );
        // Not an object, or not JSON: left to the engine to refuse, byte for byte.
        assert_eq!(asked("[1]"), None);
        assert_eq!(asked(""), None);
        assert_eq!(asked(r#"{"stream":true,}"#), None);
        assert_eq!(asked(r#"{"stream":true} x"#), None);
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

    /// Feeds `chunks`; what went out, the latest progress, the events counted.
    fn run(strip: bool, chunks: &[String]) -> (String, Option<u64>, u64) {
        let mut p = Progress::new("prompt_progress", prompt_progress, strip);
        let (mut out, mut latest, mut events) = (Vec::new(), None, 0);
        for c in chunks {
            let fed = p.feed(Bytes::from(c.clone()));
            if let Some(o) = fed.out {
                out.extend_from_slice(&o);
            }
            latest = fed.latest.map(|p| p.done).or(latest);
            events += fed.events;
        }
        if let Some(rest) = p.rest() {
            out.extend_from_slice(&rest);
        }
        (String::from_utf8(out).unwrap(), latest, events)
    }

    #[test]
    fn progress_events_are_read_and_taken_out_when_dsv4d_asked() {
        let answer = format!("{TOKEN}{TOKEN}{DONE}");
        let all = format!("{}{}{answer}", progress_event(50), progress_event(100));
        // In the engine's own pieces, one event each.
        let pieces: Vec<String> = vec![
            progress_event(50),
            progress_event(100),
            TOKEN.into(),
            TOKEN.into(),
            DONE.into(),
        ];
        assert_eq!(run(true, &pieces), (answer.clone(), Some(100), 2));
        // Asked by the client: read, and passed byte for byte.
        assert_eq!(run(false, &pieces), (all.clone(), Some(100), 2));
        // Cut anywhere, in pieces of any size.
        for size in [1, 2, 7, 33, 200, all.len()] {
            let cut: Vec<String> = all
                .as_bytes()
                .chunks(size)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            assert_eq!(run(true, &cut), (answer.clone(), Some(100), 2), "{size}");
            assert_eq!(run(false, &cut), (all.clone(), Some(100), 2), "{size}");
        }
    }

    #[test]
    fn a_stream_without_event_ends_is_let_through_whole() {
        // An engine whose events end otherwise: nothing held back past the cap, nothing lost.
        let line = format!("data: {}\r\n\r\n", "x".repeat(1000));
        let chunks: Vec<String> = std::iter::repeat_n(line, 100).collect();
        let (out, latest, _) = run(true, &chunks);
        assert_eq!(out, chunks.concat());
        assert_eq!(latest, None);
        // An event cut off by the stream's end goes out at the end.
        assert_eq!(run(true, &["data: {\"a\":1}".into()]).0, "data: {\"a\":1}");
    }

    #[test]
    fn an_answers_events_are_counted_without_done() {
        assert_eq!(
            count_events(format!("{TOKEN}{TOKEN}{DONE}").as_bytes(), true),
            2
        );
        assert_eq!(count_events(b"", true), 0);
        assert_eq!(count_events(DONE.as_bytes(), true), 0);
        // The model's own text is no event (the probe's `data: data: x`, 12 events: 12).
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\"data: data: x\"}}]}\n\n";
        assert_eq!(count_events(text.repeat(12).as_bytes(), true), 12);
        // A chunk that begins within a line: its first `data: ` is within it.
        assert_eq!(count_events(b"data: x\n\n", false), 0);
        assert_eq!(count_events(b"\r\ndata: x", false), 1);
    }
}
