//! A prefill's progress, read from the engine's own event stream (llama-server's
//! `prompt_progress` objects, which it sends when the request asks with
//! `"return_progress": true`), and taken out of what the client gets unless the client asked
//! for them itself.
//!
//! Owns: [`ask`] (the request body with the engine's own field that asks for progress put
//! in) and [`Progress`] (which events tell the progress, read by the answer's observers in
//! [`crate::http::watch`], which take them out). Pure: no I/O.

use bytes::Bytes;
use dsv4_engine::Prefill;
use memchr::memmem::Finder;

/// The request `body` with `"field":true` put last in its top-level object; `None` when the
/// body does not parse as a JSON object (left to the engine to refuse, with its own error
/// positions), or when its top level names `field` already, written plainly or escaped (the
/// client asked, or declined, itself). Put at the end, so that every byte the client wrote
/// keeps its place.
pub fn ask(body: &[u8], field: &str) -> Option<Bytes> {
    let keys: std::collections::HashMap<String, serde::de::IgnoredAny> =
        serde_json::from_slice(body).ok()?;
    if keys.contains_key(field) {
        return None;
    }
    // It parsed as an object: its last byte other than blanks is the closing brace.
    let close = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    let comma = if keys.is_empty() { "" } else { "," };
    let added = format!("{comma}\"{field}\":true");
    let mut out = Vec::with_capacity(body.len() + added.len());
    out.extend_from_slice(&body[..close]);
    out.extend_from_slice(added.as_bytes());
    out.extend_from_slice(&body[close..]);
    Some(Bytes::from(out))
}

/// Which of a stream's events tell the prefill's progress, and whether they are taken out.
pub struct Progress {
    read: fn(&[u8]) -> Option<Prefill>,
    field: Finder<'static>,
    /// Take the progress events out (dsv4d asked for them, not the client).
    strip: bool,
}

impl Progress {
    /// The events whose data has the key `field`, read with `read`; taken out with `strip`.
    pub fn new(field: &str, read: fn(&[u8]) -> Option<Prefill>, strip: bool) -> Self {
        Progress {
            read,
            field: Finder::new(format!("\"{field}\"").as_bytes()).into_owned(),
            strip,
        }
    }

    /// Whether its events are taken out of what the client gets.
    pub fn strips(&self) -> bool {
        self.strip
    }

    /// The progress an event's `data` tells, when it is a progress event.
    pub fn read(&self, data: &[u8]) -> Option<Prefill> {
        self.field.find(data)?;
        (self.read)(data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_field_is_put_last_unless_the_top_level_names_it() {
        let asked = |body: &str| ask(body.as_bytes(), "return_progress").map(|b| b.to_vec());
        let s = |t: &str| Some(t.as_bytes().to_vec());
        assert_eq!(
            asked(r#"{"stream":true,"messages":[]}"#),
            s(r#"{"stream":true,"messages":[],"return_progress":true}"#)
        );
        assert_eq!(
            asked(" \n{ \"stream\": true }\n"),
            s(" \n{ \"stream\": true ,\"return_progress\":true}\n")
        );
        assert_eq!(asked("{}"), s(r#"{"return_progress":true}"#));
        assert_eq!(asked("{ }"), s(r#"{ "return_progress":true}"#));
        // The client's own choice stands, either way, written plainly or escaped.
        assert_eq!(asked(r#"{"return_progress":false,"stream":true}"#), None);
        assert_eq!(asked(r#"{"stream":true,"return_progress":true}"#), None);
        assert_eq!(
            asked(r#"{"return\u005fprogress":true,"stream":true}"#),
            None
        );
        // The name deeper down, or in the text, is not the client's choice.
        assert_eq!(
            asked(r#"{"messages":[{"content":"\"return_progress\""}],"x":{"return_progress":1}}"#),
            s(
                r#"{"messages":[{"content":"\"return_progress\""}],"x":{"return_progress":1},"return_progress":true}"#
            )
        );
        // Not an object, or not JSON: left to the engine to refuse, byte for byte.
        assert_eq!(asked("[1]"), None);
        assert_eq!(asked(""), None);
        assert_eq!(asked(r#"{"stream":true,}"#), None);
        assert_eq!(asked(r#"{"stream":true} x"#), None);
    }
}
