//! amdgpu's `gpu_metrics`: the binary table of temperatures, power and throttling that the
//! SMU firmware fills, decoded for the APU layouts (v2.0 to v2.4, and v3.0 of Strix Point and
//! Strix Halo).
//!
//! Follows: Documentation/gpu/amdgpu/thermal.rst ("gpu_metrics"), and the structures
//! `gpu_metrics_v2_0` .. `gpu_metrics_v3_0` of drivers/gpu/drm/amd/include/kgd_pp_interface.h
//! (little endian, naturally aligned). Owns: decoding bytes into [`Metrics`]. Must not: read
//! files (the card does), or trust the header: a table is decoded only when its
//! `structure_size` matches the layout it names and the bytes read hold all of it. Any input
//! gives a value or an error, never a panic.
//!
//! The layout is chosen by the revision, and the table must have that layout's size. v2.x
//! tables hold `average_gfx_activity` in centi-percent (the SMU's `GfxActivity`, which the
//! driver divides by 100 for `gpu_busy_percent`); v3.0 holds percent. v2.x tables report
//! throttling as bits
//! (`indep_throttle_status`, v2.2 and later: bits 0-15 power, 16-31 current, 32-47 thermal,
//! 48-63 other); v3.0 has cumulative `throttle_residency_*` counters instead, whose rise
//! between two readings is throttling in that interval. All ones in a field means the
//! firmware does not report it: it reads as absent.

use serde::Serialize;

/// What a table says about throttling, as the layout reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ThrottleReading {
    /// v2.2+: the ASIC-independent throttler bits now.
    Bits(u64),
    /// v3.0: the residency counters `[prochot, spl, fppt, sppt, thm_core, thm_gfx, thm_soc]`.
    Residency([u32; 7]),
}

/// The figures dsv4 uses from one table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Metrics {
    /// `format.content`, as the header says.
    pub revision: (u8, u8),
    /// The layout decoded.
    pub layout: &'static str,
    pub gfx_celsius: Option<f64>,
    pub soc_celsius: Option<f64>,
    /// The hottest CPU core.
    pub core_max_celsius: Option<f64>,
    pub gfx_busy_percent: Option<f64>,
    /// The whole package's power (APU + dGPU on v3.0).
    pub socket_watts: Option<f64>,
    /// v3.0 only: the APU's power.
    pub apu_watts: Option<f64>,
    pub gfx_watts: Option<f64>,
    pub throttle: Option<ThrottleReading>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("gpu_metrics: {0} bytes, too short for a header")]
    NoHeader(usize),
    #[error("gpu_metrics: revision {format}.{content} of {size} bytes is not a layout dsv4 knows")]
    Unknown { format: u8, content: u8, size: u16 },
    #[error("gpu_metrics: the header says {size} bytes, but only {read} were read")]
    Truncated { size: u16, read: usize },
}

/// One layout: its name, size, and where its fields are.
struct Layout {
    name: &'static str,
    size: u16,
    gfx: usize,
    soc: usize,
    /// Offset and count of `temperature_core`.
    cores: (usize, usize),
    /// `average_gfx_activity`: offset, and whether it is in centi-percent (v2.x) or percent.
    busy: (usize, bool),
    /// `average_socket_power`: offset, and whether it is a u32 (v3.0) or a u16.
    socket: (usize, bool),
    apu: Option<usize>,
    /// `average_gfx_power`: offset, u32 or u16.
    gfx_power: (usize, bool),
    throttle: Option<ThrottleAt>,
}

#[derive(Clone, Copy)]
enum ThrottleAt {
    Bits(usize),
    Residency(usize),
}

const V2_0: Layout = Layout {
    name: "2.0",
    size: 120,
    gfx: 16,
    soc: 18,
    cores: (20, 8),
    busy: (40, true),
    socket: (44, false),
    apu: None,
    gfx_power: (50, false),
    throttle: None,
};

/// v2.1 to v2.4 share their first 120 bytes; v2.2 adds the throttler bits at 120.
const fn v2(name: &'static str, size: u16) -> Layout {
    Layout {
        name,
        size,
        gfx: 4,
        soc: 6,
        cores: (8, 8),
        busy: (28, true),
        socket: (40, false),
        apu: None,
        gfx_power: (46, false),
        throttle: if size >= 128 {
            Some(ThrottleAt::Bits(120))
        } else {
            None
        },
    }
}

