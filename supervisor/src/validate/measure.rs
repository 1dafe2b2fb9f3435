//! How the suite asks an engine for its figures.
//!
//! llama-server's native `/completion` answers with `timings` (prompt and generation
//! milliseconds, token counts) and `cache_prompt: false` makes every run cold; its
//! `/tokenize` gives prompts of an exact length. ds4-server speaks only the OpenAI API: its
//! figures are taken here from a streamed `/v1/completions`, the time to the first token
//! (prefill) and from the first to the last (decode), with the token counts of the `usage`
//! it sends at the end; its prompts are text measured by its own count, and each run's
//! begins with a mark of its own so that no cached prefix serves it beyond the opening of
//! the chat template it renders every prompt in.

use std::time::Duration;

use dsv4_client::validate::RunDetail;
use dsv4_engine::{EngineKind, ValidationApi};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::kv::engine::Engine as _;
use crate::lifecycle::engine_ref::EngineRef;

use super::{DECODE_PROMPT, DECODE_TOKENS};

/// The longest a streamed run may take, as for a native one.
const STREAM_TIMEOUT: Duration = Duration::from_secs(3600);

/// How close a text prompt's count must come to the asked length (the engine's tokenizer is
/// not reachable: the text is cut to measure).
const TEXT_PROMPT_SLACK: f64 = 0.02;

/// The filler text prompts are made of.
const TEXT: &str = "The quick brown fox jumps over the lazy dog while the five boxing \
                    wizards jump quickly and a sphinx of black quartz judges my vow. ";

/// The API the figures come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    /// llama-server's native endpoints.
    Native,
    /// The OpenAI API, timed from the stream (ds4-server).
    Streamed,
}

/// A prompt of a length measured by the engine.
pub(super) enum Prompt {
    /// Token ids (native).
    Tokens(Vec<u64>),
    /// Text (streamed): its count, as the engine gave it.
    Text(String),
}

impl Api {
    /// The API an engine of this kind is measured through; `None` for one that serves none.
    pub(super) fn of(engine: EngineKind) -> Option<Api> {
        match engine.describe().validation {
            ValidationApi::Native => Some(Api::Native),
            ValidationApi::Streamed => Some(Api::Streamed),
            ValidationApi::Lends => None,
        }
    }

    /// The decode test's run: a short prompt and [`DECODE_TOKENS`] generated (fewer if the
    /// model ends its answer: ds4-server has no `ignore_eos`).
    pub(super) async fn decode(self, engine: &EngineRef, run: u32) -> Result<Done, String> {
        match self {
            Api::Native => {
                let body = json!({
                    "prompt": DECODE_PROMPT,
                    "n_predict": DECODE_TOKENS,
                    "ignore_eos": true,
                    "cache_prompt": false,
                });
                complete(engine, body).await
            }
            Api::Streamed => {
                let prompt = format!("{} {DECODE_PROMPT}", mark(run));
                streamed(engine, &prompt, DECODE_TOKENS).await
            }
        }
    }

    /// A prompt of `n` tokens, as the engine counts them.
    pub(super) async fn prompt(self, engine: &EngineRef, n: u64) -> Result<Prompt, String> {
        match self {
            Api::Native => exact_prompt(engine, n).await.map(Prompt::Tokens),
            Api::Streamed => text_prompt(engine, n).await.map(Prompt::Text),
        }
    }

    /// One cold run of `prompt`, with `n_predict` tokens generated.
    pub(super) async fn prefill(
        self,
        engine: &EngineRef,
        prompt: &Prompt,
        n_predict: u64,
        run: u32,
    ) -> Result<Done, String> {
        match prompt {
            Prompt::Tokens(ids) => {
                let body = json!({"prompt": ids, "n_predict": n_predict, "cache_prompt": false});
                complete(engine, body).await
            }
            Prompt::Text(text) => {
                let text = format!("{} {text}", mark(run));
                streamed(engine, &text, n_predict).await
            }
        }
    }
}

/// What starts a streamed run's prompt: its own, so that the engine finds no cached prefix
/// (the same width each time, so the count stays the same).
fn mark(run: u32) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("Run {:08x}.", nanos ^ run.rotate_left(16))
}

pub(super) fn rate(tokens: u64, ms: f64) -> f64 {
    if ms > 0.0 {
        tokens as f64 * 1000.0 / ms
    } else {
        0.0
    }
}

/// One completion's figures.
pub(super) struct Done {
    pub detail: RunDetail,
    /// Until the first generated token.
    pub prompt_ms: f64,
    /// Tokens generated over `predicted_ms`.
    pub predicted_n: u64,
    pub predicted_ms: f64,
}

async fn complete(engine: &EngineRef, body: Value) -> Result<Done, String> {
    timed(engine, "/completion", body).await
}

pub(super) async fn chat(engine: &EngineRef, body: Value) -> Result<Done, String> {
    timed(engine, "/v1/chat/completions", body).await
}

