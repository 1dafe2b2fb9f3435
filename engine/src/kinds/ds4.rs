//! antirez's `ds4-server`.
//!
//! It loads its model before it opens its port and has no `/health`: a connect that succeeds
//! followed by `GET /v1/models` 200 means ready. Its options (`ds4-server --help`: host,
//! port, CORS, queue, trace, ...) include no key or authentication of any kind. It keeps KV
//! checkpoints of its own (`--kv-disk-dir`), written after its SIGTERM, so it is never
//! interrupted: it gets the whole stop timeout, and says in its log what it saved. It has no
//! native completion endpoint with token ids: validation times the OpenAI stream. Its log
//! says each prompt's start, every prefill chunk and its end (`prompt start`, `prefill chunk
//! 64/123 ... 6.400s`, `prompt done 12.345s`).

use std::ffi::OsString;

use super::{
    Argv, BackendReport, Identify, Kind, KvKeeping, KvSaved, OwnKv, OwnLoad, Prefill, PrefillLine,
    PrefillReport, ValidationApi,
};
use nix::sys::signal::Signal;

use crate::settings::{EngineParams, KeyPassing, Readiness, Setting, Stop};

pub const KIND: Kind = Kind {
    name: "ds4",
    aliases: &["ds4-server"],
    program: "ds4-server",
    readiness: |_| Readiness::Get("/v1/models".into()),
    stop: |_| Stop {
        signal: Signal::SIGTERM,
        interrupt_grace: None,
        grace: None,
    },
    key: |_| KeyPassing::None,
    key_protection: |_| "none (ds4-server has no key option)",
    requires_model: false,
    requires: &[],
    reads: &[
        Setting::Model,
        Setting::Context,
        Setting::PrefillChunk,
        Setting::KvDiskDir,
        Setting::KvDiskSpace,
    ],
    ignores: &[
        Setting::Mmproj,
        Setting::Parallel,
        Setting::Batch,
        Setting::Ubatch,
        Setting::KvCache,
        Setting::FlashAttn,
        Setting::GpuLayers,
        Setting::KvCheckpoint,
    ],
    kv: KvKeeping::OwnFiles(OwnKv {
        file_suffix: ".kv",
        shown: "ds4-server's own",
        silent_when: "it saves none under 512 tokens",
        saved,
        loaded,
        tokens_in,
    }),
    validation: ValidationApi::Streamed,
    prefill: PrefillReport::Lines(prefill_line),
    settings_argv,
    address_flags: true,
    load_method,
    identify: Identify {
        version: None,
        backend: BackendReport::Log(log_backend),
    },
};

/// The backend ds4-server names as it sizes its context (`context buffers 3.58 MiB (ctx=4096,
/// backend=cpu, ...)`), as it is spelled elsewhere (`cpu` is CPU).
fn log_backend(line: &str) -> Option<String> {
    let rest = &line[line.find("backend=")? + "backend=".len()..];
    let name: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    match name.as_str() {
        "" => None,
        "cpu" | "cuda" => Some(name.to_ascii_uppercase()),
        "metal" => Some("Metal".into()),
        "rocm" => Some("ROCm".into()),
        _ => Some(name),
    }
}

/// Resident whole by default; `--ssd-streaming` streams the experts from the disk.
fn load_method(extra_args: &[String]) -> String {
    match extra_args.iter().any(|a| a == "--ssd-streaming") {
        true => "streamed from the disk as needed (--ssd-streaming)".to_string(),
        false => "loaded whole, resident (ds4-server's default)".to_string(),
    }
}

/// `-m --ctx --prefill-chunk --kv-disk-dir --kv-disk-space-mb`.
fn settings_argv(p: &EngineParams, _host: &str, _port: u16) -> Vec<OsString> {
    Argv::default()
        .flag("-m", p.model.clone())
        .flag("--ctx", p.context.map(|c| c.to_string()))
        .flag("--prefill-chunk", p.prefill_chunk.map(|c| c.to_string()))
        .flag("--kv-disk-dir", p.kv_disk_dir.clone())
        .flag(
            "--kv-disk-space-mb",
            p.kv_disk_space_mb.map(|mb| mb.to_string()),
        )
        .into_vec()
}

