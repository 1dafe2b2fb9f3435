//! `dsv4d`: the supervisor daemon.
//!
//! Reads the config, takes the API socket (socket activation or `api.listen`), starts the
//! lifecycle actor and the HTTP front, and on SIGTERM/SIGINT drains and stops the engine
//! before it exits 0.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use dsv4::cli::Args;
use dsv4::config::Config;
use dsv4::control::dbus;
use dsv4::control::reload::Reloader;
use dsv4::host::state_file;
use dsv4::host::sysroot::SysRoot;
use dsv4::http::ctx::Ctx;
use dsv4::http::listener::{self, Origin};
use dsv4::http::serve;
use dsv4::lifecycle::alert::Alerts;
use dsv4::lifecycle::engine_key::KeyFolder;
use dsv4::lifecycle::Services;
use dsv4::observe::stats::Stats;
use dsv4::parts::Parts;
use tokio::signal::unix::{signal, SignalKind};

/// How long an engine a previous dsv4d left running gets between SIGTERM and SIGKILL. Short:
/// clients may be waiting for this daemon, and the engine had no one to serve.
const LEFTOVER_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Log lines that may wait for the log writer.
const LOG_QUEUE_LINES: usize = 4096;
/// Bytes the log writer gathers before it must write (it writes sooner, once its queue is
/// empty); a longer line goes out on its own.
const LOG_WRITE_BUFFER: usize = 64 * 1024;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if args.check_config {
        return check_config(&args.config, args.merged);
    }
    if args.doctor {
        return doctor(&args);
    }
    // Before any thread exists (the log writer is one): taking the activation fds edits the
    // environment.
    // SAFETY: no other thread exists yet (the runtime and the log writer start below), and
    // this is the only call.
    let activated = unsafe { listener::take_activation_fds() };
    let log = init_logging();
    // Everything dsv4d and its engine write (state, KV checkpoints, the engine's secret) is
    // its user's alone, whatever umask it was started with (the unit sets the same).
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    // Each client connection is a file: the common default soft limit (1,024) is too low.
    dsv4::http::connections::raise_nofile_limit();
    let activated = match activated {
        Ok(fds) => fds,
        Err(e) => return fail(e),
    };
    // One thread: the proxy carries a handful of connections to a one-slot engine, and one
    // thread saves every cross-thread wake-up (measured: lower added latency than the
    // multi-threaded runtime on two cores). It is also the thread that forks the engine, so
    // the engine's parent-death signal is tied to the daemon's life.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(anyhow::Error::new(e).context("starting the async runtime")),
    };
    let socket_activated = !activated.is_empty();
    let result = runtime.block_on(run(args, activated));
    // A blocking read that never returns (a stalled sysfs file) must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match result {
        Ok(Ended::Done) => std::process::ExitCode::SUCCESS,
        Ok(Ended::StartAfresh(fd)) => {
            // Every line written before the program is replaced.
            drop(log);
            let e = dsv4::control::unusable::exec_again(fd);
            fail(anyhow::Error::new(e).context("starting dsv4d afresh on its socket"))
        }
        // EX_CONFIG (sysexits.h): the unit's RestartPreventExitStatus=78 keeps systemd from
        // starting it again and again on a configuration that cannot work until it is edited.
        Err(e) if e.is::<ConfigInvalid>() && !socket_activated => {
            fail(e);
            std::process::ExitCode::from(EX_CONFIG)
        }
        Err(e) => fail(e),
    }
}

/// The exit code for a configuration that cannot be used (sysexits.h's EX_CONFIG).
const EX_CONFIG: u8 = 78;

/// The configuration's problems, as the loader lists them.
#[derive(Debug)]
struct ConfigInvalid(String);

impl std::fmt::Display for ConfigInvalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigInvalid {}

