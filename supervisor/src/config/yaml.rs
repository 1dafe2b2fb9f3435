//! Reading one YAML file into a serde type, reporting every mistake in it with its position.
//!
//! The text is parsed once into nodes with their marks ([`super::node`]); this project's own
//! deserializer reads the type from them, and every mistake it finds names the path of the
//! value, whose entry says where it is written. Keys the type does not read are found in the
//! same pass (the deserializer knows each struct's keys). serde stops at a value that does
//! not fit: its entry is then taken out of the nodes and the type read again from them, until
//! it reads, so one run reports every mistake.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use saphyr_parser::Marker;
use serde::de::{Deserialize, DeserializeOwned};

use super::error::Problem;
use super::node::{self, Kind, Node};

/// The largest configuration file read, in bytes (the shipped one is a few KiB).
pub(crate) const MAX_BYTES: u64 = 256 << 10;

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

/// Where a mapping entry or a sequence item is written.
#[derive(Debug, Clone)]
struct Entry {
    /// The key; for an item, the item.
    key: Marker,
    value: Marker,
}

/// A file that was read: problems found afterwards get their key's position from it.
#[derive(Debug, Default)]
pub(crate) struct Doc {
    /// As shown in messages.
    pub file: PathBuf,
    /// Every entry by path: `engine.idle_timeout`, `extra_args[2]`.
    entries: HashMap<String, Entry>,
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
        let mut root = match node::parse(text) {
            Ok(Some(root)) => root,
            Ok(None) => return (doc, Some(T::default())),
            Err((at, message)) => {
                problems.push(Problem::new(&doc.file, "", message).at(Some(at)));
                return (doc, None);
            }
        };
        doc.record(&root, "");
        drop_nulls(&mut root, "", null_is_value);
        let before = problems.len();
        let mut unknown_seen = HashSet::new();
        loop {
            let unknown = RefCell::new(Vec::new());
            // A document that is only `null` (or `~`) is every default.
            let read = Option::<T>::deserialize(node::De::root(&root, &unknown))
                .map(Option::unwrap_or_default);
            for u in unknown.into_inner() {
                if unknown_seen.insert(u.path.clone()) {
                    let problem = doc.unknown_key(&u.path, u.keys);
                    problems.push(problem);
                }
            }
            let error = match read {
                Ok(value) => return (doc, Some(value)),
                Err(error) => error,
            };
            let path = error.path.clone().unwrap_or_default();
            let mut problem = doc.problem(&path, &error.message);
            if problem.line.is_none() {
                problem = problem.at(error.mark.as_ref().map(node::position));
            }
            // A list item that does not fit sets its whole list aside.
            let mut culprit = path;
            while culprit.ends_with(']') {
                culprit.truncate(culprit.rfind('[').unwrap_or(0));
            }
            if culprit.is_empty()
                || !doc.dropped.insert(culprit.clone())
                || !remove(&mut root, &culprit)
            {
                if problems.len() == before {
                    problems.push(problem);
                }
                return (doc, None);
            }
            problems.push(problem);
        }
    }

    /// Records the entries inside `node`, at `path`.
    fn record(&mut self, node: &Node, path: &str) {
        match &node.kind {
            Kind::Scalar { .. } => {}
            Kind::Seq(items) => {
                for (i, item) in items.iter().enumerate() {
                    let child = format!("{path}[{i}]");
                    self.record(item, &child);
                    let entry = Entry {
                        key: item.mark,
                        value: item.mark,
                    };
                    self.entries.entry(child).or_insert(entry);
                }
            }
            Kind::Map(entries) => {
                for (key, value) in entries {
                    let name = key.text().unwrap_or("?");
                    let child = match path {
                        "" => name.to_string(),
                        _ => format!("{path}.{name}"),
                    };
                    self.record(value, &child);
                    let entry = Entry {
                        key: key.mark,
                        value: value.mark,
                    };
                    self.entries.entry(child).or_insert(entry);
                }
            }
        }
    }

    /// The problem of the key at `path`, which its struct does not read (it reads `keys`):
    /// the keys there are, and the nearest of them when it looks like a typo (then marked
    /// dropped: checks about the key meant would only repeat the problem).
    fn unknown_key(&mut self, path: &str, keys: &'static [&'static str]) -> Problem {
        let (parent, key) = match path.rfind('.') {
            Some(i) => (&path[..=i], &path[i + 1..]),
            None => ("", path),
        };
        let (message, meant) = node::unknown_key(key, keys);
        if let Some(meant) = meant {
            self.dropped.insert(format!("{parent}{meant}"));
        }
        self.dropped.insert(path.to_string());
        self.at(path, path, true, message)
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
            // 1-based, the column in characters.
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
}

/// Takes the entries whose value is a plain null out of `node`, at `path` (a key set to null
/// counts as not written), unless `null_is_value` says the null is the value.
fn drop_nulls(node: &mut Node, path: &str, null_is_value: fn(&str) -> bool) {
    match &mut node.kind {
        Kind::Scalar { .. } => {}
        Kind::Seq(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                drop_nulls(item, &format!("{path}[{i}]"), null_is_value);
            }
        }
        Kind::Map(entries) => {
            entries.retain_mut(|(key, value)| {
                let name = key.text().unwrap_or("?");
                let child = match path {
                    "" => name.to_string(),
                    _ => format!("{path}.{name}"),
                };
                if value.is_null() && !null_is_value(&child) {
                    return false;
                }
                drop_nulls(value, &child, null_is_value);
                true
            });
        }
    }
}

/// Takes the entry at `path` (a key's, dotted) out of `node`; whether it was there.
fn remove(node: &mut Node, path: &str) -> bool {
    let (parent, key) = match path.rfind('.') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    };
    let Some(Node {
        kind: Kind::Map(entries),
        ..
    }) = find(node, parent)
    else {
        return false;
    };
    let before = entries.len();
    entries.retain(|(k, _)| k.text() != Some(key));
    entries.len() < before
}

/// The node at `path` (keys dotted, items `[i]`), if there is one.
fn find<'n>(node: &'n mut Node, path: &str) -> Option<&'n mut Node> {
    if path.is_empty() {
        return Some(node);
    }
    let (first, rest) = match path.find(['.', '[']) {
        Some(0) => {
            let end = path.find(']')?;
            let i: usize = path[1..end].parse().ok()?;
            let rest = path[end + 1..].trim_start_matches('.');
            return match &mut node.kind {
                Kind::Seq(items) => find(items.get_mut(i)?, rest),
                _ => None,
            };
        }
        Some(i) => (&path[..i], path[i..].trim_start_matches('.')),
        None => (path, ""),
    };
    match &mut node.kind {
        Kind::Map(entries) => {
            let (_, value) = entries.iter_mut().find(|(k, _)| k.text() == Some(first))?;
            find(value, rest)
        }
        _ => None,
    }
}
