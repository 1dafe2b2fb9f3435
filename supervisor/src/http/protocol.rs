//! The APIs dsv4d's clients speak, in one table: for each, the paths it is served at, which
//! of them stream, which event ends a complete stream, which events are the answer's tokens,
//! where its token counts are, how an error event looks in it, and how an error dsv4d
//! answers itself must look for that API's SDKs to raise it as their own, and what keeps its
//! silent streams' clients waiting (comments, or events of its own, which
//! [`crate::http::opening`] writes).
//!
//! Owns: [`ApiProtocol`], [`SPECS`] (one row per protocol: a new protocol is one more row),
//! [`Route`] (a path's protocol and how its answers stream, looked up once per request) and
//! [`Failure`] (an error to tell, in any protocol). Pure: no I/O, no clock.

use bytes::Bytes;
/// The API a request speaks: one type for dsv4d, its statistics and its clients (the client
/// crate's, named as `/status` and `/metrics` name it); what dsv4d knows of each is its row
/// here, reached through [`Api`].
pub use dsv4_client::ApiProtocol;
use serde_json::{json, Value};

use crate::http::events::Event;
use crate::observe::stats::value_after_key;

/// How the answers at a path stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Streams {
    /// Never (token counts and the like).
    No,
    /// When asked (`"stream": true`), and a complete stream ends with its protocol's last
    /// event ([`Spec::last`]).
    Ended,
    /// When asked, with no last event of its own (llama-server's native completions): only
    /// the connection's close or the chunked framing tells its end.
    Unmarked,
}

/// What dsv4d knows of one API: where its answers' token counts are (the `usage` shape read
/// when an answer has no llama-server `timings`, [`crate::observe::stats`]) is its
/// `protocol`'s.
pub struct Spec {
    pub protocol: ApiProtocol,
    /// The paths it is served at, as the engine routes them, and how each streams.
    pub paths: &'static [(&'static str, Streams)],
    /// The event that ends a complete stream.
    pub last: Last,
    /// That last event, as a message names it.
    pub end_name: &'static str,
    /// The events that are the answer's tokens (shown in flight, and the first ends the
    /// prefill).
    pub tokens: Tokens,
    /// What keeps its silent streams' clients waiting.
    pub keepalive: KeepAlive,
    /// Which events of its streams carry the answer's figures (a plain answer's body does).
    pub figures: Figures,
    /// The error event that tells a streaming client of `failure`.
    pub error_event: fn(&Failure) -> Bytes,
    /// The body of an error dsv4d answers itself, for this protocol's SDKs.
    pub error_body: fn(&Failure) -> Bytes,
}

/// Which event ends a complete stream.
pub enum Last {
    /// `data: [DONE]`.
    Done,
    /// An event of one of these kinds (its name, or its data's `type`: [`Event::kind`]).
    Kinds(&'static [&'static str]),
}

/// What keeps the clients of a silent stream waiting (see [`crate::http::keepalive`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    /// SSE comments: its clients count bytes.
    Comments,
    /// Comments, and events of the API's own that carry no content ([`crate::http::opening`]):
    /// its clients count events.
    Events(Opens),
}

/// The API's own events that open a stream and say it goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opens {
    /// `message_start`, then `message_delta`s (Anthropic Messages).
    Message,
    /// `response.created`, then `response.in_progress` (OpenAI Responses).
    Response,
}

/// Which events of a stream carry the answer's figures (`usage`, llama-server's `timings`).
pub enum Figures {
    /// Any event with data.
    Any,
    /// The events of these kinds.
    Kinds(&'static [&'static str]),
}

