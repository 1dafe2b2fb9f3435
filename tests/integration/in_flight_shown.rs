//! The requests in flight, shown wherever one looks: on the real llama-server, while a
//! streamed request's long prompt is read (the tiny model with a 16K context, one thread,
//! its progress told every 256 tokens), `dsv4ctl status`, the dashboard in a real browser
//! and `/metrics` each show its prefill's tokens rising, and the D-Bus property `InProgress`
//! holds it. Each looks at a prefill of its own (a prompt that no cache holds).

use std::time::{Duration, Instant};

use crate::control::{ctl, wait_bus_name};
use crate::dashboard::Browser;
use crate::support::*;
use crate::validate::tiny_16k;
use serde_json::{json, Value};

/// Prompt tokens (one character is one token of the tiny model): a prefill of seconds on
/// one thread, within the 16K context.
const PROMPT_TOKENS: usize = 15_000;

/// A daemon on `bus` in front of the real llama-server on the tiny model with a 16K
/// context, its engine started. The host is sampled once an hour: nothing but the
/// requests moves in the status while a prompt is read.
async fn daemon(bus: &PrivateBus) -> Daemon {
    let dir = temp_dir("daemon");
    let model = tiny_16k(dir.path());
    let mut s = Setup::default()
        .session_bus(bus)
        .engine("idle_timeout", "10m")
        .top_level("monitor", "{ interval: 1h, idle_interval: 1h }");
    s.custom_profiles.insert(
        "16k".into(),
        crate::support::real::profile(&model, 16384, "batch: 256\nubatch: 256\n"),
    );
    s.default_profile = "16k".into();
    let d = Daemon::start_in(&s, dir);
    let (status, _, v) = body_json(d.post("/v1/chat/completions", chat(2, false)).await).await;
    assert_eq!(status, 200, "{v}\n{}", d.log());
    wait_bus_name(&d, bus).await;
    d
}

