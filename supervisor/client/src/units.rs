//! Byte sizes (`87.82GiB`, `64MiB`, `1048576`) and temperatures (`85C`, `85.5°C`), as the
//! configuration writes them and messages show them; durations are [`crate::duration`]'s,
//! with the same number grammar.
//!
//! The parsers are strict: a value must carry a unit where one is needed, negative or empty
//! values are refused, and every error message repeats the offending text.

/// Size units and their length in bytes.
const SIZE_UNITS: [(&str, u64); 10] = [
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

/// Splits `s` into a leading unsigned decimal number (`digits[.digits]`, as durations read
/// it) and the rest; `None` when it does not start with one.
fn number_and_unit(s: &str) -> Option<(&str, &str)> {
    let (_, _, rest) = crate::duration::split_number(s)?;
    Some(s.split_at(s.len() - rest.len()))
}

/// Parses a byte size such as `87.82GiB`, `64MiB`, `8 GiB`, `20GB` or `1048576` (bytes).
///
/// Binary units `B`, `KiB`, `MiB`, `GiB`, `TiB`; decimal units `KB` (or `kB`), `MB`, `GB`,
/// `TB`. Decimals are allowed with a unit and round to the nearest byte.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("invalid size {s:?}: {why}");
    let (number, unit) = match s.trim() {
        "" => return Err(bad("empty value; write e.g. 8GiB or 512MiB")),
        text if text.starts_with('-') => return Err(bad("must not be negative")),
        text => number_and_unit(text)
            .ok_or_else(|| bad("expected a number followed by a unit, e.g. 8GiB"))?,
    };
    let (unit, fraction) = (unit.trim_start(), number.contains('.'));
    let length = match SIZE_UNITS.iter().find(|(name, _)| *name == unit) {
        Some((_, length)) => *length,
        None if unit.is_empty() && fraction => {
            return Err(bad(&format!(
                "a fractional size needs a unit ({SIZE_HINT})"
            )))
        }
        None if unit.is_empty() => 1,
        None => return Err(bad(&format!("unknown unit {unit:?} (use {SIZE_HINT})"))),
    };
    // A fraction is within a part in 2^52 of the exact value, which is far below a byte for
    // any size that fits in memory.
    let bytes = match number.parse::<u64>() {
        Ok(n) => n.checked_mul(length),
        Err(_) if fraction => {
            let bytes = (number.parse::<f64>().unwrap_or(f64::INFINITY) * length as f64).round();
            (bytes < u64::MAX as f64).then_some(bytes as u64)
        }
        Err(_) => None,
    };
    bytes.ok_or_else(|| bad("too large"))
}

/// Formats a byte size in the project's one size format: one decimal, a space, the largest
/// binary unit it reaches: `87.8 GiB`, `8.0 GiB`, `64.0 MiB`, `512 B`. Meant for people; it
/// rounds (`parse_size` reads it back within that rounding).
pub fn format_size(bytes: u64) -> String {
    let units = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
    match units.into_iter().find(|(_, shift)| bytes >> shift > 0) {
        Some((name, shift)) => format!("{:.1} {name}", bytes as f64 / (1u64 << shift) as f64),
        None => format!("{bytes} B"),
    }
}

/// Bytes as GiB: the one conversion every figure of memory in GiB goes through.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// A size in GiB whatever its size, in the same format: for figures read side by side
/// (`81.4 GiB in use, 0.6 GiB before it started`).
pub fn format_gib(bytes: u64) -> String {
    format!("{:.1} GiB", gib(bytes))
}

/// A count with its thousands grouped: `262,144`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Parses a temperature in degrees Celsius: `85C`, `85.5C`, `85°C`, `85 °C`, `-5C`.
pub fn parse_temperature(s: &str) -> Result<f64, String> {
    let bad = |why: &str| Err(format!("invalid temperature {s:?}: {why}"));
    let text = s.trim();
    let is_number = |t: &str| {
        number_and_unit(t.strip_prefix('-').unwrap_or(t)).is_some_and(|(_, rest)| rest.is_empty())
    };
    let number = ["°C", "℃", "C"]
        .iter()
        .find_map(|unit| text.strip_suffix(unit));
    match number.map(str::trim_end) {
        _ if text.is_empty() => bad("empty value; write e.g. 85C"),
        Some(number) if is_number(number) => match number.parse::<f64>() {
            Ok(value) if value.is_finite() => Ok(value),
            _ => bad("too large"),
        },
        None if is_number(text) => bad("add the unit C (e.g. 85C)"),
        _ => bad("expected degrees Celsius, e.g. 85C"),
    }
}

/// Formats a temperature for messages: `85C`, `85.5C`.
pub fn format_temperature(celsius: f64) -> String {
    format!("{celsius}C")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_people_write_them() {
        for (n, want) in [
            (0, "0"),
            (999, "999"),
            (1000, "1,000"),
            (262_144, "262,144"),
            (1_234_567, "1,234,567"),
        ] {
            assert_eq!(thousands(n), want);
        }
    }

    use proptest::prelude::*;

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
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(1024), "1.0 KiB");
        assert_eq!(format_size(64 << 20), "64.0 MiB");
        assert_eq!(format_size(8 << 30), "8.0 GiB");
        assert_eq!(format_size(94_296_006_984), "87.8 GiB");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(format_gib(644_245_094), "0.6 GiB");
        // What it writes, the config reads back (within its rounding).
        for bytes in [512, 1536, 64 << 20, 94_296_006_984] {
            let back = parse_size(&format_size(bytes)).unwrap() as f64;
            assert!(
                (back - bytes as f64).abs() / (bytes as f64) < 0.001,
                "{bytes}"
            );
        }
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
        fn unit_parsers_never_panic(s in "\\PC{0,24}") {
            let _ = parse_size(&s);
            let _ = parse_temperature(&s);
        }

        #[test]
        fn binary_sizes_are_exact(n in 0u64..1_000_000, unit in 0usize..5) {
            let (name, len) = SIZE_UNITS[unit];
            prop_assert_eq!(parse_size(&format!("{n}{name}")), Ok(n * len));
        }
    }
}
