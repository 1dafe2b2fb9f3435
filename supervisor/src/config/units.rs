//! The units written in `supervisor.yaml` and the profiles: durations (`90s`, `1h30m`),
//! byte sizes (`87.82GiB`, `64MiB`, `1048576`) and temperatures (`85C`, `85.5°C`).
//!
//! The parsers are strict: a value must carry a unit where one is needed, negative or empty
//! values are refused, and every error message repeats the offending text.

use std::time::Duration;

/// Duration units, largest first, with their length in nanoseconds. `us` and `ns` are
/// accepted so that [`format_duration`] output always parses back.
const DURATION_UNITS: [(&str, u128); 7] = [
    ("d", 86_400_000_000_000),
    ("h", 3_600_000_000_000),
    ("m", 60_000_000_000),
    ("s", 1_000_000_000),
    ("ms", 1_000_000),
    ("us", 1_000),
    ("ns", 1),
];

const DURATION_HINT: &str = "ms, s, m, h, d";

/// Size units and their length in bytes.
const SIZE_UNITS: [(&str, u128); 10] = [
    ("B", 1),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("KB", 1_000),
    ("kB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
];

const SIZE_HINT: &str = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB";

/// At most this many fraction digits take part in the arithmetic; more digits than that
/// cannot change a whole number of bytes or nanoseconds in any realistic value.
const MAX_FRACTION_DIGITS: usize = 18;

/// Splits a leading unsigned decimal number `digits[.digits]` off `s`.
/// Returns (integer digits, fraction digits, rest) or `None` when `s` does not start with a digit.
fn split_number(s: &str) -> Option<(&str, &str, &str)> {
    let int_end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if int_end == 0 {
        return None;
    }
    let (int, rest) = s.split_at(int_end);
    if let Some(after_dot) = rest.strip_prefix('.') {
        let frac_end = after_dot
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after_dot.len());
        if frac_end == 0 {
            return None;
        }
        let (frac, rest) = after_dot.split_at(frac_end);
        return Some((int, frac, rest));
    }
    Some((int, "", rest))
}

/// `int.frac * unit`, rounded to the nearest whole number; `None` on overflow.
fn scale(int: &str, frac: &str, unit: u128) -> Option<u128> {
    let int = int.trim_start_matches('0');
    let whole: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let mut total = whole.checked_mul(unit)?;
    let frac = &frac[..frac.len().min(MAX_FRACTION_DIGITS)];
    if !frac.is_empty() {
        let digits: u128 = frac.parse().ok()?;
        let denominator = 10u128.pow(frac.len() as u32);
        // digits < 10^18 and unit < 2^47, so the product fits comfortably in u128.
        let part = (digits * unit + denominator / 2) / denominator;
        total = total.checked_add(part)?;
    }
    Some(total)
}

/// Parses a duration such as `500ms`, `90s`, `15m`, `2h`, `1d`, `1h30m` or `1.5h`.
///
/// Units: `ms`, `s`, `m`, `h`, `d` (also `us`, `ns`). In a compound value every unit appears
/// once, larger units first. A bare number is refused: the unit must be written.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| format!("invalid duration {s:?}: {why}");
    let text = s.trim();
    if text.is_empty() {
        return Err(bad("empty value; write e.g. 90s or 15m"));
    }
    if text.starts_with('-') {
        return Err(bad("must not be negative"));
    }
    let mut rest = text;
    let mut total: u128 = 0;
    let mut previous_rank: Option<usize> = None;
    while !rest.is_empty() {
        let Some((int, frac, after)) = split_number(rest) else {
            return Err(bad(
                "expected a number followed by a unit, e.g. 90s or 1h30m",
            ));
        };
        let after = after.trim_start();
        let unit_len = after
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(after.len());
        let (unit, after_unit) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(bad(&format!("add a unit ({DURATION_HINT})")));
        }
        let Some(rank) = DURATION_UNITS.iter().position(|(name, _)| *name == unit) else {
            return Err(bad(&format!("unknown unit {unit:?} (use {DURATION_HINT})")));
        };
        if previous_rank.is_some_and(|p| rank <= p) {
            return Err(bad("write each unit once, larger units first (e.g. 1h30m)"));
        }
        previous_rank = Some(rank);
        let part = scale(int, frac, DURATION_UNITS[rank].1).ok_or_else(|| bad("too large"))?;
        total = total.checked_add(part).ok_or_else(|| bad("too large"))?;
        rest = after_unit.trim_start();
    }
    let secs = u64::try_from(total / 1_000_000_000).map_err(|_| bad("too large"))?;
    Ok(Duration::new(secs, (total % 1_000_000_000) as u32))
}

