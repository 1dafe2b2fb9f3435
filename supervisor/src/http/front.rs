//! What web browsers may do with the API: the `Host` a request names, and the web pages
//! (origins) whose scripts may use it.
//!
//! Owns: the `Host` check against DNS rebinding (loopback names, and `api.allowed_hosts`),
//! CORS (preflights answered here, every `Access-Control-*` header of the engine's replaced
//! by dsv4d's own, for the origins in `api.cors_origins`), the refusal of requests from other
//! web pages. The syntax of both keys, and of `Host` and `Origin`, is
//! `config::names`'s. Must not: start the engine or need it, ask a preflight for an API key (browsers send
//! none with it), or let a response allow credentials (dsv4d's keys travel in headers, never
//! in cookies).
//!
//! Why: a web page the user visits can send requests to `127.0.0.1:8080` ("simple" ones, like
//! a `text/plain` POST, even without a preflight). llama-server's own CORS headers would let
//! it read the answers, and every such request would load the model. A page can also make
//! its own name resolve to 127.0.0.1 (DNS rebinding), and then it is not even cross-origin:
//! only its `Host` header gives it away.

use std::net::{Ipv4Addr, Ipv6Addr};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};

use crate::config::names::{Authority, Origin};
use crate::config::Api;
use crate::http::http_error::{ApiError, ErrorCode, ErrorType};

/// What a listed origin's preflight is allowed: every method the engines serve.
const ALLOW_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE";

/// How long a browser may keep a preflight's answer (Chrome keeps it 2 h at most). Short, so
/// that an origin taken off the list stops passing preflights soon; its requests are refused
/// at once either way.
const MAX_AGE_SECS: &str = "600";

/// The longest `Host` or `Origin` an error message repeats.
const SHOWN_MAX: usize = 100;

/// Who sends a request that got past [`admit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// No `Origin`: not a script on a web page (curl, the SDKs, a server). Nothing to add.
    Tool,
    /// A script on a web page that may use the API: a listed origin, or a page dsv4d serves
    /// itself (the engine's web UI). Its responses carry this `Access-Control-Allow-Origin`.
    Page { allow_origin: HeaderValue },
}

/// The front's checks, before anything else happens to a request: its `Host` must be a
/// loopback name or listed in `api.allowed_hosts`, and a request from a web page (with an
/// `Origin`) must come from one listed in `api.cors_origins` or from a page of dsv4d's own.
/// The refusal is a 400 or 403 to send as it is.
pub fn admit<B>(api: &Api, req: &Request<B>) -> Result<Caller, ApiError> {
    let host = check_host(api, req)?;
    let mut origins = req.headers().get_all(header::ORIGIN).iter();
    let Some(origin) = origins.next() else {
        return without_origin(api, req.headers());
    };
    let listed = |allow_origin: HeaderValue| Ok(Caller::Page { allow_origin });
    if origins.next().is_none() {
        if api.cors_origins.iter().any(|o| o == "*") {
            return listed(HeaderValue::from_static("*"));
        }
        if let Some(parsed) = origin.to_str().ok().and_then(|o| Origin::parse(o).ok()) {
            // The same origin: a page dsv4d serves (over plain HTTP, at the Host just checked).
            let own = host.as_ref().is_some_and(|h| is_own(&parsed, h));
            let canonical = parsed.to_string();
            if own || api.cors_origins.contains(&canonical) {
                // As the browser sent it: it compares the answer byte for byte.
                return listed(origin.clone());
            }
        }
    }
    let shown = shown(origin.as_bytes());
    tracing::debug!("refused a request from the web page origin {shown:?}");
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        ErrorType::InvalidRequest,
        ErrorCode::OriginNotAllowed,
        format!(
            "requests from web pages at {shown:?} are not allowed: list the origin in \
             api.cors_origins to let its pages use this API"
        ),
    ))
}

