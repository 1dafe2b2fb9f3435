//! The one reader of an event stream: the HTML standard's grammar (lines end with LF, CRLF
//! or CR; a line that begins with `:` is a comment; `event:` and `data:` fields, the space
//! after the colon dropped; a blank line ends an event), fed chunk by chunk, split anywhere.
//!
//! Owns: [`Reader`] (the incremental parser), [`Event`] (one event as the reader hands it
//! over: its name, a borrowed view of its data, and where in the stream it lies) and
//! [`Place`] (where the stream stands, for a line of dsv4d's own). Pure: no I/O, no clock.
//! What is done with each event is the observers' (see [`crate::http::watch`]).
//!
//! Each chunk is read once: its line ends are found with `memchr`, an event whole within
//! one chunk is handed over as a view of that chunk, and only an event or a line that
//! spans chunks is copied (into buffers the reader keeps and reuses).

use std::ops::Range;

/// Where a stream stands after the bytes so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Place {
    /// Between events: the start, or after a blank line ended by LF or CRLF.
    #[default]
    Between,
    /// Between events, after a blank line ended by CR: an LF that comes next still belongs to
    /// it (CRLF).
    BetweenCr,
    /// Within an event (or a block of comments): only its end may come next.
    Within,
}

impl Place {
    /// Whether a line of dsv4d's own may go in now: only between events, never within one.
    pub fn between(self) -> bool {
        matches!(self, Place::Between | Place::BetweenCr)
    }
}

/// One event, as the reader hands it over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event<'a> {
    /// Its `event:` field (the last one), empty when it has none.
    pub name: &'a [u8],
    /// Its `data:` fields, joined by LF (as a client reads them).
    pub data: &'a [u8],
    /// It had a `data:` field (one with an empty value counts).
    pub has_data: bool,
    /// Where it lies in the stream (offsets from the stream's first byte): from its first
    /// line's start to the end of the blank line that ended it (the LF of a CRLF included
    /// when it came in the same chunk). For one the stream's end cut off, to the stream's end.
    pub span: Range<u64>,
}

impl<'a> Event<'a> {
    /// What kind of event it is: its name, else the `type` its data begins with
    /// (`{"type":"response.completed",...`, as ds4-server writes events without a name), else
    /// nothing.
    pub fn kind(&self) -> &'a [u8] {
        if !self.name.is_empty() {
            return self.name;
        }
        const HEAD: &[u8] = b"{\"type\":\"";
        self.data
            .strip_prefix(HEAD)
            .and_then(|rest| rest.iter().position(|&b| b == b'"').map(|n| &rest[..n]))
            .unwrap_or_default()
    }

    /// Whether it carries fields (a block of comments alone carries none, and is no event to
    /// a client).
    pub fn is_comment(&self) -> bool {
        !self.has_data && self.name.is_empty()
    }
}

/// The grammar's state between two bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum At {
    /// Between events.
    #[default]
    Between,
    /// After a blank line's CR.
    BetweenCr,
    /// At the start of a line within an event.
    LineStart,
    /// After a line's CR within an event.
    LineCr,
    /// Within a line (its bytes so far in `Reader::line` when it began in an earlier chunk).
    InLine,
}

/// Where the event being read keeps its data.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Data {
    #[default]
    None,
    /// One `data:` line whole in the chunk being read: its value's range there.
    InChunk(Range<usize>),
    /// In `Reader::data`.
    Owned,
}

/// The incremental reader (see the module docs).
#[derive(Debug, Default)]
pub struct Reader {
    at: At,
    /// Offset in the stream of the chunk being read (of the next one, between chunks).
    base: u64,
    /// The line being read, when it began in an earlier chunk.
    line: Vec<u8>,
    /// Offset in the stream where the event being read began (its first line).
    start: u64,
    /// The event being read: its name, its data, whether it had a data field or any line.
    name: Vec<u8>,
    data: Vec<u8>,
    at_data: Data,
    has_data: bool,
    open: bool,
}

impl Reader {
    pub fn new() -> Reader {
        Reader::default()
    }

    /// Where the stream stands after what was fed.
    pub fn place(&self) -> Place {
        match self.at {
            At::Between => Place::Between,
            At::BetweenCr => Place::BetweenCr,
            At::LineStart | At::LineCr | At::InLine => Place::Within,
        }
    }

    /// Where in the stream the event still being read began; `None` between events.
    pub fn pending(&self) -> Option<u64> {
        self.open.then_some(self.start)
    }

    /// How many bytes were fed.
    pub fn fed(&self) -> u64 {
        self.base
    }

