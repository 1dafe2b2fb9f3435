//! Best-effort positions of keys in YAML text, for problems found after parsing.
//!
//! A plain line scan, not a YAML parser: it follows block mappings by indentation and looks
//! one level into a flow mapping written on the key's line (`power: { cpu: keep }`). When the
//! key cannot be found this way the answer is `None` and the problem has no position.

/// 1-based (line, column) of the key at `path` (e.g. `["engine", "idle_timeout"]`).
pub(crate) fn find_key(text: &str, path: &[&str]) -> Option<(usize, usize)> {
    let (&first, _) = path.split_first()?;
    let mut depth = 0;
    let mut want = first;
    // Lines of the current block are indented more than `parent_indent`, and its keys sit at
    // `block_indent` (the indentation of its first line).
    let mut parent_indent: Option<usize> = None;
    let mut block_indent: Option<usize> = None;
    for (number, line) in text.lines().enumerate() {
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') || content.trim().is_empty() {
            continue;
        }
        let indent = line.len() - content.len();
        if parent_indent.is_some_and(|p| indent <= p) {
            return None;
        }
        if *block_indent.get_or_insert(indent) != indent {
            continue;
        }
        let Some(after) = strip_key(content, want) else {
            continue;
        };
        if depth + 1 == path.len() {
            return Some((number + 1, indent + 1));
        }
        let value = after.trim_start();
        if value.starts_with('{') {
            // Flow mapping on the same line: look for the next key only.
            if depth + 2 != path.len() {
                return None;
            }
            let value_start = line.len() - value.len();
            return find_in_flow(value, path[depth + 1])
                .map(|offset| (number + 1, line[..value_start + offset].chars().count() + 1));
        }
        depth += 1;
        want = path[depth];
        parent_indent = Some(indent);
        block_indent = None;
    }
    None
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
            if after.is_empty() || after.starts_with([' ', '\t']) {
                return Some(after);
            }
        }
    }
    None
}

/// Byte offset of `key:` inside a flow mapping text `{ a: 1, key: 2 }`.
fn find_in_flow(flow: &str, key: &str) -> Option<usize> {
    let mut search_from = 0;
    while let Some(found) = flow[search_from..].find(key) {
        let start = search_from + found;
        let before = flow[..start].trim_end_matches(' ');
        let boundary = before.ends_with('{') || before.ends_with(',');
        if boundary && strip_key(&flow[start..], key).is_some() {
            return Some(start);
        }
        search_from = start + key.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "\
# comment
api:
  listen: 127.0.0.1:8080
  # max_body: 1MiB
  max_body: 64MiB
engine:

    idle_timeout: 15m
    stop_timeout: 2m
idle_timeout: 1m
power:   { cpu: keep, gpu: auto }
\"state_dir\": /x
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
    fn flow_keys() {
        assert_eq!(find_key(TEXT, &["power", "cpu"]), Some((11, 12)));
        assert_eq!(find_key(TEXT, &["power", "gpu"]), Some((11, 23)));
        assert_eq!(find_key(TEXT, &["power", "method"]), None);
    }

    #[test]
    fn missing_keys() {
        assert_eq!(find_key(TEXT, &["api", "api_keys_file"]), None);
        assert_eq!(find_key(TEXT, &["engine", "max_waiting"]), None);
        assert_eq!(find_key(TEXT, &["nothing"]), None);
        assert_eq!(find_key(TEXT, &[]), None);
        assert_eq!(find_key("", &["a"]), None);
        assert_eq!(find_key("é: {é: 1}", &["é", "é"]), Some((1, 5)));
    }
}
