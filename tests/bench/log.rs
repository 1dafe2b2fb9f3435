//! The log path: the CPU dsv4d spends on each of the engine's lines, as text on stderr (a
//! terminal, or the journal's stream with priority prefixes) and as journal entries with
//! fields sent to a native-protocol socket, side by side with writing the bare lines.
//!
//! The lines come as the engine's output readers log them: in batches of ten (llama-server
//! writes about ten per request). Figures are the whole process's CPU (the logging thread
//! and the log writer's thread) less that of the thread that drains the socket, which
//! stands in for journald, per line.
//!
//! Run: `cargo bench -p dsv4-tests --bench log` (`BENCH_LINES`, default 200000;
//! `BENCH_ROUNDS`, default 3).

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

use dsv4::control::log_format;
use dsv4::log::{journal, sink};
use tracing_subscriber::layer::SubscriberExt as _;

const BATCH: usize = 10;

/// CPU time of the whole process.
fn process_cpu() -> Duration {
    cpu(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

fn cpu(who: nix::sys::resource::UsageWho) -> Duration {
    let u = nix::sys::resource::getrusage(who).expect("getrusage");
    let t =
        |tv: nix::sys::time::TimeVal| Duration::new(tv.tv_sec() as u64, tv.tv_usec() as u32 * 1000);
    t(u.user_time()) + t(u.system_time())
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A line as llama-server writes one.
fn line(i: usize) -> String {
    format!("slot update_slots: id  0 | task {i} | prompt done, n_past = 42, n_tokens = 7")
}

fn batches(n: usize) -> Vec<String> {
    (0..n / BATCH)
        .map(|b| {
            (0..BATCH)
                .map(|j| format!("\n{}", line(b * BATCH + j)))
                .collect()
        })
        .collect()
}

fn emit(batches: &[String]) {
    for text in batches {
        tracing::info!(target: "engine", pid = 4242u32, stream = "stderr", lines = BATCH, "{text}");
    }
}

fn devnull() -> Box<dyn Write + Send> {
    Box::new(std::fs::File::create("/dev/null").expect("/dev/null"))
}

struct Figure {
    cpu: Duration,
    wall: Duration,
}

/// Text through the fmt layer and the log sink into /dev/null.
fn text(batches: &[String], format: log_format::LogFormat) -> Figure {
    let (sink, guard) = sink::start_to(4096, 64 * 1024, None, devnull());
    let sub = tracing_subscriber::registry().with(
        tracing_subscriber::fmt::layer()
            .with_writer(sink)
            .with_ansi(false)
            .event_format(format),
    );
    let (cpu0, t0) = (process_cpu(), Instant::now());
    tracing::subscriber::with_default(sub, || emit(batches));
    drop(guard);
    Figure {
        cpu: process_cpu() - cpu0,
        wall: t0.elapsed(),
    }
}

/// Entries through the journal layer to a socket drained by a thread of its own.
fn native(batches: &[String], lines: usize) -> Figure {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("journal");
    let server = UnixDatagram::bind(&path).expect("bind");
    let drain = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        let mut n = 0;
        while n < lines {
            if server.recv(&mut buf).is_err() {
                break;
            }
            n += 1;
        }
        (n, cpu(nix::sys::resource::UsageWho::RUSAGE_THREAD))
    });
    let client = UnixDatagram::unbound().expect("socket");
    client.connect(&path).expect("connect");
    let (sink, guard) = sink::start_to(4096, 64 * 1024, Some(client), devnull());
    let sub = tracing_subscriber::registry().with(journal::JournalLayer::new(sink));
    let (cpu0, t0) = (process_cpu(), Instant::now());
    tracing::subscriber::with_default(sub, || {
        let span = journal::engine_span("320k", Some(1));
        span.record("engine_pid", 4242u32);
        span.in_scope(|| emit(batches));
    });
    drop(guard);
    let (got, drained) = drain.join().expect("drain");
    assert_eq!(got, lines, "entries lost");
    Figure {
        cpu: (process_cpu() - cpu0).saturating_sub(drained),
        wall: t0.elapsed(),
    }
}

/// The floor: the bare lines written through a buffer into /dev/null.
fn bare(batches: &[String]) -> Figure {
    let (cpu0, t0) = (process_cpu(), Instant::now());
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, devnull());
    for text in batches {
        let _ = out.write_all(text.as_bytes());
    }
    let _ = out.flush();
    Figure {
        cpu: process_cpu() - cpu0,
        wall: t0.elapsed(),
    }
}

fn main() {
    let lines = env_or("BENCH_LINES", 200_000) / BATCH * BATCH;
    let rounds = env_or("BENCH_ROUNDS", 3).max(1);
    let batches = batches(lines);
    println!("log path: {lines} engine lines in batches of {BATCH}, {rounds} rounds (median)");
    let names = [
        "bare lines to /dev/null",
        "text (terminal format)",
        "text (journal stream, <N>)",
        "journal entries (native)",
    ];
    let mut figures: Vec<Vec<Figure>> = (0..names.len()).map(|_| Vec::new()).collect();
    // Interleaved by round, so that drift hits every path alike.
    for _ in 0..rounds {
        figures[0].push(bare(&batches));
        figures[1].push(text(&batches, log_format::LogFormat::new()));
        figures[2].push(text(&batches, log_format::LogFormat::journal()));
        figures[3].push(native(&batches, lines));
    }
    println!(
        "{:<28} {:>14} {:>14}",
        "path", "CPU us/line", "wall us/line"
    );
    for (name, mut f) in names.iter().zip(figures) {
        f.sort_by_key(|x| x.cpu);
        let mid = &f[f.len() / 2];
        let per = |d: Duration| d.as_secs_f64() * 1e6 / lines as f64;
        println!("{name:<28} {:>14.3} {:>14.3}", per(mid.cpu), per(mid.wall));
    }
}