/// The body of GET `url`, as text.
async fn text(url: &str) -> String {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = hyper::Request::get(url)
        .body(http_body_util::Full::default())
        .unwrap();
    let resp = client.request(req).await.unwrap();
    use http_body_util::BodyExt;
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// A streamed chat request with a long prompt of its own (`n` first: no cache holds it),
/// sent and read to its end by a task of its own; once `/status` shows its prefill under
/// way with figures, its number and the task.
async fn long_prefill(d: &Daemon, n: u32) -> (u64, tokio::task::JoinHandle<String>) {
    let body = json!({
        "messages": [{
            "role": "user",
            "content": format!("{n} {}", "word ".repeat(PROMPT_TOKENS / 5)),
        }],
        "max_tokens": 4,
        "temperature": 0,
        "stream": true,
    });
    let url = d.url("/v1/chat/completions");
    let request = tokio::spawn(async move {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<bytes::Bytes>>();
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_string(),
            )))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        use http_body_util::BodyExt;
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    });
    let t = Instant::now();
    loop {
        let s = d.status().await;
        let prefill = s["in_progress"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["phase"] == "prefill" && r["prefill"].is_object());
        if let Some(r) = prefill {
            return (r["id"].as_u64().unwrap(), request);
        }
        assert!(
            t.elapsed() < PATIENCE && !request.is_finished(),
            "no prefill with figures in the status: {s}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Calls `read` until it has given two different figures, the second the greater: the
/// figures. `read` gives `None` while its figure is not shown (yet). Fails when `request`
/// ends first.
async fn rising<F, Fut>(
    what: &str,
    request: &tokio::task::JoinHandle<String>,
    mut read: F,
) -> Vec<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (Option<u64>, String)>,
{
    let mut seen: Vec<u64> = Vec::new();
    let t = Instant::now();
    loop {
        let finished = request.is_finished();
        let (n, shown) = read().await;
        if let Some(n) = n.filter(|n| seen.last() != Some(n)) {
            seen.push(n);
        }
        if let [first, .., last] = seen[..] {
            assert!(last > first, "{what}: the figure fell: {seen:?}\n{shown}");
            return seen;
        }
        assert!(
            !finished && t.elapsed() < PATIENCE,
            "{what}: the prefill ended before its figure rose: {seen:?}; last shown:\n{shown}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `4,096` in `prefill 4,096 / 262,144 tokens` of `line`.
fn done_in(line: &str) -> Option<u64> {
    let rest = &line[line.find("prefill ")? + "prefill ".len()..];
    rest[..rest.find(" / ")?].replace(',', "").parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_is_shown_rising_in_dsv4ctl_the_dashboard_and_metrics_and_on_d_bus() {
    let bus = PrivateBus::start();
    let d = daemon(&bus).await;

    // dsv4ctl status: a line of the request, its prefill's tokens rising.
    let took = Instant::now();
    let (id, request) = long_prefill(&d, 1).await;
    let seen = rising("dsv4ctl status", &request, || {
        let out = tokio::task::block_in_place(|| ctl(&bus.address, &["status"], None));
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        let line = printed
            .lines()
            .find(|l| l.contains(&format!("#{id} /v1/chat/completions  prefill ")));
        let done = line.and_then(done_in).filter(|_| out.status.success());
        std::future::ready((done, printed))
    })
    .await;
    println!("dsv4ctl status: {seen:?}");
    request.await.unwrap();
    println!("the first request took {:?}", took.elapsed());

    // /metrics: the prefill counted in its phase, its tokens rising.
    let (_, request) = long_prefill(&d, 2).await;
    let url = d.url("/metrics");
    let seen = rising("/metrics", &request, || {
        let url = url.clone();
        async move {
            let metrics = text(&url).await;
            let lines: Vec<&str> = metrics.lines().collect();
            let done = lines
                .iter()
                .find_map(|l| l.strip_prefix("dsv4_prefill_tokens{state=\"done\"} "))
                .and_then(|n| n.parse().ok());
            let counted = lines.contains(&"dsv4_requests_in_progress{phase=\"prefill\"} 1");
            (done.filter(|_| counted), metrics)
        }
    })
    .await;
    println!("/metrics: {seen:?}");
    request.await.unwrap();

    // D-Bus: the property holds the request, in its prefill.
    let proxy = live_proxy(&bus, &d).await;
    let (id, request) = long_prefill(&d, 3).await;
    let list: Value = serde_json::from_str(&proxy.in_progress().await.unwrap()).unwrap();
    let held = list
        .as_array()
        .and_then(|l| l.iter().find(|r| r["id"] == id))
        .unwrap_or_else(|| panic!("no request {id} in InProgress: {list}"));
    assert_eq!(held["path"], "/v1/chat/completions", "{held}");
    assert_eq!(held["stream"], true, "{held}");
    assert_eq!(held["profile"], "16k", "{held}");
    assert_eq!(held["phase"], "prefill", "{held}");
    assert!(
        held["prefill"]["total"]
            .as_u64()
            .is_some_and(|t| t > 10_000),
        "{held}"
    );
    request.await.unwrap();

    // The dashboard, open before the request: its bar's figure rises without a reload,
    // though nothing but the request moves.
    let page = format!("http://{}/ui", d.addr);
    let mut browser = tokio::task::block_in_place(|| {
        Browser::opened(
            &page,
            "document.getElementById('live').textContent === 'live'",
        )
    });
    let (id, request) = long_prefill(&d, 4).await;
    let done = format!(
        "(() => {{ const li = document.querySelector('#in-progress li[data-id=\"{id}\"]'); \
         return li && li.dataset.phase === 'prefill' && li.dataset.done !== undefined \
           ? Number(li.dataset.done) : null; }})()"
    );
    let seen = rising("the dashboard", &request, || {
        let n = tokio::task::block_in_place(|| browser.eval(&done));
        let shown = tokio::task::block_in_place(|| {
            browser.eval("document.getElementById('in-progress').textContent")
        });
        std::future::ready((n.as_u64(), shown.to_string()))
    })
    .await;
    println!("the dashboard: {seen:?}");
    let bar = tokio::task::block_in_place(|| {
        browser.eval(&format!(
            "(() => {{ const b = document.querySelector('#in-progress li[data-id=\"{id}\"] progress'); \
             return b ? [b.value, b.max] : null; }})()"
        ))
    });
    assert!(bar[1].as_f64().is_some_and(|m| m > 10_000.0), "{bar}");
    request.await.unwrap();
    drop(browser);
}
