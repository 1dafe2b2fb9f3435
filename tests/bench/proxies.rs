//! The proxies section: `wrk` against the same fake engine direct, through dsv4d, through a
//! bare hyper proxy (the floor of dsv4d's stack), through nginx (a plain keep-alive reverse
//! proxy) and through systemd-socket-proxyd, interleaved by round
//! (each round starts at the next route, so that none always runs first).
//! Latency at concurrency 1, throughput at 64, and per request the CPU each proxy spent itself
//! and the CPU the engine spent behind it (from /proc, around each wrk run).
//!
//! Env: `BENCH_WRK_SECONDS` (3) per run, `BENCH_ROUNDS` (3), `BENCH_NGINX_WORKERS` (`1,auto`:
//! one nginx row per value; the first is the one the verdict compares with),
//! `BENCH_ENGINE_CONNECTIONS` (the fake engine's `--connections` SPEC; default `keep`, `llama`
//! to see llama-server's closes).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::support::env_or;
use crate::support::{temp_dir, Daemon, EngineSeen, Setup, TempDir};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/chat.lua");
const PROXYD: &str = "/lib/systemd/systemd-socket-proxyd";
const BODY: &str = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
const CONCURRENCY: [usize; 2] = [1, 64];
/// dsv4d's own CPU per proxied request, at most this many times nginx's (one worker).
const CPU_TARGET: f64 = 1.3;
/// dsv4d's own CPU per streamed event, at most nginx's.
const STREAM_CPU_TARGET: f64 = 1.0;

/// `name` on PATH or in the sbin folders (nginx lives in /usr/sbin).
pub(crate) fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .filter(|d| !d.is_empty())
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found
}

/// Installs the Debian packages with apt-get (update only if the first try fails).
fn install(pkgs: &[&str]) -> Result<(), String> {
    if !nix::unistd::geteuid().is_root() {
        return Err("not root, so apt-get install is impossible".into());
    }
    let apt = find_tool("apt-get").ok_or("no apt-get on this system")?;
    let run = |args: &[&str]| {
        Command::new(&apt)
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .output()
    };
    let args = [&["install", "-y", "--no-install-recommends"][..], pkgs].concat();
    eprintln!("proxies: installing {} (apt-get install)", pkgs.join(" "));
    if run(&args).is_ok_and(|o| o.status.success()) {
        return Ok(());
    }
    eprintln!("proxies: apt-get install failed; apt-get update and retry");
    let _ = run(&["update"]);
    match run(&args) {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "apt-get install {} failed: {}",
            pkgs.join(" "),
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .rfind(|l| !l.trim().is_empty())
                .unwrap_or("")
        )),
        Err(e) => Err(format!("apt-get: {e}")),
    }
}

/// A process the bench started (nginx, systemd-socket-activate), with its scratch folder.
/// On drop: SIGTERM to its pid, SIGKILL if it lingers, and SIGKILL to any child it had
/// (nginx workers), all by pid.
pub(crate) struct Started {
    child: Child,
    dir: TempDir,
}

