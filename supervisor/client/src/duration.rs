//! Durations as people write them, for the configuration files and the command line alike:
//! one grammar to read them ([`parse`]) and one way to print them ([`format`]).
//!
//! The grammar, with spaces allowed around and between the parts:
//!
//! ```text
//! duration = part { part }
//! part     = number unit
//! number   = digits [ "." digits ]          e.g. 90, 1.5, 0.25
//! unit     = "d" | "h" | "m" | "min" | "s" | "ms" | "us" | "ns"
//! ```
//!
//! Examples: `90s`, `15m`, `1h30m`, `1h 30m`, `1.5h`, `500ms`, `2d`. Each unit comes at most
//! once and larger units come first (`1h30m`, not `30m1h`); `min` is another spelling of `m`.
//! A fraction is exact up to the nanosecond (`1.5h` is 90 minutes). Not accepted: signs,
//! exponents, other unit spellings (`5M` or `5sec`), and a bare number, since `90` could mean
//! seconds or minutes; [`parse_or_seconds`] reads a bare number as seconds, the habit of
//! command-line tools such as `sleep` and `timeout`.
//!
//! [`format`] prints the largest units first and leaves out the zero ones (`5m`, `1h30m`,
//! `45s`, `1s500ms`, `0s`), so that what it prints always parses back to the same duration.
//! [`brief`] prints a measured time for people in the same grammar, to the precision its
//! size deserves (`250ms`, `1.2s`, `42s`, `12m5s`, `1h58m`, `2d4h`): every time dsv4 shows
//! (its messages, logs, streams and tables) is printed by one of the two.

use std::fmt;
use std::time::Duration;

/// Units, largest first, with their length in nanoseconds. `min` ranks with `m`.
const UNITS: [(&str, u128); 8] = [
    ("d", 86_400_000_000_000),
    ("h", 3_600_000_000_000),
    ("m", 60_000_000_000),
    ("min", 60_000_000_000),
    ("s", 1_000_000_000),
    ("ms", 1_000_000),
    ("us", 1_000),
    ("ns", 1),
];

/// The units an error message suggests.
const HINT: &str = "ms, s, m, h, d";

/// Why a text is not a duration; it displays as `invalid duration "TEXT": REASON`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    text: String,
    reason: Reason,
}

/// What is wrong with the text, for [`ParseError`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    Empty,
    Negative,
    /// Something other than a number where a part starts.
    NotANumber,
    /// A number without its unit, as in `90` or `1h30`.
    NoUnit,
    UnknownUnit(String),
    /// A unit repeated, or a smaller unit before a larger one.
    Order,
    TooLarge,
}

impl ParseError {
    pub fn reason(&self) -> &Reason {
        &self.reason
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid duration {:?}: ", self.text)?;
        match &self.reason {
            Reason::Empty => f.write_str("empty value; write e.g. 90s or 15m"),
            Reason::Negative => f.write_str("must not be negative"),
            Reason::NotANumber => {
                f.write_str("expected a number followed by a unit, e.g. 90s or 1h30m")
            }
            Reason::NoUnit => write!(f, "add a unit ({HINT})"),
            Reason::UnknownUnit(unit) => write!(f, "unknown unit {unit:?} (use {HINT})"),
            Reason::Order => f.write_str("write each unit once, larger units first (e.g. 1h30m)"),
            Reason::TooLarge => f.write_str("too large (at most 36500d, a hundred years)"),
        }
    }
}

impl std::error::Error for ParseError {}

/// Reads a duration written with units, such as `90s`, `1h30m` or `1.5h` (see the module
/// documentation for the grammar).
/// The longest duration read: a hundred years.
pub const MAX_SECONDS: u64 = 36_500 * 86_400;