const V3_0: Layout = Layout {
    name: "3.0",
    size: 264,
    gfx: 4,
    soc: 6,
    cores: (8, 16),
    busy: (42, false),
    socket: (112, true),
    apu: Some(120),
    gfx_power: (124, true),
    throttle: Some(ThrottleAt::Residency(228)),
};

fn layout(format: u8, content: u8, size: u16) -> Option<Layout> {
    let want = match (format, content) {
        (2, 0) => V2_0,
        (2, 1) => v2("2.1", 120),
        (2, 2) => v2("2.2", 128),
        (2, 3) => v2("2.3", 152),
        (2, 4) => v2("2.4", 168),
        (3, 0) => V3_0,
        _ => return None,
    };
    (want.size == size).then_some(want)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    let v = u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?);
    (v != u16::MAX).then_some(v)
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let v = u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?);
    (v != u32::MAX).then_some(v)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    let v = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
    (v != u64::MAX).then_some(v)
}

/// Centi-degrees, as the APU tables hold them; 0 is "no sensor" on these parts.
fn centi(v: Option<u16>) -> Option<f64> {
    v.filter(|v| *v > 0).map(|v| f64::from(v) / 100.0)
}

fn milliwatts(b: &[u8], (at, wide): (usize, bool)) -> Option<f64> {
    let mw = if wide {
        u32_at(b, at)
    } else {
        u16_at(b, at).map(u32::from)
    };
    mw.map(|mw| f64::from(mw) / 1000.0)
}

fn busy_percent(b: &[u8], (at, centi): (usize, bool)) -> Option<f64> {
    let v = f64::from(u16_at(b, at)?);
    let percent = if centi { v / 100.0 } else { v };
    (percent <= 100.0).then_some(percent)
}