/// Whether the request comes from a page dsv4d itself serves: one `Origin`, naming the host
/// the request is for over plain HTTP, and `Sec-Fetch-Site: same-origin` if the header is
/// there. Stricter than [`admit`]: neither `api.cors_origins` (even `*`) nor a missing
/// `Origin` passes. What the dashboard's actions need, so that no other page and no tool
/// can use them.
pub fn same_origin<B>(api: &Api, req: &Request<B>) -> Result<(), ApiError> {
    let refused = |why: &str| {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorType::InvalidRequest,
            ErrorCode::NotSameOrigin,
            format!(
                "{why}: the dashboard's actions are taken only from its own page (/ui); \
                 dsv4ctl does each of them over D-Bus"
            ),
        ))
    };
    let host = check_host(api, req)?;
    let mut origins = req.headers().get_all(header::ORIGIN).iter();
    let (Some(origin), None) = (origins.next(), origins.next()) else {
        return refused("the request has no single Origin header");
    };
    let site = req.headers().get(SEC_FETCH_SITE).map(HeaderValue::as_bytes);
    if site.is_some_and(|s| s != b"same-origin") {
        return refused("the request comes from another site");
    }
    let own = origin
        .to_str()
        .ok()
        .and_then(|o| Origin::parse(o).ok())
        .zip(host)
        .is_some_and(|(o, h)| is_own(&o, &h));
    match own {
        true => Ok(()),
        false => refused(&format!(
            "the request comes from the page origin {:?}",
            shown(origin.as_bytes())
        )),
    }
}

/// Whether `origin` is dsv4d's own for a request to `host`: its pages are served over plain
/// HTTP at the host the request names.
fn is_own(origin: &Origin, host: &Authority) -> bool {
    origin.scheme == "http"
        && origin.authority.host == host.host
        && origin.authority.port == host.port.filter(|p| *p != 80)
}

/// The `Sec-Fetch-Site` header, which browsers send on every request (and no other client).
const SEC_FETCH_SITE: HeaderName = HeaderName::from_static("sec-fetch-site");

/// A request without an `Origin`: a tool (curl, the `openai` packages), the user's own
/// navigation (`Sec-Fetch-Site: none`), a page dsv4d serves (`same-origin`), or a page of
/// another site that embeds the API (an `<img>`, a `<script>`: `cross-site` or `same-site`,
/// sent with no Origin and no preflight). The last is refused unless its page, as its
/// `Referer` names it, is listed in `api.cors_origins`: each such request would load the
/// engine.
fn without_origin(api: &Api, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let site = headers.get(SEC_FETCH_SITE).map(HeaderValue::as_bytes);
    if matches!(site, None | Some(b"none") | Some(b"same-origin"))
        || api.cors_origins.iter().any(|o| o == "*")
    {
        return Ok(Caller::Tool);
    }
    let page = headers
        .get(header::REFERER)
        .and_then(|r| r.to_str().ok())
        .and_then(origin_of_url);
    if let Some(page) = &page {
        if api.cors_origins.contains(&page.to_string()) {
            return Ok(Caller::Tool);
        }
    }
    let site = shown(site.unwrap_or_default());
    let from = page.map_or_else(
        || "an unnamed page".to_string(),
        |p| format!("{:?}", p.to_string()),
    );
    tracing::debug!("refused a request from {from} of another site (Sec-Fetch-Site: {site})");
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        ErrorType::InvalidRequest,
        ErrorCode::OriginNotAllowed,
        format!(
            "requests embedded in web pages of other sites (Sec-Fetch-Site: {site}, from \
             {from}) are not allowed: list the page's origin in api.cors_origins to let its \
             pages use this API"
        ),
    ))
}

/// The origin of a URL (`http://127.0.0.2:9000/page.html` -> `http://127.0.0.2:9000`).
fn origin_of_url(url: &str) -> Option<Origin> {
    let (scheme, rest) = url.split_once("://")?;
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    Origin::parse(&format!("{scheme}://{}", &rest[..end])).ok()
}

/// What the front door asks of a name.
impl Authority {
    /// Whether this is a name for the machine itself: `localhost`, any `127.x.y.z`, `[::1]`
    /// (also as `[::ffff:127.0.0.1]`). Such a name cannot be made to lead elsewhere by a web
    /// page, which is what DNS rebinding needs.
    pub(crate) fn is_loopback(&self) -> bool {
        if self.host == "localhost" {
            return true;
        }
        if let Ok(v4) = self.host.parse::<Ipv4Addr>() {
            return v4.is_loopback();
        }
        let v6 = self
            .host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'));
        v6.and_then(|h| h.parse::<Ipv6Addr>().ok())
            .is_some_and(|v6| {
                v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
            })
    }

