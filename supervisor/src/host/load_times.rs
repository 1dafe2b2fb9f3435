//! How long each profile's engine took to load, its last few times: the file
//! `state_dir/load-times.json` (`{"320k": [{"s": 54.2, "class": "cold"}, 0.9]}`, oldest
//! first: seconds, with the load's class by what the page cache held of the model, or a bare
//! number from before classes were kept), and the estimate of the next load made from it.
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

use dsv4_client::CacheClass;

/// The loads of each profile, oldest first.
pub type Book = BTreeMap<String, Vec<Load>>;

/// One load: its seconds, and its class when known.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Load {
    Classed { s: f64, class: CacheClass },
    Plain(f64),
}

impl Load {
    fn seconds(&self) -> f64 {
        match *self {
            Load::Classed { s, .. } | Load::Plain(s) => s,
        }
    }

    fn class(&self) -> Option<CacheClass> {
        match *self {
            Load::Classed { class, .. } => Some(class),
            Load::Plain(_) => None,
        }
    }
}

/// The seconds of `profile`'s loads that count: of `class` when it has some of that class,
/// else all of them.
fn loads(book: &Book, profile: &str, class: Option<CacheClass>) -> Option<Vec<f64>> {
    let all = book.get(profile)?;
    let counts = |l: &&Load| {
        let s = l.seconds();
        s.is_finite() && (0.0..=LONGEST).contains(&s)
    };
    let of_class: Vec<f64> = all
        .iter()
        .filter(counts)
        .filter(|l| class.is_some() && l.class() == class)
        .map(Load::seconds)
        .collect();
    if !of_class.is_empty() {
        return Some(of_class);
    }
    Some(all.iter().filter(counts).map(Load::seconds).collect())
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("load-times.json")
}

/// The book in `text`; `None` when it is not one.
pub fn parse(text: &str) -> Option<Book> {
    serde_json::from_str(text).ok()
}

/// The load to expect of `profile`: the median of its last loads of `class` (of all of them
/// when none is of that class; the upper one of an even count); `None` before its first.
pub fn estimate(book: &Book, profile: &str, class: Option<CacheClass>) -> Option<Duration> {
    let mut loads = loads(book, profile, class)?;
    loads.sort_by(f64::total_cmp);
    loads
        .get(loads.len() / 2)
        .map(|s| Duration::from_secs_f64(*s))
}

/// The shortest and the longest of `profile`'s last loads (of `class`, as
/// [`estimate`]); `None` before its first.
pub fn range(
    book: &Book,
    profile: &str,
    class: Option<CacheClass>,
) -> Option<(Duration, Duration)> {
    let loads = loads(book, profile, class)?;
    let low = loads.iter().copied().reduce(f64::min)?;
    let high = loads.iter().copied().reduce(f64::max)?;
    Some((Duration::from_secs_f64(low), Duration::from_secs_f64(high)))
}

/// `book` with a load of `profile` that took `took` (of `class`, when known) added, keeping
/// the last [`KEEP`].
pub fn add(mut book: Book, profile: &str, took: Duration, class: Option<CacheClass>) -> Book {
    let loads = book.entry(profile.to_string()).or_default();
    let s = (took.as_secs_f64() * 10.0).round() / 10.0;
    loads.push(match class {
        Some(class) => Load::Classed { s, class },
        None => Load::Plain(s),
    });
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

/// Adds a load of `profile` that took `took` (of `class`) to the file in `state_dir`.
pub fn record(
    state_dir: &Path,
    profile: &str,
    took: Duration,
    class: Option<CacheClass>,
) -> std::io::Result<()> {
    let book = add(read(state_dir), profile, took, class);
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
            assert_eq!(estimate(&book, "320k", None), want, "{text}");
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
    fn a_load_is_estimated_from_loads_of_its_class() {
        let secs = |s: f64| Some(Duration::from_secs_f64(s));
        let book = parse(
            r#"{"320k": [{"s": 54, "class": "cold"}, {"s": 1.2, "class": "warm"},
                         {"s": 0.9, "class": "warm"}, 30, {"s": 20, "class": "partly"}]}"#,
        )
        .unwrap();
        use CacheClass::*;
        for (class, want) in [
            (Some(Cold), secs(54.0)),
            (Some(Warm), secs(1.2)),
            (Some(Partly), secs(20.0)),
            // No class known: every load, as before classes.
            (None, secs(20.0)),
        ] {
            assert_eq!(estimate(&book, "320k", class), want, "{class:?}");
        }
        let mixed = parse(r#"{"320k": [3, 5]}"#).unwrap();
        // None of that class yet: all of them.
        assert_eq!(estimate(&mixed, "320k", Some(Cold)), secs(5.0));
        assert_eq!(
            range(&book, "320k", Some(Warm)),
            Some((Duration::from_secs_f64(0.9), Duration::from_secs_f64(1.2)))
        );
    }

    #[test]
    fn a_load_is_added_and_only_the_last_few_are_kept() {
        let mut book = Book::new();
        for s in 1..=7 {
            book = add(book, "320k", Duration::from_secs(s), None);
        }
        book = add(
            book,
            "64k",
            Duration::from_millis(3_140),
            Some(CacheClass::Warm),
        );
        let plain: Vec<Load> = [3.0, 4.0, 5.0, 6.0, 7.0].map(Load::Plain).to_vec();
        assert_eq!(book["320k"], plain);
        assert_eq!(
            book["64k"],
            [Load::Classed {
                s: 3.1,
                class: CacheClass::Warm
            }]
        );
    }

    #[test]
    fn the_file_round_trips_and_a_bad_one_is_no_estimate() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).is_empty());
        let cold = Some(CacheClass::Cold);
        record(dir.path(), "320k", Duration::from_secs(54), cold).unwrap();
        record(dir.path(), "320k", Duration::from_secs(52), cold).unwrap();
        let book = read(dir.path());
        assert_eq!(estimate(&book, "320k", cold), Some(Duration::from_secs(54)));
        let text = std::fs::read_to_string(path(dir.path())).unwrap();
        assert!(text.contains(r#"{"s":54.0,"class":"cold"}"#), "{text}");
        std::fs::write(path(dir.path()), "{not json").unwrap();
        assert!(read(dir.path()).is_empty());
        // Written anew at the next load.
        record(dir.path(), "320k", Duration::from_secs(7), None).unwrap();
        assert_eq!(read(dir.path())["320k"], [Load::Plain(7.0)]);
        // A FIFO in its place is not waited on.
        std::fs::remove_file(path(dir.path())).unwrap();
        nix::unistd::mkfifo(&path(dir.path()), nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(read(dir.path()).is_empty());
    }
}
