//! Reading a YAML file, with its drop-ins laid over it, into a serde type, reporting every
//! mistake with its file and position.
//!
//! The text is parsed once into nodes with their marks ([`dsv4_yaml`]); this project's own
//! deserializer reads the type from them, and every mistake it finds names the path of the
//! value, whose entry says where it is written. Keys the type does not read are found in the
//! same pass (the deserializer knows each struct's keys). serde stops at a value that does
//! not fit: its entry is then taken out of the nodes and the type read again from them, until
//! it reads, so one run reports every mistake (up to [`MAX_VALUE_PROBLEMS`] values that do
//! not fit).
//!
//! Drop-ins ([`Doc::read_layers`]) are parsed alone, then laid over the file in order: a
//! mapping merges into the mapping under the same key, anything else (a scalar, a list)
//! replaces what was there, and a key set to null in a drop-in changes nothing (unless null
//! is that key's value). Each entry remembers the file that wrote it last, so a mistake is
//! placed in the file it comes from.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::marker::PhantomData;
use std::path::PathBuf;

use dsv4_yaml::{Kind, Marker, Node};
use serde::de::DeserializeOwned;

use super::error::Problem;

/// The most values that do not fit one reading reports.
const MAX_VALUE_PROBLEMS: usize = 50;

/// The largest configuration file read, in bytes (the shipped one is a few KiB).
pub(crate) const MAX_BYTES: u64 = 256 << 10;

/// Reads the configuration file `path`, refusing one larger than [`MAX_BYTES`] before
/// reading it whole, and anything but a regular file (opened without blocking, as
/// `host::regular` does for the state files, which this layer is below: a FIFO would hang the
/// open).
pub(crate) fn read_file(path: &std::path::Path) -> Result<String, String> {
    read_file_held(path, |_| None)
}

/// As [`read_file`], after `held` found nothing wrong with the file opened (its owner and
/// mode, judged on what was opened, not on whatever the path names a moment later).
pub(crate) fn read_file_held(
    path: &std::path::Path,
    held: impl FnOnce(&std::fs::Metadata) -> Option<String>,
) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("cannot read: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("cannot read: {e}"))?;
    if let Some(problem) = held(&meta) {
        return Err(problem);
    }
    let kind = meta.file_type();
    if !kind.is_file() {
        let what = match () {
            _ if kind.is_dir() => "a folder",
            _ if kind.is_fifo() => "a FIFO (named pipe)",
            _ => "a device or a socket",
        };
        return Err(format!("is {what}, not a regular file"));
    }
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
    /// Which of [`Doc::files`] it is written in.
    file: usize,
}

