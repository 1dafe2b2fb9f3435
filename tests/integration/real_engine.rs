//! `dsv4d` with a real llama-server (built by `tests/engine/prepare`) and the tiny generated
//! model, whose output is known: letters run a, b, c, ... and digits count up to 9, then stop.
//!
//! The engine comes from `DSV4_LLAMA_SERVER` and `DSV4_TINY_MODEL`, or else from the cache
//! that `tests/engine/prepare` fills. These tests fail, with that hint, when neither has it:
//! they never pass by skipping.

use crate::engine_key::{
    assert_invalid_api_key, assert_kept_private, assert_only_the_secret_opens,
};
use crate::support::real::{engine, setup};
use crate::support::*;
use dsv4_client::State;
use nix::sys::signal::Signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_chat_starts_the_real_engine_on_demand() {
    let d = Daemon::start(&setup());
    assert_eq!(d.status().await["state"], State::Stopped.as_str());
    let resp = d.post("/v1/chat/completions", chat(8, true)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
    assert_eq!(content, "abcdefgh");
    assert!(done);
    let s = d.status().await;
    assert_eq!(s["state"], State::Ready.as_str());
    assert_eq!(s["generation"], 1);
    assert!(alive(s["engine_pid"].as_i64().unwrap()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_completion_returns_timings_and_status_weights_them() {
    let d = Daemon::start(&setup());
    let mut tokens = 0.0;
    let mut ms = 0.0;
    for (prompt, want) in [
        ("count 5", "6789"),
        ("count 1", "23456789"),
        ("3", "456789"),
    ] {
        let body = serde_json::json!({"prompt": prompt, "n_predict": 16, "cache_prompt": false});
        let (status, _, v) = body_json(d.post("/completion", body).await).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["content"], want);
        let t = &v["timings"];
        assert!(t["prompt_n"].as_u64().unwrap() > 0, "{t}");
        assert_eq!(
            t["predicted_n"].as_u64().unwrap() as usize,
            want.len() + 1,
            "{t}"
        );
        tokens += t["predicted_n"].as_f64().unwrap();
        ms += t["predicted_ms"].as_f64().unwrap();
    }
    let r = d.status().await["requests"].clone();
    assert_eq!(r["requests"], 3, "{r}");
    assert_eq!(r["generated_tokens"].as_f64().unwrap(), tokens);
    let want = tokens * 1000.0 / ms;
    let got = r["decode_tok_s"].as_f64().unwrap();
    assert!(
        (got - want).abs() <= 1e-6 * want,
        "weighted decode {got} vs {want} from the engine's timings"
    );
    assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0);
    assert_eq!(r["by_profile"]["tiny"]["requests"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_idle_real_engine_stops_and_starts_again() {
    let d = Daemon::start(&setup());
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(3, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(!alive(pid), "idle engine {pid} still running");
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
    assert_eq!(d.status().await["generation"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_real_engine_and_exits_zero() {
    let mut d = Daemon::start(&setup());
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200);
    let pid = d.status().await["engine_pid"].as_i64().unwrap();
    d.signal(Signal::SIGTERM);
    let st = d.wait_exit(PATIENCE).await;
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(!alive(pid), "engine {pid} outlived the daemon");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_profile_settings_start_the_real_engine() {
    // The argv the shipped 64k/320k profiles produce (all but the model files): the real
    // llama-server must accept every flag dsv4d writes.
    let (server, model) = engine();
    let mut s = Setup::default();
    s.custom_profiles.insert(
        "tiny".into(),
        format!(
            "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 2048\nparallel: 1\n\
             batch: 2048\nubatch: 512\nkv_cache: q8_0\nflash_attn: on\ngpu_layers: all\n\
             planned_memory: 10MiB\nextra_args: [--metrics, --no-webui]\n",
            server.display(),
            model.display()
        ),
    );
    s.default_profile = "tiny".into();
    let d = Daemon::start(&s);
    let resp = d.post("/v1/chat/completions", chat(5, true)).await;
    assert_eq!(resp.status(), 200);
    let (content, done, _) = Stream::new(resp.into_body()).collect_chat().await;
    assert_eq!(content, "abcde");
    assert!(done);
    let log = d.log_with(&["starting engine:"]).await;
    assert!(
        log.contains("-c 2048 -np 1 -ctk q8_0 -ctv q8_0 -fa on -ngl all -b 2048 -ub 512 --metrics --no-webui --api-key-file "),
        "{log}"
    );
    assert!(
        log.contains("/state/engine-keys/engine-1.key --host 127.0.0.1 --port"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_engine_answers_401_to_anyone_without_its_generation_secret() {
    let d = Daemon::start(&setup().engine("idle_timeout", "1h"));
    // A client's own credentials stop at dsv4d: llama-server would refuse them.
    let (status, _, v) = d
        .send(
            "POST",
            "/v1/chat/completions",
            &[
                ("authorization", "Bearer sk-client"),
                ("x-api-key", "sk-client"),
            ],
            Some(chat(3, false)),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert_eq!(d.status().await["engine_key"], "per-generation secret");
    let e = EngineSeen::of(&d).await;
    assert!(e.secret.is_some(), "no --api-key-file in {:?}", e.argv);
    assert_only_the_secret_opens(&e).await;
    assert_kept_private(&e, &d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_real_engine_start_gets_a_new_secret_and_the_old_file_goes() {
    let d = Daemon::start(&setup());
    let (status, _, _) = body_json(d.post("/v1/chat/completions", chat(1, false)).await).await;
    assert_eq!(status, 200);
    let first = EngineSeen::of(&d).await;
    let old_file = first.key_file.clone().expect("a key file");
    d.wait_state(State::Stopped, PATIENCE).await;
    assert!(
        !old_file.exists(),
        "{} outlived its engine",
        old_file.display()
    );

    // The second engine stays while it is tried directly (those requests are not leases).
    d.reconfigure(&setup().engine("idle_timeout", "1h")).await;
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "ab");
    let second = EngineSeen::of(&d).await;
    assert_eq!(d.status().await["generation"], 2);
    assert_ne!(second.secret, first.secret);
    assert!(second.key_file.as_ref().is_some_and(|f| f.exists()));
    // The old secret opens nothing.
    let got = second
        .send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", &first.bearer())],
            Some(chat(1, false)),
        )
        .await;
    assert_invalid_api_key("the first engine's secret", &got);
    let bearer = second.bearer();
    let (status, _, v) = second
        .send(
            "POST",
            "/v1/chat/completions",
            &[("authorization", &bearer)],
            Some(chat(1, false)),
        )
        .await;
    assert_eq!(status, 200, "{v}");
}

/// Every way of writing a slot action that llama-server's HTTP library decodes to
/// `/slots/0` (or could), each refused by dsv4d: 403 where it decodes cleanly, 400 where
/// another parser could read it another way.
pub const ENCODED_SLOT_ACTIONS: [(&str, u16); 9] = [
    ("/%73lots/0", 403),
    ("/slots%2F0", 403),
    ("/slots%2f0", 403),
    ("/%73%6C%6f%74%73/0", 403),
    ("/%2e%2e/slots/0", 400),
    ("/x/%2E%2E/slots/0", 400),
    ("/x/../slots/0", 400),
    ("/%u0073lots/0", 400),
    ("/slots/%30%", 400),
];

/// llama-server decodes the path before it routes: none of those reaches its slots. The slot
/// stays as it was: a save straight to the engine before and after gives the same count,
/// and no file of a client's naming lands in the managed folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_slot_actions_never_reach_the_real_engine() {
    let mut s = setup().engine("idle_timeout", "10m");
    if let Some(p) = s.custom_profiles.get_mut("tiny") {
        p.push_str("kv_checkpoint: { dir: kv }\n");
    }
    let d = Daemon::start(&s);
    let (status, _, v) = d
        .send(
            "POST",
            "/completion",
            &[],
            Some(serde_json::json!({"prompt": "count 1", "n_predict": 8})),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let e = EngineSeen::of(&d).await;
    let bearer = e.bearer();
    let save = |name: &'static str| {
        let (e, bearer) = (e.clone(), bearer.clone());
        async move {
            let (status, _, v) = e
                .send(
                    "POST",
                    "/slots/0?action=save",
                    &[("authorization", &bearer)],
                    Some(serde_json::json!({ "filename": name })),
                )
                .await;
            assert_eq!(status, 200, "{v}");
            v["n_saved"].as_u64().unwrap()
        }
    };
    let before = save("probe-before.bin").await;
    assert!(before > 0, "the slot holds nothing to begin with");
    for (path, want) in ENCODED_SLOT_ACTIONS {
        for action in ["erase", "save"] {
            let target = format!("{path}?action={action}");
            let body = serde_json::json!({ "filename": "client.bin" });
            let (status, _, v) = d.send("POST", &target, &[], Some(body)).await;
            assert_eq!(status, want, "{target}: {v}");
        }
    }
    assert_eq!(save("probe-after.bin").await, before);
    let kv = d.dir().join("profiles/kv");
    assert!(!kv.join("client.bin").exists(), "a client's file in {kv:?}");
}