    /// Reads `chunk`, handing each event (and block of comments) it ends to `each`.
    pub fn feed(&mut self, chunk: &[u8], mut each: impl FnMut(&Event)) {
        let mut i = 0;
        while i < chunk.len() {
            // The LF of a CRLF whose CR ended a line.
            if chunk[i] == b'\n' && matches!(self.at, At::LineCr | At::BetweenCr) {
                self.at = match self.at {
                    At::LineCr => At::LineStart,
                    _ => At::Between,
                };
                i += 1;
                continue;
            }
            let Some(n) = memchr::memchr2(b'\n', b'\r', &chunk[i..]) else {
                // A line that goes on in the next chunk.
                self.begin_line(i);
                self.line.extend_from_slice(&chunk[i..]);
                self.at = At::InLine;
                break;
            };
            let end = i + n;
            let cr = chunk[end] == b'\r';
            let blank = n == 0 && self.line.is_empty();
            if blank {
                if self.open {
                    // The LF of a CRLF that is here already belongs to this event.
                    let lf = cr && chunk.get(end + 1) == Some(&b'\n');
                    let until = end + 1 + usize::from(lf);
                    self.dispatch(chunk, until as u64, &mut each);
                    self.at = if cr && !lf {
                        At::BetweenCr
                    } else {
                        At::Between
                    };
                    i = until;
                    continue;
                }
                self.at = if cr { At::BetweenCr } else { At::Between };
            } else {
                self.begin_line(i);
                if self.line.is_empty() {
                    self.field(chunk, i..end, true);
                } else {
                    self.line.extend_from_slice(&chunk[i..end]);
                    let line = std::mem::take(&mut self.line);
                    self.field(&line, 0..line.len(), false);
                    // Its buffer kept for the next line that spans chunks.
                    self.line = line;
                    self.line.clear();
                }
                self.at = if cr { At::LineCr } else { At::LineStart };
            }
            i = end + 1;
        }
        // What stays of this chunk's data is copied: the next chunk is another buffer.
        if let Data::InChunk(r) = &self.at_data {
            self.data.extend_from_slice(&chunk[r.clone()]);
            self.at_data = Data::Owned;
        }
        self.base += chunk.len() as u64;
    }

