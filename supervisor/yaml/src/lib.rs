//! A YAML document as nodes with their marks, and the serde deserializer that reads types
//! from them: dsv4's configuration reader, apart from what the configuration says.
//!
//! The text is parsed once, by saphyr-parser, into [`Node`]s (aliases expanded, within
//! [`MAX_NODES`] and [`MAX_DEPTH`]). The deserializer, [`De`], knows the path of every value
//! it hands to serde, so every error it returns names that path and its mark ([`At`]), and a
//! struct's keys that its type does not read are found by the deserializer itself (the
//! field list serde hands to `deserialize_struct`), recorded with their path ([`Unknown`])
//! and skipped: one pass finds them all. Plain scalars are resolved as YAML 1.2's core
//! schema says when a type asks for any value (`null`, booleans, integers, floats, else
//! text); a type that asks for text gets any scalar as it is written (`extra_args: [100]`
//! is the text `100`).
//!
//! What to do with the errors (report them, set a value aside and read the rest again) is
//! the caller's: `dsv4::config` reports every mistake in a file this way. The parser's own
//! refusals (more than one document, nesting too deep, aliases expanding too far) are
//! worded for that caller: they speak of a configuration file and its settings.

use std::cell::RefCell;

pub use saphyr_parser::Marker;
use saphyr_parser::{Event, Parser, ScalarStyle, Span};
use serde::de::{self, DeserializeSeed, IntoDeserializer, Unexpected, Visitor};

/// Deeper nesting than this is refused (no setting is nested more than three deep).
pub const MAX_DEPTH: usize = 32;

/// The most nodes a document may have once its aliases are expanded: a few aliases of
/// aliases (a "billion laughs") would otherwise expand to more than memory holds.
pub const MAX_NODES: u64 = 100_000;

/// The longest value an error quotes: a longer one is named by its length, never shown, so
/// that a file read by mistake as configuration (a key file, `/etc/shadow`) is not echoed
/// into the log, a D-Bus alert or `/events`. No setting's word is longer (`power-saver` is
/// 11), and a key is at least 16 characters or warned about.
pub const MAX_QUOTED_VALUE: usize = 12;

/// The longest key an error quotes (the longest key a setting has is 16 characters).
pub const MAX_QUOTED_KEY: usize = 32;

/// `message` with every appearance of `text` (as written, quoted by serde's `{:?}` or in
/// backticks) replaced by its length, when `text` is longer than `most` characters.
pub fn unquoted(message: &str, text: &str, most: usize) -> String {
    let n = text.chars().count();
    if n <= most {
        return message.to_string();
    }
    let hidden = format!("({n} characters, not shown)");
    let debug = format!("{text:?}");
    let ticked = format!("`{text}`");
    let message = message.replace(&debug, &hidden).replace(&ticked, &hidden);
    message.replace(text, &hidden)
}

/// A key as errors show it: itself, or its length when longer than [`MAX_QUOTED_KEY`].
pub fn shown_key(key: &str) -> String {
    match key.chars().count() {
        n if n > MAX_QUOTED_KEY => format!("({n} characters, not shown)"),
        _ => key.to_string(),
    }
}

/// One parsed YAML value and where it is written.
#[derive(Debug, Clone)]
pub struct Node {
    pub kind: Kind,
    pub mark: Marker,
}

#[derive(Debug, Clone)]
pub enum Kind {
    /// A scalar as written; `plain` when unquoted (only a plain scalar can be `null`, a
    /// number or a boolean).
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    /// Keys and values, in order.
    Map(Vec<(Node, Node)>),
}

impl Node {
    /// Whether this is a plain `null`, `~` or nothing: a key set to it counts as not written.
    pub fn is_null(&self) -> bool {
        matches!(&self.kind, Kind::Scalar { text, plain: true } if is_null(text))
    }

    /// The scalar's text, for a map key (`?` for another kind of key).
    pub fn text(&self) -> &str {
        match &self.kind {
            Kind::Scalar { text, .. } => text,
            _ => "?",
        }
    }
}

/// The path of the entry `key` in the mapping at `parent` (`engine` + `idle_timeout`:
/// `engine.idle_timeout`; at the top, the key alone).
pub fn key_path(parent: &str, key: &str) -> String {
    match parent {
        "" => key.to_string(),
        parent => format!("{parent}.{key}"),
    }
}

