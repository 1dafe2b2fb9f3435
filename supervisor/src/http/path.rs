//! The request path as the engine sees it. llama-server's HTTP library (cpp-httplib)
//! percent-decodes the path before it routes (`decode_path_component`: `%XX`, and `%uXXXX`
//! as UTF-8), so `/%73lots/0` is `/slots/0` to it. Every path rule of dsv4d (the slot guard,
//! its own endpoints, the statistics) judges the decoded path, and the engine is sent that
//! same path, encoded so that one decoding gives it back exactly: what the engine routes is
//! what dsv4d judged, whatever the client wrote.
//!
//! Owns: decoding strictly and encoding canonically. Must not: accept a path whose decoding
//! another parser could read differently: an escape that is not `%` and two hex digits (the
//! `%u` form included), bytes that are not UTF-8 once decoded, control characters, `.` or
//! `..` segments (cpp-httplib does not resolve them; other servers do), or a path that does
//! not start with `/`. Those are refused with a 400 that says why.

/// Why a path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path has a `%` at byte {0} that is not followed by two hex digits")]
    BadEscape(usize),
    #[error("the path is not UTF-8 once its escapes are decoded")]
    NotUtf8,
    #[error("the path holds a control character once its escapes are decoded")]
    Control,
    #[error("the path has a `.` or `..` segment once its escapes are decoded")]
    DotSegment,
    #[error("the path does not start with `/`")]
    NotAbsolute,
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The path `raw` (without its query) as the engine would route it, or why it is refused.
pub fn decode(raw: &str) -> Result<String, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).copied().and_then(hex);
            let lo = bytes.get(i + 2).copied().and_then(hex);
            let (Some(hi), Some(lo)) = (hi, lo) else {
                return Err(PathError::BadEscape(i));
            };
            out.push(hi << 4 | lo);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let path = String::from_utf8(out).map_err(|_| PathError::NotUtf8)?;
    if path.chars().any(char::is_control) {
        return Err(PathError::Control);
    }
    if path.split('/').any(|s| s == "." || s == "..") {
        return Err(PathError::DotSegment);
    }
    Ok(path)
}

/// Bytes a path may carry as they are (RFC 3986 `pchar` and `/`, less `%`).
fn plain(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'/' | b'-'
                | b'.'
                | b'_'
                | b'~'
                | b'!'
                | b'$'
                | b'&'
                | b'\''
                | b'('
                | b')'
                | b'*'
                | b'+'
                | b','
                | b';'
                | b'='
                | b':'
                | b'@'
        )
}

/// The path `raw` as dsv4d sends it on: [`encode`] of [`decode`], borrowed when `raw` is
/// written that way already (no escape, nothing to escape), as nearly every path is.
pub fn canonical(raw: &str) -> Result<std::borrow::Cow<'_, str>, PathError> {
    // No segment that starts with a dot either: dot segments (`.`, `..`) are among them,
    // and the rare others (`/.well-known`) take the longer way to the same text.
    let b = raw.as_bytes();
    let plain_already = b.first() == Some(&b'/')
        && b.iter().all(|&c| plain(c))
        && !b.windows(2).any(|w| w == b"/.");
    if plain_already {
        return Ok(std::borrow::Cow::Borrowed(raw));
    }
    decode(raw).map(|p| std::borrow::Cow::Owned(encode(&p)))
}

/// `path` (decoded) written so that one decoding gives it back: every other byte escaped.
pub fn encode(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for &b in path.as_bytes() {
        if plain(b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn escapes_decode_as_the_engine_decodes_them() {
        for (raw, want) in [
            ("/slots/0", "/slots/0"),
            ("/%73lots/0", "/slots/0"),
            ("/slots%2F0", "/slots/0"),
            ("/slots%2f0", "/slots/0"),
            ("/%53LOTS/0", "/SLOTS/0"),
            ("/v1/chat/completions", "/v1/chat/completions"),
            ("/%2525", "/%25"),
            ("/caf%C3%A9", "/café"),
            ("/", "/"),
        ] {
            assert_eq!(decode(raw).as_deref(), Ok(want), "{raw}");
        }
    }

    #[test]
    fn what_could_be_read_two_ways_is_refused() {
        for (raw, why) in [
            ("/%u0073lots/0", PathError::BadEscape(1)),
            ("/slots/%", PathError::BadEscape(7)),
            ("/slots/%4", PathError::BadEscape(7)),
            ("/slots/%zz", PathError::BadEscape(7)),
            ("/%FF", PathError::NotUtf8),
            ("/slots/0%00", PathError::Control),
            ("/slots%0A/0", PathError::Control),
            ("/%2e%2e/slots/0", PathError::DotSegment),
            ("/x/%2E/slots", PathError::DotSegment),
            ("/x/../slots/0", PathError::DotSegment),
            ("/slots/.", PathError::DotSegment),
            ("%2Fslots", PathError::NotAbsolute),
            ("slots", PathError::NotAbsolute),
        ] {
            assert_eq!(decode(raw), Err(why), "{raw}");
        }
        // A dot inside a segment is a name, not a dot segment.
        assert_eq!(decode("/v1/a..b/.x").as_deref(), Ok("/v1/a..b/.x"));
    }

    #[test]
    fn the_encoded_form_decodes_once_to_what_was_judged() {
        for path in ["/slots/0", "/%25", "/a b/ü?#", "/x%2Fy"] {
            assert_eq!(decode(&encode(path)).as_deref(), Ok(path));
        }
        assert_eq!(encode("/slots/0"), "/slots/0");
        assert_eq!(encode("/a b?#%"), "/a%20b%3F%23%25");
    }

    #[test]
    fn a_path_written_canonically_is_borrowed_and_the_rest_agree_with_decode() {
        use std::borrow::Cow;
        assert!(matches!(
            canonical("/v1/chat/completions"),
            Ok(Cow::Borrowed(_))
        ));
        assert_eq!(canonical("/%73lots/0").as_deref(), Ok("/slots/0"));
        assert_eq!(canonical("/x/../slots/0"), Err(PathError::DotSegment));
        assert_eq!(canonical("/x/./slots/0"), Err(PathError::DotSegment));
        assert_eq!(canonical("/x/.."), Err(PathError::DotSegment));
        assert_eq!(canonical("slots"), Err(PathError::NotAbsolute));
        // A segment that starts with a dot and is no dot segment passes, unchanged.
        assert_eq!(canonical("/.well-known/x").as_deref(), Ok("/.well-known/x"));
        assert_eq!(canonical("/a/..b/.c").as_deref(), Ok("/a/..b/.c"));
    }

    proptest! {
        /// What `canonical` gives is `encode` of `decode`, or the same refusal.
        #[test]
        fn canonical_is_encode_of_decode(raw in "/[ -~]{0,40}") {
            prop_assert_eq!(
                canonical(&raw).map(|c| c.into_owned()),
                decode(&raw).map(|p| encode(&p))
            );
        }

        /// Whatever decodes, its encoding decodes to the same path: dsv4d and the engine see
        /// one path.
        #[test]
        fn encode_then_decode_is_the_identity(raw in "/[ -~]{0,40}") {
            if let Ok(path) = decode(&raw) {
                prop_assert_eq!(decode(&encode(&path)), Ok(path));
            }
        }
    }
}