    /// The stream's end: an event it cut off (fields with no blank line after them) is
    /// handed to `each` as it is.
    pub fn finish(&mut self, mut each: impl FnMut(&Event)) {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.field(&line, 0..line.len(), false);
        }
        if self.open {
            self.dispatch(&[], 0, &mut each);
        }
        self.at = At::Between;
    }

    /// A line begins at `i` of the chunk being read (unless it began in an earlier one); the
    /// first of an event marks where the event begins.
    fn begin_line(&mut self, i: usize) {
        if matches!(self.at, At::Between | At::BetweenCr) {
            self.start = self.base + i as u64;
            self.open = true;
        }
    }

    /// One line of the event being read: `buf[r]`, a comment or a field; `in_chunk` when
    /// `buf` is the chunk being read (whose data may be handed over as a view of it).
    fn field(&mut self, buf: &[u8], r: Range<usize>, in_chunk: bool) {
        let line = &buf[r.clone()];
        if line.first() == Some(&b':') {
            return;
        }
        let (name, value) = match memchr::memchr(b':', line) {
            Some(c) => {
                let v = c + 1 + usize::from(line.get(c + 1) == Some(&b' '));
                (&line[..c], r.start + v..r.end)
            }
            None => (line, r.end..r.end),
        };
        match name {
            b"event" => {
                self.name.clear();
                self.name.extend_from_slice(&buf[value]);
            }
            b"data" => {
                self.at_data = match std::mem::take(&mut self.at_data) {
                    Data::None if in_chunk => Data::InChunk(value),
                    at => {
                        if let Data::InChunk(first) = at {
                            self.data.extend_from_slice(&buf[first]);
                        }
                        if self.has_data {
                            self.data.push(b'\n');
                        }
                        self.data.extend_from_slice(&buf[value]);
                        Data::Owned
                    }
                };
                self.has_data = true;
            }
            _ => {}
        }
    }

    /// Hands the event read so far to `each` (it ends at `until` of the chunk `chunk`; for a
    /// stream's end, `chunk` is empty), and makes room for the next.
    fn dispatch(&mut self, chunk: &[u8], until: u64, each: &mut impl FnMut(&Event)) {
        let data: &[u8] = match &self.at_data {
            Data::None => &[],
            Data::InChunk(r) => &chunk[r.clone()],
            Data::Owned => &self.data,
        };
        each(&Event {
            name: &self.name,
            data,
            has_data: self.has_data,
            span: self.start..self.base + until,
        });
        self.name.clear();
        self.data.clear();
        self.at_data = Data::None;
        self.has_data = false;
        self.open = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a client reads of an event: its kind, its data, and the bytes of its span.
    #[derive(Debug, PartialEq)]
    struct Seen {
        name: String,
        data: Option<String>,
        raw: String,
    }

    fn read(pieces: &[&[u8]]) -> (Vec<Seen>, Place) {
        let whole: Vec<u8> = pieces.concat();
        let mut r = Reader::new();
        let mut seen = Vec::new();
        let mut take = |e: &Event| {
            seen.push(Seen {
                name: String::from_utf8_lossy(e.kind()).into(),
                data: e.has_data.then(|| String::from_utf8_lossy(e.data).into()),
                raw: String::from_utf8_lossy(&whole[e.span.start as usize..e.span.end as usize])
                    .into(),
            })
        };
        for p in pieces {
            r.feed(p, &mut take);
        }
        let place = r.place();
        r.finish(&mut take);
        (seen, place)
    }

    fn seen(name: &str, data: Option<&str>, raw: &str) -> Seen {
        Seen {
            name: name.into(),
            data: data.map(String::from),
            raw: raw.into(),
        }
    }

    #[test]
    fn the_grammar_reads_each_line_end_comments_and_fields() {
        for (stream, want, place) in [
            (
                "data: a\n\n",
                vec![seen("", Some("a"), "data: a\n\n")],
                Place::Between,
            ),
            (
                "data: a\r\n\r\n",
                vec![seen("", Some("a"), "data: a\r\n\r\n")],
                Place::Between,
            ),
            (
                "data: a\r\r",
                vec![seen("", Some("a"), "data: a\r\r")],
                Place::BetweenCr,
            ),
            (
                "event: x\ndata:b\ndata:  c\n\n",
                vec![seen("x", Some("b\n c"), "event: x\ndata:b\ndata:  c\n\n")],
                Place::Between,
            ),
            (
                ": ping\n\ndata: [DONE]\n\n",
                vec![
                    seen("", None, ": ping\n\n"),
                    seen("", Some("[DONE]"), "data: [DONE]\n\n"),
                ],
                Place::Between,
            ),
            // Stray blank lines are between events; a field with no colon is its name.
            (
                "\n\r\ndata\n\n",
                vec![seen("", Some(""), "data\n\n")],
                Place::Between,
            ),
            // Unknown fields are no data; `type` names an unnamed event.
            (
                "id: 1\nretry: 5\n\ndata: {\"type\":\"response.completed\",\"x\":1}\n\n",
                vec![
                    seen("", None, "id: 1\nretry: 5\n\n"),
                    seen(
                        "response.completed",
                        Some("{\"type\":\"response.completed\",\"x\":1}"),
                        "data: {\"type\":\"response.completed\",\"x\":1}\n\n",
                    ),
                ],
                Place::Between,
            ),
            // Cut off by the stream's end: handed over as it is.
            (
                "data: {}\n\ndata: [DONE]",
                vec![
                    seen("", Some("{}"), "data: {}\n\n"),
                    seen("", Some("[DONE]"), "data: [DONE]"),
                ],
                Place::Within,
            ),
            (
                "data: a\n",
                vec![seen("", Some("a"), "data: a\n")],
                Place::Within,
            ),
            // The model's text holds what looks like fields: within a line, it is text.
            (
                "data: {\"t\":\"x\\n\\ndata: y event: z\"}\n\n",
                vec![seen(
                    "",
                    Some("{\"t\":\"x\\n\\ndata: y event: z\"}"),
                    "data: {\"t\":\"x\\n\\ndata: y event: z\"}\n\n",
                )],
                Place::Between,
            ),
        ] {
            let (got, at) = read(&[stream.as_bytes()]);
            assert_eq!(got, want, "{stream:?}");
            assert_eq!(at, place, "{stream:?}");
        }
    }

    #[test]
    fn split_anywhere_the_same_events_are_read() {
        let stream = "event: message_start\r\ndata: {\"a\":1}\r\n\r\n: c\n\ndata: x\rdata: y\r\r\
                      event: e\ndata:\n\ndata: [DONE]\n\n";
        let (whole, _) = read(&[stream.as_bytes()]);
        assert_eq!(whole.len(), 5, "{whole:#?}");
        let b = stream.as_bytes();
        for cut in 0..=b.len() {
            let (two, _) = read(&[&b[..cut], &b[cut..]]);
            // A CRLF cut between its CR and LF leaves the LF to the next chunk: the event
            // ends at its CR, the same event.
            let trim = |s: &[Seen]| -> Vec<(String, Option<String>, String)> {
                s.iter()
                    .map(|e| (e.name.clone(), e.data.clone(), e.raw.trim_end().to_string()))
                    .collect()
            };
            assert_eq!(trim(&two), trim(&whole), "cut at {cut}");
            for cut2 in cut..=b.len() {
                let (three, _) = read(&[&b[..cut], &b[cut..cut2], &b[cut2..]]);
                assert_eq!(trim(&three), trim(&whole), "cut at {cut} and {cut2}");
            }
        }
        let ones: Vec<&[u8]> = b.chunks(1).collect();
        let (ones, _) = read(&ones);
        assert_eq!(ones.len(), whole.len());
    }

    #[test]
    fn spans_tile_what_the_events_were() {
        // Each event's span is where its bytes are, whatever the chunks.
        let stream = "data: 1\n\n: c\r\n\r\ndata: 2\r\rdata: 3\n\n";
        let b = stream.as_bytes();
        for size in 1..=b.len() {
            let pieces: Vec<&[u8]> = b.chunks(size).collect();
            let (got, _) = read(&pieces);
            let raws: Vec<&str> = got.iter().map(|e| e.raw.trim_end_matches('\n')).collect();
            assert_eq!(
                raws,
                ["data: 1", ": c\r\n\r", "data: 2\r\r", "data: 3"],
                "{size}"
            );
        }
    }
}
