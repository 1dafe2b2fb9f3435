//! Request statistics in `/status`, read from the engine's `timings` without touching the
//! responses.

use std::time::Duration;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_sums_requests_and_weights_rates_by_tokens() {
    let d = Daemon::start(&Setup::default().knob("token_ms", "5"));
    let s = d.status().await;
    assert_eq!(s["requests"]["requests"], 0);
    assert!(s["requests"]["decode_tok_s"].is_null());

    // One streamed, one not, one native completion.
    let resp = d.post("/v1/chat/completions", chat(4, true)).await;
    let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
    assert_eq!((content.as_str(), done), ("abcd", true));
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(6, false)).await).await;
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["message"]["content"], "abcdef");
    let body = serde_json::json!({"prompt": "count 5", "n_predict": 8, "cache_prompt": false});
    let (_, _, v) = body_json(d.post("/completion", body).await).await;
    assert_eq!(v["content"], "6789");

    // A stream the client abandons has no timings: it is not counted.
    let resp = d.post("/v1/chat/completions", chat(500, true)).await;
    let mut s = Stream::new(resp.into_body());
    s.next_event().await.unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let r = d.status().await["requests"].clone();
    assert_eq!(r["requests"], 3, "{r}");
    assert_eq!(r["generated_tokens"], 4 + 6 + 4, "{r}");
    // The fake engine's timings: recompute the weighted decode rate from the records.
    let recent = r["recent"].as_array().unwrap();
    assert_eq!(recent.len(), 3);
    let tokens: f64 = recent
        .iter()
        .map(|x| x["generated_tokens"].as_f64().unwrap())
        .sum();
    let ms: f64 = recent
        .iter()
        .map(|x| x["decode_ms"].as_f64().unwrap())
        .sum();
    let want = tokens * 1000.0 / ms;
    let got = r["decode_tok_s"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
    // 5 ms per token: a weighted rate near 200 tok/s, not a mean of per-request rates
    assert!(got > 100.0 && got < 210.0, "{got}");
    assert_eq!(recent[2]["path"], "/completion");
    assert_eq!(recent[0]["profile"], "320k");
    assert_eq!(r["by_profile"]["320k"]["requests"], 3);
}
