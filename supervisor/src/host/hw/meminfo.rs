//! `/proc/meminfo`: the machine's memory and swap, as the kernel counts them.
//!
//! Follows: Documentation/filesystems/proc.rst ("meminfo"): `Key:  value kB` lines, where
//! `MemAvailable` is the kernel's own estimate of what a new workload can take without
//! swapping. Owns: reading and parsing that file. Must not: fail on a line it does not know
//! or a value it cannot read: that figure is absent, the others stand.

use dsv4_client::telemetry::Memory;

use crate::host::sysroot::SysRoot;

pub const PATH: &str = "/proc/meminfo";

/// The figures, when the file can be read and has `MemTotal` and `MemAvailable`.
pub fn read(root: &SysRoot) -> Option<Memory> {
    parse(&root.read(PATH).ok()?)
}

/// `MemAvailable` less `CmaFree` (absent: 0): what a start may take.
pub fn admissible(root: &SysRoot) -> Option<u64> {
    let text = root.read(PATH).ok()?;
    let available = parse(&text)?.available;
    Some(available.saturating_sub(bytes(&text, "CmaFree").unwrap_or(0)))
}

pub fn parse(text: &str) -> Option<Memory> {
    Some(Memory {
        total: bytes(text, "MemTotal")?,
        available: bytes(text, "MemAvailable")?,
        swap_total: bytes(text, "SwapTotal").unwrap_or(0),
        swap_free: bytes(text, "SwapFree").unwrap_or(0),
    })
}

/// The value of `key` in a `Key:   12345 kB` line, in bytes.
pub fn bytes(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, rest) = line.split_once(':')?;
        if k.trim() != key {
            return None;
        }
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_and_units() {
        let text = "MemTotal: 10 kB\nMemAvailable:    7 kB\nHugepagesize: 2048 kB\n";
        assert_eq!(bytes(text, "MemAvailable"), Some(7 * 1024));
        assert_eq!(bytes(text, "MemFree"), None);
        assert_eq!(bytes("MemAvailable: 7\n", "MemAvailable"), None);
        assert_eq!(bytes("MemAvailable: x kB\n", "MemAvailable"), None);
        let m = parse(text).unwrap();
        assert_eq!((m.total, m.available, m.swap_total), (10240, 7168, 0));
        assert_eq!(parse("MemTotal: 10 kB\n"), None);
        assert_eq!(parse("\u{0}\u{ff}garbage"), None);
    }

    #[test]
    fn what_a_start_may_take_leaves_the_cma_area_out() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        let root = SysRoot::new(dir.path()).unwrap();
        let write = |text: &str| std::fs::write(dir.path().join("proc/meminfo"), text).unwrap();
        write("MemTotal: 100 kB\nMemAvailable: 70 kB\nCmaTotal: 40 kB\nCmaFree: 30 kB\n");
        assert_eq!(admissible(&root), Some(40 * 1024));
        write("MemTotal: 100 kB\nMemAvailable: 70 kB\n");
        assert_eq!(admissible(&root), Some(70 * 1024));
        write("MemTotal: 100 kB\nMemAvailable: 10 kB\nCmaFree: 30 kB\n");
        assert_eq!(admissible(&root), Some(0));
    }
}
