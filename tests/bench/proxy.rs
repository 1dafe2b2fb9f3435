//! Proxy benchmark: what a client sees direct to the engine vs through `dsv4d`, in one run.
//!
//! Prints (with the fake engine as the upstream, both paths interleaved so drift hits both):
//! - non-streaming request latency (p50/p90/p99) direct and via dsv4d, and the added p50;
//! - streaming throughput in SSE events/s both ways, and the ratio;
//! - readiness lag: engine ready -> first response byte to a request that waited for the start,
//!   with the engine announcing readiness on stderr (as llama-server does) and without (polling);
//! - proxies (`proxies.rs`): wrk against the same engine direct, through dsv4d, nginx and
//!   systemd-socket-proxyd: p50 and added p50 at concurrency 1, req/s at 64, and the CPU per
//!   request of each proxy and of the engine behind it; installs nginx and wrk if missing.
//!
//! Run: `cargo bench -p dsv4-tests --bench proxy` (env `BENCH_REQUESTS`, `BENCH_TOKENS`,
//! `BENCH_STARTS` scale it; `BENCH_WRK_SECONDS`, `BENCH_ROUNDS`, `BENCH_NGINX_WORKERS`,
//! `BENCH_ENGINE_CONNECTIONS`, `BENCH_BASELINE_DSV4D` (another build's dsv4d-under-test, measured
//! beside this one in the same rounds) the proxies section). `BENCH_ONLY=proxies` runs only the proxies
//! section, `BENCH_ONLY=classic` only the others, and `BENCH_ONLY=callgrind` the callgrind
//! section alone (`callgrind.rs`: instructions per plain request and per streamed event, with
//! `BENCH_BASELINE_DSV4D` too; not run otherwise: valgrind makes it slow).

#[path = "../integration/support/mod.rs"]
mod support;

mod callgrind;
mod proxies;

use dsv4_client::State;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use support::{env_or, Daemon, Setup};

fn chat(max_tokens: usize, stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "stream": stream,
        })
        .to_string(),
    )
}

/// The chat request, with `authorization` when given: the engine's key, which the engine
/// requires and dsv4d puts in place of whatever a client sends, so both paths carry the same
/// header.
fn request(
    addr: SocketAddr,
    authorization: Option<&str>,
    body: Bytes,
) -> hyper::Request<Full<Bytes>> {
    let mut r = hyper::Request::post("/v1/chat/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    if let Some(a) = authorization {
        r = r.header("authorization", a);
    }
    r.body(Full::new(body)).unwrap()
}