    /// Whether `entry`, an `api.allowed_hosts` item in its canonical form, names this host: a
    /// bare host matches it on any port, `host:port` on that port only.
    pub(crate) fn matches(&self, entry: &str) -> bool {
        match entry.strip_prefix(self.host.as_str()) {
            Some("") => true,
            Some(rest) => {
                let port = rest.strip_prefix(':').and_then(|p| p.parse::<u16>().ok());
                port.is_some() && port == self.port
            }
            None => false,
        }
    }
}

/// Reads a `Host` (or a URI's authority); a loopback one is kept as the last seen.
fn parse_host(text: &[u8]) -> Option<Authority> {
    let host = Authority::parse(std::str::from_utf8(text).ok()?).ok()?;
    if host.is_loopback() {
        LAST_LOOPBACK.with_borrow_mut(|last| *last = Some((text.to_vec(), host.clone())));
    }
    Some(host)
}

thread_local! {
    /// The last `Host` read that named the machine itself, as written and as read: each
    /// request of a client names the same host, and reading it again was a tenth of the
    /// front door's cost per request (callgrind). Whether a loopback name is allowed does
    /// not depend on the configuration, so this memo never needs to be forgotten.
    static LAST_LOOPBACK: std::cell::RefCell<Option<(Vec<u8>, Authority)>> =
        const { std::cell::RefCell::new(None) };
}

/// `text` read as the last loopback `Host` was, if it is that one, byte for byte.
fn loopback_seen(text: &[u8]) -> Option<Authority> {
    LAST_LOOPBACK.with_borrow(|last| {
        last.as_ref()
            .filter(|(seen, _)| seen.as_slice() == text)
            .map(|(_, host)| host.clone())
    })
}

/// The host the request names (its URI's authority when it is in absolute form, and its
/// `Host`), when allowed; `None` for an HTTP/1.0 request without one.
fn check_host<B>(api: &Api, req: &Request<B>) -> Result<Option<Authority>, ApiError> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let (header, more) = (hosts.next(), hosts.next().is_some());
    let bad_request = |message: &str| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorType::InvalidRequest,
            ErrorCode::InvalidHost,
            message,
        )
    };
    if more {
        return Err(bad_request("the request has more than one Host header"));
    }
    let uri = req.uri().authority().map(|a| a.as_str().as_bytes());
    let named = [uri, header.map(HeaderValue::as_bytes)];
    let mut allowed = None;
    for text in named.into_iter().flatten() {
        match loopback_seen(text).or_else(|| parse_host(text)) {
            Some(host)
                if host.is_loopback() || api.allowed_hosts.iter().any(|e| host.matches(e)) =>
            {
                // The URI's, when it has one (RFC 9112 3.2.2).
                allowed.get_or_insert(host);
            }
            _ => {
                let shown = shown(text);
                tracing::debug!("refused a request for the host {shown:?}");
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    ErrorType::InvalidRequest,
                    ErrorCode::HostNotAllowed,
                    format!(
                        "the host {shown:?} is not allowed: add it to api.allowed_hosts if \
                         clients reach dsv4d by this name. Only loopback names are allowed \
                         without it, so that no web page can reach the API by DNS rebinding"
                    ),
                ));
            }
        }
    }
    // HTTP/1.1 requires a Host (RFC 9112 3.2); HTTP/1.0 clients may not send one.
    if allowed.is_none() && req.version() != Version::HTTP_10 {
        return Err(bad_request(
            "the request has no Host header, which HTTP/1.1 requires",
        ));
    }
    Ok(allowed)
}

/// Text from a request, for a message: lossy UTF-8, cut at [`SHOWN_MAX`] characters.
fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    match text.char_indices().nth(SHOWN_MAX) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.into_owned(),
    }
}

/// Whether the request is a CORS preflight: `OPTIONS` with `Origin` and
/// `Access-Control-Request-Method`. dsv4d answers it itself; the engine never sees one.
pub fn is_preflight<B>(req: &Request<B>) -> bool {
    let h = req.headers();
    req.method() == Method::OPTIONS
        && h.contains_key(header::ORIGIN)
        && h.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
}

