//! fake-engine: a test double for llama.cpp's `llama-server` (and, with
//! `--mode ds4`, for antirez's `ds4-server`), driven by dsv4's integration
//! tests over real loopback sockets.
//!
//! This file owns the command line (llama-server's flags plus failure-mode
//! knobs, each knob also readable from `FAKE_ENGINE_<NAME>`), startup (fake
//! model loading, reading the API keys, binding, failing on purpose) and signal
//! handling. The HTTP side lives in `server.rs`, the deterministic content in
//! `gen.rs`, when connections close (`--connections`) in `conn.rs`.

// Denied, not forbidden: the syscall probe alone (`probe_syscalls`) makes raw system calls,
// which is all it is for.
#![deny(unsafe_code)]

/// `eprintln!` that never panics. The engine's stderr is a pipe to dsv4d; once dsv4d is gone
/// (killed, in a test of what it leaves behind) a write fails, and a real engine goes on
/// until it is signalled, so this one must not die inside a task over a log line either.
/// Each line goes out in one write, as llama-server's logger writes it (one `fprintf` of the
/// whole message to unbuffered stderr): `writeln!` on Rust's unbuffered stderr would write
/// each piece of the format on its own, a pipe reader woken several times per line.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut line = format!($($arg)*);
        line.push('\n');
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

mod conn;
mod gen;
mod server;

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;
use tokio::signal::unix::{signal, SignalKind};

use crate::conn::Connections;
use crate::server::{Engine, EventLog};

/// Which real engine to imitate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// llama-server: port open at once, `/health` 503 while loading.
    Llama,
    /// ds4-server: port bound only once loaded, no `/health`.
    Ds4,
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "llama" | "llama-server" => Ok(Mode::Llama),
            "ds4" | "ds4-server" => Ok(Mode::Ds4),
            other => Err(format!("unknown mode {other:?} (expected llama or ds4)")),
        }
    }
}

/// `--fail-start`: how startup goes wrong on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailStart {
    None,
    /// Exit with this code before binding.
    Exit(u8),
    /// Never become ready.
    Hang,
}

impl FromStr for FailStart {
    type Err = String;
    fn from_str(s: &str) -> Result<FailStart, String> {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("none") {
            return Ok(FailStart::None);
        }
        if s.eq_ignore_ascii_case("hang") {
            return Ok(FailStart::Hang);
        }
        if let Some(code) = s.strip_prefix("exit:") {
            return code
                .trim()
                .parse::<u8>()
                .map(FailStart::Exit)
                .map_err(|_| format!("bad exit code in {s:?} (expected exit:0..255)"));
        }
        Err(format!(
            "unknown --fail-start {s:?} (expected exit:CODE or hang)"
        ))
    }
}

