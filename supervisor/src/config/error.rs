//! Configuration problems: where (file, line, column, field) and what.

use std::fmt;
use std::path::{Path, PathBuf};

/// Everything wrong with a configuration, one [`Problem`] per finding, sorted by file
/// (`supervisor.yaml` first) and position.
///
/// Displays as one problem per line (no trailing newline).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}", .problems.iter().map(Problem::to_string).collect::<Vec<_>>().join("\n"))]
pub struct ConfigError {
    /// The folder of `supervisor.yaml`, which relative [`Problem::file`] paths (and relative
    /// paths in messages) are relative to.
    pub dir: PathBuf,
    pub problems: Vec<Problem>,
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
            (self.line, self.column) = (Some(line), Some(column));
        }
        self
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        // The column only after a line.
        for n in [self.line, self.line.and(self.column)]
            .into_iter()
            .flatten()
        {
            write!(f, ":{n}")?;
        }
        match self.field.as_str() {
            "" => write!(f, ": {}", self.message),
            field => write!(f, ": {field}: {}", self.message),
        }
    }
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
}