/// The answer to a preflight from `caller`, a page [`admit`] let through: 204, allowing
/// every method the engines serve and the headers the page asked for.
pub fn preflight<B: From<Bytes>>(caller: &Caller, request: &HeaderMap) -> Response<B> {
    let mut r = Response::new(B::from(Bytes::new()));
    *r.status_mut() = StatusCode::NO_CONTENT;
    let Caller::Page { allow_origin } = caller else {
        // Not a preflight (no Origin): nothing to allow.
        return r;
    };
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin.clone());
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(ALLOW_METHODS),
    );
    if let Some(asked) = requested_headers(request) {
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked);
    }
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static(MAX_AGE_SECS),
    );
    // Chrome asks before a public site's page may reach a private address (Private Network
    // Access); a listed origin is meant to.
    let private = HeaderName::from_static("access-control-request-private-network");
    if request.get(private).is_some_and(|v| v == "true") {
        h.insert(
            HeaderName::from_static("access-control-allow-private-network"),
            HeaderValue::from_static("true"),
        );
    }
    h.insert(
        header::VARY,
        HeaderValue::from_static(
            "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
        ),
    );
    r
}

/// `Access-Control-Request-Headers` when it is a list of header names (`authorization,
/// content-type, x-api-key`, or the SDKs' `x-stainless-*`): allowed as asked.
fn requested_headers(request: &HeaderMap) -> Option<HeaderValue> {
    let asked = request.get(header::ACCESS_CONTROL_REQUEST_HEADERS)?;
    let names: Vec<&str> = asked.to_str().ok()?.split(',').map(str::trim).collect();
    let valid = |n: &&str| HeaderName::from_bytes(n.as_bytes()).is_ok();
    if names.iter().all(valid) {
        Some(asked.clone())
    } else {
        None
    }
}