/// How many levels `node` spans (a scalar: 1).
fn height(node: &Node) -> usize {
    match &node.kind {
        Kind::Scalar { .. } => 1,
        Kind::Seq(items) => 1 + items.iter().map(height).max().unwrap_or(0),
        Kind::Map(entries) => 1 + entries.iter().map(|(_, v)| height(v)).max().unwrap_or(0),
    }
}

fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

/// Whether `text`, written as a plain scalar, reads as that text under YAML 1.2's core
/// schema (not as null, a boolean or a number), as [`De`] resolves it.
pub fn plain_reads_as_text(text: &str) -> bool {
    matches!(Scalar::of(text), Scalar::Text(_))
}

/// A position as messages give it: 1-based line and column (in characters).
pub fn position(m: &Marker) -> (usize, usize) {
    (m.line(), m.col() + 1)
}

/// Why a text is not a document this loader reads: where, and what.
pub type ParseError = ((usize, usize), String);

fn fail<T>(at: &Marker, message: impl Into<String>) -> Result<T, ParseError> {
    Err((position(at), message.into()))
}

fn too_deep<T>(at: &Marker) -> Result<T, ParseError> {
    fail(
        at,
        format!("nested more than {MAX_DEPTH} deep (no setting is)"),
    )
}

/// Parses `text`: its one document's root node (`None` for an empty file).
pub fn parse(text: &str) -> Result<Option<Node>, ParseError> {
    let mut b = Builder {
        events: Parser::new_from_str(text),
        anchors: Vec::new(),
        nodes: 0,
    };
    let (mut root, mut document) = (None, Marker::default());
    loop {
        match b.next()? {
            (Event::DocumentStart(_), span) => document = span.start,
            (Event::StreamStart | Event::DocumentEnd | Event::Nothing, _) => {}
            (Event::StreamEnd, _) => return Ok(root),
            _ if root.is_some() => {
                let message = "the file holds more than one YAML document; a configuration \
                               file holds one";
                return fail(&document, message);
            }
            (event, span) => root = Some(b.node(event, span, 1)?),
        }
    }
}

struct Builder<'a> {
    events: Parser<'a, saphyr_parser::StrInput<'a>>,
    /// The anchored nodes so far, by anchor id, with their size once expanded.
    anchors: Vec<(usize, Node, u64)>,
    /// Nodes so far, aliases expanded.
    nodes: u64,
}

impl<'a> Builder<'a> {
    fn next(&mut self) -> Result<(Event<'a>, Span), ParseError> {
        match self.events.next() {
            Some(Ok(next)) => Ok(next),
            // The scanner's own limit on flow nesting, met before any event of that depth (a
            // test holds this wording of the parser's).
            Some(Err(e)) if e.info().contains("recursion limit") => too_deep(e.marker()),
            Some(Err(e)) => fail(e.marker(), e.info()),
            None => Ok((Event::StreamEnd, Span::empty(Marker::default()))),
        }
    }

    fn count(&mut self, n: u64, at: &Marker) -> Result<(), ParseError> {
        self.nodes += n;
        if self.nodes > MAX_NODES {
            let message = format!(
                "its aliases expand to more than {MAX_NODES} values; write the settings out \
                 instead"
            );
            return fail(at, message);
        }
        Ok(())
    }

