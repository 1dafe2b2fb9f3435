//! Keep-alives the agents count: events of the stream's own API that carry no content.
//!
//! Claude Code (Anthropic Messages) and Codex (OpenAI Responses) time a stream by its events,
//! not its bytes: an SSE comment resets neither watchdog, and an Anthropic `ping` is dropped by
//! the SDK Claude Code is built on before its watchdog sees it. llama-server sends a streamed
//! answer's head at once but its first event only when the prefill is done, so a prefill of an
//! hour, or a cold start, is an hour without an event. While the engine is silent, dsv4d
//! writes what each API's clients count and ignore as content:
//!
//! - **Anthropic**: its own `message_start` (when the engine has not sent one), then
//!   `message_delta` events that change nothing (`stop_reason` null, no tokens). The engine's
//!   own `message_start`, when it comes after dsv4d's, becomes a `message_delta` that carries
//!   its usage (the prompt's tokens), since a message starts once;
//! - **Responses**: its own `response.created` (likewise), then `response.in_progress` events
//!   with the same response. The engine's own `response.created` and `response.in_progress`,
//!   when they come after dsv4d's, are dropped, and the engine's response id is written as
//!   dsv4d's in the rest of the stream, so that a client that checks the response's identity
//!   (the `openai` package's stream helper) sees one response.
//!
//! Owns: [`Opening`], one per stream of those APIs, and [`Rewrite`] (what becomes of an
//! engine's event). Pure: no I/O, no clock. [`crate::http::keepalive::Keepalive`] calls
//! [`Opening::keepalive`] only where the stream is between events; the answer's reader
//! ([`crate::http::watch`]) hands it the engine's events and makes the changes it asks for.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::http::protocol::Opens;

/// What becomes of one of the engine's events on its way to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rewrite {
    /// It goes as it came.
    Keep,
    /// It goes not at all.
    Drop,
    /// These bytes go in its place.
    Replace(Bytes),
    /// It goes with the engine's response id written as dsv4d's ([`Opening::swap_id`]).
    SwapId,
}

/// Who opened the stream with its API's first event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Opened {
    /// No one yet: the engine's events are read until its opening has passed.
    No,
    /// dsv4d: the engine's opening is changed to follow it.
    Ours,
    /// The engine, before any keep-alive: its events pass as they are.
    Engines,
}

/// One stream's opening and keep-alives (see the module docs).
#[derive(Debug)]
pub struct Opening {
    api: Opens,
    /// dsv4d's own message or response id.
    id: String,
    model: String,
    /// Unix seconds, for a response's `created_at`.
    created: u64,
    opened: Opened,
    /// Responses: the engine's response id, once read.
    engine_id: Option<String>,
    /// Anthropic: the engine's `message_start` has come (changed, when dsv4d opened).
    engine_started: bool,
    /// The sequence number of dsv4d's next Responses event.
    sequence: u64,
}

impl Opening {
    /// For a stream that `api`'s events open, whose request names `model`; `stream` numbers
    /// dsv4d's ids, `created` is the time in Unix seconds.
    pub fn new(api: Opens, model: String, stream: u64, created: u64) -> Opening {
        let id = match api {
            Opens::Message => format!("msg_dsv4_{stream:016x}"),
            Opens::Response => format!("resp_dsv4_{stream:016x}"),
        };
        Opening {
            api,
            id,
            model,
            created,
            opened: Opened::No,
            engine_id: None,
            engine_started: false,
            sequence: 0,
        }
    }

    /// The event a keep-alive writes now, between events: the API's opening when no one has
    /// opened the stream yet, else one that says the answer is in progress.
    pub fn keepalive(&mut self) -> Bytes {
        if self.opened == Opened::No {
            self.opened = Opened::Ours;
            return self.open();
        }
        match self.api {
            Opens::Message => event(
                "message_delta",
                &json!({"type": "message_delta",
                        "delta": {"stop_reason": null, "stop_sequence": null},
                        "usage": {"output_tokens": 0}}),
            ),
            Opens::Response => {
                let id = match self.opened {
                    Opened::Ours => self.id.clone(),
                    _ => self.engine_id.clone().unwrap_or_else(|| self.id.clone()),
                };
                let response = self.response(&id);
                self.next_event("response.in_progress", response)
            }
        }
    }