/// Sets the CORS headers of a response to `caller`: every `Access-Control-*` header the
/// engine sent goes (llama-server allows any origin, with credentials), and a page allowed
/// by [`admit`] gets its `Access-Control-Allow-Origin`.
pub fn finish(caller: &Caller, headers: &mut HeaderMap) {
    let theirs: Vec<HeaderName> = headers
        .keys()
        .filter(|k| k.as_str().starts_with("access-control-"))
        .cloned()
        .collect();
    for name in theirs {
        headers.remove(name);
    }
    if let Caller::Page { allow_origin } = caller {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow_origin.clone());
        if allow_origin != "*" {
            headers.append(header::VARY, HeaderValue::from_static("Origin"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::names::{host_entry, origin_entry};

    fn api(origins: &[&str], hosts: &[&str]) -> Api {
        Api {
            cors_origins: origins.iter().map(|o| origin_entry(o).unwrap()).collect(),
            allowed_hosts: hosts.iter().map(|h| host_entry(h).unwrap()).collect(),
            ..Api::default()
        }
    }

    fn request(version: Version, headers: &[(&str, &str)]) -> Request<()> {
        let mut r = Request::post("/v1/chat/completions").version(version);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.body(()).unwrap()
    }

    fn get(headers: &[(&str, &str)]) -> Request<()> {
        request(Version::HTTP_11, headers)
    }

    #[test]
    fn only_dsv4ds_own_page_is_the_same_origin() {
        let listed = api(&["*"], &["dsv4.lan"]);
        for (headers, same) in [
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                ][..],
                true,
            ),
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                ],
                true,
            ),
            (
                &[("host", "localhost"), ("origin", "http://LOCALHOST:80")],
                true,
            ),
            (
                &[
                    ("host", "dsv4.lan:8080"),
                    ("origin", "http://dsv4.lan:8080"),
                ],
                true,
            ),
            // No Origin: a tool, or a navigation.
            (&[("host", "127.0.0.1:8080")], false),
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                ],
                false,
            ),
            // Another port, host or scheme is another origin, listed or not.
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8081"),
                ],
                false,
            ),
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://localhost:8080"),
                ],
                false,
            ),
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "https://127.0.0.1:8080"),
                ],
                false,
            ),
            (&[("host", "127.0.0.1:8080"), ("origin", "null")], false),
            // The browser says the page is of another site.
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                    ("sec-fetch-site", "same-site"),
                ],
                false,
            ),
            // Two origins.
            (
                &[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                ],
                false,
            ),
        ] {
            let r = same_origin(&listed, &get(headers));
            assert_eq!(r.is_ok(), same, "{headers:?}: {r:?}");
            if let Err(e) = r {
                assert_eq!(e.code, ErrorCode::NotSameOrigin, "{headers:?}");
                assert_eq!(e.status, StatusCode::FORBIDDEN);
            }
        }
        // A host that is not allowed is refused as ever.
        let e = same_origin(
            &listed,
            &get(&[("host", "evil.example"), ("origin", "http://evil.example")]),
        )
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::HostNotAllowed);
    }

    #[test]
    fn host_spellings() {
        for (text, host, port) in [
            ("localhost", "localhost", None),
            ("LocalHost:8080", "localhost", Some(8080)),
            ("127.0.0.1:1", "127.0.0.1", Some(1)),
            ("[::1]", "[::1]", None),
            ("[0:0:0:0:0:0:0:1]:65535", "[::1]", Some(65535)),
            ("::1", "[::1]", None),
            ("dsv4.lan", "dsv4.lan", None),
            ("Box-1.Example.COM:8443", "box-1.example.com", Some(8443)),
            ("my_host", "my_host", None),
            ("xn--bcher-kva.example", "xn--bcher-kva.example", None),
        ] {
            let a = Authority::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!((a.host.as_str(), a.port), (host, port), "{text}");
        }
    }

    #[test]
    fn bad_hosts_say_why() {
        for (text, why) in [
            ("", "must not be empty"),
            ("http://dsv4.lan", "without a scheme"),
            ("*.example.com", "wildcards are not supported"),
            ("dsv4.lan/", "a host has no '/'"),
            ("user@dsv4.lan", "a host has no '@'"),
            ("dsv4.lan:", "the port must be a number from 1 to 65535"),
            ("dsv4.lan:0", "the port must be a number"),
            ("dsv4.lan:65536", "the port must be a number"),
            ("dsv4.lan:+80", "the port must be a number"),
            ("dsv4.lan:80:81", "not an IPv6 address"),
            (":8080", "the host name is missing"),
            ("127.1", "not an IPv4 address"),
            ("300.0.0.1", "not an IPv4 address"),
            // Leading zeros: octal to some resolvers, so no spelling of an address but one.
            ("127.0.0.01", "not an IPv4 address"),
            ("0127.0.0.1:80", "not an IPv4 address"),
            ("[::1", "lacks its closing ]"),
            ("[::1]8080", "expected :port after ]"),
            ("[dsv4.lan]", "not an IPv6 address"),
            ("dsv4..lan", "not a host name"),
            (".dsv4.lan", "not a host name"),
            ("dsv4 lan", "not a host name"),
            ("bücher.example", "xn-- form"),
        ] {
            let e = Authority::parse(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn loopback_names() {
        for text in [
            "localhost",
            "localhost:8080",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.255.3.4:1",
            "[::1]",
            "[::1]:8080",
            "::1",
            "[::ffff:127.0.0.1]:8080",
        ] {
            assert!(Authority::parse(text).unwrap().is_loopback(), "{text}");
        }
        for text in [
            "localhost.example",
            "evil.localhost.example",
            "128.0.0.1",
            "0.0.0.0",
            "[::]",
            "[::2]",
            "192.168.1.5:8080",
            "127.0.0.1.nip.io",
        ] {
            assert!(!Authority::parse(text).unwrap().is_loopback(), "{text}");
        }
    }

    #[test]
    fn origin_entries_are_canonical() {
        for (text, want) in [
            ("*", "*"),
            ("https://chat.example.com", "https://chat.example.com"),
            ("HTTPS://Chat.Example.com:443", "https://chat.example.com"),
            ("http://localhost:80", "http://localhost"),
            ("http://localhost:3000", "http://localhost:3000"),
            ("https://example.com:80", "https://example.com:80"),
            ("http://[::1]:3000", "http://[::1]:3000"),
            ("chrome-extension://abcdefgh", "chrome-extension://abcdefgh"),
            ("tauri://localhost", "tauri://localhost"),
        ] {
            assert_eq!(origin_entry(text).as_deref(), Ok(want), "{text}");
        }
    }

    #[test]
    fn bad_origins_say_why() {
        for (text, why) in [
            ("", "expected scheme://host[:port]"),
            ("chat.example.com", "expected scheme://host[:port]"),
            ("null", "the null origin cannot be listed"),
            (
                "https://chat.example.com/",
                "an origin has no path, query or fragment: write \"https://chat.example.com\"",
            ),
            ("https://chat.example.com/app", "no path"),
            ("https://x.example?a=1", "no path, query"),
            ("https://*.example.com", "wildcards are not supported"),
            ("https://user@x.example", "no user name"),
            ("1http://x.example", "invalid scheme"),
            ("://x.example", "invalid scheme"),
            ("https://", "must not be empty"),
            ("https://x.example:99999", "the port must be"),
            ("*://x.example", "invalid scheme"),
        ] {
            let e = origin_entry(text).unwrap_err();
            assert!(e.starts_with(&format!("invalid origin {text:?}: ")), "{e}");
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn host_entries_are_canonical() {
        assert_eq!(host_entry("DSV4.lan").as_deref(), Ok("dsv4.lan"));
        assert_eq!(host_entry("[0::1]:80").as_deref(), Ok("[::1]:80"));
        let e = host_entry("https://dsv4.lan").unwrap_err();
        assert_eq!(
            e,
            "invalid host \"https://dsv4.lan\": write the host alone, without a scheme \
             (e.g. dsv4.lan or dsv4.lan:8080)"
        );
    }

    /// What the front makes of a request: `tool`, `page ORIGIN-TO-ALLOW`, or `STATUS CODE`.
    fn outcome(api: &Api, req: &Request<()>) -> String {
        match admit(api, req) {
            Ok(Caller::Tool) => "tool".into(),
            Ok(Caller::Page { allow_origin }) => format!("page {}", allow_origin.to_str().unwrap()),
            Err(e) => format!("{} {}", e.status.as_u16(), e.code),
        }
    }

    #[test]
    fn hosts_are_loopback_or_listed() {
        let none = api(&[], &[]);
        let listed = api(&[], &["dsv4.lan", "box.example:8443", "192.168.1.5"]);
        let refused = "403 host_not_allowed";
        for (host, by_default, when_listed) in [
            ("localhost:8080", "tool", "tool"),
            ("127.0.0.1:8080", "tool", "tool"),
            ("127.0.0.2", "tool", "tool"),
            ("[::1]:8080", "tool", "tool"),
            ("evil.example", refused, refused),
            ("evil.example:8080", refused, refused),
            ("dsv4.lan", refused, "tool"),
            ("DSV4.LAN:8080", refused, "tool"),
            ("box.example:8443", refused, "tool"),
            ("box.example:8080", refused, refused),
            ("box.example", refused, refused),
            ("192.168.1.5:8080", refused, "tool"),
            ("dsv4.lan.evil.example", refused, refused),
            ("dsv4.la", refused, refused),
            ("not a host", refused, refused),
            ("", refused, refused),
        ] {
            let req = get(&[("host", host)]);
            assert_eq!(outcome(&none, &req), by_default, "{host:?}");
            assert_eq!(outcome(&listed, &req), when_listed, "{host:?} listed");
        }
    }

    #[test]
    fn a_missing_host_passes_only_in_http_1_0() {
        let none = api(&[], &[]);
        assert_eq!(outcome(&none, &request(Version::HTTP_10, &[])), "tool");
        let missing = "400 invalid_host";
        assert_eq!(outcome(&none, &request(Version::HTTP_11, &[])), missing);
        // Named, it is checked in HTTP/1.0 too.
        let evil = request(Version::HTTP_10, &[("host", "evil.example")]);
        assert_eq!(outcome(&none, &evil), "403 host_not_allowed");
        let twice = get(&[("host", "localhost"), ("host", "localhost")]);
        assert_eq!(outcome(&none, &twice), missing);
    }

    #[test]
    fn an_absolute_uri_names_the_host_too() {
        let none = api(&[], &[]);
        let req = |uri: &str| {
            Request::get(uri)
                .header("host", "localhost:8080")
                .body(())
                .unwrap()
        };
        assert_eq!(outcome(&none, &req("http://127.0.0.1:8080/status")), "tool");
        let evil = req("http://evil.example/status");
        assert_eq!(outcome(&none, &evil), "403 host_not_allowed");
    }

    #[test]
    fn origins_are_listed_or_the_pages_own() {
        let none = api(&[], &[]);
        let listed = api(&["https://app.example", "http://localhost:3000"], &[]);
        let any = api(&["*"], &[]);
        let refused = "403 origin_not_allowed";
        for (host, origin, by_default, when_listed) in [
            (
                "localhost:8080",
                "https://app.example",
                refused,
                "page https://app.example",
            ),
            (
                "localhost:8080",
                "http://localhost:3000",
                refused,
                "page http://localhost:3000",
            ),
            ("localhost:8080", "https://evil.example", refused, refused),
            ("localhost:8080", "http://app.example", refused, refused),
            (
                "localhost:8080",
                "https://app.example:8443",
                refused,
                refused,
            ),
            ("localhost:8080", "null", refused, refused),
            ("localhost:8080", "garbage", refused, refused),
            // The page's own origin: dsv4d served it (the engine's web UI).
            (
                "localhost:8080",
                "http://localhost:8080",
                "page http://localhost:8080",
                "page http://localhost:8080",
            ),
            (
                "127.0.0.1",
                "http://127.0.0.1",
                "page http://127.0.0.1",
                "page http://127.0.0.1",
            ),
            (
                "127.0.0.1:80",
                "http://127.0.0.1",
                "page http://127.0.0.1",
                "page http://127.0.0.1",
            ),
            // Another port, scheme or name of the same machine is another origin.
            ("localhost:8080", "http://localhost:3001", refused, refused),
            ("localhost:8080", "https://localhost:8080", refused, refused),
            ("127.0.0.1:8080", "http://localhost:8080", refused, refused),
        ] {
            let req = get(&[("host", host), ("origin", origin)]);
            assert_eq!(outcome(&none, &req), by_default, "{host} {origin}");
            assert_eq!(
                outcome(&listed, &req),
                when_listed,
                "{host} {origin} listed"
            );
            assert_eq!(outcome(&any, &req), "page *", "{host} {origin} any");
        }
        // Two Origin headers: no browser sends that.
        let twice = get(&[
            ("host", "localhost"),
            ("origin", "https://app.example"),
            ("origin", "https://app.example"),
        ]);
        assert_eq!(outcome(&listed, &twice), refused);
        // A bad Host is refused before the origin is looked at, even with `*`.
        let evil = get(&[("host", "evil.example"), ("origin", "http://evil.example")]);
        assert_eq!(outcome(&any, &evil), "403 host_not_allowed");
    }

    #[test]
    fn embedded_requests_from_other_sites_need_their_page_listed() {
        let none = api(&[], &[]);
        let listed = api(&["http://127.0.0.3:9000"], &[]);
        let any = api(&["*"], &[]);
        let host = ("host", "127.0.0.1:8080");
        let from = |site: &'static str, referer: Option<&'static str>| {
            let mut h = vec![host, ("sec-fetch-site", site)];
            h.extend(referer.map(|r| ("referer", r)));
            h
        };
        for (headers, by_default, when_listed) in [
            // Tools send no Sec-Fetch-Site; the user's own navigation says none; the pages
            // dsv4d serves, same-origin.
            (vec![host], true, true),
            (from("none", None), true, true),
            (
                from("same-origin", Some("http://127.0.0.1:8080/")),
                true,
                true,
            ),
            // An <img> or <script> on another site's page.
            (
                from("cross-site", Some("http://127.0.0.2:9000/page.html")),
                false,
                false,
            ),
            (
                from("cross-site", Some("http://127.0.0.3:9000/page.html")),
                false,
                true,
            ),
            (from("cross-site", None), false, false),
            (
                from("same-site", Some("http://localhost:3000/")),
                false,
                false,
            ),
            (from("cross-site", Some("not a url")), false, false),
        ] {
            let req = get(&headers);
            assert_eq!(admit(&none, &req).is_ok(), by_default, "{headers:?}");
            assert_eq!(admit(&listed, &req).is_ok(), when_listed, "{headers:?}");
            assert!(admit(&any, &req).is_ok(), "{headers:?}");
        }
        let refused = admit(
            &none,
            &get(&from("cross-site", Some("http://127.0.0.2:9000/p"))),
        )
        .unwrap_err();
        assert_eq!(refused.code, ErrorCode::OriginNotAllowed);
        assert!(
            refused
                .message
                .contains("(Sec-Fetch-Site: cross-site, from \"http://127.0.0.2:9000\")"),
            "{}",
            refused.message
        );
    }

    #[test]
    fn refusals_name_the_value_and_the_key() {
        let none = api(&[], &[]);
        let e = admit(&none, &get(&[("host", "evil.example:8080")])).unwrap_err();
        assert!(
            e.message.starts_with(
                "the host \"evil.example:8080\" is not allowed: add it to api.allowed_hosts"
            ),
            "{}",
            e.message
        );
        let req = get(&[("host", "localhost"), ("origin", "https://evil.example")]);
        let e = admit(&none, &req).unwrap_err();
        assert_eq!(
            e.message,
            "requests from web pages at \"https://evil.example\" are not allowed: list the \
             origin in api.cors_origins to let its pages use this API"
        );
        let long = format!("{}.example", "a".repeat(500));
        let e = admit(&none, &get(&[("host", &long)])).unwrap_err();
        assert!(e.message.len() < 400, "{}", e.message);
    }

    fn headers_of<B>(r: &Response<B>) -> Vec<(String, String)> {
        let mut v: Vec<_> = r
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_preflight_allows_what_the_page_asks_for() {
        let req = Request::options("/v1/chat/completions")
            .header("origin", "https://app.example")
            .header("access-control-request-method", "POST")
            .header(
                "access-control-request-headers",
                "authorization, content-type, x-stainless-os",
            )
            .header("access-control-request-private-network", "true")
            .body(())
            .unwrap();
        assert!(is_preflight(&req));
        let caller = Caller::Page {
            allow_origin: HeaderValue::from_static("https://app.example"),
        };
        let r: Response<Bytes> = preflight(&caller, req.headers());
        assert_eq!(r.status(), 204);
        let want = [
            (
                "access-control-allow-headers",
                "authorization, content-type, x-stainless-os",
            ),
            ("access-control-allow-methods", ALLOW_METHODS),
            ("access-control-allow-origin", "https://app.example"),
            ("access-control-allow-private-network", "true"),
            ("access-control-max-age", "600"),
            (
                "vary",
                "Origin, Access-Control-Request-Method, Access-Control-Request-Headers",
            ),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(headers_of(&r), want);

        // Headers that are not header names are not echoed.
        let mut asked = HeaderMap::new();
        asked.insert(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static("a b, c"),
        );
        let r: Response<Bytes> = preflight(&caller, &asked);
        assert!(r
            .headers()
            .get(header::ACCESS_CONTROL_ALLOW_HEADERS)
            .is_none());
        assert!(r
            .headers()
            .get("access-control-allow-private-network")
            .is_none());

        // Not a preflight: no Origin, or no method asked.
        let plain = |h: &[(&str, &str)]| {
            let mut r = Request::options("/");
            for (k, v) in h {
                r = r.header(*k, *v);
            }
            is_preflight(&r.body(()).unwrap())
        };
        assert!(!plain(&[("access-control-request-method", "POST")]));
        assert!(!plain(&[("origin", "https://app.example")]));
    }

    #[test]
    fn the_engines_cors_headers_are_replaced() {
        // llama-server's, on a preflight it answers itself.
        let engine = || {
            let mut h = HeaderMap::new();
            for (k, v) in [
                ("access-control-allow-origin", "https://evil.example"),
                ("access-control-allow-credentials", "true"),
                ("access-control-allow-methods", "GET, POST, DELETE, OPTIONS"),
                ("access-control-allow-headers", "*"),
                ("content-type", "application/json"),
                ("vary", "accept-encoding"),
            ] {
                h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
            }
            h
        };
        let mut h = engine();
        finish(&Caller::Tool, &mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        left.sort();
        assert_eq!(left, ["content-type", "vary"]);

        let mut h = engine();
        let page = Caller::Page {
            allow_origin: HeaderValue::from_static("https://app.example"),
        };
        finish(&page, &mut h);
        assert_eq!(
            h.get_all("access-control-allow-origin")
                .iter()
                .collect::<Vec<_>>(),
            ["https://app.example"]
        );
        assert_eq!(
            h.get_all("vary").iter().collect::<Vec<_>>(),
            ["accept-encoding", "Origin"]
        );
        assert!(h.get("access-control-allow-credentials").is_none());
        assert!(h.get("access-control-allow-methods").is_none());

        let mut h = engine();
        finish(
            &Caller::Page {
                allow_origin: HeaderValue::from_static("*"),
            },
            &mut h,
        );
        assert_eq!(h.get("access-control-allow-origin").unwrap(), "*");
        assert_eq!(h.get_all("vary").iter().count(), 1);
    }
}
