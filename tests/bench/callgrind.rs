//! The callgrind section: dsv4d's own user-space instructions per plain request and per
//! streamed event, counted by valgrind's callgrind on the daemon's process while the same
//! fake engine answers (its instructions are not the daemon's). For this build and, with
//! `BENCH_BASELINE_DSV4D`, another, one after the other (instruction counts do not drift with
//! the machine's load, as times do).
//!
//! Each daemon runs under `valgrind --tool=callgrind`; after a warm-up its counters are zeroed
//! (`callgrind_control -z`), `BENCH_CALLGRIND_REQUESTS` (200) plain chats are sent one by one
//! on a kept-alive connection and the counters dumped (`callgrind_control -d`), then the same
//! for `BENCH_CALLGRIND_STREAMS` (50) streamed chats of 64 tokens (66 events each). The
//! engine takes `BENCH_CALLGRIND_TOKEN_MS` (2) per token, so each event arrives alone, as a
//! real engine's do (a few to a few hundred a second); at 0 they come as fast as the fake
//! engine writes them and dsv4d, slowed by valgrind, reads dozens at once. With
//! `BENCH_CALLGRIND_KEEP=DIR` the two dumps are copied there (`<build>-plain.out`,
//! `<build>-stream.out`), for `callgrind_annotate` to say where the instructions went.
//!
//! Last, the bare hyper proxy (`tests/bare-proxy`, the floor of dsv4d's stack) and nginx with
//! one worker (the proxies section's configuration) are counted the same way in front of the
//! same kind of engine: the reference of issue 55's goals.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::proxies::Started;
use crate::support::{env_or, temp_dir, Daemon, EngineSeen, Setup};

/// Any key: dsv4d puts the engine's own in place of what a client sends.
const AUTH: &str = "Bearer bench";

/// What one daemon cost.
struct Counted {
    name: String,
    /// The name in the `BENCH` line and the kept dumps' file names.
    slug: String,
    per_request: f64,
    per_event: f64,
}

pub async fn run() {
    println!("\ncallgrind: dsv4d's own instructions (user space, all its threads)");
    if Command::new("valgrind").arg("--version").output().is_err() {
        println!("  SKIPPED: no valgrind (apt-get install valgrind)");
        return;
    }
    let requests = env_or::<usize>("BENCH_CALLGRIND_REQUESTS", 200).max(1);
    let streams = env_or::<usize>("BENCH_CALLGRIND_STREAMS", 50).max(1);
    let token_ms = env_or::<u64>("BENCH_CALLGRIND_TOKEN_MS", 2);
    let mut builds = vec![("dsv4d".to_string(), None)];
    if let Some(bin) = std::env::var_os("BENCH_BASELINE_DSV4D").map(PathBuf::from) {
        builds.push(("dsv4d, baseline".to_string(), Some(bin)));
    }
    let mut counted = Vec::new();
    for (name, bin) in builds {
        match count(&name, bin.as_deref(), (requests, streams), token_ms).await {
            Ok(c) => counted.push(c),
            Err(e) => println!("  {name}: {e}"),
        }
    }
    // The floor of dsv4d's stack (hyper's server and client, nothing else), and nginx.
    let bare = |engine, wrapper: &[&str]| crate::proxies::start_bare(engine, wrapper);
    let nginx = |engine, wrapper: &[&str]| {
        let bin = crate::proxies::find_tool("nginx")
            .ok_or("no nginx (the proxies section installs it; apt-get install nginx)")?;
        crate::proxies::start_nginx(&bin, engine, "1", wrapper)
    };
    let sizes = (requests, streams);
    for c in [
        count_other(("hyper, bare", "hyper-bare"), bare, sizes, token_ms).await,
        count_other(("nginx (1 worker)", "nginx-w1"), nginx, sizes, token_ms).await,
    ] {
        match c {
            Ok(c) => counted.push(c),
            Err(e) => println!("  {e}"),
        }
    }
    println!(
        "  {:<16} {:>16} {:>18}   ({requests} plain requests, {streams} streams of 66 events, \
         {token_ms} ms a token)",
        "build", "Ir per request", "Ir per event"
    );
    for c in &counted {
        println!(
            "  {:<16} {:>16.0} {:>18.0}",
            c.name, c.per_request, c.per_event
        );
        println!(
            "BENCH section=callgrind build={} ir_per_request={:.0} ir_per_event={:.0} \
             requests={requests} streams={streams} token_ms={token_ms}",
            c.slug, c.per_request, c.per_event
        );
    }
}

/// valgrind's callgrind, writing its dumps to `out` (and `out.N` for each dump asked for).
fn valgrind(out: &Path) -> Vec<String> {
    vec![
        "valgrind".to_string(),
        "--tool=callgrind".into(),
        format!("--callgrind-out-file={}", out.display()),
    ]
}

/// The setup of every counted route's engine: paced at `token_ms` a token, kept alive.
fn setup(token_ms: u64) -> Setup {
    Setup::default()
        .engine("idle_timeout", "1h")
        .knob("connections", "keep")
        .knob("token_ms", &token_ms.to_string())
}

