//! Web pages and the HTTP front, end to end: the `Host` check against DNS rebinding
//! (`api.allowed_hosts`), CORS preflights answered by dsv4d, and the engine's CORS headers
//! replaced by dsv4d's own for the origins in `api.cors_origins`. Neither a refused page nor
//! a preflight ever starts the engine.
//!
//! The fake engine sends CORS headers as llama-server does (every answer allows the origin
//! that asked; an `OPTIONS` also allows credentials, any method and any header), and one test
//! runs the real llama-server, after checking that it really does so.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support::real::LlamaServer;
use crate::support::*;
use bytes::Bytes;
use dsv4_client::State;
use http_body_util::Full;

const SEC: Duration = Duration::from_secs(1);
const APP: &str = "https://app.example";
const DEV: &str = "http://localhost:3000";
const EVIL: &str = "https://evil.example";
const KEY: &str = "sk-dsv4-cors-test";

type Answer = (u16, hyper::HeaderMap, serde_json::Value);

/// Sends `method path` with `headers` and `body` on a connection of its own, with
/// `Host: 127.0.0.1:PORT` unless `headers` name one; status, headers, body as JSON.
async fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut s = one_connection(addr).await;
    let mut req = hyper::Request::builder().method(method).uri(path);
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req = req.header("host", addr.to_string());
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    let resp = s.send_request(req).await.expect("a response");
    body_json(resp).await
}

/// A chat completion as JSON text.
fn chat_text(stream: bool) -> String {
    chat(3, stream).to_string()
}

/// The preflight a browser sends before a page's JSON POST with a key.
fn preflight_headers(origin: &str) -> [(&str, &str); 3] {
    [
        ("origin", origin),
        ("access-control-request-method", "POST"),
        (
            "access-control-request-headers",
            "authorization, content-type, x-stainless-os",
        ),
    ]
}

/// The `Access-Control-*` headers of an answer, as `name: value`, sorted.
fn cors_headers(h: &hyper::HeaderMap) -> Vec<String> {
    let mut v: Vec<String> = h
        .iter()
        .filter(|(k, _)| k.as_str().starts_with("access-control-"))
        .map(|(k, v)| format!("{k}: {}", v.to_str().unwrap()))
        .collect();
    v.sort();
    v
}

