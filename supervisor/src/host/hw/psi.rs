//! `/proc/pressure/memory`: how much time tasks lose waiting for memory (PSI).
//!
//! Follows: Documentation/accounting/psi.rst: a `some` and a `full` line, each with
//! `avg10=`, `avg60=`, `avg300=` (percent of wall time) and `total=` (microseconds). Owns:
//! reading and parsing that file. Must not: fail when the kernel has no PSI (`psi=0`, or
//! before 4.20): the pressure is then absent.

use dsv4_client::telemetry::Pressure;

use crate::host::sysroot::SysRoot;

pub const PATH: &str = "/proc/pressure/memory";

pub fn read(root: &SysRoot) -> Option<Pressure> {
    parse(&root.read(PATH).ok()?)
}

pub fn parse(text: &str) -> Option<Pressure> {
    let line = |kind: &str| {
        let fields = text
            .lines()
            .find_map(|l| l.strip_prefix(kind)?.strip_prefix(' '))?;
        let value = |name: &str| {
            fields
                .split_whitespace()
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        };
        let avg10: f64 = value("avg10")?
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite())?;
        let total: u64 = value("total")?.parse().ok()?;
        Some((avg10, total))
    };
    let (some_avg10, some_total_us) = line("some")?;
    // `full` is missing for the CPU resource and on some older kernels.
    let (full_avg10, full_total_us) = line("full").unwrap_or((0.0, 0));
    Some(Pressure {
        some_avg10,
        full_avg10,
        some_total_us,
        full_total_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn some_and_full() {
        let p = parse(
            "some avg10=1.25 avg60=0.50 avg300=0.12 total=4181234\n\
             full avg10=0.40 avg60=0.10 avg300=0.02 total=1015321\n",
        )
        .unwrap();
        assert_eq!(p.some_avg10, 1.25);
        assert_eq!(p.full_avg10, 0.4);
        assert_eq!(p.some_total_us, 4181234);
        assert_eq!(p.full_total_us, 1015321);
        let only_some = parse("some avg10=3.00 avg60=0 avg300=0 total=9\n").unwrap();
        assert_eq!((only_some.full_avg10, only_some.full_total_us), (0.0, 0));
        assert_eq!(parse(""), None);
        assert_eq!(parse("some avg10=NaN total=1\n"), None);
        assert_eq!(parse("something avg10=1 total=1\n"), None);
    }
}