impl Started {
    fn spawn(mut cmd: Command, dir: TempDir) -> Result<Started, String> {
        let log = std::fs::File::create(dir.path().join("stderr")).map_err(|e| e.to_string())?;
        // SAFETY: prctl is async-signal-safe. The bench spawns from its main thread, so the
        // child gets SIGTERM when the bench dies whichever way (nginx's master then stops its
        // workers).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawn {:?}: {e}", cmd.get_program()))?;
        Ok(Started { child, dir })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its stderr and, for nginx, its error log.
    fn logs(&self) -> String {
        ["stderr", "error.log"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(self.dir.path().join(f)).ok())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let pid = self.pid();
        let kids = children(pid);
        let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        let t = Instant::now();
        while self.child.try_wait().ok().flatten().is_none() {
            if t.elapsed() > Duration::from_secs(3) {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for k in kids {
            if crate::support::alive(k as i64) {
                let _ = kill(Pid::from_raw(k as i32), Signal::SIGKILL);
            }
        }
    }
}

/// The fields of /proc/PID/stat after the command name (index 0 is the state).
fn stat_fields(pid: u32) -> Option<Vec<u64>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.rsplit_once(')')?.1;
    Some(
        rest.split_whitespace()
            .skip(1)
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

/// The pids whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        // Field 4 (ppid) is index 0 once the state is skipped.
        .filter(|p| stat_fields(*p).is_some_and(|f| f.first() == Some(&(pid as u64))))
        .collect()
}

/// CPU time of a set of processes: per thread from schedstat (ns), and utime+stime from stat
/// (clock ticks, but it keeps the time of threads that have exited).
#[derive(Default)]
struct Cpu {
    threads: BTreeMap<u32, u64>,
    ticks: u64,
}

fn cpu(pids: &[u32]) -> Cpu {
    let mut c = Cpu::default();
    for &pid in pids {
        // utime and stime are fields 14 and 15: index 11 and 12 once the state is skipped.
        if let Some(f) = stat_fields(pid) {
            c.ticks += f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.filter_map(|e| e.ok()) {
            let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ns) = std::fs::read_to_string(t.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
            {
                c.threads.insert(tid, ns);
            }
        }
    }
    c
}

/// CPU nanoseconds between two samples: from schedstat when no thread went away in between,
/// else from the clock ticks.
fn cpu_ns(before: &Cpu, after: &Cpu) -> f64 {
    let kept = before.threads.keys().all(|t| after.threads.contains_key(t));
    if kept && !after.threads.is_empty() {
        after
            .threads
            .iter()
            .map(|(t, ns)| ns.saturating_sub(before.threads.get(t).copied().unwrap_or(0)))
            .sum::<u64>() as f64
    } else {
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        after.ticks.saturating_sub(before.ticks) as f64 * 1e9 / hz
    }
}

/// Whose CPU is the proxy's own.
enum Own {
    None,
    /// One process (dsv4d: its child, the engine, is counted apart).
    Process(u32),
    /// A process and its children (nginx's master and workers).
    Tree(u32),
}

impl Own {
    fn pids(&self) -> Vec<u32> {
        match *self {
            Own::None => Vec::new(),
            Own::Process(p) => vec![p],
            Own::Tree(p) => {
                let mut v = vec![p];
                v.extend(children(p));
                v
            }
        }
    }
}

struct Route {
    name: String,
    slug: String,
    addr: SocketAddr,
    own: Own,
}

/// What wrk reported for one run.
#[derive(Clone, Copy, Default)]
struct Run {
    rps: f64,
    requests: f64,
    /// p50, p75, p90, p99 in us.
    lat: [f64; 4],
    /// Non-2xx responses, then socket errors: connect, read, write, timeout.
    errors: [u64; 5],
    own_us: f64,
    engine_us: f64,
}

/// "27.00us", "1.02ms", "2.00s", "1.00m" -> us.
fn duration_us(s: &str) -> Option<f64> {
    let (num, mul) = if let Some(n) = s.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60e6)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600e6)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|n| n * mul)
}

fn parse_wrk(out: &str) -> Option<Run> {
    let mut r = Run::default();
    let mut seen = [false; 4];
    let (mut rps, mut requests) = (false, false);
    for line in out.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            r.rps = v.trim().parse().ok()?;
            rps = true;
        } else if line.contains(" requests in ") {
            r.requests = words.first()?.parse().ok()?;
            requests = true;
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            r.errors[0] = v.trim().parse::<u64>().unwrap_or(1);
        } else if line.starts_with("Socket errors:") {
            let n = line
                .split(|c: char| !c.is_ascii_digit())
                .filter_map(|n| n.parse::<u64>().ok());
            for (slot, n) in r.errors[1..].iter_mut().zip(n) {
                *slot = n;
            }
        } else if words.len() == 2 {
            let i = match words[0] {
                "50%" => 0,
                "75%" => 1,
                "90%" => 2,
                "99%" => 3,
                _ => continue,
            };
            r.lat[i] = duration_us(words[1])?;
            seen[i] = true;
        }
    }
    (rps && requests && r.requests > 0.0 && seen.iter().all(|s| *s)).then_some(r)
}

