//! Deterministic "generation" for the fake engine, plus the JSON builders for
//! every response shape it speaks (OpenAI chat/text completions, llama.cpp's
//! native `/completion`, SSE framing and llama-style error bodies).
//!
//! Nothing here does I/O or sleeps: pacing lives in `server.rs`. Keeping the
//! content rules pure makes them easy to unit-test and easy for integration
//! tests to predict:
//!
//! * chat: token `i` (0-based) is the letter `a + (i mod 26)`, one char per token;
//! * completions: if the prompt ends with a digit `d`, the tokens are
//!   `d+1 ..= 9` and generation stops ("stop"); otherwise letters as for chat.

use bytes::Bytes;
use serde_json::{json, Value};

/// `max_tokens` used when the request does not say (or says something odd).
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// Upper bound on tokens per response, so a silly request cannot exhaust memory.
pub const MAX_TOKENS_CAP: u64 = 1_000_000;

/// The letter produced as token `i` of a letter sequence.
pub fn letter(i: u64) -> char {
    // `i % 26` is < 26, so the cast cannot truncate.
    char::from(b'a' + (i % 26) as u8)
}

/// The tokens of a prompt that ends with `fields`, in turn.
pub const FIELDS: [&str; 3] = ["data: data: x", " event: message_stop", " data: [DONE]"];

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// Ran into `max_tokens` / `n_predict`.
    Length,
    /// Reached a natural end (the digit rule ran out of digits).
    Stop,
}

impl Finish {
    /// OpenAI `finish_reason`.
    pub fn reason(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
        }
    }

    /// llama.cpp native `stop_type`.
    pub fn stop_type(self) -> &'static str {
        match self {
            Finish::Length => "limit",
            Finish::Stop => "eos",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Letters,
    /// Tokens whose text is what an event stream's fields look like ([`FIELDS`]), so that a
    /// reader that counts lines by their look, not by the grammar, miscounts.
    Fields,
    /// Digits starting at `first` (1..=9).
    Digits {
        first: u8,
    },
}

/// What a response will contain, computed up front; tokens are produced lazily.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    kind: Kind,
    count: u64,
    finish: Finish,
}

impl Plan {
    /// `max_tokens` letters, finishing with "length".
    pub fn letters(max_tokens: u64) -> Plan {
        Plan {
            kind: Kind::Letters,
            count: max_tokens.min(MAX_TOKENS_CAP),
            finish: Finish::Length,
        }
    }

    /// The chat rule: a last message that ends with `fields` is answered with [`FIELDS`],
    /// anything else with letters.
    pub fn for_chat(last: Option<&str>, max_tokens: u64) -> Plan {
        match last {
            Some(text) if text.ends_with("fields") => Plan {
                kind: Kind::Fields,
                count: max_tokens.min(MAX_TOKENS_CAP),
                finish: Finish::Length,
            },
            _ => Plan::letters(max_tokens),
        }
    }

    /// The completion rule: a trailing digit `d` yields `d+1 ..= 9` then "stop"
    /// (cut short with "length" if `max_tokens` is smaller); otherwise letters.
    pub fn for_prompt(prompt: &str, max_tokens: u64) -> Plan {
        let max_tokens = max_tokens.min(MAX_TOKENS_CAP);
        if prompt.ends_with("fields") {
            return Plan::for_chat(Some(prompt), max_tokens);
        }
        match prompt.chars().last().and_then(|c| c.to_digit(10)) {
            Some(d) => {
                // d <= 9, so these casts are lossless.
                let natural = u64::from(9 - d);
                let (count, finish) = if natural <= max_tokens {
                    (natural, Finish::Stop)
                } else {
                    (max_tokens, Finish::Length)
                };
                Plan {
                    kind: Kind::Digits { first: d as u8 + 1 },
                    count,
                    finish,
                }
            }
            None => Plan::letters(max_tokens),
        }
    }

    /// Number of tokens in the response.
    pub fn len(&self) -> u64 {
        self.count
    }

    pub fn finish(&self) -> Finish {
        self.finish
    }

    /// Token `i` (0-based). Only meaningful for `i < len()`.
    pub fn token(&self, i: u64) -> std::borrow::Cow<'static, str> {
        match self.kind {
            Kind::Letters => letter(i).to_string().into(),
            Kind::Fields => FIELDS[(i % 3) as usize].into(),
            Kind::Digits { first } => {
                let d = u64::from(first).saturating_add(i).min(9);
                char::from(b'0' + d as u8).to_string().into()
            }
        }
    }

    /// The whole content at once.
    #[cfg(test)]
    pub fn content(&self) -> String {
        (0..self.count).map(|i| self.token(i)).collect()
    }
}