/// Decodes a table read whole from `gpu_metrics`.
pub fn decode(bytes: &[u8]) -> Result<Metrics, DecodeError> {
    let Some(head) = bytes.get(..4) else {
        return Err(DecodeError::NoHeader(bytes.len()));
    };
    let size = u16::from_le_bytes([head[0], head[1]]);
    let (format, content) = (head[2], head[3]);
    let l = layout(format, content, size).ok_or(DecodeError::Unknown {
        format,
        content,
        size,
    })?;
    if bytes.len() < usize::from(size) {
        return Err(DecodeError::Truncated {
            size,
            read: bytes.len(),
        });
    }
    let b = &bytes[..usize::from(size)];
    let (core_at, cores) = l.cores;
    let core_max_celsius = (0..cores)
        .filter_map(|i| centi(u16_at(b, core_at + 2 * i)))
        .reduce(f64::max);
    let throttle = l.throttle.and_then(|t| match t {
        ThrottleAt::Bits(at) => u64_at(b, at).map(ThrottleReading::Bits),
        ThrottleAt::Residency(at) => {
            let mut r = [0u32; 7];
            for (i, v) in r.iter_mut().enumerate() {
                *v = u32_at(b, at + 4 * i)?;
            }
            Some(ThrottleReading::Residency(r))
        }
    });
    Ok(Metrics {
        revision: (format, content),
        layout: l.name,
        gfx_celsius: centi(u16_at(b, l.gfx)),
        soc_celsius: centi(u16_at(b, l.soc)),
        core_max_celsius,
        gfx_busy_percent: busy_percent(b, l.busy),
        socket_watts: milliwatts(b, l.socket),
        apu_watts: l.apu.and_then(|at| milliwatts(b, (at, true))),
        gfx_watts: milliwatts(b, l.gfx_power),
        throttle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::path::PathBuf;

    fn blob(name: &str) -> Vec<u8> {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/sysfs/gpu_metrics")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    const BLOBS: [&str; 4] = ["v3_0.bin", "v2_3.bin", "v2_1.bin", "v2_0.bin"];

    #[test]
    fn strix_halo_v3_0() {
        let m = decode(&blob("v3_0.bin")).unwrap();
        assert_eq!(
            m,
            Metrics {
                revision: (3, 0),
                layout: "3.0",
                gfx_celsius: Some(73.25),
                soc_celsius: Some(68.1),
                core_max_celsius: Some(65.5),
                gfx_busy_percent: Some(97.0),
                socket_watts: Some(85.0),
                apu_watts: Some(69.6),
                gfx_watts: Some(61.25),
                throttle: Some(ThrottleReading::Residency([0, 40, 0, 0, 0, 3, 0])),
            }
        );
        // A v3.0 table under another label is not read as v3.0.
        let mut labelled = blob("v3_0.bin");
        labelled[2..4].copy_from_slice(&[2, 1]);
        assert_eq!(
            decode(&labelled),
            Err(DecodeError::Unknown {
                format: 2,
                content: 1,
                size: 264
            })
        );
    }

    #[test]
    fn older_apus_v2() {
        let m = decode(&blob("v2_3.bin")).unwrap();
        assert_eq!(m.layout, "2.3");
        assert_eq!(m.gfx_celsius, Some(64.2));
        assert_eq!(m.soc_celsius, Some(59.3));
        assert_eq!(m.core_max_celsius, Some(61.0));
        // Centi-percent on v2.x.
        assert_eq!(m.gfx_busy_percent, Some(41.25));
        assert_eq!(m.socket_watts, Some(28.5));
        assert_eq!(m.apu_watts, None);
        assert_eq!(m.gfx_watts, Some(12.75));
        assert_eq!(m.throttle, Some(ThrottleReading::Bits(1 << 33)));
        // v2.1 has no throttler bits.
        let m = decode(&blob("v2_1.bin")).unwrap();
        assert_eq!(
            (m.layout, m.throttle, m.socket_watts),
            ("2.1", None, Some(28.5))
        );
        // v2.0 puts its timestamp first.
        let m = decode(&blob("v2_0.bin")).unwrap();
        assert_eq!(m.layout, "2.0");
        assert_eq!((m.gfx_celsius, m.socket_watts), (Some(58.0), Some(15.0)));
        assert_eq!(m.gfx_busy_percent, Some(12.0));
    }

    #[test]
    fn bad_tables_say_what_is_wrong() {
        assert_eq!(decode(&[1, 2]), Err(DecodeError::NoHeader(2)));
        let v3 = blob("v3_0.bin");
        assert_eq!(
            decode(&v3[..200]),
            Err(DecodeError::Truncated {
                size: 264,
                read: 200
            })
        );
        // A dGPU's v1.x table, or a size that does not match its revision.
        let mut other = v3.clone();
        other[0..4].copy_from_slice(&[100, 0, 1, 3]);
        assert_eq!(
            decode(&other),
            Err(DecodeError::Unknown {
                format: 1,
                content: 3,
                size: 100
            })
        );
        // A dGPU's table (format 1) of v3.0's size is not read as one.
        let mut dgpu = v3.clone();
        dgpu[2..4].copy_from_slice(&[1, 5]);
        assert!(matches!(decode(&dgpu), Err(DecodeError::Unknown { .. })));
        let mut wrong = blob("v2_3.bin");
        wrong[0] = 128;
        assert!(matches!(decode(&wrong), Err(DecodeError::Unknown { .. })));
        // A file longer than its table (st_size is only an upper bound): the rest is ignored.
        let mut longer = v3.clone();
        longer.extend_from_slice(&[0xAB; 64]);
        assert_eq!(decode(&longer), decode(&v3));
    }

    #[test]
    fn every_prefix_of_every_layout_decodes_or_errs() {
        for name in BLOBS {
            let b = blob(name);
            for n in 0..=b.len() {
                let r = decode(&b[..n]);
                assert_eq!(r.is_ok(), n == b.len(), "{name} cut at {n}: {r:?}");
            }
        }
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn real_headers_with_random_bodies_never_panic(
            pick in 0usize..4,
            body in proptest::collection::vec(any::<u8>(), 0..300),
        ) {
            let head = blob(BLOBS[pick]);
            let mut b = head[..4].to_vec();
            b.extend_from_slice(&body);
            if let Ok(m) = decode(&b) {
                prop_assert!(m.gfx_busy_percent.is_none_or(|p| p <= 100.0));
            }
        }
    }
}