/// What ds4-server said it saved at its shutdown, from its last lines: the `kv cache stored`
/// line that follows its `... KV cache before shutdown` line, or the failure. `None` when it
/// said nothing about it (it saves nothing below `--kv-cache-min-tokens`, and nothing when an
/// equal checkpoint is on disk already).
///
/// The line is read by its named fields, in any order, and fields not known here are passed
/// over: upstream has reordered and added fields before (`ds4_kvstore.c` at 54b36ed prints
/// `tokens= trimmed= reason= key= size=N MiB save=N ms`).
pub fn saved(lines: &[String]) -> Option<(KvSaved, String)> {
    // What came after the shutdown began; the whole tail when its start was cut off.
    let start = lines
        .iter()
        .rposition(|l| l.contains("KV cache before shutdown"))
        .or_else(|| lines.iter().rposition(|l| l.contains("shutdown requested")))
        .unwrap_or(0);
    let after = &lines[start..];
    let stored = after.iter().map(|l| (l, Ds4KvLine::of(l))).find(|(_, f)| {
        f.as_ref()
            .is_some_and(|f| f.stored && f.reason.as_deref().is_none_or(|r| r == "shutdown"))
    });
    if let Some((line, Some(f))) = stored {
        let said = line.trim().to_string();
        let step = KvSaved {
            ok: true,
            seconds: f.save_ms.map_or(0.0, |ms| ms / 1000.0),
            tokens: f.tokens.unwrap_or(0),
            bytes: f.bytes.unwrap_or(0),
            reason: f.reason,
        };
        return Some((step, said));
    }
    let (failed, f) = after
        .iter()
        .filter_map(|l| Ds4KvLine::of(l).map(|f| (l, f)))
        .find(|(_, f)| !f.stored)?;
    let said = failed.trim().to_string();
    let step = KvSaved {
        ok: false,
        tokens: f.tokens.unwrap_or(0),
        reason: f.reason,
        ..KvSaved::default()
    };
    Some((step, said))
}

/// What a line of ds4-server's log says of loading a disk KV checkpoint for a request:
/// `kv cache hit text tokens=N ... load=X ms file=...` when it took it, `kv cache load failed
/// [RESPPROTO] PATH: WHY load=X ms` when the request's text matched it and it could not
/// (`ds4_kvstore.c` at 54b36ed).
pub fn loaded(line: &str) -> Option<OwnLoad> {
    let rest = &line[line.find("kv cache ")? + "kv cache ".len()..];
    if let Some(hit) = rest.strip_prefix("hit ") {
        let words: Vec<&str> = hit.split_whitespace().collect();
        let field = |name: &str| {
            words.iter().enumerate().find_map(|(i, w)| {
                let value = w.strip_prefix(name)?.strip_prefix('=')?;
                Some((value, words.get(i + 1).copied()))
            })
        };
        let tokens = field("tokens")?.0.parse().ok()?;
        let seconds = match field("load") {
            Some((ms, Some("s"))) => ms.parse::<f64>().unwrap_or(0.0),
            Some((ms, _)) => ms.parse::<f64>().unwrap_or(0.0) / 1000.0,
            None => 0.0,
        };
        return Some(OwnLoad::Loaded { tokens, seconds });
    }
    let failed = rest.strip_prefix("load failed")?;
    let failed = failed
        .trim_start()
        .trim_start_matches("RESPPROTO")
        .trim_start();
    // `PATH: WHY load=X ms`: the reason is between the path's colon and the time.
    let (file, why) = failed.split_once(": ").unwrap_or(("", failed));
    let why = why.rsplit_once(" load=").map_or(why, |(why, _)| why);
    Some(OwnLoad::Failed {
        why: why.trim().to_string(),
        file: file.to_string(),
    })
}

/// The tokens a ds4-server checkpoint holds: its header's `KVC` magic, its version, and at
/// byte 8 the count, little-endian (`ds4_kvstore_fill_header`).
pub fn tokens_in(path: &std::path::Path) -> Option<u64> {
    use std::io::Read;
    let mut head = [0u8; 12];
    std::fs::File::open(path).ok()?.read_exact(&mut head).ok()?;
    if &head[..3] != b"KVC" {
        return None;
    }
    Some(u32::from_le_bytes([head[8], head[9], head[10], head[11]]).into())
}