/// Which events are the answer's tokens.
pub enum Tokens {
    /// The events whose data carries text the model generated: a non-empty string under
    /// `content`, `text`, `reasoning_content` or a tool call's `arguments` (OpenAI's chat and
    /// completions chunks, llama-server's native events). Not the role's opening chunk, the
    /// one with the finish reason alone, the usage's, or the end.
    Text,
    /// The events whose kind ends with this.
    KindEndsWith(&'static str),
}

/// The protocols, one row each. OpenAI's chat path comes first: most requests are found at
/// the first comparison.
pub static SPECS: [Spec; 3] = [
    Spec {
        protocol: ApiProtocol::OpenAi,
        paths: &[
            ("/v1/chat/completions", Streams::Ended),
            ("/chat/completions", Streams::Ended),
            ("/v1/completions", Streams::Ended),
            // llama-server routes these two to its native completion, whose stream has no
            // `[DONE]`.
            ("/completions", Streams::Unmarked),
            ("/completion", Streams::Unmarked),
            ("/v1/chat/completions/input_tokens", Streams::No),
            ("/chat/completions/input_tokens", Streams::No),
        ],
        last: Last::Done,
        end_name: "[DONE]",
        // (llama-server's progress events are taken out before: `crate::http::watch`.)
        tokens: Tokens::Text,
        keepalive: KeepAlive::Comments,
        // The last chunk (llama-server's `timings`; `usage` when asked for).
        figures: Figures::Any,
        error_event: openai_event,
        error_body: openai_body,
    },
    Spec {
        protocol: ApiProtocol::Anthropic,
        paths: &[
            ("/v1/messages", Streams::Ended),
            ("/v1/messages/count_tokens", Streams::No),
        ],
        last: Last::Kinds(&["message_stop"]),
        end_name: "message_stop",
        tokens: Tokens::KindEndsWith("content_block_delta"),
        keepalive: KeepAlive::Events(Opens::Message),
        // The opening's usage (the prompt's tokens), the closing delta's (the output's).
        figures: Figures::Kinds(&["message_start", "message_delta"]),
        error_event: anthropic_event,
        error_body: anthropic_body,
    },
    Spec {
        protocol: ApiProtocol::Responses,
        paths: &[
            ("/v1/responses", Streams::Ended),
            ("/responses", Streams::Ended),
            ("/v1/responses/input_tokens", Streams::No),
            ("/responses/input_tokens", Streams::No),
        ],
        // llama-server names its events; ds4-server sends `data:` alone, its type first.
        last: Last::Kinds(&[
            "response.completed",
            "response.failed",
            "response.incomplete",
        ]),
        end_name: "response.completed",
        // Text, reasoning and a tool call's arguments: `response.*.delta`.
        tokens: Tokens::KindEndsWith(".delta"),
        keepalive: KeepAlive::Events(Opens::Response),
        // The last event's response (and llama-server's `timings` beside it).
        figures: Figures::Kinds(&[
            "response.completed",
            "response.failed",
            "response.incomplete",
        ]),
        error_event: responses_event,
        error_body: openai_body,
    },
];

impl Spec {
    /// Whether `e` is the event that ends a complete stream.
    pub fn is_end(&self, e: &Event) -> bool {
        match self.last {
            Last::Done => e.has_data && e.data.trim_ascii() == b"[DONE]",
            Last::Kinds(kinds) => {
                let kind = e.kind();
                kinds.iter().any(|k| k.as_bytes() == kind)
            }
        }
    }

    /// Whether `e` may carry the answer's figures.
    pub fn carries_figures(&self, e: &Event) -> bool {
        match self.figures {
            Figures::Any => e.has_data,
            Figures::Kinds(kinds) => {
                let kind = e.kind();
                kinds.iter().any(|k| k.as_bytes() == kind)
            }
        }
    }

    /// Whether `e` is one of the answer's tokens.
    pub fn is_token(&self, e: &Event) -> bool {
        match self.tokens {
            Tokens::Text => e.has_data && carries_text(e.data),
            Tokens::KindEndsWith(end) => e.kind().ends_with(end.as_bytes()),
        }
    }
}

/// Whether `data` (a JSON object, as the engine wrote it) holds a non-empty string under one
/// of the keys of generated text. A key in the model's own text cannot match: its quotes
/// are escaped there.
fn carries_text(data: &[u8]) -> bool {
    use memchr::memmem::Finder;
    // Built once: a one-shot search builds its searcher on every call. Chat's key first.
    static KEYS: std::sync::LazyLock<[Finder<'static>; 4]> = std::sync::LazyLock::new(|| {
        [
            Finder::new(b"\"content\""),
            Finder::new(b"\"text\""),
            Finder::new(b"\"reasoning_content\""),
            Finder::new(b"\"arguments\""),
        ]
    });
    KEYS.iter().any(|key| {
        key.find_iter(data).any(|at| {
            value_after_key(&data[at + key.needle().len()..])
                .is_some_and(|v| v.first() == Some(&b'"') && v.get(1).is_some_and(|&b| b != b'"'))
        })
    })
}

/// What dsv4d knows of an API: its row of [`SPECS`], and what the row says.
pub trait Api: Sized {
    /// Its row of [`SPECS`].
    fn spec(self) -> &'static Spec;

