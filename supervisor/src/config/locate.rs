//! Best-effort positions of keys, values and sequence items in YAML text, for problems found
//! after parsing (serde_yaml_ng gives positions only for the errors it finds itself).
//!
//! A line scan, not a YAML parser: it follows block mappings by indentation, block sequences
//! (`- item`), and flow collections written on one line (`power: { cpu: keep }`,
//! `extra_args: [--metrics, --no-webui]`, or a whole document `{engine: ds4, context: 10}`).
//! When something cannot be found this way the answer is `None` and the problem has no
//! position.
//!
//! Positions are 1-based (line, column), the column counted in characters, like
//! serde_yaml_ng's.

/// Where a key and its value are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spot {
    pub key: (usize, usize),
    /// Where the value starts, when it starts on the key's line.
    pub value: Option<(usize, usize)>,
}

impl Spot {
    /// The value when it is on the key's line, else the key.
    pub fn value_or_key(self) -> (usize, usize) {
        self.value.unwrap_or(self.key)
    }
}

/// Position of the key at `path` (e.g. `["engine", "idle_timeout"]`).
pub(crate) fn find_key(text: &str, path: &[&str]) -> Option<(usize, usize)> {
    find(text, path).map(|spot| spot.key)
}

/// Positions of the key at `path` and of its value.
pub(crate) fn find(text: &str, path: &[&str]) -> Option<Spot> {
    locate(text, path).map(|hit| hit.spot())
}

/// Position of item `index` (0-based) of the sequence at `path`, written either as a flow
/// sequence on the key's line or as a block sequence below it.
pub(crate) fn find_item(text: &str, path: &[&str], index: usize) -> Option<(usize, usize)> {
    let hit = locate(text, path)?;
    if let Some(value) = hit.value {
        if !hit.line[value..].starts_with('[') {
            return None;
        }
        let starts = flow_entries(hit.line, value);
        return starts
            .get(index)
            .map(|&start| position(hit.number, hit.line, start));
    }
    if !hit.block {
        return None;
    }
    // A block sequence: its items sit at one indentation, which may equal the key's.
    let mut item_indent: Option<usize> = None;
    let mut count = 0;
    for (number, line) in text.lines().enumerate().skip(hit.number + 1) {
        let Some((indent, content)) = significant(line) else {
            continue;
        };
        let is_item = content == "-" || content.starts_with("- ");
        if indent < hit.key || (indent == hit.key && !is_item) {
            return None;
        }
        match item_indent {
            None if is_item => item_indent = Some(indent),
            None => return None,
            Some(i) if indent < i => return None,
            Some(i) if indent > i => continue,
            Some(_) if !is_item => return None,
            Some(_) => {}
        }
        if count == index {
            let after = content[1..].trim_start_matches([' ', '\t']);
            let start = if after.is_empty() || after.starts_with('#') {
                indent
            } else {
                line.len() - after.len()
            };
            return Some(position(number, line, start));
        }
        count += 1;
    }
    None
}

/// A key found in the text: byte offsets into its line.
struct Hit<'a> {
    /// 0-based line number.
    number: usize,
    line: &'a str,
    key: usize,
    value: Option<usize>,
    /// Found in a block mapping (not inside a flow collection).
    block: bool,
}

impl Hit<'_> {
    fn spot(&self) -> Spot {
        Spot {
            key: position(self.number, self.line, self.key),
            value: self.value.map(|v| position(self.number, self.line, v)),
        }
    }
}

fn position(number: usize, line: &str, byte: usize) -> (usize, usize) {
    (number + 1, line[..byte].chars().count() + 1)
}

/// The indentation and content of a line that holds YAML (not blank, not a comment).
fn significant(line: &str) -> Option<(usize, &str)> {
    let content = line.trim_start_matches(' ');
    if content.trim().is_empty() || content.starts_with('#') {
        return None;
    }
    Some((line.len() - content.len(), content))
}