/// A request whose answer carries llama-server's `timings`.
async fn timed(engine: &EngineRef, path: &str, body: Value) -> Result<Done, String> {
    let v: Value = engine
        .call_json(http::Method::POST, path, Some(body))
        .await?;
    let t = &v["timings"];
    let n = |k: &str| t[k].as_u64().unwrap_or(0);
    let f = |k: &str| t[k].as_f64().unwrap_or(0.0);
    if t.is_null() {
        return Err("the engine's answer has no timings".into());
    }
    Ok(Done {
        detail: RunDetail {
            prompt_n: n("prompt_n"),
            cache_n: n("cache_n"),
            predicted_n: n("predicted_n"),
            ..RunDetail::default()
        },
        prompt_ms: f("prompt_ms"),
        predicted_n: n("predicted_n"),
        predicted_ms: f("predicted_ms"),
    })
}

/// The vision test's image: 512 x 512 pixels of colour gradients and a white grid every 64
/// pixels (a photo-like image of the size a vision projector tiles), as a PNG in a data URI.
/// The PNG (4,349 bytes, each row filtered by Sub or Up) is kept base64-encoded beside this
/// file, so that no image or base64 code is linked into dsv4d for it; the test below decodes
/// it and checks every pixel against the formula.
pub(super) fn test_image_uri() -> String {
    format!(
        "data:image/png;base64,{}",
        include_str!("test-image.png.b64").trim()
    )
}

/// One image and a question, cold; `decode`: 256 tokens generated, else one.
pub(super) fn vision_request(image: &str, decode: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture in detail."},
            {"type": "image_url", "image_url": {"url": image}},
        ]}],
        "max_tokens": if decode { DECODE_TOKENS } else { 1 },
        "ignore_eos": decode,
        "cache_prompt": false,
    })
}

pub(super) async fn build_info(engine: &EngineRef) -> Result<String, String> {
    let v: Value = engine.call_json(http::Method::GET, "/props", None).await?;
    Ok(v["build_info"].as_str().unwrap_or_default().to_string())
}

/// Exactly `n` token ids of ordinary text, from the engine's own tokenizer.
async fn exact_prompt(engine: &EngineRef, n: u64) -> Result<Vec<u64>, String> {
    let mut text = TEXT.repeat(64);
    loop {
        let v: Value = engine
            .call_json(
                http::Method::POST,
                "/tokenize",
                Some(json!({"content": text, "add_special": false})),
            )
            .await?;
        let tokens: Vec<u64> = v["tokens"]
            .as_array()
            .ok_or("the engine's /tokenize answered no tokens")?
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        if tokens.len() as u64 >= n {
            return Ok(tokens[..n as usize].to_vec());
        }
        if tokens.is_empty() {
            return Err("the engine's /tokenize answered no tokens".into());
        }
        let factor = (n as usize / tokens.len()).max(1) + 1;
        text = text.repeat(factor);
    }
}

/// A text prompt of `n` tokens (within [`TEXT_PROMPT_SLACK`] or one token, its mark
/// included), measured by the engine's own count: one short run per try, the length found
/// by the secant through the last two counts (a count is the text's tokens and a constant:
/// the mark, the engine's own start token).
async fn text_prompt(engine: &EngineRef, n: u64) -> Result<String, String> {
    let text_of = |chars: usize| -> String { TEXT.chars().cycle().take(chars).collect() };
    let count = |chars: usize| async move {
        let prompt = format!("{} {}", mark(0), text_of(chars));
        match streamed(engine, &prompt, 1).await?.detail.prompt_n {
            0 => Err("the engine counted no prompt tokens (usage.prompt_tokens)".to_string()),
            got => Ok(got as f64),
        }
    };
    let target = n as f64;
    let slack = (target * TEXT_PROMPT_SLACK).max(1.0);
    // A character is at most a token: the first tries cost at most `n` tokens of prefill
    // each, and a tokenizer of several characters a token is reached by the secant.
    let mut before = ((n as usize / 2).max(8), 0.0);
    before.1 = count(before.0).await?;
    let mut last = (n as usize).max(16);
    let mut last_got = count(last).await?;
    for _ in 0..8 {
        if (last_got - target).abs() <= slack {
            return Ok(text_of(last));
        }
        let slope = (last_got - before.1) / (last as f64 - before.0 as f64);
        if !slope.is_finite() || slope <= 0.0 {
            break;
        }
        let next = (last as f64 + (target - last_got) / slope).round().max(1.0) as usize;
        if next == last {
            break;
        }
        before = (last, last_got);
        last = next;
        last_got = count(last).await?;
    }
    if (last_got - target).abs() <= slack {
        return Ok(text_of(last));
    }
    Err(format!(
        "could not make a prompt of {n} tokens from text (the engine counted {last_got} for \
         the nearest)"
    ))
}