    /// The node that opened with `event`, at `depth`.
    fn node(&mut self, event: Event<'a>, span: Span, depth: usize) -> Result<Node, ParseError> {
        let (mark, began) = (span.start, self.nodes);
        let mapping = matches!(event, Event::MappingStart(..));
        let (kind, anchor, tag) = match event {
            Event::Alias(id) => {
                let Some((_, node, size)) = self.anchors.iter().rev().find(|a| a.0 == id) else {
                    return fail(&mark, "an alias to no anchor");
                };
                let (node, size) = (node.clone(), *size);
                // Nesting built by aliases counts as written out.
                if depth + height(&node) - 1 > MAX_DEPTH {
                    return too_deep(&mark);
                }
                self.count(size, &mark)?;
                return Ok(node);
            }
            Event::Scalar(text, style, anchor, tag) => {
                self.count(1, &mark)?;
                let (text, plain) = (text.into_owned(), style == ScalarStyle::Plain);
                (Kind::Scalar { text, plain }, anchor, tag)
            }
            Event::SequenceStart(anchor, tag) | Event::MappingStart(anchor, tag) => {
                self.count(1, &mark)?;
                if depth > MAX_DEPTH {
                    return too_deep(&mark);
                }
                let mut items = Vec::new();
                loop {
                    match self.next()? {
                        (Event::SequenceEnd | Event::MappingEnd, _) => break,
                        (Event::StreamEnd, span) => {
                            return fail(&span.start, "the file ends early")
                        }
                        (event, span) => items.push(self.node(event, span, depth + 1)?),
                    }
                }
                let kind = match mapping {
                    false => Kind::Seq(items),
                    true => {
                        let mut items = items.into_iter();
                        let pairs = std::iter::from_fn(|| Some((items.next()?, items.next()?)));
                        Kind::Map(pairs.collect())
                    }
                };
                (kind, anchor, tag)
            }
            _ => return fail(&mark, "unexpected YAML event"),
        };
        let mut node = Node { kind, mark };
        // `!!str 64` is the text `64`; other tags (`!!int 64`) change nothing a setting reads.
        if let (Some(tag), Kind::Scalar { plain, .. }) = (tag, &mut node.kind) {
            if tag.handle == "tag:yaml.org,2002:" && tag.suffix == "str" {
                *plain = false;
            }
        }
        if anchor != 0 {
            self.anchors
                .push((anchor, node.clone(), self.nodes - began));
        }
        Ok(node)
    }
}

/// A mistake serde found in a value: what, and where (once known).
#[derive(Debug)]
pub struct Error {
    pub message: String,
    pub at: Option<At>,
}

/// Where a value is: its path (`engine.idle_timeout`, `extra_args[2]`), its mark, and the
/// mapping entry it is in (its own, or that of the list it is an item of; none at the root).
#[derive(Debug, Clone)]
pub struct At {
    pub path: String,
    pub mark: Marker,
    pub entry: Option<Entry>,
}

/// A mapping entry: its path, and its value node, which names it exactly (paths cannot: a
/// key may hold `.` or `[`) as long as the tree is not changed. Only its address is kept.
#[derive(Debug, Clone)]
pub struct Entry {
    pub path: String,
    pub value: *const Node,
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

impl de::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Error {
        let message = msg.to_string();
        Error { message, at: None }
    }
}

/// A key a struct does not read: where it is, and the keys there are.
#[derive(Debug)]
pub struct Unknown {
    /// The entry's path (`api.max_bdy`).
    pub path: String,
    /// Its struct's path (`api`, empty at the top), and its key as written (which may hold a
    /// `.` itself).
    pub parent: String,
    pub key: String,
    /// The keys the struct reads.
    pub keys: &'static [&'static str],
}

/// The deserializer of one node; unknown keys go to `unknown`.
///
/// Errors are given their place by whoever handed the value to serde ([`De::read`] at the
/// root, the sequence and map accesses below it), so that an error the type itself makes
/// (a `deserialize_with` that parses the text) is placed as well as the deserializer's own.
pub struct De<'a> {
    node: &'a Node,
    at: At,
    unknown: &'a RefCell<Vec<Unknown>>,
}

