//! Configuration problems: where (file, line, column, field) and what.

use std::fmt;
use std::path::{Path, PathBuf};

/// Everything wrong with a configuration, one [`Problem`] per finding, sorted by file
/// (`supervisor.yaml` first) and position.
///
/// Displays as one problem per line (no trailing newline).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", render(.problems))]
pub struct ConfigError {
    /// The folder of `supervisor.yaml`, which relative [`Problem::file`] paths (and relative
    /// paths in messages) are relative to.
    pub dir: PathBuf,
    pub problems: Vec<Problem>,
}

fn render(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(Problem::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// One thing wrong with one file.
///
/// Displays as `file:line:column: field: message`; the line, column and field parts are left
/// out when unknown (`file:line: field: message`, `file: field: message`, `file: message`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// As shown to the user: relative to the folder of `supervisor.yaml` when inside it
    /// (see [`ConfigError::dir`]), else absolute.
    pub file: PathBuf,
    /// 1-based.
    pub line: Option<usize>,
    /// 1-based, in characters.
    pub column: Option<usize>,
    /// Dotted key path such as `engine.idle_timeout`; empty when the problem is the whole file.
    pub field: String,
    pub message: String,
}

impl Problem {
    /// A problem without a position.
    pub fn new(file: &Path, field: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem {
            file: file.to_path_buf(),
            line: None,
            column: None,
            field: field.into(),
            message: message.into(),
        }
    }

    /// The same problem at `(line, column)`.
    pub fn at(mut self, position: Option<(usize, usize)>) -> Problem {
        if let Some((line, column)) = position {
            self.line = Some(line);
            self.column = Some(column);
        }
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        f.write_str(": ")?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// Turns a serde_yaml_ng error into a [`Problem`].
///
/// serde_yaml_ng renders `path: message at line L column C`; the path (e.g.
/// `engine.idle_timeout`) becomes the field when its first segment is one of `top_keys`, the
/// position comes from `Error::location()`. Unknown and duplicate keys get the key appended to
/// the field, and a spelling suggestion when one is close.
pub(crate) fn from_yaml(file: &Path, err: &serde_yaml_ng::Error, top_keys: &[&str]) -> Problem {
    let mut text = err.to_string();
    let position = err.location().map(|l| (l.line(), l.column()));
    if let Some((line, column)) = position {
        let suffix = format!(" at line {line} column {column}");
        if let Some(i) = text.find(&suffix) {
            text.replace_range(i..i + suffix.len(), "");
        }
    }
    let (mut field, mut message) = split_path(&text, top_keys);
    for (serde_word, key_word) in [
        ("unknown field `", "unknown key `"),
        ("duplicate field `", "duplicate key `"),
    ] {
        let Some(rest) = message.strip_prefix(serde_word) else {
            continue;
        };
        let Some(end) = rest.find('`') else {
            continue;
        };
        let key = rest[..end].to_string();
        let expected: Vec<&str> = rest[end + 1..].split('`').skip(1).step_by(2).collect();
        let suggestion = closest(&key, &expected).map(str::to_string);
        message = format!("{key_word}{rest}");
        if let Some(s) = suggestion {
            message.push_str(&format!("; did you mean `{s}`?"));
        }
        field = if field.is_empty() {
            key
        } else {
            format!("{field}.{key}")
        };
        break;
    }
    Problem {
        file: file.to_path_buf(),
        line: position.map(|p| p.0),
        column: position.map(|p| p.1),
        field,
        message,
    }
}

/// Splits `path: message` when the text starts with a key path rooted at one of `top_keys`.
fn split_path(text: &str, top_keys: &[&str]) -> (String, String) {
    if let Some(i) = text.find(": ") {
        let path = &text[..i];
        let first = path.split(['.', '[']).next().unwrap_or("");
        if top_keys.contains(&first) {
            return (path.to_string(), text[i + 2..].to_string());
        }
    }
    (String::new(), text.to_string())
}

/// The candidate nearest to `word` by edit distance, when it is near enough to be a typo.
fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .iter()
        .map(|c| (edit_distance(word, c), *c))
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance: insertions, deletions, substitutions and swaps of two
/// neighbouring characters each cost 1.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut best = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_display_leaves_out_unknown_parts() {
        let p = Problem::new(
            Path::new("/etc/dsv4/supervisor.yaml"),
            "engine.idle_timeout",
            "must be greater than 0",
        );
        assert_eq!(
            p.to_string(),
            "/etc/dsv4/supervisor.yaml: engine.idle_timeout: must be greater than 0"
        );
        let p = p.at(Some((3, 17)));
        assert_eq!(
            p.to_string(),
            "/etc/dsv4/supervisor.yaml:3:17: engine.idle_timeout: must be greater than 0"
        );
        let p = Problem { column: None, ..p };
        assert_eq!(
            p.to_string(),
            "/etc/dsv4/supervisor.yaml:3: engine.idle_timeout: must be greater than 0"
        );
        let p = Problem::new(Path::new("a.yaml"), "", "cannot read");
        assert_eq!(p.to_string(), "a.yaml: cannot read");
    }

    #[test]
    fn config_error_is_one_problem_per_line() {
        let e = ConfigError {
            dir: PathBuf::from("/etc/dsv4"),
            problems: vec![
                Problem::new(Path::new("a.yaml"), "x", "one"),
                Problem::new(Path::new("b.yaml"), "", "two").at(Some((1, 2))),
            ],
        };
        assert_eq!(e.to_string(), "a.yaml: x: one\nb.yaml:1:2: two");
    }

    #[test]
    fn paths_split_only_on_known_keys() {
        let keys = ["engine", "env"];
        assert_eq!(
            split_path("engine.idle_timeout: invalid duration \"9\": x", &keys),
            (
                "engine.idle_timeout".into(),
                "invalid duration \"9\": x".into()
            )
        );
        assert_eq!(
            split_path("env.A B: invalid type: sequence", &keys),
            ("env.A B".into(), "invalid type: sequence".into())
        );
        assert_eq!(
            split_path("invalid type: sequence, expected x", &keys),
            ("".into(), "invalid type: sequence, expected x".into())
        );
    }

    #[test]
    fn suggestions() {
        let names = [
            "start_timeout",
            "idle_timeout",
            "stop_timeout",
            "max_waiting",
        ];
        assert_eq!(closest("idle_timout", &names), Some("idle_timeout"));
        assert_eq!(closest("stop_timeot", &names), Some("stop_timeout"));
        assert_eq!(closest("banana", &names), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("modle", "model"), 1);
        assert_eq!(closest("modle", &["model", "mmproj"]), Some("model"));
    }
}