/// One streamed `/v1/completions` run of `prompt` with `max_tokens` generated, timed from
/// its chunks, with the counts of its closing `usage`.
async fn streamed(engine: &EngineRef, prompt: &str, max_tokens: u64) -> Result<Done, String> {
    let body = json!({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let work = async {
        let sent = Instant::now();
        let resp = engine
            .send(http::Method::POST, "/v1/completions", Some(body))
            .await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != http::StatusCode::OK {
            let bytes = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let text: String = String::from_utf8_lossy(&bytes).chars().take(200).collect();
            return Err(format!("/v1/completions: {status}: {text}"));
        }
        let mut reader = Stream::default();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("the engine's stream broke off: {e}"))?;
            if let Some(data) = frame.data_ref() {
                if reader.feed(data, Instant::now()) {
                    break;
                }
            }
        }
        reader.done(sent)
    };
    tokio::time::timeout(STREAM_TIMEOUT, work)
        .await
        .map_err(|_| "the engine's stream did not end".to_string())?
}

/// What a streamed completion has said so far.
#[derive(Default)]
struct Stream {
    pending: Vec<u8>,
    /// When the first and the last generated text came.
    first: Option<Instant>,
    last: Option<Instant>,
    usage: Option<Value>,
}

impl Stream {
    /// Takes in `data`, come at `now`; `true` once the stream said `[DONE]`.
    fn feed(&mut self, data: &[u8], now: Instant) -> bool {
        self.pending.extend_from_slice(data);
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    return true;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                if !text.is_empty() {
                    self.first.get_or_insert(now);
                    self.last = Some(now);
                }
                if v["usage"].is_object() {
                    self.usage = Some(v["usage"].clone());
                }
            }
        }
        false
    }

    /// The run's figures, for a request sent at `sent`.
    fn done(self, sent: Instant) -> Result<Done, String> {
        let usage = self
            .usage
            .ok_or("the engine's stream ended without its usage (stream_options.include_usage)")?;
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        let generated = n(&usage["completion_tokens"]);
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let (first, last) = match (self.first, self.last) {
            (Some(f), Some(l)) => (f, l),
            _ => return Err("the engine's stream held no generated text".into()),
        };
        Ok(Done {
            detail: RunDetail {
                prompt_n: n(&usage["prompt_tokens"]),
                cache_n: n(&usage["prompt_tokens_details"]["cached_tokens"]),
                predicted_n: generated,
                ..RunDetail::default()
            },
            prompt_ms: ms(first - sent),
            // The first token came with the prefill; the rest over the time after it.
            predicted_n: generated.saturating_sub(1),
            predicted_ms: ms(last - first),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn the_test_image_is_the_512_pixel_gradient_and_grid() {
        let uri = test_image_uri();
        let data = uri.strip_prefix("data:image/png;base64,").unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data)
            .unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let info = reader.info().clone();
        assert_eq!((info.width, info.height), (512, 512));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
        reader.next_frame(&mut pixels).unwrap();
        for y in 0..512usize {
            for x in 0..512usize {
                let want = if x % 64 < 2 || y % 64 < 2 {
                    [255, 255, 255]
                } else {
                    [(x / 2) as u8, (y / 2) as u8, ((x + y) / 4) as u8]
                };
                let at = (y * 512 + x) * 3;
                assert_eq!(pixels[at..at + 3], want, "pixel {x},{y}");
            }
        }
    }

    #[test]
    fn a_stream_is_timed_from_its_first_and_last_text_and_counted_by_its_usage() {
        let sent = Instant::now();
        let at = |ms: u64| sent + Duration::from_millis(ms);
        let mut s = Stream::default();
        let chunk = |text: &str| {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"text": text, "index": 0}]})
            )
        };
        // Split anywhere: events are read whole.
        let first = chunk("Hi");
        assert!(!s.feed(&first.as_bytes()[..7], at(100)));
        assert!(!s.feed(&first.as_bytes()[7..], at(400)));
        assert!(!s.feed(chunk("").as_bytes(), at(450)));
        assert!(!s.feed(chunk(" there").as_bytes(), at(500)));
        assert!(!s.feed(chunk("!").as_bytes(), at(600)));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 8}}});
        assert!(!s.feed(format!("data: {usage}\n\n").as_bytes(), at(610)));
        assert!(s.feed(b"data: [DONE]\n\n", at(620)));
        let d = s.done(sent).unwrap();
        assert_eq!(d.prompt_ms, 400.0);
        assert_eq!(d.predicted_ms, 200.0);
        assert_eq!(d.predicted_n, 2);
        assert_eq!(
            (d.detail.prompt_n, d.detail.cache_n, d.detail.predicted_n),
            (40, 8, 3)
        );
        assert_eq!(rate(d.predicted_n, d.predicted_ms), 10.0);
    }

    #[test]
    fn a_stream_without_usage_or_text_is_said_to_be_so() {
        let sent = Instant::now();
        for (events, said) in [
            (
                &b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n"[..],
                "without its usage",
            ),
            (
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\n",
                "no generated text",
            ),
        ] {
            let mut s = Stream::default();
            s.feed(events, sent);
            let e = s.done(sent).err().unwrap();
            assert!(e.contains(said), "{e}");
        }
    }
}