fn check_config(path: &std::path::Path, merged: bool) -> std::process::ExitCode {
    // The merged settings first, when asked for: the verdict stays the last thing said.
    if merged {
        match Config::merged(path) {
            Ok(text) => {
                println!("# {} with its drop-ins, as read:", path.display());
                print!("{text}");
                println!();
            }
            Err(_) => println!("# no merged settings: a file cannot be read (below)\n"),
        }
    }
    match Config::load_to_check(path) {
        Ok(config) => {
            println!("{}", config.summary());
            std::process::ExitCode::SUCCESS
        }
        Err(problems) => {
            // Run by the unit's ExecReload=, its output is the journal's: at error priority.
            let prefix = if dsv4::control::log_format::stdout_is_journal() {
                dsv4::control::log_format::priority(&tracing::Level::ERROR)
            } else {
                ""
            };
            for line in problems.to_string().lines() {
                println!("{prefix}{line}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// `--doctor`: the checks as a JSON array on stdout.
fn doctor(args: &Args) -> std::process::ExitCode {
    use dsv4::doctor::{Options, Verdict};
    let sysroot = match SysRoot::new(&args.sysroot) {
        Ok(root) => root,
        Err(e) => return fail(anyhow::Error::new(e).context("--sysroot")),
    };
    let opts = Options {
        config: args.config.clone(),
        sysroot,
        kernel_log: args.kernel_log.clone(),
        part: args.part,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(anyhow::Error::new(e).context("starting the async runtime")),
    };
    let checks = runtime.block_on(dsv4::doctor::run(&opts));
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    match serde_json::to_string_pretty(&checks) {
        Ok(json) => println!("{json}"),
        Err(e) => return fail(anyhow::Error::new(e).context("writing the checks")),
    }
    if dsv4_client::doctor::worst(&checks) == Verdict::Fail {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}

fn fail(e: anyhow::Error) -> std::process::ExitCode {
    tracing::error!("{e:#}");
    eprintln!("dsv4d: {e:#}");
    std::process::ExitCode::FAILURE
}

/// Logs go to stderr, or to the journal under systemd, from a thread of their own, so that
/// the engine's chatter (llama-server logs several lines per request) never makes a request
/// wait for a write. Nothing is dropped: a full queue makes the logger wait instead. The
/// returned guard writes what is left when `main` ends.
fn init_logging() -> dsv4::log::sink::Guard {
    use dsv4::control::log_format;
    use dsv4::log::{journal, sink};
    use std::io::IsTerminal;
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    // `DSV4_LOG`: a level, and `target=level` directives (`debug,dsv4::http=trace`), read
    // by tracing-subscriber's `Targets`, which needs no regex engine.
    let spec = std::env::var("DSV4_LOG").unwrap_or_default();
    let info = || Targets::new().with_default(LevelFilter::INFO);
    let mut filter = match spec.trim() {
        "" => info(),
        given => given.parse::<Targets>().unwrap_or_else(|e| {
            eprintln!("dsv4d: DSV4_LOG={given:?} is not a log filter ({e}); logging at info");
            info()
        }),
    };
    // The file watcher traces every event in the watched folders, the writes of a log file
    // kept there among them: at `trace` each line it logged made another event, a loop that
    // took half a core. It stays at info unless DSV4_LOG names it.
    if !spec.contains("notify") {
        filter = filter.with_target("notify", LevelFilter::INFO);
    }
    // Under journald (stderr is its stream, and its native socket takes entries), each event
    // is an entry with its priority and fields; else text on stderr.
    let to_journal = log_format::stderr_is_journal();
    let socket = to_journal.then(sink::connect_journal).flatten();
    // The queue holds this many events; a burst longer than this waits for the writer.
    let native = socket.is_some();
    let (sink, guard) = sink::start(LOG_QUEUE_LINES, LOG_WRITE_BUFFER, socket);
    if native {
        tracing_subscriber::registry()
            .with(journal::JournalLayer::new(sink))
            .with(filter)
            .init();
        return guard;
    }
    // Colours only on a terminal, and not when NO_COLOR is set (no-color.org); a journal
    // stream whose socket is closed to us gets each line with its priority, without a time.
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let format = if to_journal {
        log_format::LogFormat::journal()
    } else {
        log_format::LogFormat::new()
    };
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(sink)
        .with_ansi(std::io::stderr().is_terminal() && !no_color && !to_journal)
        // Reporting a failed log write is itself a write to stderr, and one that panics when
        // stderr is gone (a closed pipe): a daemon must outlive its log reader. (Kept by the
        // layer when the format changes next.)
        .log_internal_errors(false)
        .event_format(format);
    tracing_subscriber::registry().with(fmt).with(filter).init();
    guard
}

/// The profile remembered from the last `SetProfile`, when it is still configured; else
/// `default_profile`.
fn active_profile(config: &Config) -> String {
    let default = &config.supervisor.default_profile;
    match state_file::load_profile(&config.supervisor.state_dir) {
        Some(p) if config.profile(&p).is_some() => {
            if &p != default {
                tracing::info!("using profile {p}, chosen earlier (default_profile is {default})");
            }
            p
        }
        Some(p) => {
            tracing::warn!(
                "profile {p}, chosen earlier, is not configured any more; using {default}"
            );
            default.clone()
        }
        None => default.clone(),
    }
}

/// The daemon: built, then serving until a signal or its idle exit, then stopping.
/// How a run ended.
enum Ended {
    Done,
    /// The configuration was unusable at start and loads now: execute dsv4d again on this
    /// socket (the activated API socket, kept open).
    StartAfresh(std::os::fd::RawFd),
}

async fn run(args: Args, activated: Vec<(std::os::fd::OwnedFd, String)>) -> Result<Ended> {
    // Socket-activated, a client already waits: it and every next one get the reason, not an
    // empty reply (see control::unusable).
    if !activated.is_empty() {
        if let Err(problems) = Config::load(&args.config) {
            let problems = problems.to_string();
            tracing::error!(
                "the configuration cannot be used; every request gets 503 config_invalid \
                 until it is fixed: {problems}"
            );
            let (std_listener, _) = listener::api_listener(activated, "")?;
            let listener = tokio::net::TcpListener::from_std(std_listener)
                .context("serving the activated socket")?;
            dsv4::control::unusable::serve(&listener, args.bus.0, &args.config, problems).await;
            let fd = std::os::fd::IntoRawFd::into_raw_fd(
                listener
                    .into_std()
                    .context("keeping the activated socket")?,
            );
            return Ok(Ended::StartAfresh(fd));
        }
    }
    let daemon = build(args, activated).await?;
    let stopping = daemon.serve().await?;
    stopping.shutdown().await;
    Ok(Ended::Done)
}

/// A daemon built and not yet serving: its listener, and its parts running.
struct Daemon {
    listener: tokio::net::TcpListener,
    origin: Origin,
    /// The configuration it started with (`exit_when_idle` is read once).
    config: Arc<Config>,
    ctx: Arc<Ctx>,
    actor: tokio::task::JoinHandle<()>,
    /// Kept for the daemon's life: dropping it leaves the bus.
    control: Option<zbus::Connection>,
    /// The peers port is dsv4d's own (bound from `peers.listen`, not passed by systemd):
    /// nobody would answer there after an idle exit.
    peers_own: bool,
}

/// A daemon that stopped serving: what its stop needs.
struct Stopping {
    ctx: Arc<Ctx>,
    actor: tokio::task::JoinHandle<()>,
    control: Option<zbus::Connection>,
    /// Resolves once every client connection has closed.
    connections_closed: std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>,
}

/// Reads the configuration, takes the API socket, ends what a previous dsv4d left running,
/// and starts the lifecycle actor, the monitor, the policies and the control interface.
async fn build(args: Args, mut activated: Vec<(std::os::fd::OwnedFd, String)>) -> Result<Daemon> {
    let config = Config::load(&args.config).map_err(|e| ConfigInvalid(e.to_string()))?;
    let config = Arc::new(config);
    let sysroot = SysRoot::new(&args.sysroot)?;
    if sysroot != SysRoot::default() {
        tracing::info!("reading /proc and /sys below {}", sysroot.root().display());
    }
    let (peers_listener, peers_own) = peers_listener(&config, &mut activated)?;
    let (listener, origin) = listen(&args, &config, activated)?;
    let key_folder = clean_slate(&config).await?;
    let alerts = Alerts::default();
    // The configuration in force, in one place: replaced by reloads (SIGHUP, or an edited
    // file), read from here by everything that uses it.
    let (config_tx, config_rx) = tokio::sync::watch::channel(config.clone());
    let (parts, actor, redact) = spawn_parts(&config, config_rx, sysroot, key_folder, &alerts);
    let activity = dsv4::http::connections::Activity::default();
    let control = match args.bus.0 {
        Some(bus) => {
            let own = dbus::Control {
                activity: activity.clone(),
                group: dbus::ControlGroup::lookup(&args.control_group),
                alerts: alerts.subscribe(),
            };
            Some(dbus::serve(bus, parts.clone(), own).await?)
        }
        None => None,
    };
    tokio::spawn(
        Reloader {
            path: args.config.clone(),
            config: config_tx,
            alerts: alerts.clone(),
        }
        .run(),
    );
    use dsv4::http::auth::{KeyCache, KeyFile};
    let peer_keys = Arc::new(KeyCache::new(KeyFile::Peers, redact.clone()));
    let ctx = Arc::new(Ctx {
        parts,
        api_keys: KeyCache::new(KeyFile::Api, redact.clone()),
        admin_keys: KeyCache::new(KeyFile::Admin, redact),
        bodies: Default::default(),
        connections: Default::default(),
        activity,
        closing: Default::default(),
        alerts,
        watchers: Default::default(),
    });
    if let Some(l) = peers_listener {
        let peers = dsv4::http::peers::Peers {
            lifecycle: ctx.parts.lifecycle.clone(),
            config: ctx.parts.config.clone(),
            holders: ctx.parts.holders.clone(),
            keys: peer_keys.clone(),
            telemetry: ctx.parts.telemetry.clone(),
            thermal: ctx.parts.thermal.clone(),
            doctor: dsv4::http::peers::SelfDoctor {
                // This very program, even after an upgrade replaced its file.
                program: "/proc/self/exe".into(),
                config: args.config.clone(),
                sysroot: args.sysroot.clone(),
            },
        };
        tokio::spawn(dsv4::http::peers::serve(l, peers));
    }
    // Read now, so that the engines' output loses them from the first line on.
    let _ = ctx.api_keys.get(&config);
    let _ = ctx.admin_keys.get(&config);
    let _ = peer_keys.get(&config);
    Ok(Daemon {
        listener,
        origin,
        config,
        ctx,
        actor,
        control,
        peers_own,
    })
}

/// The peers port: systemd's socket named `peers`, else `peers.listen` bound (then `true`:
/// dsv4d's own); `None` when the box lends to no one.
fn peers_listener(
    config: &Config,
    activated: &mut Vec<(std::os::fd::OwnedFd, String)>,
) -> Result<(Option<tokio::net::TcpListener>, bool)> {
    let passed = listener::take_named(activated, "peers")?;
    let own = passed.is_none() && config.supervisor.peers.listen.is_some();
    let std_listener = match passed {
        Some(l) => Some(l),
        None => match &config.supervisor.peers.listen {
            Some(listen) => {
                let l = std::net::TcpListener::bind(listen)
                    .with_context(|| format!("binding the peers port on {listen}"))?;
                l.set_nonblocking(true)
                    .context("setting the peers port non-blocking")?;
                Some(l)
            }
            None => None,
        },
    };
    let Some(l) = std_listener else {
        return Ok((None, false));
    };
    let addr = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    match config.supervisor.peers.keys_file.is_some() {
        true => tracing::info!("lending to coordinators on other boxes at {addr} (peers)"),
        false => tracing::warn!(
            "the peers port {addr} is open but peers.keys_file is not set: every coordinator \
             is refused"
        ),
    }
    let listener = tokio::net::TcpListener::from_std(l).context("registering the peers port")?;
    Ok((Some(listener), own))
}

/// The API's listener: systemd's socket, else `--listen`, else `api.listen`.
fn listen(
    args: &Args,
    config: &Config,
    activated: Vec<(std::os::fd::OwnedFd, String)>,
) -> Result<(tokio::net::TcpListener, Origin)> {
    let listen = args
        .listen
        .as_deref()
        .unwrap_or(&config.supervisor.api.listen);
    let (std_listener, origin) = listener::api_listener(activated, listen)?;
    let listener =
        tokio::net::TcpListener::from_std(std_listener).context("registering the API listener")?;
    match &origin {
        Origin::Activated { fd, name } => {
            tracing::info!("listening on socket-activated fd {fd} ({name})")
        }
        Origin::Bound { addr } => tracing::info!("listening on http://{addr}"),
    }
    Ok((listener, origin))
}

/// What must be so before any engine of ours exists: the engine keys' folder private (checked
/// now, so that a folder others may enter stops the daemon with the reason rather than every
/// engine start), what a killed dsv4d left running ended (so that its memory is free for
/// ours), an interrupted validation's settings given back, and the key settings compared
/// with the last run's.
async fn clean_slate(config: &Config) -> Result<KeyFolder> {
    let state_dir = &config.supervisor.state_dir;
    let key_folder = KeyFolder::for_daemon(state_dir);
    key_folder.prepare()?;
    tracing::info!(
        "engine keys go to {} (a fresh one for each engine start)",
        key_folder.path().display()
    );
    let reaped =
        dsv4::lifecycle::leftover::reap(state_dir, std::path::Path::new("/proc"), LEFTOVER_GRACE)
            .await;
    if !reaped.ended.is_empty() {
        tracing::warn!(
            "ended {} engine process(es) that a previous dsv4d left running ({} needed \
             SIGKILL)",
            reaped.ended.len(),
            reaped.killed
        );
    }
    dsv4::validate::recover(state_dir);
    dsv4::control::reload::note_start(config);
    Ok(key_folder)
}

/// The lifecycle actor, the monitor, the policies and the validator, started, in the bundle
/// both faces serve from; the actor's task, and the keys taken out of the engines' output
/// (each engine's own, and the API and admin keys, which their caches tell it).
fn spawn_parts(
    config: &Config,
    config_rx: tokio::sync::watch::Receiver<Arc<Config>>,
    sysroot: SysRoot,
    key_folder: KeyFolder,
    alerts: &Alerts,
) -> (
    Parts,
    tokio::task::JoinHandle<()>,
    dsv4::lifecycle::Redactor,
) {
    let profile = active_profile(config);
    // A validation matrix cell's settings: the lifecycle adds its arguments, the power
    // policy applies its profile and level, the validator sets and clears it.
    let trial = dsv4::lifecycle::trial::Trial::default();
    let services = Services {
        alerts: alerts.clone(),
        sysroot: sysroot.clone(),
        key_folder: Some(key_folder),
        trial: trial.clone(),
        redact: Default::default(),
    };
    let redact = services.redact.clone();
    let (lifecycle, actor) =
        dsv4::lifecycle::actor::spawn(config_rx.clone(), profile.clone(), services);
    let telemetry = dsv4::observe::monitor::spawn(
        dsv4::host::hw::Sampler::new(sysroot.clone()),
        config_rx.clone(),
        lifecycle.watch_status(),
    );
    let thermal =
        dsv4::policy::thermal::spawn(config_rx.clone(), telemetry.clone(), lifecycle.clone());
    let flights = dsv4::observe::flights::Flights::new(alerts.clone());
    let power = dsv4::policy::power::spawn(dsv4::policy::power::Parts {
        config: config_rx.clone(),
        lifecycle: lifecycle.watch_status(),
        telemetry: telemetry.clone(),
        sysroot: sysroot.clone(),
        alerts: alerts.clone(),
        trial: trial.clone(),
        flights: flights.clone(),
    });
    let validator = dsv4::validate::Validator::new(
        lifecycle.clone(),
        telemetry.clone(),
        config_rx.clone(),
        sysroot,
        trial,
        power.clone(),
    );
    // The canary after a change: once an engine that changed is idle.
    tokio::spawn(validator.clone().canary_after_changes());
    tracing::info!(profile, "ready; the engine starts on the first request");
    let parts = Parts {
        lifecycle: lifecycle.clone(),
        config: config_rx,
        stats: Stats::default(),
        telemetry,
        power,
        thermal,
        validator: validator.clone(),
        actions: dsv4::actions::Actions::new(lifecycle, validator),
        flights,
        holders: Default::default(),
    };
    (parts, actor, redact)
}

impl Daemon {
    /// Serves the API until SIGTERM, SIGINT or the idle exit; then no connection is taken.
    async fn serve(self) -> Result<Stopping> {
        let Daemon {
            listener,
            origin,
            config,
            ctx,
            actor,
            control,
            peers_own,
        } = self;
        let lifecycle = ctx.parts.lifecycle.clone();
        let (activity, connections) = (ctx.activity.clone(), ctx.connections.clone());

        let lifecycle_status = lifecycle.watch_status();
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        // Under socket activation, an idle daemon may go: systemd keeps the socket and starts
        // it again at the next connection. Without, nobody would.
        let idle_after = config.supervisor.exit_when_idle;
        let activated = matches!(origin, Origin::Activated { .. });
        if idle_after.is_some() && !activated {
            tracing::info!("exit_when_idle applies only under socket activation: not used");
        }
        if idle_after.is_some() && activated && peers_own {
            tracing::info!(
                "exit_when_idle is not used: the peers port is dsv4d's own (peers.listen), \
                 and no one would answer there after an exit"
            );
        }
        let activated = activated && !peers_own;
        let idle = async move {
            match idle_after.filter(|_| activated) {
                Some(after) => {
                    dsv4::control::idle_exit::due(after, lifecycle_status, activity, connections)
                        .await;
                    after
                }
                None => std::future::pending().await,
            }
        };
        let shutdown = async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: draining and stopping"),
                _ = int.recv() => tracing::info!("SIGINT: draining and stopping"),
                after = idle => tracing::info!(
                    "no engine and no client for {}: exiting (systemd starts dsv4d again at the \
                     next connection)",
                    dsv4::config::format_duration(after)
                ),
            }
        };
        if std::env::var("DSV4_TEST_FAULTS").is_ok_and(|f| f.contains("stall-actor-on-sigusr2")) {
            // A test's fault switch: SIGUSR2 hangs the lifecycle actor, so that the watchdog's
            // part can be seen. Nothing else turns it on.
            let mut usr2 = signal(SignalKind::user_defined2()).context("installing SIGUSR2")?;
            let handle = lifecycle.clone();
            tokio::spawn(async move {
                if usr2.recv().await.is_some() {
                    handle.stall().await;
                }
            });
        }
        // The listener, the configuration and the bus name are in place: ready.
        dsv4::control::service::ready(&lifecycle.status());
        dsv4::control::service::spawn(lifecycle.clone(), ctx.parts.telemetry.clone());
        let connections_closed = Box::pin(serve::serve(listener, ctx.clone(), shutdown).await);
        Ok(Stopping {
            ctx,
            actor,
            control,
            connections_closed,
        })
    }
}

impl Stopping {
    /// Drains the requests in flight, saves the KV checkpoint, stops the engine, and gives
    /// the power settings back; systemd is told how long that may take.
    async fn shutdown(self) {
        let Stopping {
            ctx,
            actor,
            control,
            connections_closed,
        } = self;
        // A drain of in-flight requests, the KV checkpoint's save, then the engine's own stop.
        let budget = {
            let config = ctx.parts.config.borrow();
            let save = config
                .profiles
                .values()
                .filter_map(|p| p.kv_checkpoint.as_ref().map(|kv| kv.save_timeout))
                .max()
                .unwrap_or_default();
            // The drain is bounded by `engine.stop_timeout`, the engine's stop by its own grace.
            let stop_timeout = config.supervisor.engine.stop_timeout;
            let stop = config
                .profiles
                .values()
                .map(|p| p.engine.stop(&p.params).grace.unwrap_or(stop_timeout))
                .max()
                .unwrap_or(stop_timeout);
            stop_timeout + stop + save + std::time::Duration::from_secs(10)
        };
        let extending = dsv4::control::service::stopping(budget);
        // In-flight streams finish (bounded by engine.stop_timeout), then the engine stops.
        ctx.parts.lifecycle.shutdown().await;
        let _ = actor.await;
        // The engine is gone: the power settings go back.
        ctx.parts.power.shutdown().await;
        extending.abort();
        // Connections still open (a cut stream's client) get a moment to see their end.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), connections_closed).await;
        tracing::info!("dsv4d stopped");
        drop(control);
    }
}
