//! Reading one YAML file into a serde type, reporting every mistake in it with its position.
//!
//! serde_yaml_ng reads the values, serde_path_to_error says which key a failure is about, and
//! the spans of saphyr-parser's events say where each key, value and list item is written,
//! for serde's errors and for the problems `load.rs` finds afterwards.
//!
//! serde stops at the first error. So that one run reports every unknown key and every value
//! that does not fit, the entry at fault is then blanked out of the text (replaced by spaces,
//! so every other position stays) and the text read again, until it reads. A file that is not
//! YAML at all stops at its first error, as does one with aliases (blanking an anchor would
//! break them).

use std::collections::{HashMap, HashSet};
use std::iter::Peekable;
use std::ops::Range;
use std::path::PathBuf;

use saphyr_parser::{Event, Marker, Parser, ScalarStyle, StrInput};
use serde::de::DeserializeOwned;

use super::error::Problem;
use super::schema::{self, Shape};

/// Deeper nesting than this is refused (no setting is nested more than three deep).
const MAX_DEPTH: usize = 32;

/// The largest configuration file read, in bytes (the shipped one is a few KiB).
pub(crate) const MAX_BYTES: u64 = 256 << 10;

/// The most nodes a document may have once its aliases are expanded: a few aliases of
/// aliases (a "billion laughs") would otherwise expand to more than memory holds.
const MAX_NODES: u64 = 100_000;

/// Reads the configuration file `path`, refusing one larger than [`MAX_BYTES`] before
/// reading it whole.
pub(crate) fn read_file(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read: {e}"))?;
    let mut text = String::new();
    file.take(MAX_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read: {e}"))?;
    if text.len() as u64 > MAX_BYTES {
        return Err(format!(
            "the file is larger than {} KiB, the most a configuration file may be",
            MAX_BYTES >> 10
        ));
    }
    Ok(text)
}

/// Refuses a document that nests deeper than [`MAX_DEPTH`] or whose aliases expand to more
/// than [`MAX_NODES`] nodes, in one pass over the parser's events (before serde, whose
/// work on such a document grows with the expansion). A YAML error ends the pass: the
/// reading that follows reports it.
fn check_shape(text: &str) -> Result<(), ((usize, usize), String)> {
    // For each open collection: its anchor, and the count of nodes when it began.
    let mut open: Vec<(usize, u64)> = Vec::new();
    let mut sizes: HashMap<usize, u64> = HashMap::new();
    let mut nodes: u64 = 0;
    for item in Parser::new_from_str(text) {
        let (event, span) = match item {
            Ok(e) => e,
            // The scanner's own limit on flow nesting, met before any event of that depth.
            Err(e) if e.info().contains("recursion limit") => {
                let at = (e.marker().line(), e.marker().col() + 1);
                return Err((
                    at,
                    format!("nested more than {MAX_DEPTH} deep (no setting is)"),
                ));
            }
            Err(_) => break,
        };
        let at = (span.start.line(), span.start.col() + 1);
        match event {
            Event::Scalar(_, _, anchor, _) => {
                nodes += 1;
                if anchor != 0 {
                    sizes.insert(anchor, 1);
                }
            }
            Event::Alias(anchor) => nodes += sizes.get(&anchor).copied().unwrap_or(1),
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                nodes += 1;
                open.push((anchor, nodes));
                if open.len() > MAX_DEPTH {
                    return Err((
                        at,
                        format!("nested more than {MAX_DEPTH} deep (no setting is)"),
                    ));
                }
            }
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some((anchor, began)) = open.pop() {
                    if anchor != 0 {
                        sizes.insert(anchor, nodes - began + 1);
                    }
                }
            }
            _ => {}
        }
        if nodes > MAX_NODES {
            return Err((
                at,
                format!(
                    "its aliases expand to more than {MAX_NODES} values; write the settings \
                     out instead"
                ),
            ));
        }
    }
    Ok(())
}

/// Where a mapping entry or a sequence item is written.
#[derive(Debug, Clone)]
struct Entry {
    /// The key; for an item, the item.
    key: Marker,
    value: Marker,
    /// In characters, from the key up to the next entry or the end of the collection.
    range: Range<usize>,
    /// The value is a plain `null`, `~` or nothing.
    null: bool,
}

type Events<'a> = Peekable<Parser<'a, StrInput<'a>>>;

/// A file that was read: problems found afterwards get their key's position from it.
#[derive(Debug, Default)]
pub(crate) struct Doc {
    /// As shown in messages.
    pub file: PathBuf,
    /// Every entry by path: `engine.idle_timeout`, `extra_args[2]` (the way
    /// serde_path_to_error writes paths).
    entries: HashMap<String, Entry>,
    aliases: bool,
    /// Entries set aside because of a problem, and the keys an unknown key may have meant:
    /// checks that would only repeat that problem skip them.
    dropped: HashSet<String>,
}