fn locate<'a>(text: &'a str, path: &[&str]) -> Option<Hit<'a>> {
    let (&first, _) = path.split_first()?;
    let mut depth = 0;
    let mut want = first;
    // Lines of the current block are indented more than `parent_indent`, and its keys sit at
    // `block_indent` (the indentation of its first line).
    let mut parent_indent: Option<usize> = None;
    let mut block_indent: Option<usize> = None;
    for (number, line) in text.lines().enumerate() {
        let Some((indent, content)) = significant(line) else {
            continue;
        };
        if depth == 0 && is_document_marker(content) {
            continue;
        }
        if parent_indent.is_some_and(|p| indent <= p) {
            return None;
        }
        if depth == 0 && content.starts_with('{') {
            // The whole document is one flow mapping.
            return flow_find(line, indent, path).map(|(key, value)| Hit {
                number,
                line,
                key,
                value,
                block: false,
            });
        }
        if *block_indent.get_or_insert(indent) != indent {
            continue;
        }
        let Some(after) = strip_key(content, want) else {
            continue;
        };
        let value = value_start(line, line.len() - after.len());
        if depth + 1 == path.len() {
            return Some(Hit {
                number,
                line,
                key: indent,
                value,
                block: true,
            });
        }
        if let Some(v) = value {
            // A flow mapping on the key's line holds the rest of the path; any other value
            // means the path cannot continue.
            if !line[v..].starts_with('{') {
                return None;
            }
            return flow_find(line, v, &path[depth + 1..]).map(|(key, value)| Hit {
                number,
                line,
                key,
                value,
                block: false,
            });
        }
        depth += 1;
        want = path[depth];
        parent_indent = Some(indent);
        block_indent = None;
    }
    None
}

fn is_document_marker(content: &str) -> bool {
    ["---", "..."].iter().any(|m| {
        content
            .strip_prefix(m)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
    })
}

/// The byte offset of the value that starts at or after `from` on `line`, if any (a comment
/// is not a value).
fn value_start(line: &str, from: usize) -> Option<usize> {
    let rest = line[from..].trim_start_matches([' ', '\t']);
    if rest.is_empty() || rest.starts_with('#') {
        None
    } else {
        Some(line.len() - rest.len())
    }
}

/// When `content` starts with `key:` (bare or quoted) followed by a space or the end of the
/// line, the text after the colon.
fn strip_key<'a>(content: &'a str, key: &str) -> Option<&'a str> {
    for quote in ["", "\"", "'"] {
        let Some(rest) = content
            .strip_prefix(quote)
            .and_then(|r| r.strip_prefix(key))
            .and_then(|r| r.strip_prefix(quote))
        else {
            continue;
        };
        let rest = rest.trim_start_matches(' ');
        if let Some(after) = rest.strip_prefix(':') {
            if after.is_empty() || after.starts_with([' ', '\t']) || !quote.is_empty() {
                return Some(after);
            }
        }
    }
    None
}

/// In the flow mapping that opens at byte `open` of `line`, the byte offsets of the key at
/// `path` and of its value.
fn flow_find(line: &str, open: usize, path: &[&str]) -> Option<(usize, Option<usize>)> {
    let (&key, rest) = path.split_first()?;
    if !line[open..].starts_with('{') {
        return None;
    }
    for start in flow_entries(line, open) {
        let Some(after) = strip_key(&line[start..], key) else {
            continue;
        };
        let value = value_start(line, line.len() - after.len())
            .filter(|&v| !line[v..].starts_with([',', '}', ']']));
        if rest.is_empty() {
            return Some((start, value));
        }
        return flow_find(line, value?, rest);
    }
    None
}