/// Reads a token budget from the first present field among `keys`. Negative
/// values (llama's `-1` = "until done") and non-integers fall back to the default.
pub fn max_tokens(body: &Value, keys: &[&str]) -> u64 {
    for key in keys {
        if let Some(v) = body.get(*key) {
            if v.is_null() {
                continue;
            }
            return match v.as_u64() {
                Some(n) => n.min(MAX_TOKENS_CAP),
                None => DEFAULT_MAX_TOKENS,
            };
        }
    }
    DEFAULT_MAX_TOKENS
}

/// Number of characters in all message contents (string contents, or the
/// `text` of content parts).
/// Prompt tokens an image part counts for.
pub const IMAGE_TOKENS: u64 = 256;

pub fn chat_prompt_chars(messages: &[Value]) -> u64 {
    let mut n: u64 = 0;
    for m in messages {
        match m.get("content") {
            Some(Value::String(s)) => n += s.chars().count() as u64,
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        n += t.chars().count() as u64;
                    }
                    // An image is some hundreds of tokens to a vision projector.
                    if p.get("type").and_then(Value::as_str) == Some("image_url") {
                        n += IMAGE_TOKENS;
                    }
                }
            }
            _ => {}
        }
    }
    n
}

/// The prompt of a completion request as text: a string, or an array of strings
/// joined together. Anything else is not a prompt.
pub fn prompt_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        // Token ids, as `/tokenize` gives them: one character each.
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => items
            .iter()
            .map(|t| t.as_u64().and_then(|t| char::from_u32(t as u32)))
            .collect(),
        Value::Array(items) => {
            let mut out = String::new();
            for it in items {
                out.push_str(it.as_str()?);
            }
            Some(out)
        }
        _ => None,
    }
}

/// `/tokenize`: one token per character, its code point as the id.
pub fn tokenize(text: &str) -> Value {
    let tokens: Vec<u32> = text.chars().map(u32::from).collect();
    serde_json::json!({ "tokens": tokens })
}

/// llama-server's `timings` object.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    pub cache_n: u64,
    pub prompt_n: u64,
    pub prompt_ms: f64,
    pub predicted_n: u64,
    pub predicted_ms: f64,
}

fn per_second(n: u64, ms: f64) -> f64 {
    let v = if ms > 0.0 {
        n as f64 * 1000.0 / ms
    } else {
        0.0
    };
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

impl Timings {
    pub fn to_json(self) -> Value {
        json!({
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": if self.prompt_n > 0 { self.prompt_ms / self.prompt_n as f64 } else { 0.0 },
            "prompt_per_second": per_second(self.prompt_n, self.prompt_ms),
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": if self.predicted_n > 0 { self.predicted_ms / self.predicted_n as f64 } else { 0.0 },
            "predicted_per_second": per_second(self.predicted_n, self.predicted_ms),
        })
    }

    fn usage(self) -> Value {
        let prompt = self.prompt_n + self.cache_n;
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.predicted_n,
            "total_tokens": prompt + self.predicted_n,
        })
    }
}

/// Identity of one response, shared by all its chunks.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// Which API a generation request came in through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Text,
    /// `POST /completion` (llama.cpp native)
    Native,
    /// `POST /v1/messages` (Anthropic's Messages)
    Anthropic,
    /// `POST /v1/responses` (OpenAI's Responses)
    Responses,
}