/// A file that was read (with its drop-ins): problems found afterwards get their key's file
/// and position from it.
#[derive(Debug, Default)]
pub(crate) struct Doc {
    /// The file, as shown in messages.
    pub file: PathBuf,
    /// The file, then its drop-ins in the order they were laid over it.
    pub files: Vec<PathBuf>,
    /// Every entry by path: `engine.idle_timeout`, `extra_args[2]`.
    entries: HashMap<String, Entry>,
    /// Entries whose value is a plain null (not written, as far as the settings go).
    nulls: HashSet<String>,
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
        Doc::read_layers(&[(file, text)], null_is_value, problems)
    }

    /// As [`read`](Self::read), for the first of `layers` with the others laid over it in
    /// order (its drop-ins: each `(file, text)`). A drop-in that is not YAML, or not a
    /// mapping, is reported and left out: the rest is still read, so that their mistakes
    /// are found too.
    pub fn read_layers<T: DeserializeOwned + Default>(
        layers: &[(PathBuf, &str)],
        null_is_value: fn(&str) -> bool,
        problems: &mut Vec<Problem>,
    ) -> (Doc, Option<T>) {
        let before = problems.len();
        let (mut doc, root) = Doc::merge(layers, null_is_value, problems);
        let Some(mut root) = root else {
            // The file itself is not YAML, or every file is empty.
            let empty = problems[before..].iter().all(|p| p.file != doc.file);
            return (doc, empty.then(T::default));
        };
        let mut unknown_seen = HashSet::new();
        // How many values' problems were reported: only the first is certain to be the file's
        // own, so a later one that cannot be set aside ends the reading unsaid.
        let mut said = 0;
        loop {
            let unknown = RefCell::new(Vec::new());
            // A document that is only `null` (or `~`) is every default.
            let read = dsv4_yaml::De::read(&root, &unknown, PhantomData::<Option<T>>);
            for u in unknown.into_inner() {
                if unknown_seen.insert(u.path.clone()) {
                    let problem = doc.unknown_key(&u);
                    problems.push(problem);
                }
            }
            let (message, at) = match read {
                Ok(value) => return (doc, Some(value.unwrap_or_default())),
                Err(dsv4_yaml::Error { message, at }) => (message, at.expect("placed at the root")),
            };
            let mut problem = doc.problem(&at.path, message);
            if problem.line.is_none() {
                problem = problem.at(Some(dsv4_yaml::position(&at.mark)));
            }
            // The entry the value is in is set aside (a list item that does not fit sets its
            // whole list aside).
            let set_aside = at.entry.is_some_and(|entry| {
                doc.dropped.insert(entry.path) && remove(&mut root, entry.value)
            });
            if !set_aside {
                if said == 0 {
                    problems.push(problem);
                }
                return (doc, None);
            }
            said += 1;
            problems.push(problem);
            // Each is found by reading the rest again: a file of thousands of mistakes would
            // take minutes. The first ones are enough to start with.
            if said == MAX_VALUE_PROBLEMS {
                let rest = format!(
                    "and perhaps more: only the first {MAX_VALUE_PROBLEMS} values that do not \
                     fit are reported; fix these and check again"
                );
                problems.push(Problem::new(&doc.file, "", rest));
                return (doc, None);
            }
        }
    }

    /// Parses each of `layers` and lays each over the ones before: the document (`None` when
    /// every file is empty or the first is not YAML).
    fn merge(
        layers: &[(PathBuf, &str)],
        null_is_value: fn(&str) -> bool,
        problems: &mut Vec<Problem>,
    ) -> (Doc, Option<Node>) {
        let mut doc = Doc {
            file: layers.first().map(|l| l.0.clone()).unwrap_or_default(),
            files: layers.iter().map(|l| l.0.clone()).collect(),
            ..Doc::default()
        };
        let mut root: Option<Node> = None;
        for (i, (file, text)) in layers.iter().enumerate() {
            let mut node = match dsv4_yaml::parse(text) {
                Ok(Some(node)) => node,
                Ok(None) => continue,
                Err((at, message)) => {
                    problems.push(Problem::new(file, "", message).at(Some(at)));
                    if i == 0 {
                        // Its drop-ins are not laid over what could not be read.
                        return (doc, None);
                    }
                    continue;
                }
            };
            if i > 0 && !matches!(node.kind, Kind::Map(_)) {
                if !node.is_null() {
                    let message = "a drop-in must be a mapping of settings, as the file it \
                                   is laid over is";
                    let at = dsv4_yaml::position(&node.mark);
                    problems.push(Problem::new(file, "", message).at(Some(at)));
                }
                continue;
            }
            let mut layer = Doc::default();
            layer.record(&mut node, "", null_is_value, i);
            match root.as_mut() {
                None => root = Some(node),
                // The file's own mistake (a list where its settings belong) is its own.
                Some(base) if !base.is_null() && !matches!(base.kind, Kind::Map(_)) => continue,
                Some(base) => doc.overlay(base, node, ""),
            }
            doc.take(layer);
        }
        (doc, root)
    }

    /// Lays `top` over `base` (at `path`): mappings merge key by key, anything else replaces
    /// what was there, and what was recorded inside it is forgotten.
    fn overlay(&mut self, base: &mut Node, mut top: Node, path: &str) {
        if let (Kind::Map(under), Kind::Map(over)) = (&mut base.kind, &mut top.kind) {
            for (key, value) in std::mem::take(over) {
                // The last of two equal keys is the one read.
                match under.iter_mut().rev().find(|(k, _)| k.text() == key.text()) {
                    Some((_, old)) => {
                        let child = dsv4_yaml::key_path(path, key.text());
                        self.overlay(old, value, &child);
                    }
                    None => under.push((key, value)),
                }
            }
            return;
        }
        let inside = |p: &String| {
            path.is_empty()
                || p.strip_prefix(path)
                    .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
        };
        self.entries.retain(|p, _| !inside(p));
        self.nulls.retain(|p| !inside(p));
        *base = top;
    }

    /// Takes the entries recorded for a drop-in: a null it took out changes nothing already
    /// written.
    fn take(&mut self, layer: Doc) {
        for (path, entry) in layer.entries {
            let null = layer.nulls.contains(&path);
            if null && self.entries.contains_key(&path) {
                continue;
            }
            if null {
                self.nulls.insert(path.clone());
            } else {
                self.nulls.remove(&path);
            }
            self.entries.insert(path, entry);
        }
    }

    /// Records where each entry inside `node` (at `path`, in the file `file`) is written, and
    /// takes out those whose value is a plain null (a key set to null counts as not written),
    /// unless `null_is_value` says the null is the value.
    fn record(
        &mut self,
        node: &mut Node,
        path: &str,
        null_is_value: fn(&str) -> bool,
        file: usize,
    ) {
        match &mut node.kind {
            Kind::Scalar { .. } => {}
            Kind::Seq(items) => {
                for (i, item) in items.iter_mut().enumerate() {
                    let child = format!("{path}[{i}]");
                    self.record(item, &child, null_is_value, file);
                    let (key, value) = (item.mark, item.mark);
                    self.entries.insert(child, Entry { key, value, file });
                }
            }
            Kind::Map(entries) => entries.retain_mut(|(key, value)| {
                let child = dsv4_yaml::key_path(path, key.text());
                self.record(value, &child, null_is_value, file);
                let entry = Entry {
                    key: key.mark,
                    value: value.mark,
                    file,
                };
                // The last of two equal keys is the one read.
                self.entries.insert(child.clone(), entry);
                let kept = !value.is_null() || null_is_value(&child);
                if !kept {
                    self.nulls.insert(child);
                }
                kept
            }),
        }
    }

    /// The problem of a key its struct does not read:
    /// the keys there are, and the nearest of them when it looks like a typo (then marked
    /// dropped: checks about the key meant would only repeat the problem).
    fn unknown_key(&mut self, u: &dsv4_yaml::Unknown) -> Problem {
        let (message, meant) = dsv4_yaml::unknown_key(&u.key, u.keys);
        if let Some(meant) = meant {
            self.dropped.insert(dsv4_yaml::key_path(&u.parent, meant));
        }
        self.dropped.insert(u.path.clone());
        let field = dsv4_yaml::key_path(&u.parent, &dsv4_yaml::shown_key(&u.key));
        self.at(&field, &u.path, true, message)
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
        let entry = self.entries.get(path);
        let spot = entry.map(|e| {
            let m = if on_key || e.value.line() != e.key.line() {
                e.key
            } else {
                e.value
            };
            // 1-based, the column in characters.
            (m.line(), m.col() + 1)
        });
        let file = entry.and_then(|e| self.files.get(e.file));
        Problem::new(file.unwrap_or(&self.file), field, message).at(spot)
    }

    /// Where `problem`'s file comes in the order files are reported: the file, then its
    /// drop-ins, then any other file.
    pub fn rank(&self, problem: &Problem) -> usize {
        let found = self.files.iter().position(|f| *f == problem.file);
        found.unwrap_or(self.files.len())
    }

    /// The first of `paths` that is written, else the first: where a rule between keys is
    /// reported.
    pub fn first_written<'a>(&self, paths: &[&'a str]) -> &'a str {
        let written = paths.iter().find(|p| self.entries.contains_key(**p));
        written.unwrap_or(&paths[0])
    }

    /// Whether the key at `path` is written with a value (not null).
    pub fn written(&self, path: &str) -> bool {
        self.entries.contains_key(path) && !self.nulls.contains(path)
    }

    /// Whether the entry at `path` was set aside after a problem (or may have been meant by
    /// an unknown key).
    pub fn dropped(&self, path: &str) -> bool {
        self.dropped.contains(path)
    }
}

