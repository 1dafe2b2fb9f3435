//! `dsv4ctl`: control dsv4d over D-Bus.
//!
//! Owns: the command line and what it prints. Must not: link the daemon's library; it
//! speaks to the daemon only through `dsv4_client` (names, proxy, status types), so it sees
//! exactly what any other client sees.
//!
//! Exit codes: 0 ok; 1 the daemon refused or failed (its message is printed); 2 a usage
//! error or a daemon that cannot be reached. Errors are one line on stderr, `dsv4ctl: ...`.

mod bus;
mod doctor;
mod error;
mod notify;
mod render;
mod top;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use dsv4_client::clock::unix_now;
use dsv4_client::{Bus, EngineStatus, State};
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::bus::Daemon;
use crate::error::Failure;

/// How long one `logs -f` question waits for a new line before it is asked again.
const FOLLOW_WAIT: Duration = Duration::from_secs(10);
/// The most lines one `logs -f` question asks for.
const FOLLOW_MAX: u32 = 10_000;

/// Control dsv4d, the on-demand supervisor of a local LLM engine.
///
/// dsv4d starts the engine (llama-server or ds4-server) when a request needs it and stops it
/// once it has been idle. dsv4ctl talks to it over D-Bus (io.github.dsv4.Supervisor1): it
/// shows the status, starts and stops the engine, switches profiles and shows the engine's
/// output. Reading is open to everyone; changing anything needs root or membership of the
/// dsv4 group.
///
/// Exit status: 0 on success, 1 when the daemon refused or failed, 2 on a usage error or
/// when the daemon cannot be reached.
#[derive(Debug, Parser)]
#[command(name = "dsv4ctl", version, propagate_version = true)]
struct Cli {
    /// The bus dsv4d is on [default: $DSV4_BUS, else system]
    #[arg(long, value_enum, global = true, value_name = "BUS")]
    bus: Option<Bus>,
    /// Print JSON instead of text
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the engine's state, profile and request statistics
    ///
    /// Shows the lifecycle state (stopped, starting, ready, draining, stopping, backoff), the
    /// active profile (and the running engine's, if another), the engine's pid and uptime,
    /// the requests in flight and waiting, each request in flight on a line of its own with
    /// its phase (waiting and for what, loading, prefill with its tokens, rate and time
    /// left as far as the engine tells, decoding, ending), when the idle engine will be
    /// stopped, the last error, request totals with token-weighted decode and prefill
    /// rates, the same by API (openai, anthropic, responses: those that had requests), and
    /// the last requests, each with its API. A rate marked ~ was timed by dsv4d's clock: the
    /// engine's answer had no timings (llama-server's Anthropic streams, ds4-server's
    /// answers). Never starts the engine.
    ///
    /// With --json, prints the Status() document as JSON.
    Status,
    /// Start the engine of the active profile now
    ///
    /// Calls Start(): the engine starts without waiting for a request. With --wait, calls
    /// StartAndWait() instead: the daemon answers once the engine is ready, or with the
    /// reason (and the engine's last lines) as soon as the start fails (exit 1). The states
    /// it goes through are shown as the daemon announces them (StateChanged).
    Start {
        /// Wait until the engine is ready
        #[arg(long)]
        wait: bool,
        /// Give up waiting after this long (e.g. 90s, 5m) [default: as long as dsv4d waits]
        #[arg(long, value_name = "DURATION", requires = "wait", value_parser = render::parse_duration)]
        timeout: Option<Duration>,
    },
    /// Stop the engine once in-flight requests have finished
    ///
    /// Calls Stop(): requests in flight finish first, then the engine is stopped. With --now,
    /// calls StopNow(), which stops it at once and cuts in-flight requests off. The next
    /// request starts it again.
    Stop {
        /// Stop at once, cutting in-flight requests off
        #[arg(long)]
        now: bool,
    },
    /// Show the active profile, or switch to another one
    ///
    /// Without NAME, prints the active profile (the one the next start uses), and the
    /// running engine's if that is another one. With NAME, makes it the active profile (it
    /// is kept across restarts of the daemon): a running engine is restarted with it once
    /// its in-flight requests have finished, and requests that arrive meanwhile wait for
    /// the new engine. When the daemon cannot save the choice (its state_dir is not
    /// writable), nothing changes and dsv4ctl exits 1 with the reason.
    Profile {
        /// The profile to switch to (see `dsv4ctl profiles`)
        name: Option<String>,
    },
    /// List the profiles
    ///
    /// Shows each profile's name, engine, context size and description; `*` marks the
    /// active one. With --json, prints the ListProfiles() JSON array.
    Profiles,
    /// Show the engine's output
    ///
    /// Prints the last lines the engine (llama-server, ds4-server) wrote, across engine
    /// restarts. With -f, keeps printing new lines until interrupted (Ctrl-C). The daemon's
    /// own log is in the journal: journalctl -u dsv4d.
    Logs {
        /// Keep printing new lines as the engine writes them
        #[arg(short, long)]
        follow: bool,
        /// How many of the last lines to print
        #[arg(short = 'n', long = "lines", value_name = "N", default_value_t = 50)]
        lines: u32,
    },
    /// Watch the engine and the host live
    ///
    /// A terminal view of the engine's state, the requests (each in flight with its phase,
    /// as in status; the finished ones by API, and the last one, ~ marking a rate timed by
    /// dsv4d's clock), memory and throttling, with
    /// sparklines of GTT, temperature, SoC power and the decode rate of the last requests,
    /// from the daemon's samples (the last ten minutes, then each new one). q, Esc or
    /// Ctrl-C quits. When standard output is not a terminal, prints a line per sample
    /// instead, until interrupted.
    Top,
    /// Turn the daemon's thermal events and alerts into desktop notifications
    ///
    /// Listens on the daemon's bus (--bus; the system bus by default) to ThermalEvent and
    /// Alert, and with --states to StateChanged (engine ready after a cold start, stopped),
    /// and shows each as a notification on the session bus (org.freedesktop.Notifications):
    /// critical temperatures with critical urgency, a follow-up replacing the earlier
    /// bubble. Runs until stopped; the daemon may start, stop and restart meanwhile. Meant
    /// for the user unit: systemctl --user enable --now dsv4-notify
    NotifyAgent {
        /// Also notify when the engine is ready after a cold start, and when it stops
        #[arg(long)]
        states: bool,
    },
    /// Validate the engine: decode and cold-prefill runs on the validation profile
    ///
    /// Asks the daemon (Validate(); root and the dsv4 group only) to switch to the
    /// validation profile by drain and restart, run each test --runs times cold
    /// (cache_prompt false on /completion): decode (256 generated tokens) and prefill (a
    /// prompt of exactly 4,096 tokens), for a profile with mmproj a test image's prefill
    /// and decode, and with --long N one prefill of exactly N tokens; then
    /// switch back to the profile that was active, whatever happens. Progress shows as it
    /// runs. Prints a table (test, mean, sample SD, runs, and the host's temperature, power
    /// and memory over each test), or with --json the result document, which the daemon
    /// also keeps in state_dir/validations/. --compare last (or a result file) shows the
    /// change per test and flags a drop beyond the noise (the larger of twice the pooled SD
    /// and 5%). Exits 1 when the run ended early (with the reason) or a drop was flagged.
    /// Client requests that arrive meanwhile wait and are served on the restored profile.
    /// Ctrl-C cancels the run (the daemon switches back).
    ///
    /// --matrix runs the suite on every cell of the profile's `matrix:` key (CPU power
    /// profiles, GPU levels, engine argument variants), each cell with its settings
    /// applied through the daemon's own power paths and the engine restarted with its
    /// arguments. Prints a row per cell (decode and prefill with their SD, warm and cold
    /// load, mean SoC power, joules per token, peak temperature, seconds throttled, GTT
    /// peak), a verdict (the cell with the fewest joules per token among those within the
    /// noise of the fastest decode) and the YAML change for the service profile, which is
    /// never applied by itself. A client request during a cell waits for its end; the matrix
    /// then pauses while the service profile serves, and goes on after engine.idle_timeout
    /// without requests.
    Validate {
        /// The validation profile
        #[arg(long, default_value = "64k")]
        profile: String,
        /// How many times each test runs
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=100))]
        runs: u32,
        /// Also one cold prefill of exactly N tokens (e.g. 262144), with its wall time
        #[arg(long, value_name = "N")]
        long: Option<u64>,
        /// Tokens of the prefill test [default: 4096]; shorter for a quick check on a slow
        /// engine, where its figure is less steady
        #[arg(long, value_name = "N")]
        prefill: Option<u64>,
        /// Compare with an earlier run: `last` (the daemon's previous run of the profile) or
        /// a result file
        #[arg(long, value_name = "PATH|last")]
        compare: Option<String>,
        /// Compare the settings of the profile's matrix: key, cell by cell
        #[arg(long)]
        matrix: bool,
        /// With --matrix, run only these values of an axis (a variant by its number from 1
        /// or its arguments); may be given for several axes, e.g. --only cpu=power-saver
        /// --only ub=2
        #[arg(long, value_name = "AXIS=VALUE[,VALUE]", requires = "matrix")]
        only: Vec<dsv4_client::validate::Narrowing>,
        /// Only the correctness canary (no load or speed tests): fixed prompts, greedy, with
        /// the engine's top log-probabilities, compared with the profile's reference
        #[arg(long, conflicts_with = "matrix")]
        canary: bool,
        /// Record this run's canary as the profile's reference (the first validation of a
        /// profile records it by itself)
        #[arg(long, conflicts_with = "matrix")]
        record: bool,
    },
    /// Each profile's correctness canary, or accept a drift
    ///
    /// dsv4d runs a profile's canary (docs/validation.md) by itself once the engine is idle
    /// after a start that found it changed. `canary` (or `canary list`) shows each profile's
    /// last: passed, drifted (where), or waiting for a quiet engine. `canary accept PROFILE`
    /// records that profile's drifted run as its reference, when the change is meant; a
    /// profile held by `canary.hold` serves again (root and the dsv4 group only).
    Canary {
        #[command(subcommand)]
        action: Option<CanaryAction>,
    },
    /// List or remove the saved KV caches (checkpoints)
    ///
    /// Profiles with kv_checkpoint save their engine's KV cache on every planned stop and
    /// get it back at the next start, so a long prompt is not prefilled again. `kv list`
    /// (the default) shows each checkpoint: its id, the profile that saved it, tokens, size,
    /// age and engine build; set-aside ones (never restored) with the reason. `kv drop
    /// WHAT` removes the checkpoints of a profile, one by id, or `all` (root and the dsv4
    /// group only). With --json, prints KvCheckpoints() or the removed ids.
    Kv {
        #[command(subcommand)]
        action: Option<KvAction>,
    },
    /// Check a configuration
    ///
    /// Reads supervisor.yaml and its profiles the way dsv4d does and prints every problem
    /// with its file, line, column and field, or a summary when there is none. Runs
    /// `dsv4d --check-config` (dsv4d next to dsv4ctl, or $DSV4D, or dsv4d in PATH); needs no
    /// running daemon.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Check this machine against everything dsv4 needs, and say how to fix what fails
    ///
    /// One line per check: ok, skip (could not look here), WARN or FAIL, what it found with
    /// its figures, and for a problem the exact fix. It checks, from the service's own place
    /// (as the dsv4 user inside dsv4.service's sandbox, through systemd-run; run it with
    /// sudo for that, else these run as you and it says so): the configuration; each
    /// profile's engine program, model files and vision projector; the state folder; the
    /// GPU's device nodes; the engine build (--version, and every extra_args flag against
    /// its --help); each model file's GGUF header; whether each profile fits in memory, by
    /// the daemon's own admission rule, with its margin; power-profiles-daemon's amdgpu_dpm
    /// action and the platform profile power-saver picks; and a dry run of the GPU-level
    /// helper (dsv4-sysfs@). As you: the kernel and firmware versions, amdgpu resets and
    /// GPU faults in this boot's kernel log, the IOMMU, the GTT ceiling (ttm.pages_limit)
    /// and the VRAM carve-out. Then the daemon over D-Bus, dsv4.socket, your membership of
    /// the dsv4 group, and the desktop notification agent. It changes nothing, unless
    /// --fix is given: then it writes the systemd drop-ins the checks offer (a model in a
    /// folder the dsv4 user cannot enter; the device nodes' groups), reloads systemd and
    /// checks again. See docs/doctor.md for every check. Exits 0 when no check failed, 1
    /// when one did. With --json, prints the checks as a JSON array.
    Doctor {
        /// The configuration to check [default: the one dsv4.service runs with, else
        /// /etc/dsv4/supervisor.yaml]
        #[arg(long, value_name = "FILE")]
        config: Option<std::path::PathBuf>,
        /// Write the drop-ins that fix what they can (needs root), then check again
        #[arg(long)]
        fix: bool,
        /// Run the service's checks as you, not in the service's sandbox
        #[arg(long)]
        no_sandbox: bool,
        /// Where --fix writes drop-ins
        #[arg(
            long,
            value_name = "DIR",
            default_value = "/etc/systemd/system",
            hide = true
        )]
        unit_dir: std::path::PathBuf,
        /// Read /sys and /proc below DIR (a fixture tree) [default: dsv4.service's --sysroot]
        #[arg(long, value_name = "DIR", hide = true)]
        sysroot: Option<std::path::PathBuf>,
        /// Read this saved kernel log instead of this boot's journal
        #[arg(long, value_name = "FILE")]
        kernel_log: Option<std::path::PathBuf>,
    },
    /// Print a shell completion script
    ///
    /// Prints the completion script for SHELL to standard output. For example, for bash:
    /// dsv4ctl completions bash > /etc/bash_completion.d/dsv4ctl
    Completions {
        /// The shell to write completions for
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), for packages: dsv4ctl man > dsv4ctl.1
    #[command(hide = true)]
    Man,
}