/// Command line: llama-server's flags (so the supervisor's argv works
/// unchanged) plus the fake's knobs.
#[derive(Parser, Debug)]
#[command(
    name = "fake-engine",
    about = "Test double for llama-server / ds4-server"
)]
struct Args {
    // ----- llama-server / ds4-server flags -----
    /// Model file (GGUF).
    #[arg(short = 'm', long = "model")]
    model: Option<PathBuf>,
    /// Multimodal projector file.
    #[arg(long = "mmproj")]
    mmproj: Option<PathBuf>,
    /// Context size (ds4-server spells it --ctx).
    #[arg(short = 'c', long = "ctx-size", visible_alias = "ctx")]
    ctx_size: Option<u64>,
    /// Number of slots (-np).
    #[arg(long = "parallel")]
    parallel: Option<u32>,
    /// K cache type (-ctk).
    #[arg(long = "cache-type-k")]
    cache_type_k: Option<String>,
    /// V cache type (-ctv).
    #[arg(long = "cache-type-v")]
    cache_type_v: Option<String>,
    /// Flash attention on|off|auto (-fa); bare -fa means on.
    #[arg(long = "flash-attn", num_args = 0..=1, default_missing_value = "on")]
    flash_attn: Option<String>,
    /// Layers to offload (-ngl), a number or "all".
    #[arg(long = "n-gpu-layers", allow_hyphen_values = true)]
    n_gpu_layers: Option<String>,
    /// Logical batch size.
    #[arg(short = 'b', long = "batch-size")]
    batch_size: Option<u64>,
    /// Physical batch size (-ub).
    #[arg(long = "ubatch-size")]
    ubatch_size: Option<u64>,
    /// Address to listen on.
    #[arg(long = "host", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 = any free port).
    #[arg(long = "port", default_value_t = 8080)]
    port: u16,
    /// Enable the metrics endpoint (accepted, ignored).
    #[arg(long = "metrics")]
    metrics: bool,
    /// Disable the web UI (accepted, ignored).
    #[arg(long = "no-webui")]
    no_webui: bool,
    /// Model name reported by /v1/models.
    #[arg(short = 'a', long = "alias")]
    alias: Option<String>,
    /// API keys, comma-separated: every request but /health then needs one.
    #[arg(long = "api-key")]
    api_key: Vec<String>,
    /// A file of API keys, one per line; lines starting with '#' are comments.
    #[arg(long = "api-key-file")]
    api_key_file: Vec<PathBuf>,
    /// ds4: prefill chunk size (accepted, ignored).
    #[arg(long = "prefill-chunk")]
    prefill_chunk: Option<u64>,
    /// ds4: KV checkpoint directory; with --mode ds4 a SIGTERM writes a checkpoint there
    /// and logs it as ds4-server does.
    #[arg(long = "kv-disk-dir")]
    kv_disk_dir: Option<PathBuf>,
    /// llama-server: where `/slots/N?action=save|restore` keep their files.
    #[arg(long = "slot-save-path")]
    slot_save_path: Option<PathBuf>,
    /// ds4: KV checkpoint space budget (accepted, ignored).
    #[arg(long = "kv-disk-space-mb")]
    kv_disk_space_mb: Option<u64>,
    /// ds4: the fewest tokens a checkpoint is written for [default 512].
    #[arg(long = "kv-cache-min-tokens")]
    kv_cache_min_tokens: Option<u64>,