impl<'a> De<'a> {
    /// Reads the root `node` with `seed`.
    pub fn read<S: DeserializeSeed<'a>>(
        node: &'a Node,
        unknown: &'a RefCell<Vec<Unknown>>,
        seed: S,
    ) -> Result<S::Value, Error> {
        let (path, mark) = (String::new(), node.mark);
        let at = At {
            path,
            mark,
            entry: None,
        };
        De { node, at, unknown }.seed(seed)
    }

    /// Reads this node with `seed`, placing an error that has no place yet here.
    fn seed<S: DeserializeSeed<'a>>(self, seed: S) -> Result<S::Value, Error> {
        let (at, node) = (self.at.clone(), self.node);
        seed.deserialize(self).map_err(|mut e| {
            // Placed here first: the value is this node's, and a long one is not repeated.
            if e.at.is_none() {
                if let Kind::Scalar { text, .. } = &node.kind {
                    e.message = unquoted(&e.message, text, MAX_QUOTED_VALUE);
                }
            }
            e.at.get_or_insert(at);
            e
        })
    }

    /// The deserializer of `node` at `path`: an item of this node's, or a key or value of
    /// the entry whose value is `entry`.
    fn child(&self, node: &'a Node, path: String, entry: Option<&'a Node>) -> De<'a> {
        let entry = match entry {
            Some(value) => Some(Entry {
                path: path.clone(),
                value,
            }),
            None => self.at.entry.clone(),
        };
        let at = At {
            path,
            mark: node.mark,
            entry,
        };
        De {
            node,
            at,
            unknown: self.unknown,
        }
    }

    /// What the node is, for a message that says it is not what was expected: a plain
    /// scalar as the core schema reads it.
    fn unexpected(&self) -> Unexpected<'a> {
        match &self.node.kind {
            Kind::Scalar { text, plain: false } => Unexpected::Str(text),
            Kind::Scalar { text, plain: true } => match Scalar::of(text) {
                Scalar::Null => Unexpected::Unit,
                Scalar::Bool(b) => Unexpected::Bool(b),
                Scalar::Unsigned(n) => Unexpected::Unsigned(n),
                Scalar::Signed(n) => Unexpected::Signed(n),
                Scalar::Float(x) => Unexpected::Float(x),
                Scalar::Text(text) => Unexpected::Str(text),
            },
            Kind::Seq(_) => Unexpected::Seq,
            Kind::Map(_) => Unexpected::Map,
        }
    }

    fn wrong<T, V: Visitor<'a>>(&self, visitor: &V) -> Result<T, Error> {
        Err(de::Error::invalid_type(self.unexpected(), visitor))
    }

    fn map(&self, fields: Option<&'static [&'static str]>) -> Map<'_, 'a> {
        let entries: &'a [(Node, Node)] = match &self.node.kind {
            Kind::Map(entries) => entries,
            _ => &[],
        };
        let entries = entries.iter();
        Map {
            de: self,
            entries,
            fields,
            value: None,
        }
    }

    /// A value for an unsigned type: a negative integer is the wrong type of number.
    fn unsigned<V: Visitor<'a>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar { text, plain: true } => match Scalar::of(text) {
                Scalar::Signed(n) => Err(de::Error::invalid_type(Unexpected::Signed(n), &visitor)),
                _ => de::Deserializer::deserialize_any(self, visitor),
            },
            _ => de::Deserializer::deserialize_any(self, visitor),
        }
    }
}

/// A plain scalar as YAML 1.2's core schema reads it.
enum Scalar<'a> {
    Null,
    Bool(bool),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Text(&'a str),
}

impl<'a> Scalar<'a> {
    fn of(text: &'a str) -> Scalar<'a> {
        match text {
            _ if is_null(text) => return Scalar::Null,
            "true" | "True" | "TRUE" => return Scalar::Bool(true),
            "false" | "False" | "FALSE" => return Scalar::Bool(false),
            ".inf" | ".Inf" | ".INF" | "+.inf" | "+.Inf" | "+.INF" => {
                return Scalar::Float(f64::INFINITY)
            }
            "-.inf" | "-.Inf" | "-.INF" => return Scalar::Float(f64::NEG_INFINITY),
            ".nan" | ".NaN" | ".NAN" => return Scalar::Float(f64::NAN),
            _ => {}
        }
        let (negative, digits) = match text.as_bytes().first() {
            Some(b'-') => (true, &text[1..]),
            Some(b'+') => (false, &text[1..]),
            _ => (false, text),
        };
        let radix = match digits.get(..2) {
            Some("0x") => Some(16),
            Some("0o") => Some(8),
            Some("0b") => Some(2),
            _ => None,
        };
        let integer = match radix {
            Some(r) => u64::from_str_radix(&digits[2..], r).ok(),
            None if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                digits.parse::<u64>().ok()
            }
            None => None,
        };
        match (integer, negative) {
            (Some(n), false) => return Scalar::Unsigned(n),
            (Some(n), true) => {
                return i64::try_from(n).map_or(Scalar::Text(text), |n| Scalar::Signed(-n))
            }
            (None, _) => {}
        }
        let numeric = digits
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'-' | b'+'))
            && digits.bytes().any(|b| b.is_ascii_digit());
        match text.parse::<f64>() {
            Ok(x) if numeric => Scalar::Float(x),
            _ => Scalar::Text(text),
        }
    }
}

