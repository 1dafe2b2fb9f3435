//! Event streams as dsv4d writes into them: where, between an engine's events, a line of its
//! own may go; the comment lines themselves; which requests ask for a stream; and the error
//! event for an engine's error answer (in its protocol's shape: [`crate::http::protocol`]).
//!
//! Owns: [`wants_stream`], [`comment`], [`reasoning_chunk`] (`api.loading_reasoning`) and
//! [`error_event`]. Pure: no I/O, no clock; the body that uses them is
//! [`crate::http::keepalive`], which learns where the stream stands ([`Place`]) from the
//! answer's reader ([`crate::http::events`]).

use bytes::Bytes;
use serde_json::{json, Value};

use crate::http::events::Place;
use crate::http::protocol::{Api, ApiProtocol, Failure};
use crate::observe::stats::value_after_key;

/// The SSE comment line `: text` for a stream at `place` (which must be [`Place::between`]),
/// ended so that the stream is between events after it as before: with a blank line, and
/// with CRs after a blank line ended by CR (an LF the engine sends next then completes the
/// comment's CRLF instead of making a line of its own).
pub fn comment(place: Place, text: &str) -> Bytes {
    let end = match place {
        Place::BetweenCr => "\r\r",
        _ => "\n\n",
    };
    Bytes::from(format!(": {text}{end}"))
}

/// Whether `path` (as the engine routes it) is OpenAI's chat completions, whose streams
/// carry `reasoning_content` deltas.
pub fn is_chat(path: &str) -> bool {
    matches!(path, "/v1/chat/completions" | "/chat/completions")
}

/// The model a request body names (`"model": "..."`), if it names one as text. For
/// `api.loading_reasoning`'s chunks, so read only for a streamed chat request with it on.
pub fn model_of(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        #[serde(default)]
        model: Option<Value>,
    }
    match serde_json::from_slice::<Named>(body).ok()?.model? {
        Value::String(model) => Some(model),
        _ => None,
    }
}

/// A chat stream's event that says `text` as a `reasoning_content` delta, which chat UIs
/// show as the model's thinking (`api.loading_reasoning`): one `data:` event of OpenAI's
/// `chat.completion.chunk` shape, as llama-server sends its own reasoning (there without
/// the role), the text ended by a line so that the next tick's words go on a line of their
/// own. `id` is the stream's (`dsv4-loading-<id>`), `created` the time in Unix seconds.
/// For a stream between events (dsv4d's own head is out and the engine has sent nothing),
/// which it leaves between events.
pub fn reasoning_chunk(id: u64, created: u64, model: &str, text: &str) -> Bytes {
    #[derive(serde::Serialize)]
    struct Chunk<'a> {
        id: String,
        object: &'static str,
        created: u64,
        model: &'a str,
        choices: [Choice<'a>; 1],
    }
    #[derive(serde::Serialize)]
    struct Choice<'a> {
        index: u32,
        delta: Delta<'a>,
        finish_reason: Option<&'static str>,
    }
    #[derive(serde::Serialize)]
    struct Delta<'a> {
        role: &'static str,
        reasoning_content: &'a str,
    }
    let line = format!("{text}\n");
    let chunk = Chunk {
        id: format!("dsv4-loading-{id}"),
        object: "chat.completion.chunk",
        created,
        model,
        choices: [Choice {
            index: 0,
            delta: Delta {
                role: "assistant",
                reasoning_content: &line,
            },
            finish_reason: None,
        }],
    };
    let json = serde_json::to_string(&chunk).expect("a chunk of strings and numbers");
    Bytes::from(format!("data: {json}\n\n"))
}

/// Whether a request body asks for a streamed answer: a JSON object with `"stream": true`.
/// Only a body where some `"stream"` is followed by `: true` is parsed: a top-level
/// `"stream": true` is always written so, and the parse of a chat's body to find
/// `"stream": false` took 2,100 of a plain request's 53,000 instructions (callgrind).
pub fn wants_stream(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Flag {
        #[serde(default)]
        stream: bool,
    }
    // Built once: a one-shot `memmem::find` builds its searcher on every call (~500
    // instructions a request, callgrind).
    static STREAM: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"stream\""));
    let says_true = |at: usize| {
        value_after_key(&body[at + STREAM.needle().len()..]).is_some_and(|v| v.starts_with(b"true"))
    };
    STREAM.find_iter(body).any(says_true)
        && serde_json::from_slice::<Flag>(body).is_ok_and(|f| f.stream)
}