/// Formats a duration the way [`parse_duration`] reads it, largest units first:
/// `15m`, `1h30m`, `250ms`, `1m30s`, `0s`.
pub fn format_duration(d: Duration) -> String {
    let mut left = d.as_nanos();
    if left == 0 {
        return "0s".to_string();
    }
    let mut out = String::new();
    for (name, len) in DURATION_UNITS {
        let count = left / len;
        if count > 0 {
            out.push_str(&count.to_string());
            out.push_str(name);
            left -= count * len;
        }
    }
    out
}

/// Parses a byte size such as `87.82GiB`, `64MiB`, `8 GiB`, `20GB` or `1048576` (bytes).
///
/// Binary units `B`, `KiB`, `MiB`, `GiB`, `TiB`; decimal units `KB` (or `kB`), `MB`, `GB`,
/// `TB`. Decimals are allowed with a unit and round to the nearest byte.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("invalid size {s:?}: {why}");
    let text = s.trim();
    if text.is_empty() {
        return Err(bad("empty value; write e.g. 8GiB or 512MiB"));
    }
    if text.starts_with('-') {
        return Err(bad("must not be negative"));
    }
    let Some((int, frac, after)) = split_number(text) else {
        return Err(bad("expected a number followed by a unit, e.g. 8GiB"));
    };
    let unit = after.trim_start();
    let bytes_per_unit = if unit.is_empty() {
        if !frac.is_empty() {
            return Err(bad(&format!(
                "a fractional size needs a unit ({SIZE_HINT})"
            )));
        }
        1
    } else {
        match SIZE_UNITS.iter().find(|(name, _)| *name == unit) {
            Some((_, len)) => *len,
            None => return Err(bad(&format!("unknown unit {unit:?} (use {SIZE_HINT})"))),
        }
    };
    let total = scale(int, frac, bytes_per_unit).ok_or_else(|| bad("too large"))?;
    u64::try_from(total).map_err(|_| bad("too large"))
}

/// Formats a byte size with the largest binary unit it reaches and at most two decimals:
/// `87.82GiB`, `8GiB`, `64MiB`, `512B`. Meant for messages; it may round.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, len) in UNITS {
        if bytes >= len {
            if bytes % len == 0 {
                return format!("{}{name}", bytes / len);
            }
            let text = format!("{:.2}", bytes as f64 / len as f64);
            let text = text.trim_end_matches('0').trim_end_matches('.');
            return format!("{text}{name}");
        }
    }
    format!("{bytes}B")
}

/// Parses a temperature in degrees Celsius: `85C`, `85.5C`, `85°C`, `85 °C`, `-5C`.
pub fn parse_temperature(s: &str) -> Result<f64, String> {
    let bad = |why: &str| format!("invalid temperature {s:?}: {why}");
    let text = s.trim();
    if text.is_empty() {
        return Err(bad("empty value; write e.g. 85C"));
    }
    let number = ["°C", "℃", "C"]
        .iter()
        .find_map(|unit| text.strip_suffix(unit))
        .map(str::trim_end);
    let Some(number) = number else {
        let hint =
            if split_number(text.trim_start_matches('-')).is_some_and(|(_, _, r)| r.is_empty()) {
                "add the unit C (e.g. 85C)"
            } else {
                "expected degrees Celsius, e.g. 85C"
            };
        return Err(bad(hint));
    };
    let (negative, magnitude) = match number.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, number),
    };
    match split_number(magnitude) {
        Some((_, _, "")) => {}
        _ => return Err(bad("expected degrees Celsius, e.g. 85C")),
    }
    let value: f64 = magnitude
        .parse()
        .map_err(|_| bad("expected degrees Celsius, e.g. 85C"))?;
    if !value.is_finite() {
        return Err(bad("too large"));
    }
    Ok(if negative { -value } else { value })
}

