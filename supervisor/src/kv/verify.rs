//! A restore checked: did the engine really take the restored tokens from its cache for the
//! first request that shared them? llama-server's slot restore can report success and reuse
//! nothing: SWA and hybrid models lose their context checkpoints (llama.cpp #25913, #28194),
//! and a dense model reused 14 tokens after one (#26676). A user whose restores do nothing
//! pays the whole prefill again and would see "restored".
//!
//! Owns: reading a slot file's tokens, a request's tokens as the engine makes them (the chat
//! it makes of the request, `/apply-template`, then `/tokenize`), and the verdict. The [`super::Book`] keeps what a
//! restore expects and what the check found.

use std::io::Read;

use serde_json::{json, Value};

use super::engine::Engine;

/// Fewer tokens in common than this, or under half of what a restored slot held, and a
/// request is not the restored conversation going on (a new one may share only its system
/// prompt): it says nothing of the restore, and the next one is looked at.
const MIN_SHARED: usize = 16;

/// The magic of llama.cpp's sequence state files (`ggsq`).
const SEQ_MAGIC: u32 = 0x6767_7371;

/// The tokens held in a llama-server slot file: after the magic and a version, a count and
/// that many 32-bit words, which are the tokens themselves (older servers) or the server's
/// packed form: -1, its version, the tokens' count, the tokens, then any media.
pub fn slot_tokens(mut file: impl Read) -> Result<Vec<i32>, String> {
    let mut word = || -> Result<u32, String> {
        let mut b = [0u8; 4];
        file.read_exact(&mut b)
            .map_err(|e| format!("cannot read the slot file's tokens: {e}"))?;
        Ok(u32::from_le_bytes(b))
    };
    if word()? != SEQ_MAGIC {
        return Err("not a llama.cpp slot file (no ggsq magic)".into());
    }
    let _version = word()?;
    let n = word()? as usize;
    // A count past what any context holds is a damaged file, not a reason to allocate.
    if n > 1 << 26 {
        return Err(format!("the slot file claims {n} tokens"));
    }
    let words: Vec<i32> = (0..n)
        .map(|_| word().map(|w| w as i32))
        .collect::<Result<_, _>>()?;
    match words.as_slice() {
        [-1, _version, count, rest @ ..] => {
            let count = usize::try_from(*count).map_err(|_| "a negative token count")?;
            rest.get(..count)
                .map(<[i32]>::to_vec)
                .ok_or_else(|| format!("the slot file's packed tokens end before {count}"))
        }
        _ => Ok(words),
    }
}

/// How many tokens `a` and `b` have in common from the start.
pub fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// What a request said of a restore of `slots`, whose engine took `cache_n` tokens from its
/// cache for it: `None` when it shared too little with every restored slot to say anything;
/// else the tokens shared and whether the restore missed (less than half of them reused).
pub fn judge(slots: &[Vec<i32>], request: &[i32], cache_n: u64) -> Option<(u64, bool)> {
    let (shared, held) = slots
        .iter()
        .map(|s| (common_prefix(s, request), s.len()))
        .max()?;
    if shared < MIN_SHARED || shared * 2 < held {
        return None;
    }
    let shared = shared as u64;
    Some((shared, cache_n * 2 < shared))
}