    /// The API of `path` (as the engine routes it), if it has one.
    fn of(path: &str) -> Option<Self>;

    /// The error event that tells a streaming client of `failure`.
    fn error_event(self, failure: &Failure) -> Bytes {
        (self.spec().error_event)(failure)
    }

    /// The body of an error dsv4d answers itself.
    fn error_body(self, failure: &Failure) -> Bytes {
        (self.spec().error_body)(failure)
    }
}

impl Api for ApiProtocol {
    fn spec(self) -> &'static Spec {
        let spec = match self {
            ApiProtocol::OpenAi => &SPECS[0],
            ApiProtocol::Anthropic => &SPECS[1],
            ApiProtocol::Responses => &SPECS[2],
        };
        debug_assert_eq!(spec.protocol, self);
        spec
    }

    fn of(path: &str) -> Option<ApiProtocol> {
        Route::of(path).map(|r| r.protocol)
    }
}

/// A path's protocol and how its answers stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub protocol: ApiProtocol,
    pub streams: Streams,
}

impl Route {
    /// The route of `path`, as the engine routes it: `None` for a path of no protocol
    /// dsv4d knows (embeddings, tokenize, slots, ...), whose errors are in OpenAI's shape.
    pub fn of(path: &str) -> Option<Route> {
        SPECS.iter().find_map(|spec| {
            spec.paths
                .iter()
                .find(|(p, _)| *p == path)
                .map(|&(_, streams)| Route {
                    protocol: spec.protocol,
                    streams,
                })
        })
    }

    /// Whether its streams end with an event of their own.
    pub fn ends_marked(self) -> bool {
        self.streams == Streams::Ended
    }
}

/// An error to tell a client, in whichever protocol it speaks.
#[derive(Clone, Debug)]
pub struct Failure<'a> {
    pub message: &'a str,
    /// The type, in OpenAI's words (`server_error`, `invalid_request_error`, ...), or the
    /// engine's own.
    pub kind: &'a str,
    /// dsv4d's code (`engine_failed`, `queue_full`, ...) or the engine's, or the status.
    pub code: Value,
    /// The status of the answer that failed; `None` for a stream cut after its 200.
    pub status: Option<u16>,
}

/// Anthropic's error type for an answer of `status` (its API's own list: an SDK shows it,
/// and picks its error class by the status).
pub fn anthropic_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Whether `kind` is one of Anthropic's error types (an engine's Anthropic error keeps its
/// own).
fn is_anthropic_type(kind: &str) -> bool {
    matches!(
        kind,
        "invalid_request_error"
            | "authentication_error"
            | "billing_error"
            | "permission_error"
            | "not_found_error"
            | "request_too_large"
            | "rate_limit_error"
            | "timeout_error"
            | "api_error"
            | "overloaded_error"
    )
}

/// The type an Anthropic client is told: the failure's own when it is one of Anthropic's,
/// else the status's; `api_error` for a cut stream.
fn anthropic_kind<'a>(f: &Failure<'a>) -> &'a str {
    match f.status {
        _ if is_anthropic_type(f.kind) && f.kind != "invalid_request_error" => f.kind,
        Some(status) => anthropic_type(status),
        None => "api_error",
    }
}

fn openai_error(f: &Failure) -> Value {
    match f.status {
        Some(status) => {
            json!({"error": {"message": f.message, "type": f.kind, "code": f.code, "status": status}})
        }
        None => json!({"error": {"message": f.message, "type": f.kind, "code": f.code}}),
    }
}

/// `data: {"error":{...}}`: the `openai` packages raise it as an `APIError` with its message.
fn openai_event(f: &Failure) -> Bytes {
    Bytes::from(format!("data: {}\n\n", openai_error(f)))
}

/// `{"error":{"message":...,"type":...,"code":...}}`, as OpenAI answers.
fn openai_body(f: &Failure) -> Bytes {
    let v = json!({ "error": { "message": f.message, "type": f.kind, "code": f.code } });
    Bytes::from(v.to_string())
}

/// Anthropic's error object, with dsv4d's code where its SDKs read one
/// (`error.details.error_code`).
fn anthropic_error(f: &Failure) -> Value {
    let mut error = json!({"type": anthropic_kind(f), "message": f.message});
    if let Value::String(code) = &f.code {
        error["details"] = json!({ "error_code": code });
    }
    json!({"type": "error", "error": error})
}