pub fn parse(text: &str) -> Result<Duration, ParseError> {
    let fail = |reason| ParseError {
        text: text.to_string(),
        reason,
    };
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(fail(Reason::Empty));
    }
    if rest.starts_with('-') {
        return Err(fail(Reason::Negative));
    }
    let mut total: u128 = 0;
    let mut smallest_so_far = None;
    while !rest.is_empty() {
        let (whole, fraction, after) =
            split_number(rest).ok_or_else(|| fail(Reason::NotANumber))?;
        let after = after.trim_start();
        let unit_end = after
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_end);
        if unit.is_empty() {
            return Err(fail(Reason::NoUnit));
        }
        let (_, length) = UNITS
            .iter()
            .find(|(name, _)| *name == unit)
            .ok_or_else(|| fail(Reason::UnknownUnit(unit.to_string())))?;
        if smallest_so_far.is_some_and(|smallest| *length >= smallest) {
            return Err(fail(Reason::Order));
        }
        smallest_so_far = Some(*length);
        total = scale(whole, fraction, *length)
            .and_then(|part| total.checked_add(part))
            .ok_or_else(|| fail(Reason::TooLarge))?;
        rest = after.trim_start();
    }
    let seconds = u64::try_from(total / 1_000_000_000).map_err(|_| fail(Reason::TooLarge))?;
    // A deadline is a clock reading plus a duration: beyond this, the sum could overflow.
    if seconds > MAX_SECONDS {
        return Err(fail(Reason::TooLarge));
    }
    Ok(Duration::new(seconds, (total % 1_000_000_000) as u32))
}

/// [`parse`], except that a bare number counts as seconds (`90` is `90s`), as command-line
/// flags such as `--timeout 90` are commonly read.
pub fn parse_or_seconds(text: &str) -> Result<Duration, ParseError> {
    match split_number(text.trim()) {
        Some((_, _, "")) => parse(&format!("{}s", text.trim())).map_err(|e| ParseError {
            text: text.to_string(),
            ..e
        }),
        _ => parse(text),
    }
}

/// Prints `d` the way [`parse`] reads it: largest units first, zero units left out (`15m`,
/// `1h30m`, `45s`, `250ms`, `1m30s`, `0s`).
pub fn format(d: Duration) -> String {
    let mut left = d.as_nanos();
    if left == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    for (name, length) in UNITS.iter().filter(|(name, _)| *name != "min") {
        if left >= *length {
            out.push_str(&format!("{}{name}", left / length));
            left %= length;
        }
    }
    out
}

/// A measured time for people, in [`parse`]'s grammar, cut (never rounded up: a counter does
/// not show a time not reached) to a precision that fits its size: milliseconds below a
/// second (`250ms`), tenths below ten seconds (`1.2s`, `3s`), seconds below a minute (`42s`)
/// and an hour (`12m5s`), minutes below a day (`1h58m`), hours above (`2d4h`).
pub fn brief(d: Duration) -> String {
    const MINUTE: u64 = 60;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    let secs = d.as_secs();
    let cut = |unit: u64| format(Duration::from_secs(secs - secs % unit));
    match secs {
        0 if d.subsec_millis() > 0 => format!("{}ms", d.subsec_millis()),
        0 => "0s".to_string(),
        1..10 => match d.subsec_millis() / 100 {
            0 => format!("{secs}s"),
            tenth => format!("{secs}.{tenth}s"),
        },
        10..HOUR => cut(1),
        HOUR..DAY => cut(MINUTE),
        _ => cut(HOUR),
    }
}

/// `d` rounded to whole seconds, for counters written at each tick of a period: a tick comes
/// a hair early as often as late (0.9995 s is one second of silence, not none).
pub fn whole_seconds(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs_f64().round() as u64)
}

/// [`brief`] of a number of seconds, as measurements are kept; a negative or unreadable one
/// counts as none.
pub fn brief_secs(seconds: f64) -> String {
    brief(Duration::try_from_secs_f64(seconds).unwrap_or_default())
}

/// Splits the number `digits[.digits]` off the front of `s`: (whole digits, fraction digits,
/// rest). `None` when `s` does not start with one.
pub(crate) fn split_number(s: &str) -> Option<(&str, &str, &str)> {
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let whole_end = digits(s);
    if whole_end == 0 {
        return None;
    }
    let (whole, rest) = s.split_at(whole_end);
    let Some(after_dot) = rest.strip_prefix('.') else {
        return Some((whole, "", rest));
    };
    let fraction_end = digits(after_dot);
    if fraction_end == 0 {
        return None;
    }
    let (fraction, rest) = after_dot.split_at(fraction_end);
    Some((whole, fraction, rest))
}