/// The tokens the engine makes of a request to `path` with `body`, as it does when it serves
/// it: a chat's messages through its template (an Anthropic message or a Responses request
/// first made the chat the engine makes of it, [`super::as_chat`]), a completion's prompt as
/// it is. `Err` for a request it cannot say (another API, a prompt of several parts).
pub async fn request_tokens(
    engine: &impl Engine,
    path: &str,
    body: &[u8],
) -> Result<Vec<i32>, String> {
    let body: Value =
        serde_json::from_slice(body).map_err(|e| format!("the request is not JSON: {e}"))?;
    let chat = match path {
        "/v1/chat/completions" | "/chat/completions" => Some(body.clone()),
        "/v1/messages" => Some(super::as_chat::anthropic(&body)?),
        "/v1/responses" | "/responses" => Some(super::as_chat::responses(&body)?),
        _ => None,
    };
    let prompt = match (chat, path) {
        (Some(chat), _) => {
            #[derive(serde::Deserialize)]
            struct Templated {
                prompt: String,
            }
            let t: Templated = engine
                .call_json(http::Method::POST, "/apply-template", Some(chat))
                .await?;
            Value::String(t.prompt)
        }
        (None, "/completion" | "/completions" | "/v1/completions") => {
            body.get("prompt")
                .cloned()
                .ok_or("the request has no prompt")?
        }
        (None, other) => return Err(format!("{other} is not a chat or a completion")),
    };
    match prompt {
        Value::String(_) => {}
        Value::Array(words) if words.iter().all(Value::is_i64) => {
            return Ok(words
                .iter()
                .filter_map(Value::as_i64)
                .map(|t| t as i32)
                .collect());
        }
        _ => return Err("a prompt of several parts".into()),
    }
    #[derive(serde::Deserialize)]
    struct Tokens {
        tokens: Vec<i32>,
    }
    let asked = json!({ "content": prompt, "add_special": true, "parse_special": true });
    let t: Tokens = engine
        .call_json(http::Method::POST, "/tokenize", Some(asked))
        .await?;
    Ok(t.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(words: &[i32]) -> Vec<u8> {
        let mut b = Vec::new();
        for w in [SEQ_MAGIC as i32, 3]
            .iter()
            .chain([words.len() as i32].iter())
            .chain(words)
        {
            b.extend_from_slice(&w.to_le_bytes());
        }
        // The state after the tokens, which is not read.
        b.extend_from_slice(b"state");
        b
    }

    #[test]
    fn a_slot_files_tokens_are_read_in_either_form() {
        // The server's packed form, as llama-server b0.3.36 writes it: -1, version 1, the
        // count, the tokens, then the media keys' count (0).
        let packed = file(&[-1, 1, 3, 1, 354, 259, 0]);
        assert_eq!(slot_tokens(&packed[..]), Ok(vec![1, 354, 259]));
        // Older servers: the tokens as they are.
        let plain = file(&[1, 354, 259]);
        assert_eq!(slot_tokens(&plain[..]), Ok(vec![1, 354, 259]));
        assert!(slot_tokens(&b"GGUF...."[..]).unwrap_err().contains("ggsq"));
        let short = file(&[-1, 1, 9, 1, 2]);
        assert!(slot_tokens(&short[..])
            .unwrap_err()
            .contains("end before 9"));
        let cut = &file(&[1, 2, 3])[..14];
        assert!(slot_tokens(cut).unwrap_err().contains("cannot read"));
    }

    #[test]
    fn a_restore_is_judged_only_by_a_request_that_goes_on_from_it() {
        let restored: Vec<i32> = (0..100).collect();
        let next_turn: Vec<i32> = (0..130).collect();
        let mut new_chat: Vec<i32> = (0..30).collect();
        new_chat.extend(500..600);
        // A request, what the engine took from its cache for it, and the verdict.
        type Row<'a> = (&'a [i32], u64, Option<(u64, bool)>);
        let rows: &[Row] = &[
            // The conversation goes on: all 100 shared; reused (the last one may be
            // evaluated again), or not.
            (&next_turn, 99, Some((100, false))),
            (&next_turn, 100, Some((100, false))),
            (&next_turn, 50, Some((100, false))),
            (&next_turn, 49, Some((100, true))),
            (&next_turn, 0, Some((100, true))),
            // The same prompt again.
            (&restored, 99, Some((100, false))),
            // A new conversation sharing only its first 30 tokens says nothing.
            (&new_chat, 0, None),
            // Nothing in common.
            (&[7, 7, 7], 0, None),
        ];
        for (request, cache_n, want) in rows {
            let got = judge(std::slice::from_ref(&restored), request, *cache_n);
            assert_eq!(
                got,
                *want,
                "cache_n {cache_n}, request of {}",
                request.len()
            );
        }
        // Of several restored slots, the one the request shares most with.
        let other: Vec<i32> = (1000..1100).collect();
        assert_eq!(judge(&[other, restored], &next_turn, 0), Some((100, true)));
        assert_eq!(judge(&[], &next_turn, 0), None);
        // Too short to say.
        let tiny: Vec<i32> = (0..10).collect();
        assert_eq!(judge(std::slice::from_ref(&tiny), &tiny, 0), None);
    }
}
