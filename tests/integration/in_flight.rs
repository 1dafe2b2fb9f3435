//! The requests in flight as `/status` shows them (`in_progress`), on the real engines: a
//! load's seconds while a request waits; on llama-server, a streamed request's prefill
//! moving (read from the `prompt_progress` events dsv4d asks for and takes out again) and
//! the events of a client that asked for them itself left in; on ds4-server, its prefill read
//! from its log lines.

use std::time::{Duration, Instant};

use crate::keepalive::{
    chat_request, long_context_daemon, long_prompt, raw_stream, DS4_PROMPT_TOKENS,
};
use crate::support::real::{ds4_engine, ds4_setup};
use crate::support::*;
use serde_json::{json, Value};

/// The status's requests in flight, polled until `task` ends: every one seen, in order.
async fn watch_until<T>(d: &Daemon, task: &tokio::task::JoinHandle<T>) -> Vec<Value> {
    let mut seen = Vec::new();
    let t = Instant::now();
    while !task.is_finished() {
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the request never ended"
        );
        let s = d.status().await;
        if let Some(first) = s["in_progress"].as_array().and_then(|a| a.first()) {
            seen.push(first.clone());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    seen
}

/// The prefill's tokens done each time the status showed them, as they came.
fn prefill_done(seen: &[Value]) -> Vec<u64> {
    let mut done: Vec<u64> = seen
        .iter()
        .filter(|r| r["phase"] == "prefill")
        .filter_map(|r| r["prefill"]["done"].as_u64())
        .collect();
    done.dedup();
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_prefill_on_the_real_llama_server_moves_in_the_status() {
    let d = long_context_daemon().await;
    let mut body = chat_request(&long_prompt(), 12);
    body["stream"] = json!(true);
    let url = d.url("/v1/chat/completions");
    let request = tokio::spawn({
        let body = body.clone();
        async move { raw_stream(&url, &body).await }
    });
    let seen = watch_until(&d, &request).await;
    let stream = request.await.unwrap();
    let done = prefill_done(&seen);
    // Several figures, rising, of the whole prompt (less what the cache held).
    assert!(done.len() >= 2, "{seen:#?}");
    assert!(done.windows(2).all(|w| w[0] < w[1]), "{done:?}");
    let last = seen
        .iter()
        .rev()
        .find(|r| r["prefill"].is_object())
        .unwrap();
    let total = last["prefill"]["total"].as_u64().unwrap();
    let tokens = crate::keepalive::LONG_PROMPT_TOKENS as u64;
    assert!((tokens - 1000..tokens + 1000).contains(&total), "{last}");
    assert!(last["prefill"]["rate"].as_f64().unwrap() > 0.0, "{last}");
    assert!(last["prefill"]["left_s"].as_f64().is_some(), "{last}");
    assert_eq!(last["path"], "/v1/chat/completions");
    assert_eq!(last["stream"], true);
    assert_eq!(last["profile"], "32k");
    // What dsv4d asked for, it took out again.
    assert!(!stream.contains("prompt_progress"), "{stream}");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");
    // Gone once answered.
    let s = d.status().await;
    assert_eq!(s["in_progress"], json!([]), "{s}");

    // A client that asks for the progress itself gets it, and the status reads it too.
    body["return_progress"] = json!(true);
    let url = d.url("/v1/chat/completions");
    body["messages"][0]["content"] = json!(format!("other {}", long_prompt()));
    let request = tokio::spawn(async move { raw_stream(&url, &body).await });
    let seen = watch_until(&d, &request).await;
    let stream = request.await.unwrap();
    assert!(stream.contains("\"prompt_progress\""), "{stream}");
    assert!(!prefill_done(&seen).is_empty(), "{seen:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_a_load_says_so_in_the_status() {
    let d = Daemon::start(&Setup::default().knob("load_ms", "3000"));
    let url = d.url("/v1/chat/completions");
    let request = tokio::spawn(async move { raw_stream(&url, &chat(4, false)).await });
    let seen = watch_until(&d, &request).await;
    let answer = request.await.unwrap();
    assert!(answer.contains("\"finish_reason\""), "{answer}");
    let loading: Vec<f64> = seen
        .iter()
        .filter(|r| r["phase"] == "loading")
        .filter_map(|r| r["loading_s"].as_f64())
        .collect();
    assert!(loading.len() >= 2, "{seen:#?}");
    assert!(loading.first() < loading.last(), "{loading:?}");
    let first = &seen[seen.iter().position(|r| r["phase"] == "loading").unwrap()];
    assert_eq!(first["profile"], "320k", "{first}");
    assert_eq!(first["stream"], false, "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_ds4_servers_prefill_shows_in_the_status_from_its_log() {
    let test = "the_real_ds4_servers_prefill_shows_in_the_status_from_its_log";
    let Some((server, model)) = ds4_engine(test) else {
        return;
    };
    let dir = temp_dir("ds4-in-flight");
    let s = ds4_setup(&server, &model, dir.path(), "10m");
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(4, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    let prompt = "word ".repeat(DS4_PROMPT_TOKENS / 5);
    let url = d.url("/v1/chat/completions");
    let body = chat_request(&prompt, 4);
    let request = tokio::spawn(async move { raw_stream(&url, &body).await });
    let seen = watch_until(&d, &request).await;
    let answer = request.await.unwrap();
    assert!(
        answer.contains("\"finish_reason\""),
        "{answer}\n{}",
        d.log()
    );
    // Its CPU path logs a prompt's start, then one chunk at the end (the GPU path logs each
    // chunk, which the unit tests read): the prompt's size from the first line, read off
    // the log while the request waits for its answer, not that of the request before.
    let started = seen
        .iter()
        .find(|r| r["prefill"].is_object())
        .unwrap_or_else(|| panic!("{seen:#?}\n{}", d.log()));
    assert_eq!(started["phase"], "prefill", "{started}");
    assert_eq!(started["prefill"]["done"], 0, "{started}");
    let total = started["prefill"]["total"].as_u64().unwrap();
    assert!(total > DS4_PROMPT_TOKENS as u64 / 2, "{started}");
    assert_eq!(started["stream"], false, "{started}");
    assert_eq!(started["profile"], "ds4", "{started}");
    // The whole prefill was seen with those figures, for longer than a moment.
    let shown = seen
        .iter()
        .filter(|r| r["prefill"]["total"] == total)
        .count();
    assert!(shown >= 10, "{seen:#?}");
}

/// dsv4d's own ask for progress cannot be seen: a client that asks with the key escaped
/// (`"return\u005fprogress"`) gets its progress events, as from llama-server alone, and a
/// body llama-server cannot parse reaches it as written, so its error positions are the
/// ones llama-server gives for that body directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ask_for_progress_cannot_be_seen() {
    let d = long_context_daemon().await;
    let prompt = serde_json::to_string(&format!("escaped {}", long_prompt())).unwrap();
    let escaped = format!(
        r#"{{"return\u005fprogress":true,"stream":true,"max_tokens":4,"messages":[{{"role":"user","content":{prompt}}}]}}"#
    );
    let (status, stream) = post_text(&d.url("/v1/chat/completions"), &[], &escaped).await;
    assert_eq!(status, 200, "{stream}");
    assert!(stream.contains("\"prompt_progress\""), "{stream}");
    assert!(stream.ends_with("data: [DONE]\n\n"), "{stream}");

    let broken = r#"{"stream":true,"messages":[{"role":"user","content":"hi"}],"max_tokens":2,}"#;
    let direct = crate::support::real::LlamaServer::start();
    let (direct_status, direct_said) =
        post_text(&format!("{}/v1/chat/completions", direct.url), &[], broken).await;
    let (status, said) = post_text(&d.url("/v1/chat/completions"), &[], broken).await;
    assert_eq!(status, direct_status, "{said}");
    assert!(direct_said.contains("column"), "{direct_said}");
    assert_eq!(said, direct_said);
}

/// The tokens a request in flight shows are its answer's content events, on each kind and
/// each API, also when the model's text holds what an event stream's fields look like
/// (`data: data: x`, `event: message_stop`, `data: [DONE]`: the fake engine's `fields`
/// answer): 12 events are 12 tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_in_flight_are_the_content_events_whatever_the_text() {
    // The engine pauses after its last token, before its answer's end: the status shows the
    // request with all its tokens meanwhile.
    let knobs = [("pause_after", "12"), ("pause_ms", "1500")];
    let llama = knobs
        .iter()
        .fold(Setup::default(), |s, (k, v)| s.knob(k, v));
    let ds4 = knobs
        .iter()
        .fold(Setup::default().ds4(), |s, (k, v)| s.knob(k, v));
    let generic = crate::openai_kind::fake_setup(
        "health: /health\n",
        &[("PAUSE_AFTER", "12"), ("PAUSE_MS", "1500")],
    );
    let prompt = "say fields";
    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
                      "stream": true});
    let text = json!({"prompt": prompt, "max_tokens": 12, "stream": true});
    let native = json!({"prompt": prompt, "n_predict": 12, "stream": true});
    let messages = json!({"model": "m", "max_tokens": 12, "stream": true,
                          "messages": [{"role": "user", "content": prompt}]});
    let responses = json!({"model": "m", "max_output_tokens": 12, "stream": true,
                           "input": prompt});
    for (kind, setup) in [("llama-server", llama), ("ds4", ds4), ("openai", generic)] {
        let d = Daemon::start(&setup);
        for (path, body) in [
            ("/v1/chat/completions", &chat),
            ("/v1/completions", &text),
            ("/completion", &native),
            ("/v1/messages", &messages),
            ("/v1/responses", &responses),
        ] {
            if kind == "ds4" && path == "/completion" {
                // ds4-server serves no native completion.
                continue;
            }
            let url = d.url(path);
            let request = tokio::spawn({
                let body = body.clone();
                async move { raw_stream(&url, &body).await }
            });
            let seen = watch_until(&d, &request).await;
            let stream = request.await.unwrap();
            assert!(stream.contains("data: data: x"), "{kind} {path}: {stream}");
            let tokens: Vec<u64> = seen.iter().filter_map(|r| r["tokens"].as_u64()).collect();
            assert_eq!(tokens.iter().max(), Some(&12), "{kind} {path}: {seen:#?}");
        }
    }
}