    // ----- knobs (each also FAKE_ENGINE_<NAME>; the flag wins) -----
    /// Engine to imitate: llama or ds4 [env FAKE_ENGINE_MODE; default llama].
    #[arg(long = "mode")]
    mode: Option<Mode>,
    /// Model load time in ms [env FAKE_ENGINE_LOAD_MS; default 0].
    #[arg(long = "load-ms")]
    load_ms: Option<u64>,
    /// Time per generated token in ms [env FAKE_ENGINE_TOKEN_MS; default 0].
    #[arg(long = "token-ms")]
    token_ms: Option<u64>,
    /// Pause once after this many tokens of a response [env FAKE_ENGINE_PAUSE_AFTER].
    #[arg(long = "pause-after")]
    pause_after: Option<u64>,
    /// Length of that pause in ms [env FAKE_ENGINE_PAUSE_MS; default 0].
    #[arg(long = "pause-ms")]
    pause_ms: Option<u64>,
    /// Prompt processing time before the first token, ms [env FAKE_ENGINE_PREFILL_MS; default 0].
    #[arg(long = "prefill-ms")]
    prefill_ms: Option<u64>,
    /// ds4: interval of `: prefill` SSE comments, ms [env FAKE_ENGINE_PREFILL_COMMENT_MS; default 5000].
    #[arg(long = "prefill-comment-ms")]
    prefill_comment_ms: Option<u64>,
    /// exit:CODE or hang [env FAKE_ENGINE_FAIL_START].
    #[arg(long = "fail-start")]
    fail_start: Option<FailStart>,
    /// Exit(3) once this many tokens were produced in total [env FAKE_ENGINE_DIE_AFTER_TOKENS].
    #[arg(long = "die-after-tokens")]
    die_after_tokens: Option<u64>,
    /// On SIGTERM wait this many ms, then exit 0 [env FAKE_ENGINE_SIGTERM_MS; default 0].
    #[arg(long = "sigterm-ms")]
    sigterm_ms: Option<u64>,
    /// A slot save takes this many ms before it writes [env FAKE_ENGINE_SAVE_MS; default 0].
    #[arg(long = "save-ms")]
    save_ms: Option<u64>,
    /// Abort on a slot restore, as llama-server does on a bad slot file
    /// [env FAKE_ENGINE_RESTORE_ABORT=1|true|yes|on].
    #[arg(long = "restore-abort")]
    restore_abort: bool,
    /// Abort on a slot save, as an engine that crashes while it writes
    /// [env FAKE_ENGINE_SAVE_ABORT=1|true|yes|on].
    #[arg(long = "save-abort")]
    save_abort: bool,
    /// Answer a slot save as llama-server does on a full disk: a partial file and 500
    /// `Unable to save slot` [env FAKE_ENGINE_SAVE_FULL=1|true|yes|on].
    #[arg(long = "save-full")]
    save_full: bool,
    /// Ignore SIGTERM entirely [env FAKE_ENGINE_IGNORE_SIGTERM=1|true|yes|on].
    #[arg(long = "ignore-sigterm")]
    ignore_sigterm: bool,
    /// At start, make the system calls behind llama.cpp's --prio, --cpu-mask and --numa
    /// (setpriority to a lower priority, sched_setaffinity, setrlimit, mbind) and log each
    /// result as `syscall NAME ok|ERRNO` [env FAKE_ENGINE_PROBE_SYSCALLS=1|true|yes|on].
    #[arg(long = "probe-syscalls")]
    probe_syscalls: bool,
    /// At start, write this many MiB of progress-bar output to stderr (`loading NN%\r`, no
    /// newline at all), as a runaway progress bar would [env FAKE_ENGINE_SPEW_CR_MIB].
    #[arg(long = "spew-cr-mib")]
    spew_cr_mib: Option<u64>,
    /// Append event lines here [env FAKE_ENGINE_LOG_FILE].
    #[arg(long = "log-file")]
    log_file: Option<PathBuf>,
    /// When to close connections: keep, close-after-stream, close-after-response, max:N,
    /// idle:MS, keep-alive-header, llama, random:PCT@before-read|after-read|mid-response,
    /// comma-separated [env FAKE_ENGINE_CONNECTIONS; default keep].
    #[arg(long = "connections")]
    connections: Option<Connections>,
    /// Seed of the random connection breaks [env FAKE_ENGINE_SEED; default 1].
    #[arg(long = "seed")]
    seed: Option<u64>,
}

/// Effective settings after merging flags and environment.
#[derive(Debug, Clone)]
pub struct Config {
    pub mode: Mode,
    /// Name reported as the model id: the alias, else the model file name.
    pub model_name: String,
    pub model_path: Option<String>,
    pub n_ctx: u64,
    pub parallel: u32,
    pub host: String,
    pub port: u16,
    pub load_ms: u64,
    pub token_ms: u64,
    pub pause_after: Option<u64>,
    pub pause_ms: u64,
    pub prefill_ms: u64,
    pub prefill_comment_ms: u64,
    pub fail_start: FailStart,
    /// `None` (or 0 on the command line) disables it.
    pub die_after_tokens: Option<u64>,
    pub sigterm_ms: u64,
    pub save_ms: u64,
    pub slot_save_path: Option<PathBuf>,
    pub kv_disk_dir: Option<PathBuf>,
    pub kv_cache_min_tokens: u64,
    pub restore_abort: bool,
    pub save_abort: bool,
    pub save_full: bool,
    pub ignore_sigterm: bool,
    pub log_file: Option<PathBuf>,
    pub connections: Connections,
    pub seed: u64,
    /// From `--api-key` and `--api-key-file`; empty: no key needed.
    pub api_keys: Vec<String>,
}