impl Doc {
    /// `layers` merged as [`read_layers`](Self::read_layers) merges them, written out as
    /// YAML, each value with a comment saying the file and line it comes from; `None`, with
    /// the problems, when a file is not YAML. Keys set to null are left out, as they count
    /// as not written.
    pub fn merged_text(
        layers: &[(PathBuf, &str)],
        null_is_value: fn(&str) -> bool,
        problems: &mut Vec<Problem>,
    ) -> Option<String> {
        let before = problems.len();
        let (doc, root) = Doc::merge(layers, null_is_value, problems);
        if problems.len() > before {
            return None;
        }
        let mut out = String::new();
        if let Some(root) = root {
            doc.write(&mut out, &root, "", 0);
        }
        Some(out)
    }

    /// Writes `node` (at `path`, as a block `depth` levels in) to `out`.
    fn write(&self, out: &mut String, node: &Node, path: &str, depth: usize) {
        let indent = "  ".repeat(depth);
        match &node.kind {
            Kind::Map(entries) if !entries.is_empty() => {
                for (key, value) in entries {
                    let child = dsv4_yaml::key_path(path, key.text());
                    out.push_str(&format!("{indent}{}:", written_scalar(key.text(), false)));
                    self.write_value(out, value, &child, depth);
                }
            }
            Kind::Seq(items) if !items.is_empty() => {
                for (i, item) in items.iter().enumerate() {
                    out.push_str(&format!("{indent}-"));
                    self.write_value(out, item, &format!("{path}[{i}]"), depth);
                }
            }
            _ => {
                out.push_str(&indent);
                self.write_value(out, node, path, depth);
            }
        }
    }