/// Formats a temperature for messages: `85C`, `85.5C`.
pub fn format_temperature(celsius: f64) -> String {
    format!("{celsius}C")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1;
    const M: u64 = 60;
    const H: u64 = 3600;

    #[test]
    fn durations_that_parse() {
        let table: &[(&str, Duration)] = &[
            ("500ms", Duration::from_millis(500)),
            ("90s", Duration::from_secs(90 * S)),
            ("15m", Duration::from_secs(15 * M)),
            ("2h", Duration::from_secs(2 * H)),
            ("1d", Duration::from_secs(24 * H)),
            ("1h30m", Duration::from_secs(H + 30 * M)),
            ("1h 30m", Duration::from_secs(H + 30 * M)),
            ("5 s", Duration::from_secs(5)),
            ("  10m  ", Duration::from_secs(10 * M)),
            (
                "1d2h3m4s5ms",
                Duration::from_millis(((24 + 2) * H + 3 * M + 4) * 1000 + 5),
            ),
            ("1.5h", Duration::from_secs(H + 30 * M)),
            ("0.25s", Duration::from_millis(250)),
            ("0s", Duration::ZERO),
            ("007s", Duration::from_secs(7)),
            ("250us", Duration::from_micros(250)),
            ("3ns", Duration::from_nanos(3)),
            ("1m0.5s", Duration::from_millis(60_500)),
        ];
        for (text, want) in table {
            assert_eq!(parse_duration(text), Ok(*want), "{text}");
        }
    }

    #[test]
    fn durations_that_do_not_parse() {
        let table: &[(&str, &str)] = &[
            (
                "90",
                r#"invalid duration "90": add a unit (ms, s, m, h, d)"#,
            ),
            (
                "1.5",
                r#"invalid duration "1.5": add a unit (ms, s, m, h, d)"#,
            ),
            (
                "1h30",
                r#"invalid duration "1h30": add a unit (ms, s, m, h, d)"#,
            ),
            (
                "",
                r#"invalid duration "": empty value; write e.g. 90s or 15m"#,
            ),
            (
                "   ",
                r#"invalid duration "   ": empty value; write e.g. 90s or 15m"#,
            ),
            ("-5s", r#"invalid duration "-5s": must not be negative"#),
            (
                "5x",
                r#"invalid duration "5x": unknown unit "x" (use ms, s, m, h, d)"#,
            ),
            (
                "5M",
                r#"invalid duration "5M": unknown unit "M" (use ms, s, m, h, d)"#,
            ),
            (
                "5sec",
                r#"invalid duration "5sec": unknown unit "sec" (use ms, s, m, h, d)"#,
            ),
            (
                "30m1h",
                r#"invalid duration "30m1h": write each unit once, larger units first (e.g. 1h30m)"#,
            ),
            (
                "1m1m",
                r#"invalid duration "1m1m": write each unit once, larger units first (e.g. 1h30m)"#,
            ),
            (
                "s",
                r#"invalid duration "s": expected a number followed by a unit, e.g. 90s or 1h30m"#,
            ),
            (
                ".5s",
                r#"invalid duration ".5s": expected a number followed by a unit, e.g. 90s or 1h30m"#,
            ),
            (
                "5.s",
                r#"invalid duration "5.s": expected a number followed by a unit, e.g. 90s or 1h30m"#,
            ),
            (
                "+5s",
                r#"invalid duration "+5s": expected a number followed by a unit, e.g. 90s or 1h30m"#,
            ),
            (
                "99999999999999999999999d",
                r#"invalid duration "99999999999999999999999d": too large"#,
            ),
        ];
        for (text, want) in table {
            assert_eq!(parse_duration(text).unwrap_err(), *want, "{text}");
        }
        let huge = format!("{}s", "9".repeat(45));
        assert_eq!(
            parse_duration(&huge),
            Err(format!("invalid duration {huge:?}: too large"))
        );
    }

    #[test]
    fn durations_format() {
        let table: &[(Duration, &str)] = &[
            (Duration::ZERO, "0s"),
            (Duration::from_secs(15 * M), "15m"),
            (Duration::from_secs(H + 30 * M), "1h30m"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(120), "2m"),
            (Duration::from_secs(24 * H), "1d"),
            (Duration::from_millis(1500), "1s500ms"),
            (Duration::from_nanos(1_001), "1us1ns"),
        ];
        for (d, want) in table {
            assert_eq!(format_duration(*d), *want);
        }
    }

    #[test]
    fn sizes_that_parse() {
        let table: &[(&str, u64)] = &[
            ("0", 0),
            ("1048576", 1 << 20),
            ("512B", 512),
            ("1KiB", 1024),
            ("64MiB", 64 << 20),
            ("8GiB", 8 << 30),
            ("8 GiB", 8 << 30),
            ("2TiB", 2 << 40),
            ("1KB", 1000),
            ("1kB", 1000),
            ("1MB", 1_000_000),
            ("20GB", 20_000_000_000),
            ("1TB", 1_000_000_000_000),
            ("87.82GiB", 94_296_006_984),
            ("86GiB", 86 << 30),
            ("0.5KiB", 512),
            ("1.0005KiB", 1025),
            ("1.5B", 2),
            ("18446744073709551615", u64::MAX),
        ];
        for (text, want) in table {
            assert_eq!(parse_size(text), Ok(*want), "{text}");
        }
        // 87.82 GiB = 94295091937.28 bytes, rounded to the nearest byte.
        assert_eq!(
            (87.82f64 * (1u64 << 30) as f64).round() as u64,
            94_296_006_984
        );
    }

    #[test]
    fn sizes_that_do_not_parse() {
        let table: &[(&str, &str)] = &[
            (
                "",
                r#"invalid size "": empty value; write e.g. 8GiB or 512MiB"#,
            ),
            ("-1GiB", r#"invalid size "-1GiB": must not be negative"#),
            ("-1", r#"invalid size "-1": must not be negative"#),
            (
                "1.5",
                r#"invalid size "1.5": a fractional size needs a unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"#,
            ),
            (
                "8G",
                r#"invalid size "8G": unknown unit "G" (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"#,
            ),
            (
                "8gib",
                r#"invalid size "8gib": unknown unit "gib" (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"#,
            ),
            (
                "8GiB8MiB",
                r#"invalid size "8GiB8MiB": unknown unit "GiB8MiB" (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"#,
            ),
            (
                "GiB",
                r#"invalid size "GiB": expected a number followed by a unit, e.g. 8GiB"#,
            ),
            (
                "18446744073709551616",
                r#"invalid size "18446744073709551616": too large"#,
            ),
            ("16777216TiB", r#"invalid size "16777216TiB": too large"#),
        ];
        for (text, want) in table {
            assert_eq!(parse_size(text).unwrap_err(), *want, "{text}");
        }
    }

    #[test]
    fn sizes_format() {
        assert_eq!(format_size(512), "512B");
        assert_eq!(format_size(1024), "1KiB");
        assert_eq!(format_size(64 << 20), "64MiB");
        assert_eq!(format_size(8 << 30), "8GiB");
        assert_eq!(format_size(94_296_006_984), "87.82GiB");
        assert_eq!(format_size(1536), "1.5KiB");
    }

    #[test]
    fn temperatures() {
        let good: &[(&str, f64)] = &[
            ("85C", 85.0),
            ("85.5C", 85.5),
            ("85°C", 85.0),
            ("85 °C", 85.0),
            ("85℃", 85.0),
            ("5C", 5.0),
            ("0C", 0.0),
            ("-5C", -5.0),
        ];
        for (text, want) in good {
            assert_eq!(parse_temperature(text), Ok(*want), "{text}");
        }
        let bad: &[(&str, &str)] = &[
            (
                "85",
                r#"invalid temperature "85": add the unit C (e.g. 85C)"#,
            ),
            (
                "85.5",
                r#"invalid temperature "85.5": add the unit C (e.g. 85C)"#,
            ),
            (
                "85F",
                r#"invalid temperature "85F": expected degrees Celsius, e.g. 85C"#,
            ),
            (
                "C",
                r#"invalid temperature "C": expected degrees Celsius, e.g. 85C"#,
            ),
            (
                "1e3C",
                r#"invalid temperature "1e3C": expected degrees Celsius, e.g. 85C"#,
            ),
            (
                "infC",
                r#"invalid temperature "infC": expected degrees Celsius, e.g. 85C"#,
            ),
            ("", r#"invalid temperature "": empty value; write e.g. 85C"#),
        ];
        for (text, want) in bad {
            assert_eq!(parse_temperature(text).unwrap_err(), *want, "{text}");
        }
        assert_eq!(format_temperature(85.0), "85C");
        assert_eq!(format_temperature(85.5), "85.5C");
    }

    proptest! {
        #[test]
        fn formatted_durations_parse_back(secs in 0u64..10_000_000_000, nanos in 0u32..1_000_000_000) {
            let d = Duration::new(secs, nanos);
            prop_assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }

        #[test]
        fn unit_parsers_never_panic(s in "\\PC{0,24}") {
            let _ = parse_duration(&s);
            let _ = parse_size(&s);
            let _ = parse_temperature(&s);
        }

        #[test]
        fn binary_sizes_are_exact(n in 0u64..1_000_000, unit in 0usize..5) {
            let (name, len) = SIZE_UNITS[unit];
            prop_assert_eq!(parse_size(&format!("{n}{name}")), Ok(n * len as u64));
        }
    }
}