/// `whole.fraction * unit`, rounded to a whole number; `None` on overflow. Fraction digits
/// past the 18th cannot change a whole number of nanoseconds and are left out.
fn scale(whole: &str, fraction: &str, unit: u128) -> Option<u128> {
    let whole = whole.trim_start_matches('0');
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let fraction = &fraction[..fraction.len().min(18)];
    let mut total = whole.checked_mul(unit)?;
    if !fraction.is_empty() {
        let denominator = 10u128.pow(fraction.len() as u32);
        let digits: u128 = fraction.parse().ok()?;
        total = total.checked_add((digits * unit + denominator / 2) / denominator)?;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: u64 = 60;
    const H: u64 = 3600;

    #[test]
    fn a_brief_time_is_cut_to_its_size_and_parses_back() {
        let ms = Duration::from_millis;
        let table: &[(Duration, &str)] = &[
            (ms(0), "0s"),
            (Duration::from_micros(300), "0s"),
            (ms(250), "250ms"),
            (ms(999), "999ms"),
            (ms(1000), "1s"),
            (ms(1234), "1.2s"),
            (ms(9_990), "9.9s"),
            (ms(10_900), "10s"),
            (ms(42_700), "42s"),
            (ms(64_000), "1m4s"),
            (ms((12 * M + 5) * 1000 + 999), "12m5s"),
            (Duration::from_secs(H + 58 * M + 59), "1h58m"),
            (Duration::from_secs(2 * H), "2h"),
            (Duration::from_secs(2 * 24 * H + 4 * H + 5 * M), "2d4h"),
        ];
        for (d, want) in table {
            let got = brief(*d);
            assert_eq!(&got, want, "brief({d:?})");
            let back = parse(&got).unwrap();
            assert!(back <= *d, "{got} reads back as {back:?}, more than {d:?}");
        }
        assert_eq!(brief_secs(-3.0), "0s");
        assert_eq!(brief_secs(f64::NAN), "0s");
        assert_eq!(brief_secs(f64::INFINITY), "0s");
        assert_eq!(brief_secs(1.26), "1.2s");
    }

    #[test]
    fn what_parses() {
        let table: &[(&str, Duration)] = &[
            ("500ms", Duration::from_millis(500)),
            ("90s", Duration::from_secs(90)),
            ("15m", Duration::from_secs(15 * M)),
            ("15min", Duration::from_secs(15 * M)),
            ("2h", Duration::from_secs(2 * H)),
            ("1d", Duration::from_secs(24 * H)),
            ("1h30m", Duration::from_secs(H + 30 * M)),
            ("1h 30m", Duration::from_secs(H + 30 * M)),
            ("1h30min", Duration::from_secs(H + 30 * M)),
            ("5 s", Duration::from_secs(5)),
            ("  10m  ", Duration::from_secs(10 * M)),
            (
                "1d2h3m4s5ms",
                Duration::from_millis(((24 + 2) * H + 3 * M + 4) * 1000 + 5),
            ),
            ("1.5h", Duration::from_secs(H + 30 * M)),
            ("1.5s", Duration::from_millis(1500)),
            ("0.25s", Duration::from_millis(250)),
            ("0s", Duration::ZERO),
            ("007s", Duration::from_secs(7)),
            ("250us", Duration::from_micros(250)),
            ("3ns", Duration::from_nanos(3)),
            ("1m0.5s", Duration::from_millis(60_500)),
            ("0.0000000001s", Duration::ZERO),
        ];
        for (text, want) in table {
            assert_eq!(parse(text), Ok(*want), "{text}");
        }
    }

    #[test]
    fn what_does_not_parse() {
        let table: &[(&str, &str)] = &[
            ("90", "add a unit (ms, s, m, h, d)"),
            ("1.5", "add a unit (ms, s, m, h, d)"),
            ("1h30", "add a unit (ms, s, m, h, d)"),
            ("", "empty value; write e.g. 90s or 15m"),
            ("   ", "empty value; write e.g. 90s or 15m"),
            ("-5s", "must not be negative"),
            ("5x", "unknown unit \"x\" (use ms, s, m, h, d)"),
            ("5M", "unknown unit \"M\" (use ms, s, m, h, d)"),
            ("5sec", "unknown unit \"sec\" (use ms, s, m, h, d)"),
            (
                "30m1h",
                "write each unit once, larger units first (e.g. 1h30m)",
            ),
            (
                "1m1m",
                "write each unit once, larger units first (e.g. 1h30m)",
            ),
            (
                "1m1min",
                "write each unit once, larger units first (e.g. 1h30m)",
            ),
            (
                "s",
                "expected a number followed by a unit, e.g. 90s or 1h30m",
            ),
            (
                ".5s",
                "expected a number followed by a unit, e.g. 90s or 1h30m",
            ),
            (
                "5.s",
                "expected a number followed by a unit, e.g. 90s or 1h30m",
            ),
            (
                "+5s",
                "expected a number followed by a unit, e.g. 90s or 1h30m",
            ),
            ("1e3s", "unknown unit \"e\" (use ms, s, m, h, d)"),
            (
                "99999999999999999999999d",
                "too large (at most 36500d, a hundred years)",
            ),
        ];
        for (text, why) in table {
            assert_eq!(
                parse(text).unwrap_err().to_string(),
                format!("invalid duration {text:?}: {why}")
            );
        }
        let huge = format!("{}s", "9".repeat(45));
        assert_eq!(parse(&huge).unwrap_err().reason(), &Reason::TooLarge);
        assert_eq!(parse("36500d"), Ok(Duration::from_secs(MAX_SECONDS)));
        assert_eq!(
            parse("36501d").unwrap_err().reason(),
            &Reason::TooLarge,
            "past a hundred years"
        );
    }

    #[test]
    fn bare_seconds_where_asked_for() {
        assert_eq!(parse_or_seconds("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_or_seconds(" 1.5 "), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_or_seconds("2m5s"), Ok(Duration::from_secs(125)));
        assert_eq!(
            parse_or_seconds("-1").unwrap_err().to_string(),
            "invalid duration \"-1\": must not be negative"
        );
        assert_eq!(
            parse_or_seconds("99999999999999999999999")
                .unwrap_err()
                .to_string(),
            "invalid duration \"99999999999999999999999\": too large (at most 36500d, a hundred \
             years)"
        );
        assert!(parse_or_seconds("").is_err());
        assert!(parse_or_seconds("5x").is_err());
    }

    #[test]
    fn formats() {
        let table: &[(Duration, &str)] = &[
            (Duration::ZERO, "0s"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_secs(5 * M), "5m"),
            (Duration::from_secs(15 * M), "15m"),
            (Duration::from_secs(H + 30 * M), "1h30m"),
            (Duration::from_secs(H + 3), "1h3s"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(24 * H), "1d"),
            (Duration::from_secs(2 * 24 * H + 4 * H + 5 * M), "2d4h5m"),
            (Duration::from_millis(1500), "1s500ms"),
            (Duration::from_nanos(1_001), "1us1ns"),
        ];
        for (d, want) in table {
            assert_eq!(format(*d), *want);
        }
    }

    #[test]
    fn formatted_durations_parse_back() {
        // Spread over every unit, up to the longest duration read.
        let mut seconds = 1u64;
        for nanos in [0, 1, 999, 1_000_000, 999_999_999] {
            while seconds < MAX_SECONDS {
                let d = Duration::new(seconds, nanos);
                assert_eq!(parse(&format(d)), Ok(d), "{d:?}");
                seconds = seconds * 7 + 3;
            }
            seconds = 1;
        }
        let longest = Duration::from_secs(MAX_SECONDS);
        assert_eq!(parse(&format(longest)), Ok(longest));
    }
}
