//! How long each profile's engine took to load, its last few times: the file
//! `state_dir/load-times.json` (`{"320k": [54.2, 53.9]}`, seconds, oldest first), and the
//! estimate of the next load made from it.
//!
//! Owns: that file. Must not: fail anything. A file that is missing, unreadable or not what
//! it should be gives no estimate (and is written anew at the next load); a figure that is
//! not a number of seconds is left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Loads kept per profile.
pub const KEEP: usize = 5;

/// The longest load that counts: anything longer is not a figure of this file.
const LONGEST: f64 = 7.0 * 24.0 * 3600.0;

/// The loads of each profile, in seconds, oldest first.
pub type Book = BTreeMap<String, Vec<f64>>;

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("load-times.json")
}

/// The book in `text`; `None` when it is not one.
pub fn parse(text: &str) -> Option<Book> {
    serde_json::from_str(text).ok()
}

/// The load to expect of `profile`: the median of its last loads (the upper one of an even
/// count); `None` before its first.
pub fn estimate(book: &Book, profile: &str) -> Option<Duration> {
    let mut loads: Vec<f64> = book
        .get(profile)?
        .iter()
        .copied()
        .filter(|s| s.is_finite() && (0.0..=LONGEST).contains(s))
        .collect();
    loads.sort_by(f64::total_cmp);
    loads
        .get(loads.len() / 2)
        .map(|s| Duration::from_secs_f64(*s))
}

/// The shortest and the longest of `profile`'s last loads; `None` before its first.
pub fn range(book: &Book, profile: &str) -> Option<(Duration, Duration)> {
    let loads = book.get(profile)?.iter().copied();
    let loads: Vec<f64> = loads
        .filter(|s| s.is_finite() && (0.0..=LONGEST).contains(s))
        .collect();
    let low = loads.iter().copied().reduce(f64::min)?;
    let high = loads.iter().copied().reduce(f64::max)?;
    Some((Duration::from_secs_f64(low), Duration::from_secs_f64(high)))
}

/// `book` with a load of `profile` that took `took` added, keeping the last [`KEEP`].
pub fn add(mut book: Book, profile: &str, took: Duration) -> Book {
    let loads = book.entry(profile.to_string()).or_default();
    loads.push((took.as_secs_f64() * 10.0).round() / 10.0);
    let extra = loads.len().saturating_sub(KEEP);
    loads.drain(..extra);
    book
}

/// The book in `state_dir`; empty when there is none that can be read.
pub fn read(state_dir: &Path) -> Book {
    let file = path(state_dir);
    let Some(text) = super::regular::read_state(&file) else {
        return Book::new();
    };
    parse(&text).unwrap_or_else(|| {
        tracing::warn!(
            "{} is not a record of load times; it is ignored",
            file.display()
        );
        Book::new()
    })
}

/// Adds a load of `profile` that took `took` to the file in `state_dir`.
pub fn record(state_dir: &Path, profile: &str, took: Duration) -> std::io::Result<()> {
    let book = add(read(state_dir), profile, took);
    let text = serde_json::to_string(&book).map_err(std::io::Error::other)?;
    super::state_file::write_atomic(&path(state_dir), format!("{text}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_is_the_median_of_the_last_loads() {
        let secs = |s: f64| Some(Duration::from_secs_f64(s));
        for (text, want) in [
            (r#"{"320k": [54.2]}"#, secs(54.2)),
            (r#"{"320k": [50, 60, 55]}"#, secs(55.0)),
            (r#"{"320k": [50, 60]}"#, secs(60.0)),
            (r#"{"320k": []}"#, None),
            (r#"{"64k": [3]}"#, None),
            // Figures that are no load are left out.
            (r#"{"320k": [-1, 1e300, 20]}"#, secs(20.0)),
        ] {
            let book = parse(text).unwrap();
            assert_eq!(estimate(&book, "320k"), want, "{text}");
        }
        // Not a book at all: no estimate.
        for text in [
            "",
            "[1,2]",
            r#"{"320k": ["54"]}"#,
            r#"{"320k": 54}"#,
            "\u{0}",
        ] {
            assert_eq!(parse(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_load_is_added_and_only_the_last_few_are_kept() {
        let mut book = Book::new();
        for s in 1..=7 {
            book = add(book, "320k", Duration::from_secs(s));
        }
        book = add(book, "64k", Duration::from_millis(3_140));
        assert_eq!(book["320k"], [3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(book["64k"], [3.1]);
    }

    #[test]
    fn the_file_round_trips_and_a_bad_one_is_no_estimate() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).is_empty());
        record(dir.path(), "320k", Duration::from_secs(54)).unwrap();
        record(dir.path(), "320k", Duration::from_secs(52)).unwrap();
        let book = read(dir.path());
        assert_eq!(estimate(&book, "320k"), Some(Duration::from_secs(54)));
        std::fs::write(path(dir.path()), "{not json").unwrap();
        assert!(read(dir.path()).is_empty());
        // Written anew at the next load.
        record(dir.path(), "320k", Duration::from_secs(7)).unwrap();
        assert_eq!(read(dir.path())["320k"], [7.0]);
        // A FIFO in its place is not waited on.
        std::fs::remove_file(path(dir.path())).unwrap();
        nix::unistd::mkfifo(&path(dir.path()), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(read(dir.path()).is_empty());
    }
}