/// The unsigned types, each read by [`De::unsigned`].
macro_rules! unsigned {
    ($($name:ident)*) => {$(
        fn $name<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.unsigned(visitor)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for De<'de> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar { text, plain: true } => match Scalar::of(text) {
                Scalar::Null => visitor.visit_unit(),
                Scalar::Bool(b) => visitor.visit_bool(b),
                Scalar::Unsigned(n) => visitor.visit_u64(n),
                Scalar::Signed(n) => visitor.visit_i64(n),
                Scalar::Float(x) => visitor.visit_f64(x),
                Scalar::Text(text) => visitor.visit_borrowed_str(text),
            },
            Kind::Scalar { text, .. } => visitor.visit_borrowed_str(text),
            Kind::Seq(items) => visitor.visit_seq(Seq {
                de: &self,
                items: items.iter().enumerate(),
            }),
            Kind::Map(_) => visitor.visit_map(self.map(None)),
        }
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match &self.node.kind {
            // Any scalar as it is written.
            Kind::Scalar { text, .. } => visitor.visit_borrowed_str(text),
            _ => self.wrong(&visitor),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_str(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.node.is_null() {
            true => visitor.visit_none(),
            false => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Map(_) => visitor.visit_map(self.map(Some(fields))),
            _ => self.wrong(&visitor),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match &self.node.kind {
            Kind::Scalar { text, .. } => visitor.visit_enum(text.as_str().into_deserializer()),
            _ => self.wrong(&visitor),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    unsigned! { deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u128 f32 f64 char bytes byte_buf unit
        unit_struct seq tuple tuple_struct map
    }
}

struct Seq<'d, 'a> {
    de: &'d De<'a>,
    items: std::iter::Enumerate<std::slice::Iter<'a, Node>>,
}

impl<'a> de::SeqAccess<'a> for Seq<'_, 'a> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'a>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        let Some((i, node)) = self.items.next() else {
            return Ok(None);
        };
        let path = format!("{}[{i}]", self.de.at.path);
        self.de.child(node, path, None).seed(seed).map(Some)
    }
}

struct Map<'d, 'a> {
    de: &'d De<'a>,
    entries: std::slice::Iter<'a, (Node, Node)>,
    /// A struct's keys: any other is recorded as unknown and skipped.
    fields: Option<&'static [&'static str]>,
    /// The value of the key just handed out, with its path.
    value: Option<(&'a Node, String)>,
}

impl<'a> de::MapAccess<'a> for Map<'_, 'a> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'a>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        for (key, value) in self.entries.by_ref() {
            let (parent, name) = (&self.de.at.path, key.text());
            let path = key_path(parent, name);
            match self.fields {
                Some(keys) if !keys.contains(&name) => {
                    let (parent, key) = (parent.clone(), name.to_string());
                    let unknown = Unknown {
                        path,
                        parent,
                        key,
                        keys,
                    };
                    self.de.unknown.borrow_mut().push(unknown);
                }
                _ => {
                    let k = self.de.child(key, path.clone(), Some(value)).seed(seed)?;
                    self.value = Some((value, path));
                    return Ok(Some(k));
                }
            }
        }
        Ok(None)
    }

    fn next_value_seed<S: DeserializeSeed<'a>>(&mut self, seed: S) -> Result<S::Value, Error> {
        let (node, path) = self
            .value
            .take()
            .ok_or_else(|| de::Error::custom("a value without its key"))?;
        self.de.child(node, path, Some(node)).seed(seed)
    }
}

/// The message for a key `key` that a struct reading `keys` does not read: serde's own
/// wording, and the nearest key when it looks like a typo (then also returned).
pub fn unknown_key(key: &str, keys: &[&'static str]) -> (String, Option<&'static str>) {
    let quoted: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
    let mut message = match quoted.as_slice() {
        [] => format!("unknown key `{key}`, there are no keys"),
        [one] => format!("unknown key `{key}`, expected {one}"),
        [a, b] => format!("unknown key `{key}`, expected {a} or {b}"),
        all => format!("unknown key `{key}`, expected one of {}", all.join(", ")),
    };
    let limit = (key.chars().count() / 3).max(1);
    let meant = keys
        .iter()
        .map(|k| (strsim::osa_distance(key, k), *k))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k);
    if let Some(meant) = meant {
        message.push_str(&format!("; did you mean `{meant}`?"));
    }
    (unquoted(&message, key, MAX_QUOTED_KEY), meant)
}