/// `event: error`: the `anthropic` packages raise it as an `APIStatusError` with its message.
fn anthropic_event(f: &Failure) -> Bytes {
    Bytes::from(format!("event: error\ndata: {}\n\n", anthropic_error(f)))
}

fn anthropic_body(f: &Failure) -> Bytes {
    Bytes::from(anthropic_error(f).to_string())
}

/// `event: error` with Responses' fields (`type`, `code`, `message`, `param`,
/// `sequence_number`), and OpenAI's `error` object beside them, which the `openai` packages
/// raise as an `APIError` (an event without it they pass on as an event among others).
fn responses_event(f: &Failure) -> Bytes {
    let code = match &f.code {
        Value::String(_) => f.code.clone(),
        other => Value::String(other.to_string()),
    };
    let v = json!({
        "type": "error", "code": code, "message": f.message, "param": null,
        "sequence_number": 0, "error": openai_error(f)["error"],
    });
    Bytes::from(format!("event: error\ndata: {v}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_openai_token_is_an_event_with_generated_text() {
        let rows: &[(&str, bool)] = &[
            // llama-server's chat: the role's opening, a token, the finish, the usage.
            (
                r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"x"}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"finish_reason":"length","index":0,"delta":{}}],"timings":{}}"#,
                false,
            ),
            (r#"{"choices":[],"usage":{"completion_tokens":12}}"#, false),
            // Reasoning, a tool call's arguments, completions' text, a spaced writer.
            (
                r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\"a"}}]}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"function":{"name":"f","arguments":""}}]}}]}"#,
                false,
            ),
            (
                r#"{"choices":[{"text":"abc","index":0,"finish_reason":null}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"text":"","index":0,"finish_reason":"length"}]}"#,
                false,
            ),
            (
                r#"{"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}"#,
                true,
            ),
            // llama-server's native events: a token, the last.
            (r#"{"index":0,"content":"x","stop":false}"#, true),
            (
                r#"{"index":0,"content":"","stop":true,"timings":{}}"#,
                false,
            ),
            // The model's text holding a key is escaped: one token, not more, and no more.
            (
                r#"{"choices":[{"delta":{"content":"data: {\"content\":\"x\"}"}}]}"#,
                true,
            ),
            (
                r#"{"choices":[{"delta":{"role":"assistant","refusal":"\"content\":\"x"}}]}"#,
                false,
            ),
        ];
        for (data, token) in rows {
            assert_eq!(carries_text(data.as_bytes()), *token, "{data}");
        }
    }

    #[test]
    fn each_path_has_its_protocol_and_stream() {
        use ApiProtocol::*;
        use Streams::*;
        for (path, route) in [
            ("/v1/chat/completions", Some((OpenAi, Ended))),
            ("/chat/completions", Some((OpenAi, Ended))),
            ("/v1/completions", Some((OpenAi, Ended))),
            ("/completions", Some((OpenAi, Unmarked))),
            ("/completion", Some((OpenAi, Unmarked))),
            ("/v1/chat/completions/input_tokens", Some((OpenAi, No))),
            ("/v1/messages", Some((Anthropic, Ended))),
            ("/v1/messages/count_tokens", Some((Anthropic, No))),
            ("/v1/responses", Some((Responses, Ended))),
            ("/responses", Some((Responses, Ended))),
            ("/v1/responses/input_tokens", Some((Responses, No))),
            ("/responses/input_tokens", Some((Responses, No))),
            ("/v1/embeddings", None),
            ("/tokenize", None),
            ("/v1/messages/", None),
            ("/v1/Messages", None),
            ("/messages", None),
            ("", None),
        ] {
            let got = Route::of(path).map(|r| (r.protocol, r.streams));
            assert_eq!(got, route, "{path}");
        }
    }

    #[test]
    fn the_apis_whose_clients_count_events_keep_them_with_events() {
        use ApiProtocol::*;
        for (api, keepalive) in [
            (OpenAi, KeepAlive::Comments),
            (Anthropic, KeepAlive::Events(Opens::Message)),
            (Responses, KeepAlive::Events(Opens::Response)),
        ] {
            assert_eq!(api.spec().keepalive, keepalive, "{api:?}");
            let opening = crate::http::keepalive::opening(api, b"{}");
            assert_eq!(
                opening.is_some(),
                keepalive != KeepAlive::Comments,
                "{api:?}"
            );
        }
    }

    #[test]
    fn the_table_is_one_row_per_protocol_and_one_protocol_per_path() {
        let mut paths = std::collections::HashSet::new();
        for (i, spec) in SPECS.iter().enumerate() {
            assert!(std::ptr::eq(spec.protocol.spec(), &SPECS[i]));
            assert_eq!(spec.protocol, ApiProtocol::ALL[i]);
            for (path, _) in spec.paths {
                assert!(paths.insert(*path), "{path} is in two rows");
                assert_eq!(ApiProtocol::of(path), Some(spec.protocol), "{path}");
            }
        }
    }

    fn data_of(event: &Bytes) -> Value {
        let text = std::str::from_utf8(event).unwrap();
        assert!(text.ends_with("\n\n"), "{text:?}");
        let data = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        serde_json::from_str(data).unwrap()
    }

    fn cut(message: &str) -> Failure<'_> {
        Failure {
            message,
            kind: "server_error",
            code: json!("engine_failed"),
            status: None,
        }
    }

    #[test]
    fn a_cut_stream_is_told_in_each_protocols_error_event() {
        let f = cut("the engine broke off the answer: x");
        let e = ApiProtocol::OpenAi.error_event(&f);
        assert_eq!(
            &e[..],
            &br#"data: {"error":{"code":"engine_failed","message":"the engine broke off the answer: x","type":"server_error"}}"#
                .iter()
                .chain(b"\n\n")
                .copied()
                .collect::<Vec<u8>>()[..]
        );
        let e = ApiProtocol::Anthropic.error_event(&f);
        assert!(e.starts_with(b"event: error\ndata: "), "{e:?}");
        assert_eq!(
            data_of(&e),
            json!({"type": "error", "error": {"type": "api_error",
                   "message": "the engine broke off the answer: x",
                   "details": {"error_code": "engine_failed"}}})
        );
        let e = ApiProtocol::Responses.error_event(&f);
        assert!(e.starts_with(b"event: error\ndata: "), "{e:?}");
        let v = data_of(&e);
        assert_eq!(v["type"], "error");
        assert_eq!(v["code"], "engine_failed");
        assert_eq!(v["message"], "the engine broke off the answer: x");
        assert_eq!(v["sequence_number"], 0);
        assert_eq!(v["error"]["message"], "the engine broke off the answer: x");
        assert_eq!(v["error"]["type"], "server_error");
        // Each is one event, leaving the stream between events.
        for p in [
            ApiProtocol::OpenAi,
            ApiProtocol::Anthropic,
            ApiProtocol::Responses,
        ] {
            let e = p.error_event(&f);
            let mut reader = crate::http::events::Reader::new();
            let mut events = 0;
            reader.feed(&e, |_| events += 1);
            assert_eq!(
                (events, reader.place()),
                (1, crate::http::events::Place::Between)
            );
        }
    }

    #[test]
    fn anthropic_errors_have_anthropics_types_by_status() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (405, "invalid_request_error"),
            (408, "timeout_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ] {
            let f = Failure {
                message: "m",
                kind: "unavailable_error",
                code: json!("queue_full"),
                status: Some(status),
            };
            let v: Value = serde_json::from_slice(&ApiProtocol::Anthropic.error_body(&f)).unwrap();
            assert_eq!(v["type"], "error", "{status}");
            assert_eq!(v["error"]["type"], kind, "{status}");
            assert_eq!(v["error"]["message"], "m");
            assert_eq!(v["error"]["details"]["error_code"], "queue_full");
        }
        // An engine's own Anthropic type stays.
        let f = Failure {
            message: "m",
            kind: "overloaded_error",
            code: json!(500),
            status: Some(500),
        };
        let v: Value = serde_json::from_slice(&ApiProtocol::Anthropic.error_body(&f)).unwrap();
        assert_eq!(v["error"]["type"], "overloaded_error");
        assert_eq!(v["error"].get("details"), None);
    }

    #[test]
    fn openai_and_responses_bodies_are_openais_shape() {
        let f = Failure {
            message: "invalid API key",
            kind: "invalid_request_error",
            code: json!("invalid_api_key"),
            status: Some(401),
        };
        for p in [ApiProtocol::OpenAi, ApiProtocol::Responses] {
            assert_eq!(
                &p.error_body(&f)[..],
                br#"{"error":{"code":"invalid_api_key","message":"invalid API key","type":"invalid_request_error"}}"#
            );
        }
    }
}