impl Flavor {
    /// Prefix for response ids.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Flavor::Chat => "chatcmpl-",
            Flavor::Text | Flavor::Native => "cmpl-",
            Flavor::Anthropic => "msg_",
            Flavor::Responses => "resp_",
        }
    }

    /// Whether a stream ends with `data: [DONE]`.
    pub fn ends_with_done(self) -> bool {
        matches!(self, Flavor::Chat | Flavor::Text)
    }

    /// One event of a stream: named by its type in the protocols whose events have names.
    pub fn sse(self, v: &Value) -> Bytes {
        match (self, v.get("type").and_then(Value::as_str)) {
            (Flavor::Anthropic | Flavor::Responses, Some(kind)) => {
                Bytes::from(format!("event: {kind}\ndata: {v}\n\n"))
            }
            _ => sse_data(v),
        }
    }

    /// The events before the first token (none for OpenAI's and llama's own).
    pub fn opening(self, meta: &Meta) -> Vec<Value> {
        match self {
            Flavor::Anthropic => vec![
                json!({"type": "message_start", "message": {
                    "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 0, "output_tokens": 0}}}),
                json!({"type": "content_block_start", "index": 0,
                       "content_block": {"type": "text", "text": ""}}),
            ],
            Flavor::Responses => vec![json!({"type": "response.created", "sequence_number": 0,
                "response": {"id": meta.id, "object": "response", "created_at": meta.created,
                             "status": "in_progress", "model": meta.model, "output": []}})],
            _ => vec![],
        }
    }

    /// The events after the last token: Anthropic's and Responses' (with the whole text
    /// `content`), or the last chunk of the others.
    pub fn closing(self, meta: &Meta, content: &str, finish: Finish, t: &Timings) -> Vec<Value> {
        match self {
            Flavor::Anthropic => vec![
                json!({"type": "content_block_stop", "index": 0}),
                json!({"type": "message_delta",
                       "delta": {"stop_reason": anthropic_stop(finish), "stop_sequence": null},
                       "usage": {"output_tokens": t.predicted_n}}),
                json!({"type": "message_stop"}),
            ],
            Flavor::Responses => vec![json!({"type": "response.completed",
                "sequence_number": t.predicted_n + 1,
                "response": self.full(meta, content, finish, t)})],
            _ => vec![self.final_chunk(meta, finish, t)],
        }
    }

    /// One streamed token.
    pub fn chunk(self, meta: &Meta, text: &str) -> Value {
        match self {
            Flavor::Chat => json!({
                "id": meta.id,
                "object": "chat.completion.chunk",
                "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}],
            }),
            Flavor::Text => json!({
                "id": meta.id,
                "object": "text_completion",
                "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": null}],
            }),
            Flavor::Native => json!({"content": text, "stop": false}),
            Flavor::Anthropic => json!({"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}}),
            Flavor::Responses => json!({"type": "response.output_text.delta",
                "item_id": "msg_0", "output_index": 0, "content_index": 0, "delta": text}),
        }
    }

    /// The last chunk of a stream: no content, a finish reason and timings.
    pub fn final_chunk(self, meta: &Meta, finish: Finish, t: &Timings) -> Value {
        match self {
            Flavor::Chat => json!({
                "id": meta.id,
                "object": "chat.completion.chunk",
                "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "delta": {}, "finish_reason": finish.reason()}],
                "usage": t.usage(),
                "timings": t.to_json(),
            }),
            Flavor::Text => json!({
                "id": meta.id,
                "object": "text_completion",
                "created": meta.created,
                "model": meta.model,
                "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": finish.reason()}],
                "usage": t.usage(),
                "timings": t.to_json(),
            }),
            Flavor::Anthropic | Flavor::Responses => {
                unreachable!("their streams close with `closing`")
            }
            Flavor::Native => json!({
                "content": "",
                "stop": true,
                "stop_type": finish.stop_type(),
                "model": meta.model,
                "tokens_predicted": t.predicted_n,
                "tokens_evaluated": t.prompt_n + t.cache_n,
                "timings": t.to_json(),
            }),
        }
    }

    /// A complete non-streamed response.
    pub fn full(self, meta: &Meta, content: &str, finish: Finish, t: &Timings) -> Value {
        match self {
            Flavor::Chat => json!({
                "id": meta.id,
                "object": "chat.completion",
                "created": meta.created,
                "model": meta.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish.reason(),
                }],
                "usage": t.usage(),
                "timings": t.to_json(),
            }),
            Flavor::Text => json!({
                "id": meta.id,
                "object": "text_completion",
                "created": meta.created,
                "model": meta.model,
                "choices": [{
                    "index": 0,
                    "text": content,
                    "logprobs": null,
                    "finish_reason": finish.reason(),
                }],
                "usage": t.usage(),
                "timings": t.to_json(),
            }),
            Flavor::Anthropic => json!({
                "id": meta.id,
                "type": "message",
                "role": "assistant",
                "model": meta.model,
                "content": [{"type": "text", "text": content}],
                "stop_reason": anthropic_stop(finish),
                "stop_sequence": null,
                "usage": {"input_tokens": t.prompt_n, "output_tokens": t.predicted_n},
            }),
            Flavor::Responses => json!({
                "id": meta.id,
                "object": "response",
                "created_at": meta.created,
                "status": "completed",
                "model": meta.model,
                "output": [{"type": "message", "id": "msg_0", "role": "assistant",
                            "status": "completed",
                            "content": [{"type": "output_text", "text": content,
                                         "annotations": []}]}],
                "usage": {"input_tokens": t.prompt_n, "output_tokens": t.predicted_n,
                          "total_tokens": t.prompt_n + t.predicted_n},
            }),
            Flavor::Native => json!({
                "content": content,
                "id_slot": 0,
                "stop": true,
                "stop_type": finish.stop_type(),
                "model": meta.model,
                "tokens_predicted": t.predicted_n,
                "tokens_evaluated": t.prompt_n + t.cache_n,
                "timings": t.to_json(),
            }),
        }
    }
}