/// Asserts that a refusal is `status` with `code` in the OpenAI shape and allows no origin.
fn assert_refused(what: &str, got: &Answer, status: u16, code: &str) {
    let (s, h, v) = got;
    assert_eq!(*s, status, "{what}: {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    assert_eq!(cors_headers(h), Vec::<String>::new(), "{what}");
}

/// Asserts that no engine was started and none was asked anything.
async fn assert_no_engine(d: &Daemon) {
    // With the key, for the daemon that requires one; the others ignore it.
    let key = format!("Bearer {KEY}");
    let (_, _, status) = send(d.addr, "GET", "/status", &[("authorization", &key)], "").await;
    assert_eq!(status["state"], State::Stopped.as_str(), "{}", d.log());
    assert_eq!(d.spawns(), 0, "{}", d.fake_log());
    assert!(!d.fake_log().contains("request "), "{}", d.fake_log());
}

/// A string list in YAML flow style.
fn yaml_list(items: &[&str]) -> String {
    let quoted: Vec<String> = items.iter().map(|i| format!("{i:?}")).collect();
    format!("[{}]", quoted.join(", "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preflight_from_an_unlisted_origin_is_refused_and_starts_nothing() {
    let d = Daemon::start(&Setup::default().api("cors_origins", &yaml_list(&[APP])));
    for (path, origin) in [
        ("/v1/chat/completions", EVIL),
        ("/v1/models", EVIL),
        // Another scheme or port of a listed origin is another origin.
        ("/v1/chat/completions", "http://app.example"),
        ("/v1/chat/completions", "https://app.example:8443"),
        ("/v1/chat/completions", "null"),
    ] {
        let got = send(d.addr, "OPTIONS", path, &preflight_headers(origin), "").await;
        assert_refused(&format!("{path} {origin}"), &got, 403, "origin_not_allowed");
        let message = got.2["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("{origin:?}")), "{message}");
        assert!(message.contains("api.cors_origins"), "{message}");
    }
    assert_no_engine(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_from_an_unlisted_origin_gets_403_and_starts_nothing() {
    let d = Daemon::start(&Setup::default());
    // What a page can send without a preflight (a "simple" request), and what it cannot.
    for (method, path, content_type) in [
        ("POST", "/v1/chat/completions", "text/plain"),
        (
            "POST",
            "/v1/completions",
            "application/x-www-form-urlencoded",
        ),
        ("POST", "/v1/chat/completions", "application/json"),
        ("GET", "/slots", "text/plain"),
        ("GET", "/status", "text/plain"),
        ("GET", "/health", "text/plain"),
    ] {
        let headers = [("origin", EVIL), ("content-type", content_type)];
        let got = send(d.addr, method, path, &headers, &chat_text(false)).await;
        assert_refused(&format!("{method} {path}"), &got, 403, "origin_not_allowed");
    }
    assert_no_engine(&d).await;
    // Tools send no Origin, and are served as before.
    let (status, h, v) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    // The engine's own (empty) Access-Control-Allow-Origin does not come through either.
    assert_eq!(cors_headers(&h), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_origin_gets_its_own_cors_headers_and_none_of_the_engines() {
    let setup = Setup::default()
        .api("cors_origins", &yaml_list(&[APP, DEV]))
        .api_keys_file(&format!("{KEY}\n"), 0o600);
    let d = Daemon::start(&setup);
    let bearer = format!("Bearer {KEY}");
    let json = ("content-type", "application/json");

    // The preflight needs no key (browsers send none with it) and starts nothing.
    let (status, h, _) = send(
        d.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight_headers(APP),
        "",
    )
    .await;
    assert_eq!(status, 204);
    assert_eq!(
        cors_headers(&h),
        [
            "access-control-allow-headers: authorization, content-type, x-stainless-os",
            "access-control-allow-methods: GET, HEAD, POST, PUT, PATCH, DELETE",
            "access-control-allow-origin: https://app.example",
            "access-control-max-age: 600",
        ]
    );
    assert!(h["vary"].to_str().unwrap().starts_with("Origin"), "{h:?}");
    // A refusal for a missing key is readable by the page.
    let got = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &[("origin", APP), json],
        &chat_text(false),
    )
    .await;
    assert_eq!(got.0, 401, "{}", got.2);
    assert_eq!(
        cors_headers(&got.1),
        ["access-control-allow-origin: https://app.example"]
    );
    assert_no_engine(&d).await;

    // A JSON answer and a stream, each with the page's origin allowed once and no credentials.
    let headers = [("origin", APP), ("authorization", &bearer), json];
    let (status, h, v) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert_eq!(
        cors_headers(&h),
        ["access-control-allow-origin: https://app.example"]
    );
    let vary: Vec<_> = h.get_all("vary").iter().collect();
    assert_eq!(vary, ["Origin"]);
    let headers = [("origin", DEV), ("authorization", &bearer), json];
    let (status, h, v) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(true),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(h["content-type"], "text/event-stream");
    assert!(v.as_str().unwrap().ends_with("data: [DONE]\n\n"), "{v}");
    assert_eq!(
        cors_headers(&h),
        ["access-control-allow-origin: http://localhost:3000"]
    );

    // An OPTIONS that is no preflight goes to the engine, which allows anything with
    // credentials: only dsv4d's answer for the page comes back.
    let headers = [("origin", APP), ("authorization", bearer.as_str())];
    let (status, h, _) = send(d.addr, "OPTIONS", "/v1/chat/completions", &headers, "").await;
    assert_eq!(status, 200);
    assert!(
        d.fake_log()
            .contains("request OPTIONS /v1/chat/completions"),
        "{}",
        d.fake_log()
    );
    assert_eq!(
        cors_headers(&h),
        ["access-control-allow-origin: https://app.example"]
    );

    // A page dsv4d serves itself (the engine's web UI) is its own origin.
    let own = format!("http://{}", d.addr);
    let headers = [("origin", own.as_str()), ("authorization", &bearer), json];
    let (status, h, v) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        cors_headers(&h),
        [format!("access-control-allow-origin: {own}")]
    );

    // A tool gets no CORS headers at all.
    let headers = [("authorization", bearer.as_str()), json];
    let (status, h, _) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(cors_headers(&h), Vec::<String>::new());
    assert_eq!(d.spawns(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_host_gets_403_everywhere_and_starts_nothing() {
    // Even with every origin allowed: the page of a rebound name is not cross-origin.
    let d = Daemon::start(&Setup::default().api("cors_origins", "[\"*\"]"));
    let port = d.addr.port();
    for host in [
        "evil.example".to_string(),
        format!("evil.example:{port}"),
        format!("127.0.0.1.evil.example:{port}"),
    ] {
        for (method, path, origin) in [
            ("POST", "/v1/chat/completions", None),
            (
                "POST",
                "/v1/chat/completions",
                Some(format!("http://{host}")),
            ),
            ("GET", "/status", None),
            ("GET", "/metrics", None),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
            ("GET", "/", None),
        ] {
            let mut headers = vec![("host", host.as_str()), ("content-type", "text/plain")];
            if let Some(origin) = &origin {
                headers.push(("origin", origin));
            }
            let got = send(d.addr, method, path, &headers, &chat_text(false)).await;
            let what = format!("{method} {path} for {host}");
            assert_refused(&what, &got, 403, "host_not_allowed");
            let message = got.2["error"]["message"].as_str().unwrap();
            assert!(message.contains(&format!("{host:?}")), "{message}");
            assert!(message.contains("api.allowed_hosts"), "{message}");
        }
        let got = send(
            d.addr,
            "OPTIONS",
            "/v1/chat/completions",
            &[
                ("host", host.as_str()),
                ("origin", APP),
                ("access-control-request-method", "POST"),
            ],
            "",
        )
        .await;
        assert_refused(
            &format!("preflight for {host}"),
            &got,
            403,
            "host_not_allowed",
        );
    }
    assert_no_engine(&d).await;
}

/// Sends `request` as it is on a fresh connection and reads the answer to its end (the request
/// closes the connection); the status code.
fn raw_status(addr: std::net::SocketAddr, request: &str) -> u16 {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(10 * SEC)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let status = answer.split(' ').nth(1).and_then(|c| c.parse().ok());
    status.unwrap_or_else(|| panic!("no status line: {answer:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_names_and_listed_hosts_are_served() {
    let d =
        Daemon::start(&Setup::default().api("allowed_hosts", "[dsv4.lan, \"box.example:8443\"]"));
    let port = d.addr.port();
    for (host, status) in [
        (format!("localhost:{port}"), 200),
        (format!("127.0.0.1:{port}"), 200),
        (format!("[::1]:{port}"), 200),
        ("localhost".to_string(), 200),
        (format!("127.0.0.5:{port}"), 200),
        ("dsv4.lan".to_string(), 200),
        (format!("DSV4.lan:{port}"), 200),
        ("box.example:8443".to_string(), 200),
        // Listed with a port: that port only.
        ("box.example".to_string(), 403),
        (format!("box.example:{port}"), 403),
        (format!("lan:{port}"), 403),
    ] {
        let (got, _, v) = send(d.addr, "GET", "/status", &[("host", host.as_str())], "").await;
        assert_eq!(got, status, "{host}: {v}");
    }
    // HTTP/1.0 clients may send no Host; HTTP/1.1 ones must.
    let addr = d.addr;
    let ok = tokio::task::spawn_blocking(move || raw_status(addr, "GET /health HTTP/1.0\r\n\r\n"));
    assert_eq!(ok.await.unwrap(), 200);
    let no_host = "GET /health HTTP/1.1\r\nconnection: close\r\n\r\n";
    let bad = tokio::task::spawn_blocking(move || raw_status(addr, no_host));
    assert_eq!(bad.await.unwrap(), 400);
    assert_no_engine(&d).await;
    // A listed name reaches the engine too.
    let headers = [("host", "dsv4.lan"), ("content-type", "application/json")];
    let (status, _, v) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

/// Saves `setup`'s supervisor.yaml and waits until the daemon has reloaded it `times` times.
async fn reload(d: &Daemon, setup: &Setup, times: usize) {
    replace_file(
        &d.dir().join("supervisor.yaml"),
        &d.config_text(setup, "supervisor.yaml"),
    );
    let t = Instant::now();
    while d.log().matches("configuration reloaded").count() < times {
        assert!(t.elapsed() < PATIENCE, "no reload\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn origins_and_hosts_follow_a_reload() {
    let setup = Setup::default();
    let d = Daemon::start(&setup);
    let pid = d.child.id();
    let preflight = || async {
        let headers = preflight_headers(APP);
        send(d.addr, "OPTIONS", "/v1/chat/completions", &headers, "").await
    };
    let lan = || send(d.addr, "GET", "/status", &[("host", "dsv4.lan")], "");
    assert_eq!(preflight().await.0, 403);
    assert_eq!(lan().await.0, 403);

    let open = setup
        .clone()
        .api("cors_origins", &yaml_list(&[APP]))
        .api("allowed_hosts", "[dsv4.lan]");
    reload(&d, &open, 1).await;
    let (status, h, _) = preflight().await;
    assert_eq!(status, 204);
    assert_eq!(h["access-control-allow-origin"], APP);
    assert_eq!(lan().await.0, 200);

    reload(&d, &setup, 2).await;
    assert_eq!(preflight().await.0, 403);
    assert_eq!(lan().await.0, 403);
    assert_eq!(d.child.id(), pid);
    assert_no_engine(&d).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_engines_cors_headers_give_way_to_dsv4ds() {
    // What the engine does by itself: any origin may read its answers, with credentials.
    let engine = LlamaServer::start();
    let direct: std::net::SocketAddr = engine.url.trim_start_matches("http://").parse().unwrap();
    let (status, h, _) = send(
        direct,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight_headers(EVIL),
        "",
    )
    .await;
    assert_eq!(status, 200);
    let echoed = cors_headers(&h);
    assert!(
        echoed.contains(&format!("access-control-allow-origin: {EVIL}")),
        "{echoed:?}"
    );
    assert!(
        echoed.contains(&"access-control-allow-credentials: true".to_string()),
        "{echoed:?}"
    );
    let headers = [("origin", EVIL), ("content-type", "text/plain")];
    let (status, h, _) = send(
        direct,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(h["access-control-allow-origin"], EVIL);
    drop(engine);

    let d = Daemon::start(&crate::support::real::setup().api("cors_origins", &yaml_list(&[APP])));
    let got = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat_text(false),
    )
    .await;
    assert_refused("an unlisted page", &got, 403, "origin_not_allowed");
    let got = send(
        d.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight_headers(EVIL),
        "",
    )
    .await;
    assert_refused("an unlisted preflight", &got, 403, "origin_not_allowed");
    assert_eq!(d.status().await["state"], State::Stopped.as_str());
    let (status, h, _) = send(
        d.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &preflight_headers(APP),
        "",
    )
    .await;
    assert_eq!(status, 204);
    assert_eq!(h["access-control-allow-origin"], APP);
    assert_eq!(d.status().await["state"], State::Stopped.as_str());

    // Requests one after another from the listed page: the engine's answers carry only
    // dsv4d's header.
    let json = [("origin", APP), ("content-type", "application/json")];
    let only_ours = vec![format!("access-control-allow-origin: {APP}")];
    for stream in [false, true, false] {
        let (status, h, v) = send(
            d.addr,
            "POST",
            "/v1/chat/completions",
            &json,
            &chat_text(stream),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(cors_headers(&h), only_ours, "stream {stream}");
        match stream {
            true => assert!(v.as_str().unwrap().ends_with("data: [DONE]\n\n"), "{v}"),
            false => assert_eq!(v["choices"][0]["message"]["content"], "abc"),
        }
    }
    let (status, h, _) = send(
        d.addr,
        "OPTIONS",
        "/v1/chat/completions",
        &[("origin", APP)],
        "",
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(cors_headers(&h), only_ours);
    // A tool: llama-server's empty Access-Control-Allow-Origin does not come through.
    let (status, h, _) = send(
        d.addr,
        "POST",
        "/v1/chat/completions",
        &json[1..],
        &chat_text(false),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(cors_headers(&h), Vec::<String>::new());
    assert_eq!(d.status().await["generation"], 1);
}

/// Serves `html` (as it is when asked) to any request on `ip`, on a port of its own: a web
/// page of another site.
async fn page_server(ip: [u8; 4], html: Arc<Mutex<String>>) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::from(ip), 0))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let html = html.lock().unwrap().clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\n\
                     connection: close\r\n\r\n{html}",
                    html.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

/// A page that embeds dsv4d at `api` as a hostile site would: an image, a script and a form
/// posted into a frame.
fn hostile_page(api: std::net::SocketAddr) -> String {
    format!(
        r#"<!doctype html><html><body>
<img src="http://{api}/props">
<script src="http://{api}/v1/models"></script>
<iframe name="sink"></iframe>
<form id="f" method="POST" action="http://{api}/completion" enctype="text/plain" target="sink">
<input name='{{"prompt": "x", "n_predict": 1, "pad": "' value='"}}'>
</form>
<script>document.getElementById("f").submit();</script>
</body></html>"#
    )
}

/// A page of another local site that embeds dsv4d (an image and a script, which a browser
/// sends without an Origin, and a form post) never starts the engine, in a real browser. The
/// same page from a listed origin does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_browser_on_another_sites_page_never_starts_the_engine() {
    // The pages' servers first (the listed origin's port is known then), the page itself
    // once dsv4d's address is.
    let page = Arc::new(Mutex::new(String::new()));
    let hostile = page_server([127, 0, 0, 2], page.clone()).await;
    let friendly = page_server([127, 0, 0, 3], page.clone()).await;
    let d = Daemon::start(
        &Setup::default()
            .api("cors_origins", &yaml_list(&[&format!("http://{friendly}")]))
            .log_level("debug"),
    );
    *page.lock().unwrap() = hostile_page(d.addr);
    chromium(&format!("http://{hostile}/"));
    // Each of the three was refused, and the engine never started.
    let from = format!("\"http://{hostile}\"");
    d.log_with(&[
        &format!("refused a request from {from} of another site (Sec-Fetch-Site: cross-site)"),
        &format!("refused a request from the web page origin {from}"),
    ])
    .await;
    let log = d.log();
    assert_eq!(
        log.matches("of another site (Sec-Fetch-Site: cross-site)")
            .count(),
        2,
        "{log}"
    );
    assert_no_engine(&d).await;
    // The same page on the listed origin: its image starts the engine, and its form is served.
    chromium(&format!("http://{friendly}/"));
    d.wait_fake_log("request GET /props", PATIENCE).await;
    d.wait_fake_log("request POST /completion", PATIENCE).await;
    assert_eq!(d.spawns(), 1);
}