impl Doc {
    /// Reads `text` (the file `file` as messages show it) as a `T`; an empty document is
    /// `T::default()`. `None` when nothing could be read, after reporting why.
    ///
    /// A key set to null counts as not written (so its default applies), unless
    /// `null_is_value` says otherwise for its path.
    pub fn read<T: DeserializeOwned + Default>(
        file: PathBuf,
        text: &str,
        null_is_value: fn(&str) -> bool,
        problems: &mut Vec<Problem>,
    ) -> (Doc, Option<T>) {
        let mut doc = Doc {
            file,
            ..Doc::default()
        };
        if let Err((at, message)) = check_shape(text) {
            problems.push(Problem::new(&doc.file, "", message).at(Some(at)));
            return (doc, None);
        }
        // The entries of the first document, as far as it is YAML.
        let mut events = Parser::new_from_str(text).peekable();
        while let Some(Ok((event, _))) = events.next() {
            if !matches!(event, Event::StreamStart | Event::DocumentStart(_)) {
                doc.node(&mut events, &event, "", 0);
                break;
            }
        }
        if let Err(error) = serde_yaml_ng::from_str::<serde::de::IgnoredAny>(text) {
            let location = error.location().map(|l| (l.line(), l.column()));
            problems.push(Problem::new(&doc.file, "", message(&error)).at(location));
            return (doc, None);
        }
        let mut text: Vec<char> = text.chars().collect();
        for (path, entry) in &doc.entries {
            if entry.null && !null_is_value(path) {
                blank(&mut text, &entry.range);
            }
        }
        // Unknown keys, from the parsed entries and the keys the type reads; each is set
        // aside, so serde never meets one.
        let shape = Shape::of::<T>();
        for (path, problem) in doc.unknown_keys(&shape, null_is_value) {
            if let Some(entry) = doc.entries.get(&path) {
                blank(&mut text, &entry.range);
            }
            doc.dropped.insert(path);
            problems.push(problem);
        }
        let before = problems.len();
        loop {
            let source: String = text.iter().collect();
            let de = serde_yaml_ng::Deserializer::from_str(&source);
            let error = match serde_path_to_error::deserialize::<_, Option<T>>(de) {
                Ok(value) => return (doc, Some(value.unwrap_or_default())),
                Err(error) => error,
            };
            let (problem, culprit) = doc.serde_problem(&error);
            let entry = match doc.entries.get(&culprit) {
                Some(entry) if !doc.aliases && doc.dropped.insert(culprit) => entry,
                // Only the first error is certain to be the file's own: a later one that
                // cannot be set aside may come from the blanking.
                _ => {
                    if problems.len() == before {
                        problems.push(problem);
                    }
                    return (doc, None);
                }
            };
            blank(&mut text, &entry.range);
            problems.push(problem);
        }
    }

    /// Records the entries inside the node that opened with `event`. `None` when the events
    /// end early (a YAML error) or nest deeper than [`MAX_DEPTH`]: what was recorded so far
    /// stands.
    fn node(&mut self, events: &mut Events, event: &Event, path: &str, depth: usize) -> Option<()> {
        let mapping = match event {
            _ if depth > MAX_DEPTH => return None,
            Event::MappingStart(..) => true,
            Event::SequenceStart(..) => false,
            Event::Alias(_) => {
                self.aliases = true;
                return Some(());
            }
            _ => return Some(()),
        };
        for index in 0.. {
            let (first, first_span) = events.next()?.ok()?;
            if matches!(first, Event::MappingEnd | Event::SequenceEnd) {
                break;
            }
            let (child, value, value_span) = if mapping {
                let name = match &first {
                    Event::Scalar(name, ..) => name.to_string(),
                    _ => "?".to_string(),
                };
                // A key that is itself a collection: followed, under no usable path.
                self.node(events, &first, "?", depth + 1)?;
                let (value, value_span) = events.next()?.ok()?;
                let child = match path {
                    "" => name,
                    _ => format!("{path}.{name}"),
                };
                (child, value, value_span)
            } else {
                (format!("{path}[{index}]"), first, first_span)
            };
            let null = mapping
                && matches!(&value, Event::Scalar(v, ScalarStyle::Plain, ..)
                    if matches!(v.as_ref(), "" | "~" | "null" | "Null" | "NULL"));
            self.node(events, &value, &child, depth + 1)?;
            let end = match events.peek() {
                Some(Ok((_, next))) => next.start.index(),
                _ => usize::MAX,
            };
            let entry = Entry {
                key: first_span.start,
                value: value_span.start,
                range: first_span.start.index()..end,
                null,
            };
            self.entries.insert(child, entry);
        }
        Some(())
    }