/// Byte offsets where the entries of the flow collection opening at byte `open` start (the
/// items of `[...]`, the keys of `{...}`), up to its closing bracket or the end of the line.
fn flow_entries(line: &str, open: usize) -> Vec<usize> {
    let bytes = line.as_bytes();
    let mut starts = Vec::new();
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut expect_entry = false;
    // The last byte that was not a space, for telling quotes and comments apart from text.
    let mut previous = b' ';
    let mut i = open;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            match b {
                b'\\' if q == b'"' => i += 1,
                b'\'' if q == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
                _ if b == q => quote = None,
                _ => {}
            }
            i += 1;
            continue;
        }
        if b == b' ' || b == b'\t' {
            i += 1;
            continue;
        }
        if b == b'#' && i > open && matches!(bytes[i - 1], b' ' | b'\t') {
            break;
        }
        if expect_entry {
            expect_entry = false;
            if !matches!(b, b',' | b'}' | b']') {
                starts.push(i);
            }
        }
        match b {
            b'{' | b'[' => {
                depth += 1;
                expect_entry = depth == 1;
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect_entry = true,
            b'"' | b'\'' if matches!(previous, b'{' | b'[' | b',' | b':' | b' ') => quote = Some(b),
            _ => {}
        }
        previous = b;
        i += 1;
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# comment
api:
  listen: 127.0.0.1:8080
  # max_body: 1MiB
  max_body: 64MiB   # the default
engine:

    idle_timeout: 15m
    stop_timeout: 2m
idle_timeout: 1m
power:   { cpu: keep, gpu: auto }
\"state_dir\": /x
extra_args: [--metrics, \"--port\", 'it''s', {a: 1}, 8]
block_args:
  - one
  -   two # comment
  - [three]
  -
    four
env:
- a
- b
thermal: {warn: 85C, nested: {deep: 1C}, empty: , last: x}
";

    #[test]
    fn block_keys() {
        assert_eq!(find_key(TEXT, &["api"]), Some((2, 1)));
        assert_eq!(find_key(TEXT, &["api", "listen"]), Some((3, 3)));
        assert_eq!(find_key(TEXT, &["api", "max_body"]), Some((5, 3)));
        assert_eq!(find_key(TEXT, &["engine", "stop_timeout"]), Some((9, 5)));
        assert_eq!(find_key(TEXT, &["idle_timeout"]), Some((10, 1)));
        assert_eq!(find_key(TEXT, &["state_dir"]), Some((12, 1)));
    }

    #[test]
    fn values() {
        let spot = |path: &[&str]| find(TEXT, path).map(Spot::value_or_key);
        assert_eq!(spot(&["api", "listen"]), Some((3, 11)));
        assert_eq!(spot(&["api", "max_body"]), Some((5, 13)));
        assert_eq!(spot(&["api"]), Some((2, 1)));
        assert_eq!(spot(&["engine"]), Some((6, 1)));
        assert_eq!(spot(&["state_dir"]), Some((12, 14)));
        assert_eq!(find(TEXT, &["engine"]).unwrap().value, None);
        assert_eq!(spot(&["power", "cpu"]), Some((11, 17)));
        assert_eq!(spot(&["thermal", "warn"]), Some((23, 17)));
        assert_eq!(spot(&["thermal", "nested", "deep"]), Some((23, 37)));
        assert_eq!(
            find(TEXT, &["thermal", "empty"]),
            Some(Spot {
                key: (23, 42),
                value: None
            })
        );
        assert_eq!(spot(&["thermal", "last"]), Some((23, 57)));
    }

    #[test]
    fn flow_keys() {
        assert_eq!(find_key(TEXT, &["power", "cpu"]), Some((11, 12)));
        assert_eq!(find_key(TEXT, &["power", "gpu"]), Some((11, 23)));
        assert_eq!(find_key(TEXT, &["power", "method"]), None);
        let doc = "# a flow document\n{engine: ds4, command: x, context: -1}\n";
        assert_eq!(find_key(doc, &["context"]), Some((2, 27)));
        assert_eq!(find(doc, &["command"]).unwrap().value, Some((2, 24)));
        assert_eq!(find_key("---\na: 1\n", &["a"]), Some((2, 1)));
    }

    #[test]
    fn items() {
        let item = |path: &[&str], i| find_item(TEXT, path, i);
        assert_eq!(item(&["extra_args"], 0), Some((13, 14)));
        assert_eq!(item(&["extra_args"], 1), Some((13, 25)));
        assert_eq!(item(&["extra_args"], 2), Some((13, 35)));
        assert_eq!(item(&["extra_args"], 3), Some((13, 44)));
        assert_eq!(item(&["extra_args"], 4), Some((13, 52)));
        assert_eq!(item(&["extra_args"], 5), None);
        assert_eq!(item(&["block_args"], 0), Some((15, 5)));
        assert_eq!(item(&["block_args"], 1), Some((16, 7)));
        assert_eq!(item(&["block_args"], 2), Some((17, 5)));
        assert_eq!(item(&["block_args"], 3), Some((18, 3)));
        assert_eq!(item(&["block_args"], 4), None);
        assert_eq!(item(&["env"], 1), Some((22, 3)));
        assert_eq!(item(&["env"], 2), None);
        assert_eq!(item(&["idle_timeout"], 0), None);
        assert_eq!(item(&["nothing"], 0), None);
        assert_eq!(find_item("a: []\n", &["a"], 0), None);
        assert_eq!(find_item("a: [x, ]\n", &["a"], 1), None);
    }

    #[test]
    fn missing_keys() {
        assert_eq!(find_key(TEXT, &["api", "api_keys_file"]), None);
        assert_eq!(find_key(TEXT, &["engine", "max_waiting"]), None);
        assert_eq!(find_key(TEXT, &["idle_timeout", "x"]), None);
        assert_eq!(find_key(TEXT, &["nothing"]), None);
        assert_eq!(find_key(TEXT, &[]), None);
        assert_eq!(find_key("", &["a"]), None);
        assert_eq!(find_key("é: {é: 1}", &["é", "é"]), Some((1, 5)));
        assert_eq!(find("é: {é: 1}", &["é", "é"]).unwrap().value, Some((1, 8)));
        assert_eq!(find_key("a: {b: 'x, c: 1'}", &["a", "c"]), None);
        assert_eq!(find_key("a: {b: x # c: 1}", &["a", "c"]), None);
    }
}