/// The most of an error body that is quoted.
pub const ERROR_BODY_MAX: usize = 16 << 10;

/// The error event, in `protocol`, for an answer of `status` whose body was `body` (of
/// `content_type`), given where dsv4d had sent a stream's head of its own already. The
/// message and type are the body's own when it is an error in OpenAI's shape
/// (`{"error":{"message":...}}`, as llama-server and dsv4d answer), else its text; the
/// status goes along in `code` (unless the body had a code of its own) and in `status`.
pub fn error_event(
    protocol: ApiProtocol,
    status: u16,
    content_type: Option<&str>,
    body: &[u8],
) -> Bytes {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
    let given = match error {
        Some(Value::String(s)) => Some(s.clone()),
        Some(e) => text(e.get("message")),
        None => parsed.as_ref().and_then(|v| text(v.get("message"))),
    };
    let message = given.unwrap_or_else(|| {
        let shown = String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY_MAX)]);
        let shown = shown.trim();
        match (shown.is_empty(), (200..300).contains(&status)) {
            (_, true) => format!(
                "the engine answered {status} with {} where an event stream was asked for",
                content_type.unwrap_or("no content type")
            ),
            (true, false) => format!("the engine answered {status} with no message"),
            (false, false) => shown.to_string(),
        }
    });
    let kind = text(error.and_then(|e| e.get("type"))).unwrap_or_else(|| {
        match status {
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
        .to_string()
    });
    // dsv4d's own code, in OpenAI's shape or in Anthropic's (`details.error_code`).
    let code = error
        .and_then(|e| {
            e.get("code")
                .or_else(|| e.get("details")?.get("error_code"))
        })
        .filter(|c| !c.is_null())
        .cloned()
        .unwrap_or_else(|| json!(status));
    protocol.error_event(&Failure {
        message: &message,
        kind: &kind,
        code,
        status: Some(status),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The place after `pieces`, read as chunks one after the other.
    fn place(pieces: &[&[u8]]) -> Place {
        let mut reader = crate::http::events::Reader::new();
        for p in pieces {
            reader.feed(p, |_| {});
        }
        reader.place()
    }

    #[test]
    fn an_event_ends_at_a_blank_line_of_any_line_end() {
        use Place::*;
        for (bytes, at) in [
            (&b""[..], Between),
            (b"data: x", Within),
            (b"data: x\n", Within),
            (b"data: x\n\n", Between),
            (b"data: x\r\n", Within),
            (b"data: x\r\n\r", BetweenCr),
            (b"data: x\r\n\r\n", Between),
            (b"data: x\r", Within),
            (b"data: x\r\r", BetweenCr),
            (b"data: x\n\r", BetweenCr),
            (b"data: x\r\n\n", Between),
            (b"event: a\ndata: x\n", Within),
            (b"event: a\ndata: x\n\n", Between),
            (b"data: x\n\n\n", Between),
            (b": prefill\n\n", Between),
            (b"data: x\n\ndata: y", Within),
            (b"\n", Between),
            (b"\r", BetweenCr),
        ] {
            let ones: Vec<&[u8]> = bytes.chunks(1).collect();
            for got in [place(&[bytes]), place(&ones)] {
                assert_eq!(got, at, "{:?}", String::from_utf8_lossy(bytes));
            }
        }
    }

    #[test]
    fn split_anywhere_the_place_is_that_of_the_whole() {
        let streams: [&[u8]; 6] = [
            b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n",
            b"data: a\r\n\r\ndata: b\r\n\r\n",
            b"data: a\r\rdata: b\r\r",
            b"event: x\ndata: 1\ndata: 2\n\n: c\n\nevent: y\ndata: 3\n\n",
            b"data: a\n\r\ndata: b\r\n\n\n\r",
            b": prefill\n\n: prefill\n\ndata: x\n\n",
        ];
        for stream in streams {
            // Every prefix, in two pieces split at every point and in one-byte pieces.
            for end in 0..=stream.len() {
                let whole = place(&[&stream[..end]]);
                for cut in 0..=end {
                    let two = place(&[&stream[..cut], &stream[cut..end]]);
                    assert_eq!(two, whole, "{:?} cut at {cut} of {end}", stream);
                }
                let ones: Vec<&[u8]> = stream[..end].chunks(1).collect();
                assert_eq!(place(&ones), whole);
            }
        }
    }

    #[test]
    fn a_comment_goes_only_between_events_and_leaves_the_stream_there() {
        let stream = b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d\n\n";
        let mut between = 0;
        for end in 0..=stream.len() {
            let at = place(&[&stream[..end]]);
            if !at.between() {
                continue;
            }
            between += 1;
            let c = comment(at, "dsv4 loading");
            assert!(c.starts_with(b": dsv4 loading"));
            assert_eq!(place(&[&stream[..end], &c]), at, "after {end}");
            // The events a parser reads are the same with the comment in.
            let mut with = stream[..end].to_vec();
            with.extend_from_slice(&c);
            with.extend_from_slice(&stream[end..]);
            assert_eq!(events(&with), events(stream), "comment at {end}");
        }
        // The start, after each event, and after the CR that may be part of a CRLF.
        assert_eq!(between, 6);
    }

    /// The data of the events in `stream`, as the HTML standard's parser reads them.
    fn events(stream: &[u8]) -> Vec<String> {
        let text = String::from_utf8_lossy(stream).replace("\r\n", "\n");
        let text = text.replace('\r', "\n");
        let (mut out, mut data) = (Vec::new(), Vec::new());
        for line in text.split('\n') {
            if line.is_empty() {
                if !data.is_empty() {
                    out.push(data.join("\n"));
                    data.clear();
                }
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push(d.to_string());
            }
        }
        out
    }

    #[test]
    fn stream_true_alone_asks_for_a_stream() {
        for (body, streamed) in [
            (&br#"{"messages":[],"stream":true}"#[..], true),
            (
                br#"{"stream": true, "messages":[{"content":"\"stream\""}]}"#,
                true,
            ),
            (br#"{"messages":[],"stream":false}"#, false),
            (
                br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#,
                false,
            ),
            (br#"{"messages":[{"content":"\"stream\": true"}]}"#, false),
            (br#"{"stream":"yes"}"#, false),
            (br#"{"stream":true"#, false),
            (b"", false),
            (br#"["stream"]"#, false),
            // Spaces and line ends around the colon, as JSON allows.
            (b"{\"stream\"\n :\r\n\ttrue}", true),
            // A nested "stream": true that is not the request's own.
            (
                br#"{"tools":[{"parameters":{"stream":true}}],"stream":false}"#,
                false,
            ),
            (
                br#"{"tools":[{"parameters":{"stream":true}}],"stream":true}"#,
                true,
            ),
            // A "stream" that is a value, then the request's own key.
            (br#"{"model":"stream","stream" : true}"#, true),
        ] {
            assert_eq!(
                wants_stream(body),
                streamed,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_loading_reasoning_chunk_is_a_chat_chunk_with_the_words_on_a_line() {
        let c = reasoning_chunk(
            7,
            1_700_000_000,
            "dsv4",
            "dsv4 loading 320k: 23s of about 54s",
        );
        assert_eq!(
            &c[..],
            &br#"data: {"id":"dsv4-loading-7","object":"chat.completion.chunk","created":1700000000,"model":"dsv4","choices":[{"index":0,"delta":{"role":"assistant","reasoning_content":"dsv4 loading 320k: 23s of about 54s\n"},"finish_reason":null}]}"#[..]
                .iter()
                .chain(b"\n\n")
                .copied()
                .collect::<Vec<u8>>()[..]
        );
        // A model name of any text stays one JSON string; the stream stays between events.
        for model in ["a\"b", "line\nbreak", "é", ""] {
            let c = reasoning_chunk(1, 0, model, "dsv4 waiting for the engine's answer: 12s");
            assert_eq!(place(&[&c]), Place::Between);
            assert_eq!(c.iter().filter(|&&b| b == b'\n').count(), 2, "{model:?}");
            let v = data_of(&c);
            assert_eq!(v["model"], model);
            assert_eq!(v["object"], "chat.completion.chunk");
            let delta = &v["choices"][0]["delta"];
            assert_eq!(delta["role"], "assistant");
            assert_eq!(
                delta["reasoning_content"],
                "dsv4 waiting for the engine's answer: 12s\n"
            );
            assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
        }
    }

    #[test]
    fn a_body_names_its_model_as_text_or_not_at_all() {
        for (body, model) in [
            (&br#"{"model":"qwen","stream":true}"#[..], Some("qwen")),
            (
                br#"{"stream":true,"messages":[{"content":"\"model\""}]}"#,
                None,
            ),
            (br#"{"model":null}"#, None),
            (br#"{"model":7}"#, None),
            (br#"{"model":"a"#, None),
            (b"", None),
        ] {
            assert_eq!(
                model_of(body).as_deref(),
                model,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(is_chat("/v1/chat/completions") && is_chat("/chat/completions"));
        assert!(!is_chat("/v1/completions") && !is_chat("/completion"));
        assert!(!is_chat("/v1/messages") && !is_chat("/v1/responses"));
    }

    fn data_of(event: &Bytes) -> Value {
        let text = std::str::from_utf8(event).unwrap();
        assert!(text.ends_with("\n\n"), "{text:?}");
        let data = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
        serde_json::from_str(data).unwrap()
    }

    #[test]
    fn an_error_event_carries_the_status_and_message_given() {
        let engine = br#"{"error":{"code":400,"message":"Failed to parse grammar","type":"invalid_request_error"}}"#;
        let e = error_event(ApiProtocol::OpenAi, 400, Some("application/json"), engine);
        assert_eq!(
            data_of(&e),
            json!({"error": {"message": "Failed to parse grammar",
                   "type": "invalid_request_error", "code": 400, "status": 400}})
        );
        // dsv4d's own refusal keeps its code; the status goes along.
        let own = br#"{"error":{"message":"the engine exited","type":"server_error","code":"engine_start_failed"}}"#;
        let e = error_event(ApiProtocol::OpenAi, 503, Some("application/json"), own);
        let v = data_of(&e);
        assert_eq!(v["error"]["code"], "engine_start_failed");
        assert_eq!(v["error"]["status"], 503);
        assert_eq!(v["error"]["message"], "the engine exited");
        // Text, nothing, and a success that is not a stream.
        let e = error_event(ApiProtocol::OpenAi, 500, Some("text/plain"), b" oops\n");
        assert_eq!(data_of(&e)["error"]["message"], "oops");
        assert_eq!(data_of(&e)["error"]["type"], "server_error");
        let e = error_event(ApiProtocol::OpenAi, 502, None, b"");
        assert_eq!(
            data_of(&e)["error"]["message"],
            "the engine answered 502 with no message"
        );
        let e = error_event(ApiProtocol::OpenAi, 200, Some("application/json"), b"{}");
        assert_eq!(
            data_of(&e)["error"]["message"],
            "the engine answered 200 with application/json where an event stream was asked for"
        );
        // The other protocols' shapes.
        let e = error_event(ApiProtocol::Anthropic, 400, None, engine);
        assert!(e.starts_with(b"event: error\ndata: "));
        assert_eq!(
            data_of(&e),
            json!({"type": "error", "error": {"type": "invalid_request_error",
                   "message": "Failed to parse grammar"}})
        );
        let e = error_event(ApiProtocol::Responses, 503, None, b"");
        assert!(e.starts_with(b"event: error\ndata: "));
        let v = data_of(&e);
        assert_eq!(
            (v["type"].clone(), v["code"].clone()),
            (json!("error"), json!("503"))
        );
        // With OpenAI's error object beside, which the openai package raises.
        assert_eq!(v["error"]["status"], 503);
        assert_eq!(
            v["error"]["message"],
            "the engine answered 503 with no message"
        );
    }
}