/// Multi-character single-dash flags of llama-server that clap cannot express
/// as short flags, mapped to their long forms.
const DASH_ALIASES: [(&str, &str); 6] = [
    ("-np", "--parallel"),
    ("-ctk", "--cache-type-k"),
    ("-ctv", "--cache-type-v"),
    ("-fa", "--flash-attn"),
    ("-ngl", "--n-gpu-layers"),
    ("-ub", "--ubatch-size"),
];

/// Rewrites `-np 4` / `-np=4` style arguments into their long forms.
fn normalize_argv(argv: &[String]) -> Vec<String> {
    argv.iter()
        .enumerate()
        .map(|(i, arg)| {
            if i == 0 {
                return arg.clone();
            }
            for (short, long) in DASH_ALIASES {
                if arg == short {
                    return long.to_string();
                }
                if let Some(rest) = arg.strip_prefix(short).and_then(|r| r.strip_prefix('=')) {
                    return format!("{long}={rest}");
                }
            }
            arg.clone()
        })
        .collect()
}

/// Reads `FAKE_ENGINE_<name>`; unset or empty means "not given".
fn env_knob<T: FromStr>(name: &str) -> Result<Option<T>, String>
where
    T::Err: Display,
{
    let key = format!("FAKE_ENGINE_{name}");
    match std::env::var(&key) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<T>()
            .map(Some)
            .map_err(|e| format!("bad {key}={v:?}: {e}")),
        Ok(_) => Ok(None),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("bad {key}: {e}")),
    }
}

/// The flag if given, else the environment variable.
/// As the real programs answer a supervisor's questions of what they are: llama-server
/// prints its version (on stderr) or its devices (none, for a build for the CPU) and exits;
/// ds4-server has neither option and says so.
fn identity_probe(flag: &str) -> ExitCode {
    if env_knob::<Mode>("MODE").ok().flatten() == Some(Mode::Ds4) {
        eprintln!("ds4-server: unknown option: {flag}");
        return ExitCode::from(2);
    }
    match flag {
        "--version" => eprintln!("version: 1 (fake)\nbuilt with rustc for the fake engine"),
        _ => println!("Available devices:\n  (none)"),
    }
    ExitCode::SUCCESS
}

fn knob<T: FromStr>(flag: Option<T>, name: &str) -> Result<Option<T>, String>
where
    T::Err: Display,
{
    match flag {
        Some(v) => Ok(Some(v)),
        None => env_knob(name),
    }
}

/// A boolean environment knob.
struct Truthy(bool);

impl FromStr for Truthy {
    type Err = String;
    fn from_str(s: &str) -> Result<Truthy, String> {
        match s.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => Ok(Truthy(true)),
            "0" | "false" | "no" | "off" => Ok(Truthy(false)),
            _ => Err("expected 1/0, true/false, yes/no or on/off".to_string()),
        }
    }
}

fn model_name(alias: Option<&str>, model: Option<&Path>) -> String {
    if let Some(a) = alias.filter(|a| !a.is_empty()) {
        return a.to_string();
    }
    model
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "fake-model".to_string())
}

/// The keys as llama-server collects them: every `--api-key` list split at commas, and every
/// line of every `--api-key-file` taken whole (no trimming) unless empty or starting with `#`.
fn api_keys(args: &Args) -> Result<Vec<String>, String> {
    let mut keys: Vec<String> = args
        .api_key
        .iter()
        .flat_map(|list| list.split(','))
        .filter(|k| !k.is_empty())
        .map(String::from)
        .collect();
    for file in &args.api_key_file {
        let text = std::fs::read_to_string(file)
            .map_err(|_| format!("failed to open file '{}'", file.display()))?;
        keys.extend(
            text.split('\n')
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(String::from),
        );
    }
    Ok(keys)
}