    /// Writes the value of the entry at `path` after its key or dash: on the same line with
    /// its origin when it is a scalar or empty, else as a block one level in.
    fn write_value(&self, out: &mut String, value: &Node, path: &str, depth: usize) {
        let leaf = match &value.kind {
            Kind::Scalar { text, plain } => Some(written_scalar(text, *plain)),
            Kind::Map(entries) if entries.is_empty() => Some("{}".to_string()),
            Kind::Seq(items) if items.is_empty() => Some("[]".to_string()),
            _ => None,
        };
        match leaf {
            Some(text) => {
                out.push(' ');
                out.push_str(&text);
                if let Some(e) = self.entries.get(path) {
                    let file = self.files.get(e.file).unwrap_or(&self.file);
                    out.push_str(&format!("  # {}:{}", file.display(), e.key.line()));
                }
                out.push('\n');
            }
            None => {
                out.push('\n');
                self.write(out, value, path, depth + 1);
            }
        }
    }
}

/// A scalar as it can be written back: a plain one as it was written (so it keeps its
/// type); a quoted one, or a key, plain when that reads as the same text, else in double
/// quotes (a JSON string is a YAML double-quoted scalar).
fn written_scalar(text: &str, plain: bool) -> String {
    if plain && text.is_empty() {
        return "null".to_string();
    }
    // Written plain after a key or a dash, as it was, a plain scalar reads the same.
    if plain && !text.contains('\n') {
        return text.to_string();
    }
    let simple = !text.is_empty()
        && !text.contains([
            '\n', '#', '"', '\'', '{', '}', '[', ']', ',', '&', '*', '!', '|', '>',
        ])
        && !text.contains(": ")
        && !text.ends_with([':', ' '])
        && !text.starts_with([' ', '-', '?', '%', '@', '`']);
    // Written plain, a quoted text that the core schema reads as a number, a boolean or null
    // would be read as one.
    if simple && dsv4_yaml::plain_reads_as_text(text) {
        return text.to_string();
    }
    serde_json::to_string(text).unwrap_or_else(|_| format!("{text:?}"))
}