/// One wrk run, every request with `Authorization: auth` (the engine's key: the engine
/// requires it, and dsv4d sends the same in place of the client's); Err carries wrk's raw
/// output.
fn wrk(
    bin: &Path,
    addr: SocketAddr,
    auth: &str,
    (conns, secs): (usize, usize),
    body: &str,
) -> Result<Run, String> {
    let out = Command::new(bin)
        .args(["-t", "1", "-c", &conns.to_string()])
        .args(["-d", &format!("{secs}s"), "--latency", "-s", SCRIPT])
        .arg(format!("http://{addr}/v1/chat/completions"))
        .env("DSV4_BENCH_AUTHORIZATION", auth)
        .env("DSV4_BENCH_BODY", body)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {}: {e}", bin.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match parse_wrk(&stdout) {
        Some(r) if out.status.success() => Ok(r),
        _ => Err(format!(
            "wrk ({}) output not understood:\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// One POST with `Connection: close` (and `Authorization: auth` when given); Ok once the
/// response head says 200.
fn check(addr: SocketAddr, auth: Option<&str>, within: Duration) -> Result<(), String> {
    let auth = auth.map_or_else(String::new, |a| format!("Authorization: {a}\r\n"));
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(within))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\nConnection: close\r\n\r\n{BODY}",
        BODY.len()
    )
    .map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("{e} after {:?}", String::from_utf8_lossy(&got))),
        }
    }
    let text = String::from_utf8_lossy(&got);
    if text.starts_with("HTTP/1.1 200") {
        Ok(())
    } else {
        Err(format!("response {text:?}"))
    }
}

/// Waits until `addr` accepts connections (or the process exits).
fn wait_listening(addr: SocketAddr, p: &mut Started) -> Result<(), String> {
    let t = Instant::now();
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(st)) = p.child.try_wait() {
            return Err(format!("exited ({st}):\n{}", p.logs()));
        }
        // Under valgrind (the callgrind section) nginx takes seconds to start.
        if t.elapsed() > Duration::from_secs(30) {
            return Err(format!("not listening after 30 s:\n{}", p.logs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// `bin`, or `wrapper` (a command and its arguments) running `bin`.
fn wrapped(bin: &Path, wrapper: &[&str]) -> Command {
    match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// nginx as a reverse proxy of `engine`, run by `wrapper` when one is given (valgrind, for
/// the callgrind section).
pub(crate) fn start_nginx(
    bin: &Path,
    engine: SocketAddr,
    workers: &str,
    wrapper: &[&str],
) -> Result<(Started, SocketAddr), String> {
    let dir = temp_dir("nginx");
    let d = dir.path().display().to_string();
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    // One worker runs as a single process, like dsv4d's single-threaded runtime; more need the
    // master. No limit on requests per connection either side (the default 1000 would make
    // wrk and nginx reconnect).
    let master = if workers == "1" { "off" } else { "on" };
    let conf = format!(
        "daemon off;\nmaster_process {master};\nworker_processes {workers};\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\nevents {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n\
         client_body_temp_path {d}/client_body;\n  proxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
         upstream engine {{\n    server {engine};\n    keepalive 64;\n    keepalive_requests 1000000;\n  }}\n\
         server {{\n    listen {addr};\n    location / {{\n      proxy_pass http://engine;\n\
         proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n\
         }}\n  }}\n}}\n"
    );
    let path = dir.path().join("nginx.conf");
    std::fs::write(&path, conf).map_err(|e| e.to_string())?;
    let mut cmd = wrapped(bin, wrapper);
    cmd.arg("-p")
        .arg(format!("{d}/"))
        .arg("-c")
        .arg(&path)
        .arg("-e")
        .arg(format!("{d}/error.log"));
    let mut p = Started::spawn(cmd, dir)?;
    wait_listening(addr, &mut p)?;
    Ok((p, addr))
}

/// The bare hyper proxy in front of `engine`, run by `wrapper` when one is given.
pub(crate) fn start_bare(
    engine: SocketAddr,
    wrapper: &[&str],
) -> Result<(Started, SocketAddr), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = wrapped(Path::new(env!("CARGO_BIN_EXE_bare-proxy")), wrapper);
    cmd.arg(addr.to_string()).arg(engine.to_string());
    let mut p = Started::spawn(cmd, temp_dir("bare"))?;
    wait_listening(addr, &mut p)?;
    Ok((p, addr))
}

fn start_proxyd(activate: &Path, engine: SocketAddr) -> Result<(Started, SocketAddr), String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut cmd = Command::new(activate);
    // systemd-socket-activate binds, then execs the proxy (same pid) on the first connection.
    cmd.arg("-l")
        .arg(addr.to_string())
        .arg(PROXYD)
        .arg(engine.to_string());
    let mut p = Started::spawn(cmd, temp_dir("proxyd"))?;
    wait_listening(addr, &mut p)?;
    Ok((p, addr))
}