/// The fields of one of ds4-server's `kv cache ...` lines that dsv4d reports.
#[derive(Debug, Default, PartialEq)]
struct Ds4KvLine {
    /// `kv cache stored` (else a failure: `store failed`, `skipped`, `failed to create`).
    stored: bool,
    tokens: Option<u64>,
    bytes: Option<u64>,
    save_ms: Option<f64>,
    reason: Option<String>,
}

impl Ds4KvLine {
    /// `None` for a line that is not about storing a KV checkpoint (loads, evictions...).
    fn of(line: &str) -> Option<Ds4KvLine> {
        let at = line.find("kv cache ")?;
        let rest = &line[at + "kv cache ".len()..];
        let stored = rest.starts_with("stored ");
        let failed = ["store failed", "skipped ", "failed to create"]
            .iter()
            .any(|f| rest.starts_with(f));
        if !stored && !failed {
            return None;
        }
        let mut f = Ds4KvLine {
            stored,
            ..Ds4KvLine::default()
        };
        // `store failed (shutdown): ...` names its reason in parentheses.
        if let Some(r) = rest
            .strip_prefix("store failed (")
            .and_then(|r| r.split_once(')'))
        {
            f.reason = Some(r.0.to_string());
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        for (i, word) in words.iter().enumerate() {
            let Some((name, value)) = word.split_once('=') else {
                continue;
            };
            // A number may have its unit as the next word (`size=1.30 MiB`, `save=2.6 ms`).
            let unit = words.get(i + 1).filter(|u| !u.contains('=')).copied();
            match name {
                "tokens" => f.tokens = value.parse().ok(),
                "reason" => f.reason = Some(value.to_string()),
                "size" => {
                    let scale = match unit {
                        Some("B") => 1.0,
                        Some("KiB") => 1024.0,
                        Some("GiB") => 1024.0 * 1024.0 * 1024.0,
                        _ => 1024.0 * 1024.0,
                    };
                    f.bytes = value.parse::<f64>().ok().map(|v| (v * scale) as u64);
                }
                "save" => {
                    let scale = if unit == Some("s") { 1000.0 } else { 1.0 };
                    f.save_ms = value.parse::<f64>().ok().map(|v| v * scale);
                }
                _ => {}
            }
        }
        Some(f)
    }
}

/// What a line of ds4-server's log says of a prefill (its `ds4-server: chat ctx=C..P:N ...`
/// lines, `C` tokens cached of a `P`-token prompt, `N` new; after its time stamp).
pub fn prefill_line(line: &str) -> Option<PrefillLine> {
    let rest = &line[line.find("ds4-server: ")? + "ds4-server: ".len()..];
    let rest = rest
        .strip_prefix("chat ")
        .or_else(|| rest.strip_prefix("completion "))?;
    let rest = rest.strip_prefix("ctx=")?;
    let (span, rest) = rest.split_once(' ')?;
    let (cached, rest_span) = span.split_once("..")?;
    let (_, new) = rest_span.split_once(':')?;
    let (cached, total): (u64, u64) = (cached.parse().ok()?, new.parse().ok()?);
    if rest.ends_with("prompt start") {
        return Some(PrefillLine::Started { total, cached });
    }
    if let Some(at) = rest.find("prompt done ") {
        let seconds = rest[at + "prompt done ".len()..].strip_suffix('s')?;
        return Some(PrefillLine::Done {
            seconds: seconds.parse().ok()?,
        });
    }
    // `[FLAGS ]PHASE chunk DONE/TOTAL (PCT%) chunk=R t/s avg=R t/s SECONDSs`
    let at = rest.find(" chunk ")?;
    let mut words = rest[at + " chunk ".len()..].split_whitespace();
    let (done, of) = words.next()?.split_once('/')?;
    let seconds = words.last()?.strip_suffix('s')?;
    Some(PrefillLine::Progress(Prefill {
        done: done.parse().ok()?,
        total: of.parse().ok()?,
        cached,
        seconds: seconds.parse().ok(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_is_read_from_the_log() {
        let line = "1207 00:00:08 ds4-server: context buffers 3.58 MiB (ctx=4096, backend=cpu, \
                    prefill_chunk=0)";
        assert_eq!(log_backend(line).as_deref(), Some("CPU"));
        assert_eq!(log_backend("x backend=rocm)").as_deref(), Some("ROCm"));
        assert_eq!(
            log_backend("ds4-server: chat ctx=0..3:3 prompt start"),
            None
        );
    }

    #[test]
    fn the_load_method_follows_ssd_streaming() {
        assert!(load_method(&[]).contains("loaded whole, resident"));
        let streamed = load_method(&["--ssd-streaming".to_string()]);
        assert!(streamed.contains("(--ssd-streaming)"), "{streamed}");
    }

    #[test]
    fn ds4_shutdown_lines_are_read() {
        let lines = owned(&[
            "0101 10:00:00 ds4-server: shutdown requested, draining requests",
            "0101 10:00:01 ds4-server: persisting current KV cache before shutdown tokens=40960",
            "0101 10:00:09 ds4-server: kv cache stored tokens=40960 trimmed=0 reason=shutdown \
             key=token-text size=1536.50 MiB save=8123.4 ms",
        ]);
        let (step, said) = saved(&lines).unwrap();
        assert_eq!(step.tokens, 40960);
        assert_eq!(step.bytes, (1536.5 * 1048576.0) as u64);
        assert!((step.seconds - 8.1234).abs() < 1e-9);
        assert!(step.ok);
        assert!(said.contains("kv cache stored"));

        let failed = owned(&[
            "ds4-server: persisting current KV cache before shutdown tokens=900",
            "ds4-server: kv cache store failed (shutdown): No space left on device save=3.0 ms",
        ]);
        let (step, said) = saved(&failed).unwrap();
        assert!(!step.ok);
        assert!(said.contains("No space left"));
        // Nothing said about a save (under 512 tokens, ds4 saves nothing and says nothing).
        assert!(saved(&["ds4-server: shutdown requested".to_string()]).is_none());
    }

    #[test]
    fn ds4_checkpoint_loads_are_read() {
        let rows: &[(&str, Option<OwnLoad>)] = &[
            (
                "1207 00:00:51 ds4-server: kv cache hit text tokens=314 text=435 quant=2 \
                 key=token-text load=1.0 ms file=/var/cache/ds4/fdfb.kv",
                Some(OwnLoad::Loaded {
                    tokens: 314,
                    seconds: 0.001,
                }),
            ),
            (
                "ds4-server: kv cache hit text RESPPROTO tokens=90000 text=1 quant=2 key=x \
                 load=2.5 s consumed file=/k/a.kv",
                Some(OwnLoad::Loaded {
                    tokens: 90000,
                    seconds: 2.5,
                }),
            ),
            (
                "1207 00:00:51 ds4-server: kv cache load failed /k/a.kv: cached text hash \
                 mismatch load=0.2 ms",
                Some(OwnLoad::Failed {
                    why: "cached text hash mismatch".into(),
                    file: "/k/a.kv".into(),
                }),
            ),
            (
                "ds4-server: kv cache load failed RESPPROTO /k/a.kv: invalid header load=0.1 ms",
                Some(OwnLoad::Failed {
                    why: "invalid header".into(),
                    file: "/k/a.kv".into(),
                }),
            ),
            ("ds4-server: kv cache stored tokens=314 reason=cold", None),
            (
                "ds4-server: live kv cache miss live=318 prompt=314 common=314",
                None,
            ),
            ("ds4-server: chat ctx=314..314:0 prompt start", None),
        ];
        for (line, want) in rows {
            assert_eq!(loaded(line), *want, "{line}");
        }
    }

    fn owned(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|l| l.to_string()).collect()
    }

    /// What ds4-server at 54b36ed printed here on an idle stop (`persisting resident ...
    /// slot=0`, where the parser looked for an older `persisting current`), and the same
    /// fields shuffled, with one more that is not known here.
    #[test]
    fn ds4_lines_are_read_by_their_named_fields_in_any_order() {
        let real = owned(&[
            "1201 21:37:23 ds4-server: shutdown requested, draining requests",
            "1201 21:37:23 ds4-server: persisting resident KV cache before shutdown slot=0 tokens=85",
            "1201 21:37:23 ds4-server: kv cache stored tokens=85 trimmed=0 reason=shutdown \
             key=token-text size=1.30 MiB save=2.6 ms",
        ]);
        let (step, _) = saved(&real).unwrap();
        assert_eq!(
            (step.tokens, step.bytes, step.ok, step.reason.as_deref()),
            (85, (1.30 * 1048576.0) as u64, true, Some("shutdown"))
        );
        assert!((step.seconds - 0.0026).abs() < 1e-9, "{}", step.seconds);

        let shuffled = [
            "ds4-server: persisting resident KV cache before shutdown slot=0 tokens=85".to_string(),
            "ds4-server: kv cache stored save=1.5 s hash=abc size=2.00 GiB reason=shutdown \
             tokens=4096 key=token-text"
                .to_string(),
        ];
        let (step, _) = saved(&shuffled).unwrap();
        assert_eq!((step.tokens, step.bytes), (4096, 2 << 30));
        assert!((step.seconds - 1.5).abs() < 1e-9);

        // A save for another reason earlier in the tail is not the shutdown's.
        let earlier = [
            "ds4-server: kv cache stored tokens=50 trimmed=0 reason=cold key=token-text \
             size=1.00 MiB save=1.2 ms"
                .to_string(),
            "ds4-server: shutdown requested, draining requests".to_string(),
        ];
        assert_eq!(saved(&earlier), None);

        // A skip names its reason too.
        let skipped = [
            "ds4-server: persisting resident KV cache before shutdown slot=0 tokens=9000".into(),
            "ds4-server: kv cache skipped tokens=9000 reason=shutdown because estimated file \
             size 9.00 MiB (9.50 MiB with safety) exceeds budget 4.00 MiB"
                .to_string(),
        ];
        let (step, said) = saved(&skipped).unwrap();
        assert!(!step.ok && said.contains("exceeds budget"));
        assert_eq!(
            (step.tokens, step.reason.as_deref()),
            (9000, Some("shutdown"))
        );
    }

    /// ds4-server's prefill lines as its log writes them (after the time stamp), and lines
    /// that look alike.
    #[test]
    fn ds4_prefill_lines_are_read() {
        use super::{Prefill, PrefillLine};
        let progress = |done, total, cached, seconds| {
            Some(PrefillLine::Progress(Prefill {
                done,
                total,
                cached,
                seconds,
            }))
        };
        for (line, want) in [
            (
                "1204 20:13:22 ds4-server: chat ctx=0..123:123 prompt start",
                Some(PrefillLine::Started {
                    total: 123,
                    cached: 0,
                }),
            ),
            (
                "1204 20:13:28 ds4-server: chat ctx=0..123:123 prefill chunk 64/123 (52.0%) \
                 chunk=12.34 t/s avg=10.00 t/s 6.400s",
                progress(64, 123, 0, Some(6.4)),
            ),
            (
                "ds4-server: completion ctx=100..612:512 RESPPROTO TOOLS prefill chunk \
                 512/512 (100.0%) chunk=40.00 t/s avg=42.10 t/s 12.160s",
                progress(512, 512, 100, Some(12.16)),
            ),
            (
                "1204 20:13:34 ds4-server: chat ctx=0..123:123 prompt done 12.345s",
                Some(PrefillLine::Done { seconds: 12.345 }),
            ),
            // As the rig's ds4-server wrote it (its layer counter ends in carriage returns,
            // so it shares the line), and its decoding line after it.
            (
                "ds4: prefill layer 3/4\rds4: prefill layer 4/4\r1204 20:38:31 ds4-server: chat \
                 ctx=0..303:303 prefill chunk 303/303 (100.0%) chunk=0.00 t/s avg=21.94 t/s \
                 13.813s",
                progress(303, 303, 0, Some(13.813)),
            ),
            (
                "1204 20:38:31 ds4-server: chat ctx=303..305:2 gen=2 THINKING decoding \
                 chunk=23.35 t/s avg=23.35 t/s 0.086s",
                None,
            ),
            ("ds4-server: chat ctx=0..123:123 prompt done soon", None),
            ("ds4-server: listening on 127.0.0.1:8000", None),
            ("ds4: prefill layer 3/43", None),
            ("ds4-server: chat ctx=x..123:123 prompt start", None),
        ] {
            assert_eq!(super::prefill_line(line), want, "{line}");
        }
    }
}