fn build_config(args: &Args) -> Result<Config, String> {
    let ignore_sigterm =
        args.ignore_sigterm || env_knob::<Truthy>("IGNORE_SIGTERM")?.is_some_and(|t| t.0);
    Ok(Config {
        mode: knob(args.mode, "MODE")?.unwrap_or(Mode::Llama),
        model_name: model_name(args.alias.as_deref(), args.model.as_deref()),
        model_path: args.model.as_ref().map(|p| p.display().to_string()),
        n_ctx: args.ctx_size.unwrap_or(4096),
        parallel: args.parallel.unwrap_or(1),
        host: args.host.clone(),
        port: args.port,
        load_ms: knob(args.load_ms, "LOAD_MS")?.unwrap_or(0),
        token_ms: knob(args.token_ms, "TOKEN_MS")?.unwrap_or(0),
        pause_after: knob(args.pause_after, "PAUSE_AFTER")?,
        pause_ms: knob(args.pause_ms, "PAUSE_MS")?.unwrap_or(0),
        prefill_ms: knob(args.prefill_ms, "PREFILL_MS")?.unwrap_or(0),
        prefill_comment_ms: knob(args.prefill_comment_ms, "PREFILL_COMMENT_MS")?.unwrap_or(5000),
        fail_start: knob(args.fail_start, "FAIL_START")?.unwrap_or(FailStart::None),
        die_after_tokens: knob(args.die_after_tokens, "DIE_AFTER_TOKENS")?.filter(|&n| n > 0),
        sigterm_ms: knob(args.sigterm_ms, "SIGTERM_MS")?.unwrap_or(0),
        save_ms: knob(args.save_ms, "SAVE_MS")?.unwrap_or(0),
        slot_save_path: args.slot_save_path.clone(),
        kv_disk_dir: args.kv_disk_dir.clone(),
        kv_cache_min_tokens: args.kv_cache_min_tokens.unwrap_or(512),
        restore_abort: args.restore_abort
            || env_knob::<Truthy>("RESTORE_ABORT")?.is_some_and(|t| t.0),
        save_abort: args.save_abort || env_knob::<Truthy>("SAVE_ABORT")?.is_some_and(|t| t.0),
        save_full: args.save_full || env_knob::<Truthy>("SAVE_FULL")?.is_some_and(|t| t.0),
        ignore_sigterm,
        log_file: knob(args.log_file.clone(), "LOG_FILE")?,
        connections: knob(args.connections.clone(), "CONNECTIONS")?.unwrap_or_default(),
        seed: knob(args.seed, "SEED")?.unwrap_or(1),
        api_keys: api_keys(args)?,
    })
}

/// SIGTERM: log, optionally linger (ds4 writes its KV checkpoint), exit 0 —
/// or ignore it with `--ignore-sigterm`. SIGINT: exit 1 at once.
///
/// In ds4 mode, as ds4-server does: the first SIGTERM or SIGINT closes the listening socket
/// at once and ends every stream once its prefill is over, with no `[DONE]`; the requests
/// under way end, then the checkpoint is written (after `--sigterm-ms`) and the engine exits
/// 0. A second signal exits 130 there and then.
async fn handle_signals(engine: Arc<Engine>) {
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            say!("fake-engine: error: cannot install signal handlers: {e}");
            std::process::exit(1);
        }
    };
    let ds4 = engine.cfg.mode == Mode::Ds4;
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let linger = async {
            match deadline {
                Some(d) => {
                    tokio::time::sleep_until(d).await;
                    // ds4-server waits for its clients before it saves.
                    while ds4 && engine.active.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                None => std::future::pending::<()>().await,
            }
        };
        let first = deadline.is_none();
        tokio::select! {
            _ = term.recv() => {
                engine.log.line("sigterm");
                if engine.cfg.ignore_sigterm {
                    say!("fake-engine: SIGTERM received, ignoring it");
                } else if ds4 && !first {
                    std::process::exit(130);
                } else if ds4 {
                    engine.stop_serving();
                    say!("{}", ds4_line("shutdown requested, draining requests"));
                    deadline = Some(tokio::time::Instant::now() + Duration::from_millis(engine.cfg.sigterm_ms));
                } else if first {
                    let ms = engine.cfg.sigterm_ms;
                    if ms > 0 {
                        say!("fake-engine: SIGTERM received, writing KV checkpoint ({ms} ms)");
                    } else {
                        say!("fake-engine: SIGTERM received, exiting");
                    }
                    deadline = Some(tokio::time::Instant::now() + Duration::from_millis(ms));
                }
            }
            _ = int.recv() => {
                if ds4 && first {
                    engine.stop_serving();
                    say!("{}", ds4_line("shutdown requested, draining requests"));
                    deadline = Some(tokio::time::Instant::now() + Duration::from_millis(engine.cfg.sigterm_ms));
                    continue;
                }
                if ds4 {
                    std::process::exit(130);
                }
                say!("fake-engine: SIGINT received, exiting");
                std::process::exit(1);
            }
            _ = linger => {
                if let (Mode::Ds4, Some(dir)) = (engine.cfg.mode, &engine.cfg.kv_disk_dir) {
                    ds4_checkpoint(&engine, dir);
                }
                say!("fake-engine: shutdown complete");
                std::process::exit(0);
            }
        }
    }
}