/// Takes the mapping entry whose value is `value` out of `node`; whether it was there.
fn remove(node: &mut Node, value: *const Node) -> bool {
    match &mut node.kind {
        Kind::Scalar { .. } => false,
        Kind::Seq(items) => items.iter_mut().any(|item| remove(item, value)),
        Kind::Map(entries) => match entries.iter().position(|(_, v)| std::ptr::eq(v, value)) {
            Some(i) => {
                entries.remove(i);
                true
            }
            None => entries.iter_mut().any(|(_, v)| remove(v, value)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::raw::RawProfile;

    /// Every problem `Doc::read` finds in `text` as a profile, `line:column: field: message`.
    fn problems(text: &str) -> (Vec<String>, bool) {
        let mut found = Vec::new();
        let (_, read) =
            Doc::read::<RawProfile>(PathBuf::from("p.yaml"), text, |_| false, &mut found);
        let shown = found
            .iter()
            .map(|p| {
                let at = p.line.map(|l| format!("{l}:{}: ", p.column.unwrap_or(0)));
                format!("{}{}: {}", at.unwrap_or_default(), p.field, p.message)
            })
            .collect();
        (shown, read.is_some())
    }

    #[test]
    fn a_scalar_is_written_back_to_read_as_it_was() {
        let table = [
            // (text, plain, written)
            ("5m", true, "5m"),
            ("", true, "null"),
            ("127.0.0.1:8080", true, "127.0.0.1:8080"),
            ("-ub", true, "-ub"),
            ("it's", true, "it's"),
            ("a\n\nb", true, "\"a\\n\\nb\""),
            // Quoted text stays text: plain when it reads so, else quoted.
            ("http://a.example", false, "http://a.example"),
            ("5", false, "\"5\""),
            ("1e3", false, "\"1e3\""),
            ("0x1F", false, "\"0x1F\""),
            ("0o17", false, "\"0o17\""),
            ("+.inf", false, "\"+.inf\""),
            ("true", false, "\"true\""),
            ("Null", false, "\"Null\""),
            ("~", false, "\"~\""),
            ("", false, "\"\""),
            ("[::1]:9000", false, "\"[::1]:9000\""),
            ("a: b", false, "\"a: b\""),
            ("a #b", false, "\"a #b\""),
            ("-x", false, "\"-x\""),
            (" x", false, "\" x\""),
            ("x:", false, "\"x:\""),
            ("say \"hi\"", false, "\"say \\\"hi\\\"\""),
        ];
        for (text, plain, want) in table {
            assert_eq!(written_scalar(text, plain), want, "{text:?} plain={plain}");
            // And it reads back as the same text.
            let node = dsv4_yaml::parse(&format!("k: {want}\n")).unwrap().unwrap();
            let Kind::Map(entries) = node.kind else {
                panic!()
            };
            let read = match &entries[0].1.kind {
                Kind::Scalar { text, .. } if !(plain && text == "null") => text.clone(),
                _ => String::new(),
            };
            assert_eq!(read, text, "{want}");
        }
    }

    #[test]
    fn a_key_holding_a_dot_is_named_whole_and_set_aside_alone() {
        let (found, read) = problems("foo.model: x\nenv: {A.B: [1], C: [2], D: ok}\n");
        assert!(read);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(
            found[0].starts_with("1:1: foo.model: unknown key `foo.model`, expected one of"),
            "{found:?}"
        );
        assert!(!found[0].contains("did you mean"), "{found:?}");
        assert!(
            found[1].contains("env.A.B: invalid type: sequence"),
            "{found:?}"
        );
        assert!(
            found[2].contains("env.C: invalid type: sequence"),
            "{found:?}"
        );
    }

    #[test]
    fn a_mistake_after_an_unknown_key_is_still_said() {
        let (found, read) = problems("contxt: 5\nengine: ds4\ncommand: x\nengine: ds4\n");
        assert!(!read);
        assert!(
            found.iter().any(|p| p.contains("unknown key `contxt`")),
            "{found:?}"
        );
        assert!(
            found.iter().any(|p| p.contains("duplicate field `engine`")),
            "{found:?}"
        );
    }

    #[test]
    fn plain_values_are_named_for_what_they_are_and_core_tags_are_read() {
        let (found, _) = problems("kv_checkpoint: 5\nenv: true\n");
        assert!(found[0].contains("invalid type: integer `5`"), "{found:?}");
        assert!(
            found[1].contains("invalid type: boolean `true`"),
            "{found:?}"
        );
        let (found, read) = problems("context: !!int 4096\ncommand: !!str 100\n");
        assert!(read && found.is_empty(), "{found:?}");
    }

    #[test]
    fn a_long_value_or_key_is_never_quoted_in_a_problem() {
        let key = "3f9a0c6e1b2d4f5a6c7e8d9b0a1c2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d";
        let shadow = "$6$Qx3v9Lk2$Zp0d8Jm4Wq7Rt1Yc5Nv2Hb6Gf3Ds9Ak0Lp4Ox8Iu7Ey1Tr5We3Qa";
        let texts = [
            // A key file read as a profile: one plain scalar.
            format!("{key}\n"),
            format!("# admin keys\n{key}\n{key}\n"),
            // /etc/shadow read as one: each line a key of a mapping.
            format!("root:{shadow}:19000:0:99999:7:::\nbin:*:19000:0:99999:7:::\n"),
            // In a setting that reads text, and one whose parser repeats what it was given.
            format!("engine: {key}\ncommand: x\n"),
            format!("kv_checkpoint: {{dir: x, save_timeout: {key}}}\n"),
            format!("context: {key}\n"),
        ];
        for text in &texts {
            // As profiles are read: a key set to null is a value.
            let mut found = Vec::new();
            Doc::read::<RawProfile>(PathBuf::from("p.yaml"), text, |_| true, &mut found);
            let found: Vec<String> = found.iter().map(|p| p.to_string()).collect();
            assert!(!found.is_empty(), "{text}");
            for secret in [key, shadow, &key[..13], &shadow[..13]] {
                assert!(
                    found.iter().all(|p| !p.contains(secret)),
                    "{text}: {found:?}"
                );
            }
            assert!(
                found.iter().any(|p| p.contains("characters, not shown")),
                "{found:?}"
            );
        }
        // A short mistake is still quoted, whole.
        let (found, _) = problems("context: lots\nengine: llama\n");
        assert!(found[0].contains("\"lots\""), "{found:?}");
        assert!(found[1].contains("`llama`"), "{found:?}");
    }

    #[test]
    fn a_file_of_thousands_of_mistakes_reports_the_first_fifty() {
        let mut text = String::from("env:\n");
        for i in 0..3000 {
            text.push_str(&format!("  V{i}: [{i}]\n"));
        }
        let (found, read) = problems(&text);
        assert!(!read);
        assert_eq!(found.len(), MAX_VALUE_PROBLEMS + 1, "{:?}", &found[..3]);
        assert!(
            found[0].starts_with("2:7: env.V0: invalid type: sequence"),
            "{found:?}"
        );
        assert!(
            found[MAX_VALUE_PROBLEMS].contains("only the first 50 values"),
            "{found:?}"
        );
    }

    #[test]
    fn nesting_built_by_aliases_counts() {
        let mut text =
            String::from("a0: &a0 [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]\n");
        for i in 1..80 {
            text.push_str(&format!("a{i}: &a{i} [[[*a{}]]]\n", i - 1));
        }
        let (found, read) = problems(&text);
        assert!(!read);
        assert!(found[0].contains("nested more than 32 deep"), "{found:?}");
    }
}