/// The first mistake in a text [`from_str`] read: `line:column: path: message`.
#[derive(Debug)]
pub struct Mistake {
    pub at: Option<(usize, usize)>,
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for Mistake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some((line, column)) = self.at {
            write!(f, "{line}:{column}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// `text` read as a `T` (an empty document as `None`), or its first mistake (a key the type
/// does not read is one).
pub fn from_str<T: de::DeserializeOwned>(text: &str) -> Result<Option<T>, Mistake> {
    let mistake = |at, path, message| Mistake { at, path, message };
    let node = parse(text).map_err(|(at, message)| mistake(Some(at), String::new(), message))?;
    let Some(node) = node else { return Ok(None) };
    let unknown = RefCell::new(Vec::new());
    let value = De::read(&node, &unknown, std::marker::PhantomData::<T>).map_err(|e| {
        let at = e.at.expect("placed at the root");
        mistake(Some(position(&at.mark)), at.path, e.message)
    })?;
    match unknown.into_inner().into_iter().next() {
        Some(u) => {
            let path = key_path(&u.parent, &shown_key(&u.key));
            Err(mistake(None, path, unknown_key(&u.key, u.keys).0))
        }
        None => Ok(Some(value)),
    }
}

/// The keys the struct `T` reads (as its deserializer is told).
pub fn keys_of<T: de::DeserializeOwned>() -> &'static [&'static str] {
    let node = |text: &str, plain| Node {
        kind: Kind::Scalar {
            text: text.into(),
            plain,
        },
        mark: Marker::default(),
    };
    let kind = Kind::Map(vec![(node("\u{0}probe", false), node("", true))]);
    let probe = Node {
        kind,
        mark: Marker::default(),
    };
    let unknown = RefCell::new(Vec::new());
    let _ = De::read(&probe, &unknown, std::marker::PhantomData::<T>);
    unknown.into_inner().first().map_or(&[], |u| u.keys)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    fn read<T: for<'a> Deserialize<'a>>(text: &str) -> Result<T, String> {
        let node = parse(text).map_err(|e| e.1)?.unwrap();
        let unknown = RefCell::new(Vec::new());
        De::read(&node, &unknown, std::marker::PhantomData::<T>).map_err(|e| {
            let at = e.at.map(|at| (at.path, position(&at.mark)));
            let (path, at) = (at.as_ref().map(|a| a.0.clone()), at.map(|a| a.1));
            format!("{}: {} {at:?}", path.unwrap_or_default(), e.message)
        })
    }

    #[test]
    fn plain_scalars_resolve_as_the_core_schema_says() {
        let v: Vec<serde_json::Value> =
            read("[~, null, '', true, False, 12, -3, 0x1f, 0o17, 1.5, -2e3, .inf, 64k, '12']")
                .unwrap();
        let shown: Vec<String> = v.iter().map(|v| v.to_string()).collect();
        assert_eq!(
            shown,
            [
                "null", "null", "\"\"", "true", "false", "12", "-3", "31", "15", "1.5", "-2000.0",
                "null", "\"64k\"", "\"12\""
            ]
        );
    }

    #[test]
    fn errors_name_the_value_and_where_it_is() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct S {
            n: Option<u32>,
            list: Vec<u32>,
        }
        let e = read::<S>("n: lots\nlist: []\n").unwrap_err();
        assert_eq!(
            e,
            "n: invalid type: string \"lots\", expected u32 Some((1, 4))"
        );
        let e = read::<S>("n: 1\nlist:\n  - 1\n  - -2\n").unwrap_err();
        assert_eq!(
            e,
            "list[1]: invalid type: integer `-2`, expected u32 Some((4, 5))"
        );
    }

    #[test]
    fn aliases_expand_and_their_size_counts() {
        let v: Vec<Vec<u32>> = read("- &a [1, 2]\n- *a\n").unwrap();
        assert_eq!(v, [[1, 2], [1, 2]]);
        let mut laughs = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
        for (i, name) in ["b", "c", "d", "e", "f"].iter().enumerate() {
            let prev = ["a", "b", "c", "d", "e"][i];
            laughs.push_str(&format!(
                "{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
            ));
        }
        let e = parse(&laughs).unwrap_err();
        assert!(e.1.contains("aliases expand to more than 100000"), "{e:?}");
    }
}