/// A line as ds4-server logs it: `MMDD HH:MM:SS ds4-server: TEXT` (UTC here).
pub fn ds4_line(text: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (day, hms) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!(
        "{m:02}{d:02} {:02}:{:02}:{:02} ds4-server: {text}",
        hms / 3600,
        hms % 3600 / 60,
        hms % 60
    )
}

/// ds4-server's prefill progress, as it prints it: one piece per layer, each ended by a
/// carriage return and none by a line end (the next line it logs follows the last one).
pub fn ds4_progress() {
    use std::io::Write as _;
    let pieces: String = (1..=4)
        .map(|l| format!("ds4: prefill layer {l}/4\r"))
        .collect();
    let _ = std::io::stderr().write_all(pieces.as_bytes());
}

/// ds4-server at shutdown: it writes the live session to `<sha1>.kv` in its folder when it
/// holds at least `--kv-cache-min-tokens` tokens, and logs it in its words.
fn ds4_checkpoint(engine: &Engine, dir: &Path) {
    let tokens = engine.tokens_served();
    if tokens < engine.cfg.kv_cache_min_tokens {
        return;
    }
    say!(
        "{}",
        ds4_line(&format!(
            "persisting resident KV cache before shutdown slot=0 tokens={tokens}"
        ))
    );
    let bytes = tokens * 1024;
    let file = dir.join(format!("{:040x}.kv", tokens));
    let started = std::time::Instant::now();
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&file, vec![0u8; bytes as usize]));
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    match written {
        Ok(()) => say!(
            "{}",
            ds4_line(&format!(
                "kv cache stored tokens={tokens} trimmed=0 reason=shutdown \
                 key=token-text size={:.2} MiB save={ms:.1} ms",
                bytes as f64 / 1048576.0
            ))
        ),
        Err(e) => say!(
            "{}",
            ds4_line(&format!(
                "kv cache store failed (shutdown): {e} save={ms:.1} ms"
            ))
        ),
    }
}

async fn bind(cfg: &Config) -> Result<TcpListener, String> {
    let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| {
            format!(
                "couldn't bind HTTP server socket, hostname: {}, port: {}: {e}",
                cfg.host, cfg.port
            )
        })?;
    match listener.local_addr() {
        Ok(addr) if cfg.mode == Mode::Ds4 => {
            say!("{}", ds4_line(&format!("listening on http://{addr}")))
        }
        Ok(addr) => say!("main: server is listening on http://{addr}"),
        Err(e) => return Err(format!("cannot read bound address: {e}")),
    }
    Ok(listener)
}