    /// A problem about the value at `path` (dotted, as `engine.idle_timeout`): at the value
    /// when it starts on the key's line, else at the key; without a position when the key is
    /// not written.
    pub fn problem(&self, path: &str, message: impl Into<String>) -> Problem {
        self.at(path, path, false, message)
    }

    /// A problem reported under `field` about the entry at `path` (an item `extra_args[2]`
    /// under `extra_args`), or about its key's name (`on_key`).
    pub fn at(&self, field: &str, path: &str, on_key: bool, message: impl Into<String>) -> Problem {
        let spot = self.entries.get(path).map(|e| {
            let m = if on_key || e.value.line() != e.key.line() {
                e.key
            } else {
                e.value
            };
            // 1-based, the column in characters, as serde_yaml_ng counts.
            (m.line(), m.col() + 1)
        });
        Problem::new(&self.file, field, message).at(spot)
    }

    /// The first of `paths` that is written, else the first: where a rule between keys is
    /// reported.
    pub fn first_written<'a>(&self, paths: &[&'a str]) -> &'a str {
        let written = paths.iter().find(|p| self.entries.contains_key(**p));
        written.unwrap_or(&paths[0])
    }

    /// Whether the entry at `path` was set aside after a problem (or may have been meant by
    /// an unknown key).
    pub fn dropped(&self, path: &str) -> bool {
        self.dropped.contains(path)
    }

    /// Every key written where the type has no such key (null ones, which count as not
    /// written, aside), with its problem: serde's wording, the keys there are, and the
    /// nearest of them when it looks like a typo (then marked dropped: checks about the key
    /// meant would only repeat the problem).
    fn unknown_keys(
        &mut self,
        shape: &Shape,
        null_is_value: fn(&str) -> bool,
    ) -> Vec<(String, Problem)> {
        let mut found = Vec::new();
        for (path, entry) in &self.entries {
            if entry.null && !null_is_value(path) {
                continue;
            }
            let mut at = shape;
            let mut parent = String::new();
            for key in schema::keys_of_path(path) {
                let Some(next) = at.get(key) else {
                    // Only the entry's own key: a parent unknown is reported for itself.
                    if parent.len() + key.len() == path.len() {
                        found.push((path.clone(), parent.clone(), key.to_string(), at.keys()));
                    }
                    break;
                };
                at = next;
                parent.push_str(key);
                parent.push('.');
            }
        }
        let mut problems = Vec::new();
        for (path, parent, key, keys) in found {
            let mut message = schema::unknown_key(&key, &keys);
            if let Some(meant) = schema::meant(&key, &keys) {
                message.push_str(&format!("; did you mean `{meant}`?"));
                self.dropped.insert(format!("{parent}{meant}"));
            }
            problems.push((path.clone(), self.at(&path, &path, true, message)));
        }
        problems
    }

    /// The problem serde found, and the path of the entry to set aside for it.
    fn serde_problem(
        &mut self,
        error: &serde_path_to_error::Error<serde_yaml_ng::Error>,
    ) -> (Problem, String) {
        let path = Some(error.path().to_string()).filter(|p| p != ".");
        let path = path.unwrap_or_default();
        let mut message = message(error.inner());
        // serde_yaml_ng starts with the path of what it was reading: the error's own path or
        // one of its parents.
        let parents = path.rmatch_indices(['.', '[']).map(|(i, _)| &path[..i]);
        let prefix = std::iter::once(path.as_str())
            .chain(parents)
            .find(|p| !p.is_empty() && message.starts_with(&format!("{p}: ")));
        if let Some(prefix) = prefix {
            message.drain(..prefix.len() + 2);
        }
        let mut problem = self.problem(&path, &message);
        if problem.line.is_none() {
            let location = error.inner().location();
            problem = problem.at(location.map(|l| (l.line(), l.column())));
        }
        // A list item that does not fit sets its whole list aside.
        let mut culprit = path;
        while culprit.ends_with(']') {
            culprit.truncate(culprit.rfind('[').unwrap_or(0));
        }
        (problem, culprit)
    }
}

/// serde_yaml_ng's message without the position it appends.
fn message(error: &serde_yaml_ng::Error) -> String {
    let mut message = error.to_string();
    if let Some(l) = error.location() {
        let suffix = format!(" at line {} column {}", l.line(), l.column());
        if let Some(i) = message.rfind(&suffix) {
            message.replace_range(i..i + suffix.len(), "");
        }
    }
    message
}

/// Replaces the characters in `range` with spaces, keeping line breaks.
fn blank(text: &mut [char], range: &Range<usize>) {
    let end = range.end.min(text.len());
    for c in text.get_mut(range.start.min(end)..end).unwrap_or_default() {
        if !matches!(c, '\n' | '\r') {
            *c = ' ';
        }
    }
}