/// A script in `dir` that runs the dsv4d at `bin` (under `prefix`, a command and its
/// arguments, when given) where the harness runs this build's: the harness appends this
/// build's path and its arguments, and the script drops the path. Its path.
pub(crate) fn baseline_wrapper(dir: &Path, bin: &Path, prefix: &[&str]) -> Result<String, String> {
    let script = dir.join("baseline-dsv4d");
    let prefix: String = prefix.iter().map(|p| format!("{p} ")).collect();
    let text = format!(
        "#!/bin/sh\nshift\nexec {prefix}'{}' \"$@\"\n",
        bin.display()
    );
    std::fs::write(&script, text).map_err(|e| e.to_string())?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(|e| e.to_string())?;
    Ok(script.display().to_string())
}

/// A daemon of the build at `bin` (`BENCH_BASELINE_DSV4D`), with `setup`, its engine
/// started; its wrapper drops the path of this build's dsv4d, which the harness appends.
async fn start_baseline(setup: &Setup, bin: &Path) -> Result<(Daemon, TempDir), String> {
    if !bin.is_file() {
        return Err(format!("{} is not a file", bin.display()));
    }
    let dir = temp_dir("baseline");
    let wrapper = baseline_wrapper(dir.path(), bin, &[])?;
    let d = Daemon::start(&setup.clone().wrapper(&[&wrapper]));
    check(d.addr, None, Duration::from_secs(60)).map_err(|e| format!("did not answer: {e}"))?;
    Ok((d, dir))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn opt(x: f64, width: usize, prec: usize) -> String {
    if x.is_finite() {
        format!("{x:>width$.prec$}")
    } else {
        format!("{:>width$}", "-")
    }
}

/// The section: sets everything up, runs the rounds, prints the table.
pub async fn run() {
    let secs = env_or::<usize>("BENCH_WRK_SECONDS", 3).max(1);
    let rounds = env_or::<usize>("BENCH_ROUNDS", 3).max(1);
    let workers: Vec<String> = std::env::var("BENCH_NGINX_WORKERS")
        .unwrap_or_else(|_| "1,auto".into())
        .split(',')
        .map(|w| w.trim().to_string())
        .filter(|w| !w.is_empty())
        .collect();
    println!("\nproxies: the same engine direct and through each proxy");

    // Tools: wrk and nginx from apt when missing.
    let mut missing = Vec::new();
    if find_tool("wrk").is_none() {
        missing.push("wrk");
    }
    if find_tool("nginx").is_none() {
        missing.push("nginx");
    }
    let install_err = if missing.is_empty() {
        None
    } else {
        install(&missing).err()
    };
    let why = |tool: &str| match &install_err {
        Some(e) => format!("{tool} missing and not installed: {e}"),
        None => format!("{tool} still not found after apt-get install"),
    };
    let Some(wrk_bin) = find_tool("wrk") else {
        println!("  SKIPPED: the whole comparison needs wrk; {}", why("wrk"));
        return;
    };
    let mut skipped = Vec::new();

    // A plain keep-alive upstream by default, so every proxy is measured on the same, error
    // free exchange; `llama` shows what llama-server's closes do to each.
    let conns = std::env::var("BENCH_ENGINE_CONNECTIONS").unwrap_or_else(|_| "keep".into());
    let setup = Setup::default()
        .engine("idle_timeout", "1h")
        .knob("connections", &conns);
    println!(
        "  engine connections: {conns} (a close by the engine is a read error for wrk, a 502 \
         from nginx for a POST on a reused connection)"
    );
    let d = Daemon::start(&setup);
    // The first request starts the engine through the daemon.
    if let Err(e) = check(d.addr, None, Duration::from_secs(60)) {
        println!("  SKIPPED: dsv4d did not answer: {e}\n{}", d.log());
        return;
    }
    let status = d.status().await;
    let seen = EngineSeen::of(&d).await;
    let (engine, auth) = (seen.addr, seen.bearer());
    let Some(engine_pid) = status["engine_pid"].as_u64().map(|p| p as u32) else {
        println!("  SKIPPED: no engine_pid in /status: {status}");
        return;
    };

    let mut routes = vec![
        Route {
            name: "direct".into(),
            slug: "direct".into(),
            addr: engine,
            own: Own::None,
        },
        Route {
            name: "dsv4d".into(),
            slug: "dsv4d".into(),
            addr: d.addr,
            own: Own::Process(d.child.id()),
        },
    ];
    let mut started = Vec::new();
    // Another build of dsv4d, measured in the same rounds (interleaved with this one): a
    // before-and-after of a change. It runs the same setup, with an engine of its own.
    let baseline = std::env::var_os("BENCH_BASELINE_DSV4D").map(PathBuf::from);
    let mut _baseline_daemon = None;
    if let Some(bin) = baseline {
        match start_baseline(&setup, &bin).await {
            Ok((b, dir)) => {
                routes.push(Route {
                    name: "dsv4d, baseline".into(),
                    slug: "dsv4d-baseline".into(),
                    addr: b.addr,
                    own: Own::Process(b.child.id()),
                });
                _baseline_daemon = Some((b, dir));
            }
            Err(e) => skipped.push(format!("dsv4d, baseline: {e}")),
        }
    }
    // The floor of dsv4d's own stack: hyper's server and client on one tokio thread, nothing
    // else (tests/bare-proxy).
    match start_bare(engine, &[]) {
        Ok((p, addr)) => {
            routes.push(Route {
                name: "hyper, bare".into(),
                slug: "hyper-bare".into(),
                addr,
                own: Own::Tree(p.pid()),
            });
            started.push(p);
        }
        Err(e) => skipped.push(format!("hyper, bare: did not start: {e}")),
    }
    match find_tool("nginx") {
        Some(bin) => {
            for w in &workers {
                match start_nginx(&bin, engine, w, &[]) {
                    Ok((p, addr)) => {
                        routes.push(Route {
                            name: format!("nginx w={w}"),
                            slug: format!("nginx-w{w}"),
                            addr,
                            own: Own::Tree(p.pid()),
                        });
                        started.push(p);
                    }
                    Err(e) => skipped.push(format!("nginx w={w}: did not start: {e}")),
                }
            }
        }
        None => skipped.push(format!("nginx: {}", why("nginx"))),
    }
    match find_tool("systemd-socket-activate") {
        Some(act) if Path::new(PROXYD).is_file() => match start_proxyd(&act, engine) {
            Ok((p, addr)) => {
                routes.push(Route {
                    name: "socket-proxyd".into(),
                    slug: "socket-proxyd".into(),
                    addr,
                    own: Own::Tree(p.pid()),
                });
                started.push(p);
            }
            Err(e) => skipped.push(format!("socket-proxyd: did not start: {e}")),
        },
        _ => skipped.push(format!(
            "socket-proxyd: {PROXYD} or systemd-socket-activate not present"
        )),
    }

    // Every path must answer 200 before it is measured; then a short warm-up at c=64.
    routes.retain(
        |r| match check(r.addr, Some(&auth), Duration::from_secs(10)) {
            Ok(()) => true,
            Err(e) => {
                skipped.push(format!("{}: no 200 through it: {e}", r.name));
                false
            }
        },
    );
    for r in &routes {
        if let Err(e) = wrk(&wrk_bin, r.addr, &auth, (64, 1), BODY) {
            println!("  warm-up {}: {e}", r.name);
        }
    }
    for s in &skipped {
        println!("  skipped: {s}");
    }
    let bench = Bench {
        wrk: wrk_bin,
        auth,
        engine_pid,
        secs,
        rounds,
        nginx_slug: format!(
            "nginx-w{}",
            workers.first().map(String::as_str).unwrap_or("1")
        ),
    };
    for w in WORKLOADS {
        measure(&bench, &routes, &w);
    }
    drop(started);
    drop(d);
}

/// What every workload is measured with.
struct Bench {
    wrk: PathBuf,
    auth: String,
    engine_pid: u32,
    secs: usize,
    rounds: usize,
    /// The nginx row the verdict compares with.
    nginx_slug: String,
}

/// One kind of request, measured through every path.
struct Workload {
    name: &'static str,
    /// Its name in the BENCH lines (`section=proxies` for the plain chat, as before).
    section: &'static str,
    body: &'static str,
    /// Events of each answer, for the CPU per event (1: per request).
    events: f64,
    /// dsv4d's own CPU per request (or event) at most this many times nginx's.
    target: f64,
}

/// A streamed chat of 64 tokens: 66 events (64 tokens, the finish, `[DONE]`).
const STREAM_BODY: &str =
    r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":64,"stream":true}"#;

const WORKLOADS: [Workload; 2] = [
    Workload {
        name: "non-streaming chat",
        section: "proxies",
        body: BODY,
        events: 1.0,
        target: CPU_TARGET,
    },
    Workload {
        name: "streamed chat, 64 tokens (66 events); CPU per event",
        section: "proxies_stream",
        body: STREAM_BODY,
        events: 66.0,
        target: STREAM_CPU_TARGET,
    },
];

/// `w` through every path in `routes`, interleaved by round: the table, the BENCH lines and
/// the verdicts.
fn measure(b: &Bench, routes: &[Route], w: &Workload) {
    println!(
        "\n  {} (wrk -t 1 --latency; {} rounds x {} s per path and concurrency, interleaved; \
         median):",
        w.name, b.rounds, b.secs
    );
    let (rounds, secs, engine_pid, auth) = (b.rounds, b.secs, b.engine_pid, &b.auth);
    let wrk_bin = &b.wrk;

    let mut runs: BTreeMap<(usize, usize), Vec<Run>> = BTreeMap::new();
    for round in 1..=rounds {
        for c in CONCURRENCY {
            eprintln!("proxies: round {round}/{rounds}, c={c}");
            // Each round starts at another route: the first run of a round read about 5% high
            // (docs/testing.md), and a fixed order gave that to the same route every time.
            let n = routes.len();
            for i in (0..n).map(|k| (k + round - 1) % n) {
                let r = &routes[i];
                let own = r.own.pids();
                let (o0, e0) = (cpu(&own), cpu(&[engine_pid]));
                let res = wrk(wrk_bin, r.addr, auth, (c, secs), w.body);
                let (o1, e1) = (cpu(&own), cpu(&[engine_pid]));
                match res {
                    Ok(mut run) => {
                        let per = run.requests * w.events;
                        run.own_us = match r.own {
                            Own::None => f64::NAN,
                            _ => cpu_ns(&o0, &o1) / 1e3 / per,
                        };
                        run.engine_us = cpu_ns(&e0, &e1) / 1e3 / per;
                        runs.entry((i, c)).or_default().push(run);
                    }
                    Err(e) => println!("  {} c={c} round {round}: {e}", r.name),
                }
            }
        }
    }

    // Medians per path and concurrency.
    let med = |i: usize, c: usize, f: &dyn Fn(&Run) -> f64| {
        median(
            runs.get(&(i, c))
                .map(|v| v.iter().map(f).collect())
                .unwrap_or_default(),
        )
    };
    let direct_p50 = med(0, 1, &|r| r.lat[0]);
    let direct_rps = med(0, 64, &|r| r.rps);
    println!(
        "  nginx: upstream keepalive 64, HTTP/1.1, proxy_buffering off, access_log off; \
         w=1 is worker_processes 1 with master_process off (one single-threaded process, like \
         dsv4d), w=auto a master and one worker per core; the verdict compares with w={}",
        b.nginx_slug.trim_start_matches("nginx-w")
    );
    let per = if w.events > 1.0 { "us/ev" } else { "us/req" };
    println!(
        "  {:<14} {:>11} {:>10} {:>9} {:>9} {:>10} | {:>10} {:>7} {:>11} {:>9} {:>10}",
        "path",
        "c=1 p50 us",
        "p99 us",
        "added us",
        "own CPU",
        "engine CPU",
        "c=64 req/s",
        "share",
        "p50 us",
        "own CPU",
        "engine CPU"
    );
    println!(
        "  {:<14} {:>11} {:>10} {:>9} {:>9} {:>10} | {:>10} {:>7} {:>11} {:>9} {:>10}",
        "", "", "", "", per, per, "", "of dir.", "", per, per
    );
    for (i, r) in routes.iter().enumerate() {
        let p50 = med(i, 1, &|r| r.lat[0]);
        let rps = med(i, 64, &|r| r.rps);
        println!(
            "  {:<14} {} {} {} {} {} | {} {} {} {} {}",
            r.name,
            opt(p50, 11, 1),
            opt(med(i, 1, &|r| r.lat[3]), 10, 1),
            opt(if i == 0 { f64::NAN } else { p50 - direct_p50 }, 9, 1),
            opt(med(i, 1, &|r| r.own_us), 9, 1),
            opt(med(i, 1, &|r| r.engine_us), 10, 1),
            opt(rps, 10, 0),
            opt(rps / direct_rps, 7, 2),
            opt(med(i, 64, &|r| r.lat[0]), 11, 1),
            opt(med(i, 64, &|r| r.own_us), 9, 1),
            opt(med(i, 64, &|r| r.engine_us), 10, 1),
        );
    }
    for (i, r) in routes.iter().enumerate() {
        for c in CONCURRENCY {
            let v = runs.get(&(i, c)).map(Vec::as_slice).unwrap_or_default();
            let mut e = [0u64; 5];
            for run in v {
                for (a, b) in e.iter_mut().zip(run.errors) {
                    *a += b;
                }
            }
            if e.iter().any(|n| *n > 0) {
                println!(
                    "  errors: {} c={c}: {} non-2xx; socket errors connect {} read {} write {} \
                     timeout {} (over {} runs, {:.0} requests)",
                    r.name,
                    e[0],
                    e[1],
                    e[2],
                    e[3],
                    e[4],
                    v.len(),
                    v.iter().map(|r| r.requests).sum::<f64>()
                );
            }
        }
    }

    // Machine-readable: one line per path and concurrency.
    for (i, r) in routes.iter().enumerate() {
        for c in CONCURRENCY {
            let n = runs.get(&(i, c)).map_or(0, Vec::len);
            let all = |f: &dyn Fn(&Run) -> f64| -> (f64, f64) {
                let v: Vec<f64> = runs
                    .get(&(i, c))
                    .map(|v| v.iter().map(f).collect())
                    .unwrap_or_default();
                (
                    v.iter().copied().fold(f64::INFINITY, f64::min),
                    v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                )
            };
            let (p50_min, p50_max) = all(&|r| r.lat[0]);
            let (rps_min, rps_max) = all(&|r| r.rps);
            let p50 = med(i, c, &|r| r.lat[0]);
            let rps = med(i, c, &|r| r.rps);
            let base = med(0, c, &|r| r.lat[0]);
            let base_rps = med(0, c, &|r| r.rps);
            println!(
                "BENCH section={} path={} c={c} runs={n} secs={secs} rps={rps:.0} \
                 rps_min={rps_min:.0} rps_max={rps_max:.0} share={:.3} p50_us={p50:.1} \
                 p50_min_us={p50_min:.1} p50_max_us={p50_max:.1} p75_us={:.1} p90_us={:.1} \
                 p99_us={:.1} added_p50_us={:.1} own_cpu_us_per_{}={:.2} \
                 engine_cpu_us_per_{}={:.2} errors={}",
                w.section,
                r.slug,
                rps / base_rps,
                med(i, c, &|r| r.lat[1]),
                med(i, c, &|r| r.lat[2]),
                med(i, c, &|r| r.lat[3]),
                p50 - base,
                if w.events > 1.0 { "event" } else { "req" },
                med(i, c, &|r| r.own_us),
                if w.events > 1.0 { "event" } else { "req" },
                med(i, c, &|r| r.engine_us),
                runs.get(&(i, c))
                    .map_or(0, |v| v.iter().flat_map(|r| r.errors).sum::<u64>()),
            );
        }
    }

    // Verdict: dsv4d against the first nginx row.
    let find = |slug: &str| routes.iter().position(|r| r.slug == slug);
    let nginx_slug = &b.nginx_slug;
    match (find("dsv4d"), find(nginx_slug)) {
        (Some(dv), Some(ng)) => {
            let added = |i| med(i, 1, &|r| r.lat[0]) - direct_p50;
            let share = |i| med(i, 64, &|r| r.rps) / direct_rps;
            let (ad, an) = (added(dv), added(ng));
            let (sd, sn) = (share(dv), share(ng));
            let lat_ok = ad <= an;
            let tput_ok = sd >= sn;
            println!(
                "  verdict (vs {}): dsv4d added p50 {ad:.1} us vs nginx {an:.1} us ({}); \
                 dsv4d at c=64 {sd:.2} of direct vs nginx {sn:.2} ({})",
                routes[ng].name,
                if lat_ok { "<= : ok" } else { "> : MISSES" },
                if tput_ok { ">= : ok" } else { "< : MISSES" },
            );
            println!(
                "BENCH section={}_verdict against={nginx_slug} dsv4d_added_p50_us={ad:.1} \
                 nginx_added_p50_us={an:.1} latency_ok={} dsv4d_share={sd:.3} nginx_share={sn:.3} \
                 throughput_ok={}",
                w.section, lat_ok as u8, tput_ok as u8
            );
            // The cost target: dsv4d's own CPU per request (or event) at most the
            // workload's target times nginx's.
            let (target, unit) = (w.target, if w.events > 1.0 { "event" } else { "request" });
            for c in CONCURRENCY {
                let (d_us, n_us) = (med(dv, c, &|r| r.own_us), med(ng, c, &|r| r.own_us));
                let ratio = d_us / n_us;
                let ok = ratio <= target;
                println!(
                    "  cost (vs {}): dsv4d own CPU per {unit} at c={c} {d_us:.2} us vs nginx \
                     {n_us:.2} us: {ratio:.2}x ({} {target}x)",
                    routes[ng].name,
                    if ok { "<= : ok" } else { "> : MISSES" },
                );
                println!(
                    "BENCH section={}_cost against={nginx_slug} c={c} dsv4d_own_us={d_us:.2} \
                     nginx_own_us={n_us:.2} ratio={ratio:.3} target={target} ok={}",
                    w.section, ok as u8
                );
            }
        }
        _ => println!("  verdict: not possible (dsv4d or {nginx_slug} not measured)"),
    }
}
