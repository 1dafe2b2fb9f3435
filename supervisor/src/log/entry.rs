//! One journal entry, and its encoding in journald's native protocol (systemd.io, "Native
//! Journal Protocol").
//!
//! Owns: the entry's shape and its bytes on the wire. Must not: send (the sink does).

/// The identifier entries carry (`SYSLOG_IDENTIFIER`), as the journal shows them.
const IDENTIFIER: &str = "dsv4d";

/// One journal entry, before encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// syslog priority, 3 (error) to 7 (debug).
    pub priority: u8,
    pub message: String,
    /// Journal field names (from [`super::journal::FIELDS`], or the engine's `ENGINE_STREAM`) and values.
    pub fields: Vec<(&'static str, String)>,
    /// Each line of the message is an entry of its own, with the same fields (the engine's
    /// lines, which come in batches).
    pub each_line: bool,
}

impl Entry {
    pub fn new(priority: u8, message: String) -> Self {
        Entry {
            priority,
            message,
            fields: Vec::new(),
            each_line: false,
        }
    }

    /// The messages of the entries this one makes: its lines with `each_line`, else itself
    /// whole.
    pub fn messages(&self) -> impl Iterator<Item = &str> {
        let (whole, lines) = match self.each_line {
            true => (None, Some(self.message.split('\n'))),
            false => (Some(self.message.as_str()), None),
        };
        whole.into_iter().chain(lines.into_iter().flatten())
    }

    /// The entry as a line for stderr, when the journal's socket cannot take it: the
    /// priority prefix of sd-daemon(3) (journald reads it from the stream), then the message.
    pub fn as_text(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for message in self.messages() {
            out.extend_from_slice(line_as_text(self.priority, message).as_bytes());
        }
        out
    }
}

/// sd-daemon(3)'s prefix for a syslog priority (0 to 7; a higher one is written as 7),
/// which journald reads at the start of a line on the stream.
pub fn prefix(priority: u8) -> &'static str {
    const PREFIXES: [&str; 8] = ["<0>", "<1>", "<2>", "<3>", "<4>", "<5>", "<6>", "<7>"];
    PREFIXES[usize::from(priority.min(7))]
}

/// One entry's message as a line for stderr, with its priority prefix.
pub fn line_as_text(priority: u8, message: &str) -> String {
    format!("{}{message}\n", prefix(priority))
}

/// An entry with `message` (one of `entry`'s [`Entry::messages`]) in journald's native
/// protocol: `NAME=value` lines, and a value that holds a newline as the name, a newline,
/// its length (64-bit little-endian), the bytes and a newline.
pub fn encode(entry: &Entry, message: &str, out: &mut Vec<u8>) {
    fn field(out: &mut Vec<u8>, name: &str, value: &[u8]) {
        out.extend_from_slice(name.as_bytes());
        if value.contains(&b'\n') {
            out.push(b'\n');
            out.extend_from_slice(&(value.len() as u64).to_le_bytes());
        } else {
            out.push(b'=');
        }
        out.extend_from_slice(value);
        out.push(b'\n');
    }
    field(out, "PRIORITY", &[b'0' + entry.priority.min(7)]);
    field(out, "SYSLOG_IDENTIFIER", IDENTIFIER.as_bytes());
    field(out, "MESSAGE", message.as_bytes());
    for (name, value) in &entry.fields {
        field(out, name, value.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_encoded_as_journald_reads_them() {
        let mut entry = Entry::new(4, "not enough memory".into());
        entry.fields.push(("PROFILE", "320k".into()));
        let mut out = Vec::new();
        encode(&entry, &entry.message, &mut out);
        assert_eq!(
            out,
            b"PRIORITY=4\nSYSLOG_IDENTIFIER=dsv4d\nMESSAGE=not enough memory\nPROFILE=320k\n"
        );
        // A value with a newline: its length before it, in binary.
        let mut out = Vec::new();
        let entry = Entry::new(3, "a\nb".into());
        encode(&entry, &entry.message, &mut out);
        let mut want = b"PRIORITY=3\nSYSLOG_IDENTIFIER=dsv4d\nMESSAGE\n".to_vec();
        want.extend_from_slice(&3u64.to_le_bytes());
        want.extend_from_slice(b"a\nb\n");
        assert_eq!(out, want);
    }

    #[test]
    fn the_fallback_line_carries_the_priority() {
        assert_eq!(Entry::new(3, "gone".into()).as_text(), b"<3>gone\n");
        let lines = Entry {
            each_line: true,
            ..Entry::new(6, "one\ntwo".into())
        };
        assert_eq!(lines.as_text(), b"<6>one\n<6>two\n");
    }
}
