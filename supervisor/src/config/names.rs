//! Host names and web origins, as the configuration lists them (`api.allowed_hosts`,
//! `api.cors_origins`) and as requests name them (`Host`, `Origin`): their syntax and their
//! canonical spelling, the same for both sides so that they compare byte for byte.
//!
//! Owns: parsing and canonical forms. Must not: decide what is allowed (the front door's
//! business: `http::front` says which names are the machine's own and which an entry
//! lists).

use std::net::{Ipv4Addr, Ipv6Addr};

/// A host as a request or the configuration names it: a lowercase name, an IPv4 address, or
/// an IPv6 address in brackets (`[::1]`), each in its canonical spelling; and the port, when
/// one is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authority {
    pub host: String,
    pub port: Option<u16>,
}

impl Authority {
    /// Reads `host`, `host:port`, `[v6]`, `[v6]:port`, or a bare IPv6 address (`::1`, which
    /// has no port). The error says what is wrong, without repeating the text.
    pub fn parse(text: &str) -> Result<Authority, String> {
        if text.is_empty() {
            return Err("must not be empty".into());
        }
        if text.contains("://") {
            return Err("write the host alone, without a scheme".into());
        }
        if text.contains('*') {
            return Err("wildcards are not supported: list each name".into());
        }
        if let Some(bad) = text.chars().find(|c| matches!(c, '/' | '?' | '#' | '@')) {
            return Err(format!("a host has no {bad:?}: write host or host:port"));
        }
        let (host, port) = if let Some(rest) = text.strip_prefix('[') {
            let (v6, after) = rest
                .split_once(']')
                .ok_or("an IPv6 address in brackets lacks its closing ]")?;
            let v6: Ipv6Addr = v6.parse().map_err(|_| "not an IPv6 address")?;
            let port = match after {
                "" => None,
                _ => Some(after.strip_prefix(':').ok_or("expected :port after ]")?),
            };
            (format!("[{v6}]"), port)
        } else if text.matches(':').count() > 1 {
            // Only an IPv6 address has several colons; without brackets it has no port.
            let v6: Ipv6Addr = text.parse().map_err(|_| {
                "not an IPv6 address (write it in brackets with a port: [::1]:8080)"
            })?;
            (format!("[{v6}]"), None)
        } else {
            let (name, port) = match text.split_once(':') {
                Some((name, port)) => (name, Some(port)),
                None => (text, None),
            };
            (host_name(name)?, port)
        };
        let port = port.map(parse_port).transpose()?;
        Ok(Authority { host, port })
    }
}

impl std::fmt::Display for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.host)?;
        match self.port {
            Some(port) => write!(f, ":{port}"),
            None => Ok(()),
        }
    }
}

/// A DNS name or an IPv4 address, lowercase. Names: ASCII letters, digits, `-` and `_`, in
/// dot-separated labels (an international name in its `xn--` form).
fn host_name(name: &str) -> Result<String, String> {
    if name.is_empty() {
        return Err("the host name is missing".into());
    }
    if name.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        // Digits alone would be read as an address by a browser, which writes it in full.
        // The parser takes only the canonical form (four numbers, no leading zeros), so the
        // text is already as a browser writes it (and formatting it again cost more than the
        // rest of the Host check).
        let _: Ipv4Addr = name
            .parse()
            .map_err(|_| "not an IPv4 address (write all four numbers, e.g. 127.0.0.1)")?;
        return Ok(name.to_owned());
    }
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    if name.len() > 253 || !name.split('.').all(label) {
        return Err(
            "not a host name: use letters, digits, '-' and '.' (an international \
                    name in its xn-- form)"
                .into(),
        );
    }
    Ok(name.to_ascii_lowercase())
}

fn parse_port(text: &str) -> Result<u16, String> {
    let port = text.parse::<u16>().ok().filter(|p| *p > 0);
    port.filter(|_| text.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(|| "the port must be a number from 1 to 65535".into())
}

/// A web origin, `scheme://host[:port]`: lowercase, without the scheme's default port
/// (browsers send `https://example.com`, never `https://example.com:443`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub scheme: String,
    pub authority: Authority,
}

impl Origin {
    /// Reads an origin. The error says what is wrong, without repeating the text.
    pub fn parse(text: &str) -> Result<Origin, String> {
        let example = "expected scheme://host[:port], e.g. https://chat.example.com or \
                       http://localhost:3000";
        if text == "null" {
            // Sent by local files and sandboxed frames: any page can claim to be one.
            return Err(
                "the null origin cannot be listed: any page can send it (list * to \
                        allow every origin)"
                    .into(),
            );
        }
        let (scheme, rest) = text.split_once("://").ok_or(example)?;
        let mut chars = scheme.chars();
        let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
            && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if !valid {
            return Err(format!("invalid scheme: {example}"));
        }
        let scheme = scheme.to_ascii_lowercase();
        if let Some(i) = rest.find(['/', '?', '#']) {
            let shown = format!("{scheme}://{}", &rest[..i]);
            return Err(format!(
                "an origin has no path, query or fragment: write {shown:?}"
            ));
        }
        if rest.contains('@') {
            return Err("an origin has no user name: write scheme://host[:port]".into());
        }
        let mut authority = Authority::parse(rest)?;
        let default = match scheme.as_str() {
            "http" => Some(80),
            "https" => Some(443),
            _ => None,
        };
        if authority.port.is_some() && authority.port == default {
            authority.port = None;
        }
        Ok(Origin { scheme, authority })
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

/// An `api.cors_origins` item in its canonical form: `*`, or the origin written lowercase
/// without its default port. The error names the item.
pub fn origin_entry(text: &str) -> Result<String, String> {
    if text == "*" {
        return Ok(text.into());
    }
    match Origin::parse(text) {
        Ok(origin) => Ok(origin.to_string()),
        Err(why) => Err(format!("invalid origin {text:?}: {why}")),
    }
}

/// An `api.allowed_hosts` item in its canonical form: `host` or `host:port`, lowercase. The
/// error names the item.
pub fn host_entry(text: &str) -> Result<String, String> {
    match Authority::parse(text) {
        Ok(host) => Ok(host.to_string()),
        Err(why) => Err(format!(
            "invalid host {text:?}: {why} (e.g. dsv4.lan or dsv4.lan:8080)"
        )),
    }
}