    fn open(&mut self) -> Bytes {
        match self.api {
            Opens::Message => event(
                "message_start",
                &json!({"type": "message_start", "message": {
                    "id": self.id, "type": "message", "role": "assistant", "content": [],
                    "model": self.model, "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}),
            ),
            Opens::Response => {
                let response = self.response(&self.id);
                self.next_event("response.created", response)
            }
        }
    }

    fn response(&self, id: &str) -> Value {
        json!({"id": id, "object": "response", "created_at": self.created,
               "status": "in_progress", "model": self.model, "output": []})
    }

    fn next_event(&mut self, kind: &str, response: Value) -> Bytes {
        let sequence = self.sequence;
        self.sequence += 1;
        event(
            kind,
            &json!({"type": kind, "sequence_number": sequence, "response": response}),
        )
    }

    /// Whether every engine event from now on passes as it is.
    pub fn passing(&self) -> bool {
        match self.opened {
            Opened::Engines => self.api == Opens::Message || self.engine_id.is_some(),
            Opened::Ours => self.api == Opens::Message && self.engine_started,
            Opened::No => false,
        }
    }

    /// One of the engine's events (its kind and data), while the stream's opening is in
    /// question: what becomes of it (see the module docs).
    pub fn engine_event(&mut self, kind: &[u8], data: &[u8]) -> Rewrite {
        match (self.api, kind) {
            (Opens::Message, b"message_start") => {
                self.engine_started = true;
                if self.opened == Opened::Ours {
                    let data: Option<Value> = serde_json::from_slice(data).ok();
                    let usage = data
                        .as_ref()
                        .and_then(|d| d.get("message")?.get("usage").cloned())
                        .unwrap_or_else(|| json!({"output_tokens": 0}));
                    return Rewrite::Replace(event(
                        "message_delta",
                        &json!({"type": "message_delta",
                                "delta": {"stop_reason": null, "stop_sequence": null},
                                "usage": usage}),
                    ));
                }
                self.opened = Opened::Engines;
            }
            (Opens::Response, b"response.created" | b"response.in_progress") => {
                if self.engine_id.is_none() {
                    let data: Option<Value> = serde_json::from_slice(data).ok();
                    let id = data
                        .as_ref()
                        .and_then(|d| d.get("response")?.get("id")?.as_str());
                    self.engine_id = id.map(String::from);
                }
                if self.opened == Opened::Ours {
                    return Rewrite::Drop;
                }
                if kind == b"response.created" {
                    self.opened = Opened::Engines;
                }
            }
            _ => {}
        }
        match (&self.engine_id, self.opened) {
            (Some(_), Opened::Ours) => Rewrite::SwapId,
            _ => Rewrite::Keep,
        }
    }

    /// An engine's event `raw` with every `"engine id"` (as a JSON string) written as dsv4d's.
    pub fn swap_id(&self, raw: &[u8]) -> Bytes {
        let Some(engine) = &self.engine_id else {
            return Bytes::copy_from_slice(raw);
        };
        let from = format!("\"{engine}\"");
        let to = format!("\"{}\"", self.id);
        let mut out = Vec::with_capacity(raw.len());
        let mut rest = raw;
        while let Some(at) = memchr::memmem::find(rest, from.as_bytes()) {
            out.extend_from_slice(&rest[..at]);
            out.extend_from_slice(to.as_bytes());
            rest = &rest[at + from.len()..];
        }
        out.extend_from_slice(rest);
        Bytes::from(out)
    }
}

/// An event named `name` with `data`, ended by a blank line.
fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::http::protocol::{Api, ApiProtocol, KeepAlive};
    use crate::http::watch::{Watch, HOLD_MAX};

    /// A fresh opening of `api`'s stream (model `m`, stream 1, created at 7).
    pub(crate) fn opening_of(api: ApiProtocol) -> Opening {
        let KeepAlive::Events(opens) = api.spec().keepalive else {
            panic!("{api:?} keeps its streams with comments alone")
        };
        Opening::new(opens, "m".into(), 1, 7)
    }

    const START: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-x\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"cache_read_input_tokens\":0,\"input_tokens\":25,\"output_tokens\":0}}}\n\n";
    const BLOCK: &str = "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n";
    const CREATED: &str = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_engine1\",\"object\":\"response\",\"status\":\"in_progress\"}}\n\n";
    const IN_PROGRESS: &str = "event: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"response\":{\"id\":\"resp_engine1\",\"object\":\"response\",\"status\":\"in_progress\"}}\n\n";
    const DELTA: &str = "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"item_id\":\"msg_1\",\"delta\":\"a\"}\n\n";
    const COMPLETED: &str = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_engine1\",\"object\":\"response\",\"status\":\"completed\"}}\n\n";

    /// The events of `stream`: each one's kind and data.
    fn events(stream: &[u8]) -> Vec<(String, Value)> {
        let mut reader = crate::http::events::Reader::new();
        let mut got = Vec::new();
        let mut each = |e: &crate::http::events::Event| {
            let kind = String::from_utf8_lossy(e.kind()).into_owned();
            got.push((kind, serde_json::from_slice(e.data).unwrap()));
        };
        reader.feed(stream, &mut each);
        reader.finish(&mut each);
        got
    }

    /// The engine's `pieces` read by an answer's reader with a fresh opening, with
    /// keep-alives where the steps say: `k` a keep-alive, `e` the next piece.
    fn run(api: ApiProtocol, steps: &str, pieces: &[&str]) -> Vec<(String, Value)> {
        let mut w = Watch::new(api.spec(), true, None, None);
        w.adopt(opening_of(api));
        let mut out = Vec::new();
        let mut pieces = pieces.iter();
        for step in steps.chars() {
            match step {
                'k' => out.extend_from_slice(&w.opening().unwrap().keepalive()),
                _ => {
                    let piece = pieces.next().unwrap().to_string();
                    out.extend_from_slice(&w.feed(Bytes::from(piece)).out)
                }
            }
        }
        out.extend_from_slice(&w.finish().out);
        events(&out)
    }

    fn names(events: &[(String, Value)]) -> Vec<&str> {
        events.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn an_anthropic_stream_is_opened_by_dsv4d_and_the_engines_start_carries_its_usage() {
        let engine = format!("{START}{BLOCK}");
        // Silent, then the engine: its message_start becomes a delta with its usage.
        let got = run(ApiProtocol::Anthropic, "kke", &[&engine]);
        assert_eq!(
            names(&got),
            [
                "message_start",
                "message_delta",
                "message_delta",
                "content_block_start",
                "content_block_delta"
            ]
        );
        assert_eq!(got[0].1["message"]["id"], "msg_dsv4_0000000000000001");
        assert_eq!(got[0].1["message"]["usage"]["input_tokens"], 0);
        assert_eq!(got[1].1["delta"]["stop_reason"], Value::Null);
        assert_eq!(got[2].1["usage"]["input_tokens"], 25);
        assert_eq!(got[2].1["delta"]["stop_reason"], Value::Null);
        // The engine first: its stream as it is, and later keep-alives are deltas.
        let got = run(ApiProtocol::Anthropic, "eke", &[START, BLOCK]);
        assert_eq!(
            names(&got),
            [
                "message_start",
                "message_delta",
                "content_block_start",
                "content_block_delta"
            ]
        );
        assert_eq!(got[0].1["message"]["id"], "chatcmpl-x");
    }

    #[test]
    fn a_responses_stream_is_one_response_whoever_opened_it() {
        let engine = [CREATED, IN_PROGRESS, DELTA, COMPLETED];
        let got = run(ApiProtocol::Responses, "kkeeee", &engine);
        assert_eq!(
            names(&got),
            [
                "response.created",
                "response.in_progress",
                "response.output_text.delta",
                "response.completed"
            ]
        );
        for (_, data) in [&got[0], &got[1], &got[3]] {
            assert_eq!(
                data["response"]["id"], "resp_dsv4_0000000000000001",
                "{data}"
            );
        }
        assert_eq!(got[0].1["sequence_number"], 0);
        assert_eq!(got[1].1["sequence_number"], 1);
        // The engine first: its own, and dsv4d's keep-alives name its response.
        let got = run(ApiProtocol::Responses, "eekee", &engine);
        assert_eq!(
            names(&got),
            [
                "response.created",
                "response.in_progress",
                "response.in_progress",
                "response.output_text.delta",
                "response.completed"
            ]
        );
        assert!(got
            .iter()
            .all(|(_, d)| d.get("response").is_none_or(|r| r["id"] == "resp_engine1")));
    }

    #[test]
    fn cut_anywhere_the_client_gets_the_same_events() {
        for (api, engine) in [
            (ApiProtocol::Anthropic, format!("{START}{BLOCK}")),
            (
                ApiProtocol::Responses,
                format!("{CREATED}{IN_PROGRESS}{DELTA}{COMPLETED}"),
            ),
        ] {
            let whole = run(api, "ke", &[&engine]);
            for cut in 0..=engine.len() {
                let (a, b) = engine.split_at(cut);
                assert_eq!(run(api, "kee", &[a, b]), whole, "{api:?} cut at {cut}");
            }
        }
    }

    #[test]
    fn events_named_by_their_type_alone_are_read_too() {
        // ds4-server writes its Responses events without an `event:` line.
        let untyped = |e: &str| e.split_once('\n').map(|(_, d)| d.to_string()).unwrap();
        let engine = [untyped(CREATED), untyped(DELTA), untyped(COMPLETED)];
        let pieces: Vec<&str> = engine.iter().map(String::as_str).collect();
        let got = run(ApiProtocol::Responses, "keee", &pieces);
        assert_eq!(
            names(&got),
            [
                "response.created",
                "response.output_text.delta",
                "response.completed"
            ]
        );
        assert_eq!(got[2].1["response"]["id"], "resp_dsv4_0000000000000001");
    }

    #[test]
    fn a_stream_without_event_ends_passes_whole() {
        let mut w = Watch::new(ApiProtocol::Anthropic.spec(), true, None, None);
        w.adopt(opening_of(ApiProtocol::Anthropic));
        let long = "x".repeat(HOLD_MAX + 1);
        assert_eq!(w.feed(Bytes::from(long.clone())).out, long.as_bytes());
        assert_eq!(w.feed(Bytes::from_static(b"y")).out, &b"y"[..]);
        assert_eq!(w.finish().out, Bytes::new());
    }
}
