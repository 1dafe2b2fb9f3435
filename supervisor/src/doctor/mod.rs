//! `dsv4d --doctor`: the machine checked against every promise dsv4 makes, from where the
//! service runs.
//!
//! `dsv4ctl doctor` runs `dsv4d --doctor --part service` as the service user inside a copy of
//! the service's sandbox (`systemd-run` with `dsv4.service`'s own user, groups and
//! protections), so that the file, device, engine and power checks see what the engine will
//! see; and `dsv4d --doctor --part host` as the caller, for what the sandbox hides (the
//! kernel's log). Each part prints its [`Check`]s as JSON. Owns: making each check, from the
//! configuration, the sysroot and what the engine says of itself. Must not: change anything:
//! the fixes it offers as drop-ins are written by `dsv4ctl doctor --fix`.

pub mod access;
pub mod canary;
pub mod engine;
pub mod files;
pub mod flags;
pub mod kernel;
pub mod kv;
pub mod memory;
pub mod power;
pub mod workers;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

pub use dsv4_client::doctor::{Check, Fix, Verdict};

use crate::config::Config;
pub use crate::host::run::{run_bounded, Ran, RunError};
use crate::host::sysroot::SysRoot;

/// How long the system bus may take to answer the connection.
const BUS_LIMIT: Duration = Duration::from_secs(5);

/// Which checks a run makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// What the service can reach: run it as the service user in its sandbox.
    Service,
    /// What only the host shows: the kernel, its log, its memory settings.
    Host,
    /// Both, in one process.
    All,
    /// The service's checks of this box alone, its worker boxes left out: what a worker box
    /// runs for a coordinator's check (so two boxes that list each other never check each
    /// other round and round).
    Box,
}

impl std::str::FromStr for Part {
    type Err = String;
    fn from_str(s: &str) -> Result<Part, String> {
        match s {
            "service" => Ok(Part::Service),
            "host" => Ok(Part::Host),
            "all" => Ok(Part::All),
            "box" => Ok(Part::Box),
            other => Err(format!("expected service, host, all or box, not {other:?}")),
        }
    }
}

/// What a run looks at.
#[derive(Debug, Clone)]
pub struct Options {
    pub config: PathBuf,
    pub sysroot: SysRoot,
    /// A saved kernel log to read instead of this boot's journal.
    pub kernel_log: Option<PathBuf>,
    pub part: Part,
}

/// Every check of `opts.part`.
pub async fn run(opts: &Options) -> Vec<Check> {
    let mut out = Vec::new();
    if opts.part != Part::Host {
        out.extend(service(opts).await);
    }
    if matches!(opts.part, Part::Host | Part::All) {
        let log = match &opts.kernel_log {
            Some(path) => kernel::read_log_file(path),
            None => kernel::read_log().await,
        };
        out.extend(kernel::checks(&opts.sysroot, &log));
    }
    out
}

/// The checks made from the service's place.
async fn service(opts: &Options) -> Vec<Check> {
    let mut out = Vec::new();
    let who = access::Who::me();
    out.push(Check::ok(
        "service.user",
        format!("checked as {}", who.describe()),
    ));
    let config = match Config::load(&opts.config) {
        Ok(c) => {
            out.push(Check::ok("config.load", first_line(&c.summary())));
            c
        }
        Err(problems) => {
            let text = problems.to_string();
            out.push(Check::fail(
                "config.load",
                format!(
                    "{}: {}",
                    opts.config.display(),
                    text.lines().take(6).collect::<Vec<_>>().join("; ")
                ),
                format!(
                    "fix what it lists (`dsv4ctl config check {}` shows all of it)",
                    opts.config.display()
                ),
            ));
            // The files it names are checked one by one below, when the rest is sound.
            match Config::load_without_files(&opts.config) {
                Ok(c) => c,
                Err(_) => return out,
            }
        }
    };
    out.extend(files::checks(&config, &who, true));
    let vulkan = config
        .profiles
        .values()
        .any(|p| engine::is_vulkan(&crate::config::resolve_command(p)));
    out.extend(files::devices(&opts.sysroot, &who, true, vulkan));
    // Each program once, each model once: profiles often share them.
    let (mut programs, mut models) = (BTreeSet::new(), BTreeSet::new());
    for profile in config.profiles.values() {
        let command = crate::config::resolve_command(profile);
        let runnable = access::check(&who, &command, access::EXEC, true).is_ok();
        if runnable && programs.insert((command.clone(), profile.params.extra_args.clone())) {
            out.extend(engine::checks(profile, &command).await);
        }
        if models.insert(profile.params.model.clone()) {
            let readable = profile
                .params
                .model
                .as_ref()
                .is_none_or(|m| access::check(&who, m, access::READ, true).is_ok());
            if readable {
                out.extend(engine::model_checks(profile));
            }
        }
    }
    let root = opts.sysroot.clone();
    let config_for_memory = config.clone();
    out.extend(
        tokio::task::spawn_blocking(move || memory::checks(&config_for_memory, &root))
            .await
            .unwrap_or_default(),
    );
    let bus = tokio::time::timeout(BUS_LIMIT, zbus::Connection::system())
        .await
        .ok()
        .and_then(Result::ok);
    out.extend(power::checks(&config, &opts.sysroot, bus).await);
    out.extend(kv::checks(&config));
    out.extend(canary::checks(&config));
    if opts.part != Part::Box {
        out.extend(workers::checks(&config).await);
    }
    out
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").to_string()
}