/// One request on a kept-alive connection; returns the latency and the number of SSE events
/// (blank-line separated) in the body. Events, not frames: a proxy may carry several events
/// in one frame. A connection the server closed (an engine closes one after so many requests,
/// or after a stream, as llama-server does) is reopened, untimed, and the request sent again:
/// it never reached the server.
async fn once(
    s: &mut SendRequest<Full<Bytes>>,
    addr: SocketAddr,
    authorization: &str,
    body: Bytes,
) -> (Duration, usize) {
    let (t, resp) = loop {
        if s.ready().await.is_err() {
            *s = support::one_connection(addr).await;
            continue;
        }
        let t = Instant::now();
        match s
            .send_request(request(addr, Some(authorization), body.clone()))
            .await
        {
            Ok(resp) => break (t, resp),
            Err(e) if e.is_canceled() || e.is_closed() || e.is_incomplete_message() => {
                *s = support::one_connection(addr).await;
            }
            Err(e) => panic!("request: {e}"),
        }
    };
    assert_eq!(resp.status(), 200);
    let mut b = resp.into_body();
    let mut events = 0;
    let mut tail = Vec::new();
    while let Some(f) = b.frame().await {
        if let Ok(d) = f.expect("frame").into_data() {
            // An event boundary may straddle two frames: keep the last byte of the previous.
            tail.extend_from_slice(&d);
            events += tail.windows(2).filter(|w| w == b"\n\n").count();
            let keep = tail.len().min(1);
            tail.drain(..tail.len() - keep);
        }
    }
    (t.elapsed(), events)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() {
    // Keep the daemon's own logging at info: per-request debug lines are not what is measured.
    std::env::set_var(
        "DSV4_LOG",
        std::env::var("DSV4_LOG").unwrap_or_else(|_| "info".into()),
    );
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    println!(
        "dsv4 proxy benchmark (fake engine upstream; {} cores)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    if only == "callgrind" {
        callgrind::run().await;
        return;
    }
    if only != "proxies" {
        classic().await;
    }
    if only != "classic" {
        proxies::run().await;
    }
}

/// The in-process sections: latency and streaming throughput with a hyper client, readiness lag.
async fn classic() {
    let requests = env_or::<usize>("BENCH_REQUESTS", 3000);
    let tokens = env_or::<usize>("BENCH_TOKENS", 20000);
    let starts = env_or::<usize>("BENCH_STARTS", 8);

    let d = Daemon::start(&Setup::default().engine("idle_timeout", "1h"));
    // Warm up: start the engine through the daemon, then find its port for the direct path.
    let mut via = support::one_connection(d.addr).await;
    // Through dsv4d any credential will do: it sends the engine's key in its place.
    once(&mut via, d.addr, "Bearer -", chat(1, false)).await;
    let status = d.status().await;
    assert_eq!(status["state"], State::Ready.as_str(), "{status}");
    let seen = support::EngineSeen::of(&d).await;
    let (engine, auth) = (seen.addr, seen.bearer());
    let auth = auth.as_str();
    let mut direct = support::one_connection(engine).await;
    for _ in 0..200 {
        once(&mut direct, engine, auth, chat(1, false)).await;
        once(&mut via, d.addr, auth, chat(1, false)).await;
    }

    // 1. Non-streaming latency, interleaved.
    let (mut ld, mut lv) = (Vec::with_capacity(requests), Vec::with_capacity(requests));
    for _ in 0..requests {
        ld.push(once(&mut direct, engine, auth, chat(1, false)).await.0);
        lv.push(once(&mut via, d.addr, auth, chat(1, false)).await.0);
    }
    ld.sort();
    lv.sort();
    println!(
        "\nnon-streaming request latency ({requests} each, 1 token, keep-alive, concurrency 1):"
    );
    println!(
        "  {:<8} {:>9} {:>9} {:>9}",
        "path", "p50 us", "p90 us", "p99 us"
    );
    for (name, v) in [("direct", &ld), ("dsv4d", &lv)] {
        println!(
            "  {:<8} {:>9.1} {:>9.1} {:>9.1}",
            name,
            us(pct(v, 0.5)),
            us(pct(v, 0.9)),
            us(pct(v, 0.99))
        );
    }
    let added = us(pct(&lv, 0.5)) - us(pct(&ld, 0.5));
    println!("  added p50: {added:.1} us (target < 100 us)");

    // 2. Streaming throughput, interleaved rounds.
    let rounds = 3;
    let (mut ed, mut ev) = (0.0f64, 0.0f64);
    let (mut td, mut tv) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..rounds {
        let (t, f) = once(&mut direct, engine, auth, chat(tokens, true)).await;
        td += t;
        ed += f as f64;
        let (t, f) = once(&mut via, d.addr, auth, chat(tokens, true)).await;
        tv += t;
        ev += f as f64;
    }
    let (rd, rv) = (ed / td.as_secs_f64(), ev / tv.as_secs_f64());
    println!("\nstreaming throughput ({rounds} streams of {tokens} tokens each way; the engine sends one SSE event per write):");
    println!("  direct {rd:>10.0} events/s");
    println!(
        "  dsv4d  {rv:>10.0} events/s  ({:.1}% of direct; target >= 95%)",
        rv / rd * 100.0
    );
    drop(direct);
    drop(via);
    drop(d);

    // 3. Readiness lag over cold starts.
    println!("\nreadiness lag: engine ready -> first byte to the waiting client ({starts} cold starts, 300 ms load):");
    for (label, quiet) in [
        ("engine logs 'model loaded' (llama-server does)", false),
        ("silent engine (polling only)", true),
    ] {
        let mut setup = Setup::default().knob("load_ms", "300");
        if quiet {
            setup = setup.knob("quiet_ready", "1");
        }
        let mut lags = Vec::new();
        for _ in 0..starts {
            let d = Daemon::start(&setup);
            let mut s = support::one_connection(d.addr).await;
            let resp = s
                .send_request(request(d.addr, None, chat(1, true)))
                .await
                .unwrap();
            let mut body = resp.into_body();
            let _ = body.frame().await;
            let first_byte = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let ready = d
                .fake_log()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("ready t_ns=")
                        .and_then(|t| t.parse::<u128>().ok())
                })
                .expect("ready line in the fake engine log");
            // The response head is sent once the engine answered the proxied request; the lag
            // includes that request's own (sub-millisecond) time.
            lags.push(Duration::from_nanos(first_byte.saturating_sub(ready) as u64));
        }
        lags.sort();
        println!(
            "  {label:<50} p50 {:>7.2} ms  max {:>7.2} ms  (target < 50 ms)",
            us(pct(&lags, 0.5)) / 1000.0,
            us(*lags.last().unwrap()) / 1000.0
        );
    }
}