/// One daemon of `bin` (this build's when `None`) under callgrind: its instructions per plain
/// request and per streamed event.
async fn count(
    name: &str,
    bin: Option<&Path>,
    sizes: (usize, usize),
    token_ms: u64,
) -> Result<Counted, String> {
    let dir = temp_dir("callgrind");
    let out = dir.path().join("callgrind.out");
    let valgrind = valgrind(&out);
    let valgrind: Vec<&str> = valgrind.iter().map(String::as_str).collect();
    let script;
    let wrapper: Vec<&str> = match bin {
        None => valgrind,
        Some(bin) => {
            script = crate::proxies::baseline_wrapper(dir.path(), bin, &valgrind)?;
            vec![&script]
        }
    };
    let d = Daemon::start(&setup(token_ms).wrapper(&wrapper));
    let slug = name.replace(", ", "-");
    tally((name, &slug), d.child.id(), &out, (d.addr, AUTH), sizes).await
}

/// Another proxy under callgrind, started by `start` (given the engine and the valgrind
/// command), in front of an engine started by a daemon of this build that is not counted:
/// its instructions for the same requests to the same engine.
async fn count_other(
    (name, slug): (&str, &str),
    start: impl FnOnce(SocketAddr, &[&str]) -> Result<(Started, SocketAddr), String>,
    sizes: (usize, usize),
    token_ms: u64,
) -> Result<Counted, String> {
    let d = Daemon::start(&setup(token_ms));
    // The first request starts the engine through the daemon.
    let mut conn = crate::support::one_connection(d.addr).await;
    crate::once(&mut conn, d.addr, AUTH, crate::chat(1, false)).await;
    let seen = EngineSeen::of(&d).await;
    let dir = temp_dir("callgrind-other");
    let out = dir.path().join("callgrind.out");
    let valgrind = valgrind(&out);
    let valgrind: Vec<&str> = valgrind.iter().map(String::as_str).collect();
    let (proxy, addr) = start(seen.addr, &valgrind).map_err(|e| format!("{name}: {e}"))?;
    let bearer = seen.bearer();
    tally((name, slug), proxy.pid(), &out, (addr, &bearer), sizes)
        .await
        .map_err(|e| format!("{name}: {e}"))
}

/// The instructions of the process `pid` (under callgrind, dumping to `out`) per plain
/// request and per streamed event of the requests sent to `addr` with `auth`.
async fn tally(
    (name, slug): (&str, &str),
    pid: u32,
    out: &Path,
    (addr, auth): (SocketAddr, &str),
    (requests, streams): (usize, usize),
) -> Result<Counted, String> {
    let mut conn = crate::support::one_connection(addr).await;
    // The first request through a daemon starts the engine; more warm everything up.
    for _ in 0..20 {
        crate::once(&mut conn, addr, auth, crate::chat(1, false)).await;
        crate::once(&mut conn, addr, auth, crate::chat(64, true)).await;
    }
    control(&["-z"], pid)?;
    for _ in 0..requests {
        crate::once(&mut conn, addr, auth, crate::chat(1, false)).await;
    }
    let plain = dumped(pid, out, (slug, "plain"))?;
    control(&["-z"], pid)?;
    let mut events = 0;
    for _ in 0..streams {
        let (_, n) = crate::once(&mut conn, addr, auth, crate::chat(64, true)).await;
        events += n;
    }
    let streamed = dumped(pid, out, (slug, "stream"))?;
    if events != streams * 66 {
        return Err(format!("{events} events in {streams} streams, not 66 each"));
    }
    Ok(Counted {
        name: name.to_string(),
        slug: slug.to_string(),
        per_request: plain as f64 / requests as f64,
        per_event: streamed as f64 / events as f64,
    })
}

fn control(args: &[&str], pid: u32) -> Result<(), String> {
    let out = Command::new("callgrind_control")
        .args(args)
        .arg(pid.to_string())
        .output()
        .map_err(|e| format!("callgrind_control: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "callgrind_control {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// The instructions counted since the last zeroing: dumped now, read from the newest dump's
/// `totals:` (or `summary:`) line.
fn dumped(pid: u32, out: &Path, (build, what): (&str, &str)) -> Result<u64, String> {
    let dir = out.parent().unwrap();
    let before = dumps(dir);
    control(&["-d"], pid)?;
    for _ in 0..200 {
        let now = dumps(dir);
        if let Some(new) = now.iter().find(|p| !before.contains(p)) {
            std::thread::sleep(Duration::from_millis(200));
            let text = std::fs::read_to_string(new).map_err(|e| e.to_string())?;
            if let Some(keep) = std::env::var_os("BENCH_CALLGRIND_KEEP") {
                let name = format!("{build}-{what}.out");
                let _ = std::fs::create_dir_all(&keep);
                std::fs::write(Path::new(&keep).join(name), &text).map_err(|e| e.to_string())?;
            }
            return text
                .lines()
                .find_map(|l| l.strip_prefix("totals: ").or(l.strip_prefix("summary: ")))
                .and_then(|n| n.split_whitespace().next()?.parse().ok())
                .ok_or_else(|| format!("no totals in {}", new.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err("callgrind wrote no dump".into())
}

fn dumps(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("callgrind.out"))
                })
                .collect()
        })
        .unwrap_or_default()
}