/// Anthropic's `stop_reason` for `finish`.
fn anthropic_stop(finish: Finish) -> &'static str {
    match finish.reason() {
        "length" => "max_tokens",
        _ => "end_turn",
    }
}

/// One SSE event carrying `v`.
pub fn sse_data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The OpenAI end-of-stream marker.
pub fn sse_done() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// An SSE comment line (ignored by clients, keeps the connection busy).
pub fn sse_comment(text: &str) -> Bytes {
    Bytes::from(format!(": {text}\n\n"))
}

/// llama-server's error body.
pub fn error_body(code: u16, message: &str, kind: &str) -> Value {
    json!({"error": {"code": code, "message": message, "type": kind}})
}

/// `GET /v1/models`.
pub fn models_list(model: &str) -> Value {
    json!({
        "object": "list",
        "data": [{"id": model, "object": "model", "owned_by": "fake-engine"}],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_are_deterministic() {
        assert_eq!(Plan::letters(8).content(), "abcdefgh");
        assert_eq!(Plan::letters(8).content(), Plan::letters(8).content());
        let long = Plan::letters(28).content();
        assert_eq!(&long[24..], "yzab");
        assert_eq!(Plan::letters(0).content(), "");
        assert_eq!(Plan::letters(3).finish(), Finish::Length);
    }

    #[test]
    fn digit_rule() {
        let p = Plan::for_prompt("count: 5", 16);
        assert_eq!(p.content(), "6789");
        assert_eq!(p.finish(), Finish::Stop);
        assert_eq!(p.len(), 4);

        let p = Plan::for_prompt("0", 4);
        assert_eq!(p.content(), "1234");
        assert_eq!(p.finish(), Finish::Length);

        let p = Plan::for_prompt("9", 16);
        assert_eq!(p.content(), "");
        assert_eq!(p.finish(), Finish::Stop);

        let p = Plan::for_prompt("hello", 5);
        assert_eq!(p.content(), "abcde");
        assert_eq!(p.finish(), Finish::Length);

        // Non-ASCII digits are not the digit rule, and must not panic.
        assert_eq!(Plan::for_prompt("٣", 2).content(), "ab");
        assert_eq!(Plan::for_prompt("", 2).content(), "ab");
    }

    #[test]
    fn max_tokens_parsing() {
        let body = json!({"max_tokens": 8});
        assert_eq!(max_tokens(&body, &["max_tokens"]), 8);
        let body = json!({"n_predict": -1});
        assert_eq!(
            max_tokens(&body, &["n_predict", "max_tokens"]),
            DEFAULT_MAX_TOKENS
        );
        let body = json!({"max_tokens": null, "n_predict": 3});
        assert_eq!(max_tokens(&body, &["max_tokens", "n_predict"]), 3);
        let body = json!({"max_tokens": "lots"});
        assert_eq!(max_tokens(&body, &["max_tokens"]), DEFAULT_MAX_TOKENS);
        assert_eq!(max_tokens(&json!({}), &["max_tokens"]), DEFAULT_MAX_TOKENS);
        let body = json!({"max_tokens": u64::MAX});
        assert_eq!(max_tokens(&body, &["max_tokens"]), MAX_TOKENS_CAP);
    }

    #[test]
    fn prompt_chars() {
        let msgs = vec![
            json!({"role": "system", "content": "abc"}),
            json!({"role": "user", "content": [{"type": "text", "text": "héllo"}]}),
            json!({"role": "user"}),
        ];
        assert_eq!(chat_prompt_chars(&msgs), 8);
    }

    #[test]
    fn sse_framing_and_timings() {
        let meta = Meta {
            id: "chatcmpl-1".into(),
            created: 1,
            model: "m".into(),
        };
        let ev = sse_data(&Flavor::Chat.chunk(&meta, "a"));
        let s = std::str::from_utf8(&ev).unwrap();
        assert!(s.starts_with("data: {") && s.ends_with("}\n\n"));
        let v: Value = serde_json::from_str(&s[6..]).unwrap();
        assert_eq!(v["choices"][0]["delta"]["content"], "a");

        let t = Timings {
            prompt_n: 4,
            predicted_n: 2,
            ..Timings::default()
        };
        let j = t.to_json();
        assert_eq!(j["prompt_per_second"], 0.0);
        let fin = Flavor::Native.final_chunk(&meta, Finish::Stop, &t);
        assert_eq!(fin["stop"], true);
        assert_eq!(fin["content"], "");
    }
}