#[derive(Debug, Subcommand)]
enum KvAction {
    /// List the checkpoints on disk
    List,
    /// Remove checkpoints: WHAT is a profile name, a checkpoint id, or `all`
    Drop {
        #[arg(value_name = "WHAT")]
        what: String,
    },
}

#[derive(Debug, Subcommand)]
enum CanaryAction {
    /// Each profile's last canary
    List,
    /// Record PROFILE's drifted canary as its reference
    Accept {
        #[arg(value_name = "PROFILE")]
        profile: String,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Check FILE (default /etc/dsv4/supervisor.yaml) with its drop-ins
    /// (FILE.d/*.yaml): exit 0 when valid, 1 when not
    Check {
        /// The supervisor.yaml to check
        #[arg(value_name = "FILE")]
        file: Option<std::path::PathBuf>,
        /// Also print the file with its drop-ins laid over it, each value with the file and
        /// line it comes from
        #[arg(long)]
        merged: bool,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => ExitCode::from(f.report()),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let json = cli.json;
    if let Command::Man = cli.command {
        let mut page = Vec::new();
        clap_mangen::Man::new(Cli::command())
            .render(&mut page)
            .map_err(|e| Failure::Failed(format!("writing the manual page: {e}")))?;
        return write_out(&page);
    }
    if let Command::Completions { shell } = cli.command {
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut Cli::command(), "dsv4ctl", &mut script);
        return write_out(&script);
    }
    if let Command::Config {
        action: ConfigAction::Check { file, merged },
    } = cli.command
    {
        return config_check(file, merged);
    }
    let bus = resolve_bus(cli.bus, std::env::var("DSV4_BUS").ok().as_deref())?;
    if let Command::Doctor {
        config,
        fix,
        no_sandbox,
        unit_dir,
        sysroot,
        kernel_log,
    } = cli.command
    {
        let req = doctor::Request {
            config,
            fix,
            no_sandbox,
            sysroot,
            kernel_log,
            unit_dir,
            bus,
        };
        return doctor::run(req, json).await;
    }
    if let Command::NotifyAgent { states } = cli.command {
        // It waits for the daemon rather than requiring it.
        return notify::run(bus, states).await;
    }
    let daemon = Daemon::connect(bus).await?;
    match cli.command {
        Command::Status => status(&daemon, json).await,
        Command::Start { wait, timeout } => start(&daemon, json, wait, timeout).await,
        Command::Stop { now } => stop(&daemon, json, now).await,
        Command::Profile { name: None } => show_profile(&daemon, json).await,
        Command::Profile { name: Some(name) } => set_profile(&daemon, json, &name).await,
        Command::Profiles => profiles(&daemon, json).await,
        Command::Logs { follow, lines } => logs(&daemon, json, follow, lines).await,
        Command::Top => top::run(&daemon).await,
        Command::Kv { action } => kv(&daemon, json, action.unwrap_or(KvAction::List)).await,
        Command::Canary { action } => {
            canary(&daemon, json, action.unwrap_or(CanaryAction::List)).await
        }
        Command::Validate {
            profile,
            runs,
            long,
            prefill,
            compare,
            matrix,
            only,
            canary,
            record,
        } => {
            let req = dsv4_client::validate::ValidateRequest {
                profile: Some(profile),
                runs,
                long,
                prefill,
                matrix,
                only,
                canary_only: canary,
                record,
            };
            validate(&daemon, json, req, compare).await
        }
        Command::Completions { .. }
        | Command::Config { .. }
        | Command::Doctor { .. }
        | Command::NotifyAgent { .. }
        | Command::Man => {
            unreachable!("handled above")
        }
    }
}

/// `config check`: the daemon's own loader judges, through `dsv4d --check-config`, so the
/// CLI needs none of the daemon's code and the two can never disagree.
fn config_check(file: Option<std::path::PathBuf>, merged: bool) -> Result<(), Failure> {
    use std::path::PathBuf;
    let dsv4d = doctor::dsv4d_path();
    let file = file.unwrap_or_else(|| PathBuf::from("/etc/dsv4/supervisor.yaml"));
    let mut command = std::process::Command::new(&dsv4d);
    command.arg("--check-config").arg("--config").arg(&file);
    if merged {
        command.arg("--merged");
    }
    let status = command.status().map_err(|e| {
        Failure::Usage(format!(
            "cannot run {}: {e} (set DSV4D to the path of dsv4d)",
            dsv4d.display()
        ))
    })?;
    match status.code() {
        Some(0) => Ok(()),
        Some(1) => Err(Failure::Failed(format!(
            "{} has problems (listed above)",
            file.display()
        ))),
        _ => Err(Failure::Usage(format!(
            "{} --check-config failed: {status}",
            dsv4d.display()
        ))),
    }
}

/// `--bus`, else `$DSV4_BUS`, else the system bus.
fn resolve_bus(flag: Option<Bus>, env: Option<&str>) -> Result<Bus, Failure> {
    if let Some(bus) = flag {
        return Ok(bus);
    }
    match env.map(str::trim) {
        None | Some("") => Ok(Bus::System),
        Some(v) => Bus::from_str(v, true)
            .map_err(|_| Failure::Usage(format!("DSV4_BUS must be system or session, not {v:?}"))),
    }
}

async fn status(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let s = daemon.status().await?;
    if json {
        print_json(&s)
    } else {
        print(&render::status_table(&s, unix_now()))
    }
}

async fn start(
    daemon: &Daemon,
    json: bool,
    wait: bool,
    timeout: Option<Duration>,
) -> Result<(), Failure> {
    if wait {
        wait_ready(daemon, timeout, !json).await?;
        return if json {
            print_json(&daemon.status().await?)
        } else {
            Ok(())
        };
    }
    daemon.start().await?;
    let s = daemon.status().await?;
    if json {
        return print_json(&s);
    }
    let e = &s.engine;
    match e.state {
        State::Ready => println_out(&format!(
            "the engine is ready (profile {})",
            e.engine_profile.as_deref().unwrap_or(&e.profile)
        )),
        _ => println_out(&format!(
            "starting the engine (profile {}); `dsv4ctl start --wait` waits until it is ready",
            e.profile
        )),
    }
}

/// `StartAndWait()`, showing the states the daemon announces meanwhile (unless `show` is
/// false), bounded by `timeout` when given.
async fn wait_ready(daemon: &Daemon, timeout: Option<Duration>, show: bool) -> Result<(), Failure> {
    let t0 = Instant::now();
    let mut progress = Progress::new(show);
    // Subscribed before the call, so no change in between is missed.
    let mut changes = daemon.state_changes().await?;
    let now = daemon.status().await?;
    progress.state(now.engine.state, &shown_profile(&now.engine), t0.elapsed())?;
    let call = daemon.start_and_wait();
    tokio::pin!(call);
    let give_up = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(give_up);
    loop {
        tokio::select! {
            answer = &mut call => {
                return match answer {
                    Ok(_) => progress.ready(t0.elapsed()),
                    Err(e) => {
                        progress.clear();
                        Err(e)
                    }
                };
            }
            Some(change) = changes.next() => {
                if let Ok(args) = change.args() {
                    progress.state(args.state, args.profile, t0.elapsed())?;
                }
            }
            () = &mut give_up => {
                progress.clear();
                let state = match daemon.status().await {
                    Ok(s) => s.engine.state.to_string(),
                    Err(_) => "unknown".into(),
                };
                return Err(Failure::Failed(format!(
                    "the engine was not ready within {} (state: {state})",
                    dsv4_client::duration::brief(t0.elapsed())
                )));
            }
        }
    }
}

/// The profile a state is about: the running engine's, else the active one.
fn shown_profile(s: &EngineStatus) -> String {
    s.engine_profile
        .clone()
        .unwrap_or_else(|| s.profile.clone())
}

/// The progress of `start --wait`: a spinner on a terminal, else a line per state change.
struct Progress {
    spinner: Option<indicatif::ProgressBar>,
    show: bool,
    last: Option<State>,
}

impl Progress {
    fn new(show: bool) -> Progress {
        let spinner = (show && std::io::stdout().is_terminal()).then(|| {
            let pb = indicatif::ProgressBar::with_draw_target(
                None,
                indicatif::ProgressDrawTarget::stdout(),
            );
            pb.set_style(
                indicatif::ProgressStyle::with_template("{spinner} {msg}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
            );
            pb.enable_steady_tick(Duration::from_millis(100));
            pb
        });
        Progress {
            spinner,
            show,
            last: None,
        }
    }

    fn state(&mut self, state: State, profile: &str, elapsed: Duration) -> Result<(), Failure> {
        if let Some(pb) = &self.spinner {
            pb.set_message(format!(
                "{state} (profile {profile}) {}",
                dsv4_client::duration::brief(elapsed)
            ));
            return Ok(());
        }
        // `stopped` and `backoff` are where a start begins, not progress.
        let progress = !matches!(state, State::Stopped | State::Backoff);
        if self.show && progress && self.last != Some(state) {
            self.last = Some(state);
            println_out(state.as_str())?;
        }
        Ok(())
    }

    fn ready(&mut self, elapsed: Duration) -> Result<(), Failure> {
        self.clear();
        if self.show {
            println_out(&format!(
                "ready after {}",
                dsv4_client::duration::brief(elapsed)
            ))?;
        }
        Ok(())
    }

    fn clear(&mut self) {
        if let Some(pb) = self.spinner.take() {
            pb.finish_and_clear();
        }
    }
}

async fn stop(daemon: &Daemon, json: bool, now: bool) -> Result<(), Failure> {
    let before = daemon.status().await?;
    if now {
        daemon.stop_now().await?;
    } else {
        daemon.stop().await?;
    }
    if json {
        return print_json(&daemon.status().await?);
    }
    let before = &before.engine;
    let text = match before.state {
        State::Stopped => "the engine is not running".to_string(),
        State::Backoff => "stopped (the retry after the failed start is called off)".to_string(),
        _ if now => "stopping now (in-flight requests are cut off)".to_string(),
        _ if before.in_flight > 0 => format!(
            "stopping (in-flight requests finish first)\n{} in flight",
            before.in_flight
        ),
        _ => "stopping (in-flight requests finish first)".to_string(),
    };
    println_out(&text)
}

async fn show_profile(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let s = daemon.status().await?.engine;
    if json {
        return print_json(&serde_json::json!({
            "profile": s.profile,
            "engine_profile": s.engine_profile,
        }));
    }
    println_out(&render::active_profile(&s))
}

async fn set_profile(daemon: &Daemon, json: bool, name: &str) -> Result<(), Failure> {
    let before = daemon.status().await?;
    daemon.set_profile(name).await?;
    if json {
        return print_json(&daemon.status().await?);
    }
    println_out(&set_profile_text(&before.engine, name))
}

/// What `dsv4ctl profile NAME` says happened, from the state before `SetProfile(NAME)`.
fn set_profile_text(before: &EngineStatus, name: &str) -> String {
    let running = matches!(before.state, State::Ready | State::Starting);
    if running && before.engine_profile.as_deref() == Some(name) {
        format!("profile {name}: the running engine already uses it")
    } else if running {
        format!(
            "profile {name}: the running engine restarts with it once in-flight requests finish"
        )
    } else {
        format!("profile {name}: applies at the next start")
    }
}

async fn validate(
    daemon: &Daemon,
    json: bool,
    req: dsv4_client::validate::ValidateRequest,
    compare: Option<String>,
) -> Result<(), Failure> {
    // What to compare with is found before the run adds itself to the daemon's list.
    let earlier = earlier_validation(daemon, &req, compare.as_deref()).await?;
    // Subscribed before the call, so nothing it says is missed.
    let signals = daemon.validation_signals().await?;
    let owner = daemon.owner().await;
    let asked_at = unix_now();
    let profile = daemon.validate(&req).await?;
    eprintln!(
        "dsv4ctl: validating profile {profile} ({} runs per test)",
        req.runs
    );
    let result = validation_result(daemon, signals, owner, (&profile, asked_at)).await?;
    let comparison = earlier.as_ref().map(|e| match (&e.matrix, &result.matrix) {
        (Some(before), Some(now)) => {
            let cells = dsv4_client::validate::compare_cells(before, now);
            let flat = cells
                .iter()
                .flat_map(|(cell, c)| {
                    c.iter().map(|c| dsv4_client::validate::Comparison {
                        name: format!("cell {} {}", cell.index, c.name),
                        ..c.clone()
                    })
                })
                .collect();
            (e, flat, Some(render::matrix_comparison(e, &cells)))
        }
        _ => (e, dsv4_client::validate::compare(e, &result), None),
    });
    if json {
        print_json(&result)?;
    } else {
        match &result.matrix {
            Some(m) => print(&render::matrix_table(&result, m))?,
            None => print(&render::validation_table(&result))?,
        }
        match &comparison {
            Some((_, _, Some(text))) => print(text)?,
            Some((e, c, None)) => print(&render::comparison_table(e, c))?,
            None => {}
        }
    }
    validation_verdict(&result, comparison.as_ref().map(|(_, c, _)| c.as_slice()))
}

/// The daemon's validation signals, subscribed to: its progress and its results.
type ValidationSignals = (
    dsv4_client::ValidationProgressStream,
    dsv4_client::ValidationDoneStream,
);

/// The earlier result a validation is compared with (`--compare last` or a file), if asked.
async fn earlier_validation(
    daemon: &Daemon,
    req: &dsv4_client::validate::ValidateRequest,
    compare: Option<&str>,
) -> Result<Option<dsv4_client::validate::ValidationResult>, Failure> {
    let profile = req.profile.clone().unwrap_or_default();
    match compare {
        None => Ok(None),
        Some("last") => daemon
            .validations(&profile)
            .await?
            .into_iter()
            // A matrix is compared with a matrix, a plain run with a plain run.
            .find(|r| r.matrix.is_some() == req.matrix)
            .map(Some)
            .ok_or_else(|| {
                let kind = if req.matrix { "matrix" } else { "validation" };
                Failure::Failed(format!(
                    "no earlier {kind} of profile {profile} to compare with"
                ))
            }),
        Some(path) => {
            let text = std::fs::read(path)
                .map_err(|e| Failure::Usage(format!("cannot read {path}: {e}")))?;
            serde_json::from_slice(&text)
                .map(Some)
                .map_err(|e| Failure::Usage(format!("{path} is not a validation result: {e}")))
        }
    }
}

/// The result of the validation of `profile` asked for at `asked_at`, its progress printed
/// as it comes; Ctrl-C cancels it (the daemon switches back), and a daemon that went away
/// is told.
async fn validation_result(
    daemon: &Daemon,
    (mut progress, mut done): ValidationSignals,
    owner: Option<String>,
    (profile, asked_at): (&str, f64),
) -> Result<dsv4_client::validate::ValidationResult, Failure> {
    use dsv4_client::validate::{Progress, ValidationResult};
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut cancelled = false;
    // A daemon that dies sends no ValidationDone: it is asked after each quiet while.
    let mut alive = tokio::time::interval(Duration::from_secs(2));
    alive.tick().await;
    loop {
        tokio::select! {
            _ = alive.tick() => {
                // Gone, or replaced by another dsv4d (which never ran this validation).
                if daemon.owner().await != owner {
                    return Err(Failure::Unreachable(
                        "dsv4d went away during the validation; its next start goes back to \
                         the profile that was active before it".into(),
                    ));
                }
            }
            Some(p) = progress.next() => {
                if let Ok(p) = p.args().map(|a| a.progress.to_string()) {
                    if let Ok(p) = serde_json::from_str::<Progress>(&p) {
                        eprintln!("dsv4ctl: {}", dsv4_client::text::printable(&p.message));
                    }
                }
            }
            Some(d) = done.next() => {
                let Ok(text) = d.args().map(|a| a.result.to_string()) else { continue };
                match serde_json::from_str::<ValidationResult>(&text) {
                    // Another run's end (one that ended as this one was asked for).
                    Ok(r) if r.profile != profile || r.started < asked_at - 1.0 => continue,
                    Ok(r) => return Ok(r),
                    Err(e) => return Err(Failure::Failed(format!(
                        "dsv4d sent a validation result dsv4ctl does not understand: {e}"
                    ))),
                }
            }
            _ = &mut ctrl_c, if !cancelled => {
                cancelled = true;
                eprintln!("dsv4ctl: cancelling; the daemon switches back");
                daemon.cancel_validation().await?;
            }
            else => return Err(Failure::Unreachable("the daemon's signals stopped".into())),
        }
    }
}

/// A validation's exit: failed when it ended early, when a cell failed, or when a test was
/// slower than the earlier run (`compared`) beyond the noise.
fn validation_verdict(
    result: &dsv4_client::validate::ValidationResult,
    compared: Option<&[dsv4_client::validate::Comparison]>,
) -> Result<(), Failure> {
    if let Some(why) = &result.error {
        return Err(Failure::Failed(format!(
            "the validation ended early: {why}; profile {} is active again",
            result.previous_profile
        )));
    }
    if let Some(d) = result.canary.as_ref().and_then(|c| c.drift.as_ref()) {
        return Err(Failure::Failed(format!(
            "the answers changed: {d}; if the change is meant (a new model, a fixed \
             engine), record the new reference with dsv4ctl validate --canary --record"
        )));
    }
    let failed: Vec<String> = result
        .matrix
        .iter()
        .flat_map(|m| &m.cells)
        .filter(|c| c.error.is_some())
        .map(|c| c.index.to_string())
        .collect();
    if !failed.is_empty() {
        return Err(Failure::Failed(format!(
            "cells that failed: {} (the table says why)",
            failed.join(", ")
        )));
    }
    let slower: Vec<String> = compared
        .unwrap_or_default()
        .iter()
        .filter(|c| c.flagged)
        .map(|c| format!("{} ({:+.1}%)", c.name, c.change_pct))
        .collect();
    if !slower.is_empty() {
        return Err(Failure::Failed(format!(
            "slower than the earlier run beyond the noise: {}",
            slower.join(", ")
        )));
    }
    Ok(())
}

async fn kv(daemon: &Daemon, json: bool, action: KvAction) -> Result<(), Failure> {
    match action {
        KvAction::List => {
            let list = daemon.kv_checkpoints().await?;
            match json {
                true => print_json(&list),
                false => print(&render::kv_table(&list, unix_now())),
            }
        }
        KvAction::Drop { what } => {
            let gone = daemon.drop_kv(&what).await?;
            match json {
                true => print_json(&gone),
                false => print(&format!("removed: {}\n", gone.join(", "))),
            }
        }
    }
}

async fn canary(daemon: &Daemon, json: bool, action: CanaryAction) -> Result<(), Failure> {
    match action {
        CanaryAction::List => {
            let checks = daemon.status().await?.canary;
            match json {
                true => print_json(&checks),
                false => print(&render::canary_lines(&checks)),
            }
        }
        CanaryAction::Accept { profile } => {
            let done = daemon.canary_accept(&profile).await?;
            match json {
                true => print_json(&serde_json::json!({ "accepted": profile, "said": done })),
                false => print(&format!("{done}\n")),
            }
        }
    }
}

async fn profiles(daemon: &Daemon, json: bool) -> Result<(), Failure> {
    let list = daemon.list_profiles().await?;
    if json {
        print_json(&list)
    } else {
        print(&render::profiles_table(&list))
    }
}

async fn logs(daemon: &Daemon, json: bool, follow: bool, lines: u32) -> Result<(), Failure> {
    let (mut next, batch) = daemon.logs(0, lines).await?;
    if !follow {
        if json {
            print_json(&serde_json::json!({ "next": next, "lines": batch }))?;
        } else {
            print_lines(&batch, false)?;
        }
        eprintln!("dsv4ctl: the daemon's own log: journalctl -u dsv4d");
        return Ok(());
    }
    print_lines(&batch, json)?;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        // Answered as soon as the engine writes a line (or after FOLLOW_WAIT with none).
        let (mut after, mut batch) = tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            answer = daemon.wait_logs(next, FOLLOW_MAX, FOLLOW_WAIT) => answer?,
        };
        if after < next {
            // The numbers went back: the daemon restarted; its lines count from 0 again.
            (after, batch) = daemon.logs(0, FOLLOW_MAX).await?;
        }
        next = after;
        print_lines(&batch, json)?;
    }
}