async fn run(engine: Arc<Engine>) -> ExitCode {
    let cfg = engine.cfg.clone();
    tokio::spawn(handle_signals(engine.clone()));

    if let FailStart::Exit(code) = cfg.fail_start {
        say!("llama_model_load: error loading model: fake failure requested");
        say!("llama_load_model_from_file: failed to load model");
        say!("fake-engine: error: failing on purpose (exit {code})");
        return ExitCode::from(code);
    }
    let hang = cfg.fail_start == FailStart::Hang;

    let listener = match cfg.mode {
        Mode::Llama => match bind(&cfg).await {
            Ok(l) => {
                let engine = engine.clone();
                tokio::spawn(async move {
                    if hang {
                        say!("fake-engine: hanging on purpose (never ready)");
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(cfg.load_ms)).await;
                    engine.set_ready();
                });
                l
            }
            Err(e) => {
                say!("main: {e}");
                return ExitCode::from(1);
            }
        },
        Mode::Ds4 => {
            if hang {
                say!("fake-engine: hanging on purpose (never binding)");
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_millis(cfg.load_ms)).await;
            ds4_progress();
            match bind(&cfg).await {
                Ok(l) => {
                    engine.set_ready();
                    l
                }
                Err(e) => {
                    say!("main: {e}");
                    return ExitCode::from(1);
                }
            }
        }
    };
    server::serve(engine, listener).await;
    // Only a ds4 engine stops serving on its own (a signal): the signal handler ends the
    // process once the requests under way are over.
    std::future::pending::<ExitCode>().await
}

fn main() -> ExitCode {
    let raw: Vec<String> = std::env::args().collect();
    if let [_, flag] = raw.as_slice() {
        if matches!(flag.as_str(), "--version" | "--list-devices") {
            return identity_probe(flag);
        }
    }
    let args = Args::parse_from(normalize_argv(&raw));
    let cfg = match build_config(&args) {
        Ok(c) => c,
        Err(e) => {
            say!("fake-engine: error: {e}");
            return ExitCode::from(2);
        }
    };
    let log = match EventLog::open(cfg.log_file.as_deref()) {
        Ok(l) => l,
        Err(e) => {
            say!("fake-engine: error: cannot open log file: {e}");
            return ExitCode::from(1);
        }
    };
    log.line(&format!(
        "start pid={} argv={}",
        std::process::id(),
        raw.join(" ")
    ));
    let probe = args.probe_syscalls
        || matches!(env_knob::<Truthy>("PROBE_SYSCALLS"), Ok(Some(Truthy(true))));
    if probe {
        for (name, result) in probe_syscalls() {
            log.line(&format!("syscall {name} {result}"));
        }
    }
    if let Ok(Some(mib)) = knob(args.spew_cr_mib, "SPEW_CR_MIB") {
        spew_progress(mib);
        log.line(&format!("spewed {mib} MiB of progress"));
    }
    say!(
        "fake-engine: loading model {}",
        cfg.model_path.as_deref().unwrap_or("(none)")
    );
    let engine = Arc::new(Engine::new(cfg, log));

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say!("fake-engine: error: cannot start runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(run(engine))
}

/// `mib` MiB of `loading NN%\r` on stderr, with no newline.
fn spew_progress(mib: u64) {
    use std::io::Write;
    let mut chunk = Vec::with_capacity(1 << 16);
    let mut n = 0u64;
    while chunk.len() < (1 << 16) - 16 {
        chunk.extend_from_slice(format!("loading {:3}%\r", n % 100).as_bytes());
        n += 1;
    }
    let mut err = std::io::stderr().lock();
    let mut left = mib << 20;
    while left > 0 {
        let part = &chunk[..chunk.len().min(left as usize)];
        if err.write_all(part).is_err() {
            return;
        }
        left -= part.len() as u64;
    }
    let _ = err.write_all(b"fake-engine: progress done\n");
    let _ = err.flush();
}

/// The system calls an engine makes to place and prioritise its threads and memory, each
/// with its result: `ok` or the errno's name.
#[allow(unsafe_code)]
fn probe_syscalls() -> Vec<(&'static str, String)> {
    fn result(r: libc::c_long) -> String {
        if r == 0 {
            "ok".into()
        } else {
            nix::errno::Errno::last().to_string()
        }
    }
    let mut out = Vec::new();
    // SAFETY: plain system calls on this process, with valid pointers to locals.
    unsafe {
        // A lower priority than it has (a nice value one higher).
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        let r = libc::setpriority(libc::PRIO_PROCESS, 0, (nice + 1).min(19));
        out.push(("setpriority", result(r.into())));
        // The CPUs it may run on, set to what they are.
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        libc::sched_getaffinity(0, size, &mut set);
        let r = libc::sched_setaffinity(0, size, &set);
        out.push(("sched_setaffinity", result(r.into())));
        // Its open-file limit, set to what it is.
        let mut lim: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let r = libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        out.push(("setrlimit", result(r.into())));
        // A page of its own memory bound to the default NUMA policy.
        let page = 4096;
        let mem = libc::mmap(
            std::ptr::null_mut(),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        const MPOL_DEFAULT: libc::c_long = 0;
        let r = libc::syscall(
            libc::SYS_mbind,
            mem,
            page,
            MPOL_DEFAULT,
            std::ptr::null::<libc::c_ulong>(),
            0 as libc::c_ulong,
            0 as libc::c_uint,
        );
        out.push(("mbind", result(r)));
        libc::munmap(mem, page);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn multi_char_short_flags_are_mapped() {
        let a = normalize_argv(&argv(
            "fe -np 2 -ctk q8_0 -ctv=q8_0 -fa on -ngl all -ub 512 -m x.gguf",
        ));
        assert_eq!(
            a,
            argv("fe --parallel 2 --cache-type-k q8_0 --cache-type-v=q8_0 --flash-attn on --n-gpu-layers all --ubatch-size 512 -m x.gguf")
        );
        let args = Args::try_parse_from(a).unwrap();
        assert_eq!(args.parallel, Some(2));
        assert_eq!(args.n_gpu_layers.as_deref(), Some("all"));
        assert_eq!(model_name(None, args.model.as_deref()), "x.gguf");
    }

    #[test]
    fn llama_and_ds4_argv_parse() {
        let a = normalize_argv(&argv(
            "fe -m /m/a.gguf --mmproj p.gguf -c 8192 -np 1 -fa -ngl -1 -b 2048 --host 0.0.0.0 --port 0 --metrics --no-webui --alias foo",
        ));
        let args = Args::try_parse_from(a).unwrap();
        assert_eq!(args.ctx_size, Some(8192));
        assert_eq!(args.flash_attn.as_deref(), Some("on"));
        assert_eq!(args.n_gpu_layers.as_deref(), Some("-1"));
        assert_eq!(args.port, 0);

        let a = argv("fe --mode ds4 -m a.gguf --ctx 100 --prefill-chunk 64 --kv-disk-dir /tmp/kv --kv-disk-space-mb 10 --fail-start exit:7");
        let args = Args::try_parse_from(a).unwrap();
        assert_eq!(args.ctx_size, Some(100));
        assert_eq!(args.mode, Some(Mode::Ds4));
        assert_eq!(args.fail_start, Some(FailStart::Exit(7)));
    }

    #[test]
    fn api_keys_come_from_lists_and_files() {
        let dir = std::env::temp_dir().join(format!("fake-engine-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# comment\nk-file\n\n k-spaced\nk-cr\r\n").unwrap();
        let a = argv(&format!(
            "fe --api-key a,b --api-key-file {} --api-key c",
            file.display()
        ));
        let args = Args::try_parse_from(a).unwrap();
        assert_eq!(
            api_keys(&args).unwrap(),
            ["a", "b", "c", "k-file", " k-spaced", "k-cr\r"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
        let err = api_keys(&args).unwrap_err();
        assert!(err.starts_with("failed to open file '"), "{err}");
    }

    #[test]
    fn fail_start_values() {
        assert_eq!("hang".parse::<FailStart>(), Ok(FailStart::Hang));
        assert_eq!("exit:0".parse::<FailStart>(), Ok(FailStart::Exit(0)));
        assert!("exit:300".parse::<FailStart>().is_err());
        assert!("explode".parse::<FailStart>().is_err());
    }
}