/// Lines as they are, or (with --json) one JSON string per line.
fn print_lines(lines: &[String], json: bool) -> Result<(), Failure> {
    let mut out = String::new();
    for l in lines {
        if json {
            out.push_str(&serde_json::Value::from(l.as_str()).to_string());
        } else {
            out.push_str(l);
        }
        out.push('\n');
    }
    print(&out)
}

pub(crate) fn print_json<T: serde::Serialize>(v: &T) -> Result<(), Failure> {
    let text = serde_json::to_string_pretty(v)
        .map_err(|e| Failure::Failed(format!("cannot write JSON: {e}")))?;
    println_out(&text)
}

pub(crate) fn println_out(s: &str) -> Result<(), Failure> {
    print(&format!("{s}\n"))
}

/// Everything dsv4ctl prints for people goes through here: the daemon's text can hold an
/// engine's output, which can echo a client's, so control characters (ESC sequences,
/// carriage returns) never reach the terminal. (JSON output has them escaped already.)
fn print(s: &str) -> Result<(), Failure> {
    write_out(dsv4_client::text::printable(s).as_bytes())
}

fn write_out(bytes: &[u8]) -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    out.write_all(bytes)
        .and_then(|()| out.flush())
        .map_err(error::output)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn the_bus_comes_from_the_flag_then_the_environment() {
        assert_eq!(resolve_bus(None, None), Ok(Bus::System));
        assert_eq!(resolve_bus(None, Some("")), Ok(Bus::System));
        assert_eq!(resolve_bus(None, Some("session")), Ok(Bus::Session));
        assert_eq!(
            resolve_bus(Some(Bus::System), Some("session")),
            Ok(Bus::System)
        );
        let bad = resolve_bus(None, Some("user")).unwrap_err();
        assert_eq!(bad.exit_code(), 2);
        assert_eq!(
            bad.message().unwrap(),
            "DSV4_BUS must be system or session, not \"user\""
        );
    }

    #[test]
    fn usage() {
        let cli = Cli::try_parse_from([
            "dsv4ctl",
            "start",
            "--wait",
            "--timeout",
            "90s",
            "--bus",
            "session",
        ])
        .unwrap();
        assert_eq!(cli.bus, Some(Bus::Session));
        assert!(matches!(
            cli.command,
            Command::Start { wait: true, timeout: Some(t) } if t == Duration::from_secs(90)
        ));
        assert!(Cli::try_parse_from(["dsv4ctl", "start", "--timeout", "9s"]).is_err());
        let cli = Cli::try_parse_from(["dsv4ctl", "--json", "logs", "-fn", "5"]).unwrap();
        assert!(cli.json);
        assert!(matches!(
            cli.command,
            Command::Logs {
                follow: true,
                lines: 5
            }
        ));
        let cli = Cli::try_parse_from(["dsv4ctl", "logs"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Logs {
                follow: false,
                lines: 50
            }
        ));
        let e = Cli::try_parse_from(["dsv4ctl", "frobnicate"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn what_set_profile_says() {
        let mut s = EngineStatus::stopped("320k");
        s.state = State::Ready;
        s.engine_profile = Some("320k".into());
        assert_eq!(
            set_profile_text(&s, "64k"),
            "profile 64k: the running engine restarts with it once in-flight requests finish"
        );
        assert_eq!(
            set_profile_text(&s, "320k"),
            "profile 320k: the running engine already uses it"
        );
        s.state = State::Stopped;
        s.engine_profile = None;
        assert_eq!(
            set_profile_text(&s, "64k"),
            "profile 64k: applies at the next start"
        );
    }
}
