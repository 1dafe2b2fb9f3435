//! `dsv4ctl doctor`: every promise checked on the machine it runs on.
//!
//! The checks that need the daemon's code come from `dsv4d --doctor` (see the daemon's
//! `doctor` module): its `service` part runs as the service user inside a copy of
//! `dsv4.service`'s sandbox, through `systemd-run` with the unit's own user, groups and
//! protections as `systemctl show` reports them (drop-ins included), so it sees what the
//! engine will see; its `host` part runs as the caller. dsv4ctl adds what only it can tell:
//! whether it ran in the sandbox, the daemon over D-Bus, the caller's group and desktop
//! notifications. `--fix` writes the drop-ins the checks offer, reloads systemd and checks
//! again. Owns: running the parts, the checks of its own, the report and the fixes. Must
//! not: change anything without `--fix`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use dsv4_client::doctor::{worst, Check, Fix, Verdict, SERVICE};
use dsv4_client::Bus;

use crate::error::Failure;

const SOCKET: &str = "dsv4.socket";
const NOTIFY_UNIT: &str = "dsv4-notify.service";
const DEFAULT_CONFIG: &str = "/etc/dsv4/supervisor.yaml";
/// The service's user, as the package makes it, where systemd cannot say the unit's.
const SERVICE_USER: &str = "dsv4";

/// The unit properties that make the service's sandbox, passed on to `systemd-run` as they
/// are (`RuntimeDirectory=` is left out: the transient unit would remove the running
/// service's at its end). The mounts (`TemporaryFileSystem=`, `BindPaths=`,
/// `BindReadOnlyPaths=`) are read over D-Bus instead ([`mounts`]): `systemctl show` prints
/// their paths unescaped, which a blank or a `:` in one would garble.
const SANDBOX: &[&str] = &[
    "User",
    "Group",
    "SupplementaryGroups",
    "UMask",
    "NoNewPrivileges",
    "ProtectHome",
    "ProtectSystem",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateNetwork",
    "DevicePolicy",
    "DeviceAllow",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "StateDirectory",
    "StateDirectoryMode",
    "ProtectKernelTunables",
    "ProtectControlGroups",
    "ProtectProc",
    "ProcSubset",
];

/// What `doctor` was asked.
#[derive(Debug, Clone)]
pub struct Request {
    pub config: Option<PathBuf>,
    pub fix: bool,
    pub no_sandbox: bool,
    pub sysroot: Option<PathBuf>,
    pub kernel_log: Option<PathBuf>,
    pub unit_dir: PathBuf,
    pub bus: Bus,
}

/// The service unit as systemd has it: its properties, one list per name.
#[derive(Debug, Default)]
struct Unit {
    props: BTreeMap<String, Vec<String>>,
    /// Whether `systemctl show` answered: a systemd runs, and may be asked.
    reachable: bool,
}

impl Unit {
    fn read() -> Unit {
        let mut cmd = Command::new("systemctl");
        cmd.args(["show", SERVICE, "-p", "LoadState,ExecStart"]);
        for p in SANDBOX {
            cmd.args(["-p", p]);
        }
        let out = cmd.output().ok().filter(|o| o.status.success());
        Unit {
            reachable: out.is_some(),
            props: out.map_or_else(BTreeMap::new, |o| {
                parse_show(&String::from_utf8_lossy(&o.stdout))
            }),
        }
    }

    fn one(&self, name: &str) -> Option<&str> {
        self.props.get(name)?.first().map(String::as_str)
    }

    fn loaded(&self) -> bool {
        self.one("LoadState") == Some("loaded")
    }

    /// The value of `--flag` in `ExecStart=`'s argv.
    fn exec_arg(&self, flag: &str) -> Option<PathBuf> {
        let exec = self.one("ExecStart")?;
        let argv = exec.split("argv[]=").nth(1)?.split(" ;").next()?;
        let words: Vec<&str> = argv.split_whitespace().collect();
        words
            .windows(2)
            .find(|w| w[0] == flag)
            .map(|w| PathBuf::from(w[1]))
    }

    /// `-p NAME=VALUE` for each sandbox property that is set.
    fn sandbox_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        for name in SANDBOX {
            for value in self.props.get(*name).into_iter().flatten() {
                if !value.is_empty() {
                    args.push("-p".into());
                    args.push(format!("{name}={value}"));
                }
            }
        }
        args
    }
}

/// `systemctl show` output: `Name=value` lines, a name repeated for each entry of some.
fn parse_show(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut props: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once('=') {
            props.entry(k.to_string()).or_default().push(v.to_string());
        }
    }
    props
}

/// `dsv4d`: `$DSV4D`, else next to dsv4ctl, else in `PATH`.
pub fn dsv4d_path() -> PathBuf {
    std::env::var_os("DSV4D")
        .map(PathBuf::from)
        .or_else(|| {
            let sibling = std::env::current_exe().ok()?.parent()?.join("dsv4d");
            sibling.is_file().then_some(sibling)
        })
        .or_else(|| {
            let path = std::env::var_os("PATH")?;
            std::env::split_paths(&path)
                .map(|d| d.join("dsv4d"))
                .find(|p| p.is_file())
        })
        .unwrap_or_else(|| PathBuf::from("dsv4d"))
}

/// The checks `dsv4d --doctor` printed, or the reason there are none. Only a run that ended
/// as the doctor ends (0: none failed, 1: one did) is read: output of a run killed or ended
/// otherwise may be anyone's, and is refused whole, as is anything that is not exactly a
/// list of checks.
fn parse_checks(out: &std::process::Output, what: &str) -> Result<Vec<Check>, String> {
    let err = String::from_utf8_lossy(&out.stderr);
    let err = err.trim();
    if !matches!(out.status.code(), Some(0 | 1)) {
        let why = if err.is_empty() { "" } else { ": " };
        return Err(format!(
            "{what} ended with {}, not as the doctor ends (0 or 1): its output is not \
             taken{why}{err}",
            out.status
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "{what} gave no checks ({}): {}",
            out.status,
            if err.is_empty() {
                format!("its output is not a list of checks: {e}")
            } else {
                err.to_string()
            }
        )
    })
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Where the checks look: the service unit as systemd has it, the configuration and the
/// sysroot (given, else the unit's, else the defaults).
struct Place {
    unit: Unit,
    /// The unit's mounts as `systemd-run -p` arguments, or why they could not be read.
    mounts: Result<Vec<String>, String>,
    dsv4d: PathBuf,
    config: PathBuf,
    sysroot: PathBuf,
}

impl Place {
    async fn new(req: &Request) -> Place {
        let unit = Unit::read();
        let mounts = match unit.loaded() && !req.no_sandbox && is_root() {
            true => mounts().await,
            false => Ok(Vec::new()),
        };
        let config = req
            .config
            .clone()
            .or_else(|| unit.exec_arg("--config"))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
        let sysroot = req
            .sysroot
            .clone()
            .or_else(|| unit.exec_arg("--sysroot"))
            .unwrap_or_else(|| PathBuf::from("/"));
        Place {
            unit,
            mounts,
            dsv4d: dsv4d_path(),
            config,
            sysroot,
        }
    }

    /// `dsv4d --doctor --config C --sysroot S --part PART`.
    fn args(&self, part: &str) -> Vec<String> {
        vec![
            "--doctor".into(),
            "--config".into(),
            self.config.display().to_string(),
            "--sysroot".into(),
            self.sysroot.display().to_string(),
            "--part".into(),
            part.into(),
        ]
    }
}

/// The service's mounts, read from systemd over the system bus, as `systemd-run -p`
/// arguments escaped the way it reads them.
async fn mounts() -> Result<Vec<String>, String> {
    use dsv4_client::doctor::{bind_entry, tmpfs_entry, Reader};
    let read = async {
        let bus = zbus::Connection::system().await?;
        let dest = "org.freedesktop.systemd1";
        let manager = zbus::Proxy::new(
            &bus,
            dest,
            "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager",
        )
        .await?;
        let path: zbus::zvariant::OwnedObjectPath = manager.call("GetUnit", &(SERVICE,)).await?;
        let service =
            zbus::Proxy::new(&bus, dest, path, "org.freedesktop.systemd1.Service").await?;
        let tmpfs: Vec<(String, String)> = service.get_property("TemporaryFileSystem").await?;
        let mut binds = Vec::new();
        for name in ["BindReadOnlyPaths", "BindPaths"] {
            let list: Vec<(String, String, bool, u64)> = service.get_property(name).await?;
            binds.extend(list.into_iter().map(|b| (name, b)));
        }
        Ok::<_, zbus::Error>((tmpfs, binds))
    };
    let (tmpfs, binds) = read
        .await
        .map_err(|e| format!("cannot read {SERVICE}'s mounts from systemd: {e}"))?;
    let mut args = Vec::new();
    for (path, options) in tmpfs {
        let entry = tmpfs_entry(Path::new(&path), &options, Reader::Run).map_err(|e| e.0)?;
        args.extend(["-p".into(), format!("TemporaryFileSystem={entry}")]);
    }
    const MS_REC: u64 = 16384;
    for (name, (source, dest, ignore_missing, flags)) in binds {
        let options = if flags & MS_REC != 0 {
            "rbind"
        } else {
            "norbind"
        };
        let entry = bind_entry(Path::new(&source), Path::new(&dest), options, Reader::Run)
            .map_err(|e| e.0)?;
        let dash = if ignore_missing { "-" } else { "" };
        args.extend(["-p".into(), format!("{name}={dash}{entry}")]);
    }
    Ok(args)
}

/// How the service's checks run.
enum Runner {
    /// As the service user inside a copy of the unit's sandbox (`systemd-run`).
    Sandbox,
    /// As the service user, by root, where no systemd could apply the sandbox: why not.
    AsUser(nix::unistd::User, String),
    /// As the caller: why not as the service user.
    Caller(String),
}

impl Runner {
    fn choose(req: &Request, unit: &Unit) -> Runner {
        if req.no_sandbox {
            return Runner::Caller("--no-sandbox was given".into());
        }
        if !is_root() {
            return Runner::Caller("only root may run a check as the service user".into());
        }
        if unit.loaded() {
            return Runner::Sandbox;
        }
        let why = match unit.reachable {
            false => "no running systemd could apply dsv4.service's sandbox (systemctl cannot \
                      reach one)"
                .to_string(),
            true => format!("{SERVICE} is not installed"),
        };
        let name = unit.one("User").unwrap_or(SERVICE_USER);
        match nix::unistd::User::from_name(name).ok().flatten() {
            Some(user) => Runner::AsUser(user, why),
            None => Runner::Caller(format!("{why}, and there is no user {name}")),
        }
    }
}

/// One run of every check.
async fn checks(req: &Request, place: &Place) -> Result<Vec<Check>, Failure> {
    let mut out = service_checks(req, place)?;
    // The host's part, as the caller (the kernel's log is not the service's to read).
    let mut args = place.args("host");
    if let Some(log) = &req.kernel_log {
        args.extend(["--kernel-log".into(), log.display().to_string()]);
    }
    let o = Command::new(&place.dsv4d)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Failure::Usage(format!("cannot run {}: {e}", place.dsv4d.display())))?;
    out.extend(parse_checks(&o, "dsv4d --doctor --part host").map_err(Failure::Usage)?);

    out.push(daemon_check(req.bus).await);
    if place.unit.loaded() {
        out.push(socket_check());
    }
    out.push(group_check());
    out.push(notify_check());
    Ok(out)
}

/// The service's part: in its sandbox when it can be, else as its user, else as the caller,
/// said so in `service.sandbox`.
fn service_checks(req: &Request, place: &Place) -> Result<Vec<Check>, Failure> {
    let args = place.args("service");
    let cannot = |e: std::io::Error| {
        Failure::Usage(format!(
            "cannot run {}: {e} (set DSV4D to the path of dsv4d)",
            place.dsv4d.display()
        ))
    };
    let mut out = Vec::new();
    match Runner::choose(req, &place.unit) {
        Runner::Sandbox => {
            let checks = sandboxed(place, &args);
            if let Ok(checks) = checks {
                let user = place.unit.one("User").unwrap_or("root");
                out.push(Check::ok(
                    "service.sandbox",
                    format!("the service's checks ran as {user} inside {SERVICE}'s sandbox"),
                ));
                out.extend(checks);
                return Ok(out);
            }
            let why = checks.err().unwrap_or_default();
            out.push(as_caller_check(&why, &place.unit));
        }
        Runner::AsUser(user, why) => {
            out.push(Check::warn(
                "service.sandbox",
                format!(
                    "{why}: the service's checks ran as {} (uid {}, with its groups), without \
                     the sandbox (ProtectHome=, DeviceAllow=, the unit's SupplementaryGroups=)",
                    user.name, user.uid
                ),
                "run `sudo dsv4ctl doctor` where systemd runs the service, to check the \
                 sandbox itself",
            ));
            let o = as_user(&place.dsv4d, &args, &user).map_err(cannot)?;
            out.extend(parse_checks(&o, "dsv4d --doctor").map_err(Failure::Usage)?);
            return Ok(out);
        }
        Runner::Caller(why) => out.push(as_caller_check(&why, &place.unit)),
    }
    let o = Command::new(&place.dsv4d)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(cannot)?;
    out.extend(parse_checks(&o, "dsv4d --doctor").map_err(Failure::Usage)?);
    Ok(out)
}

/// `service.sandbox` for checks that ran as the caller, and why.
fn as_caller_check(why: &str, unit: &Unit) -> Check {
    let fix = if unit.loaded() {
        "run `sudo dsv4ctl doctor` to check what the service itself can reach"
    } else {
        "install the package (its dsv4.service), then run `sudo dsv4ctl doctor`"
    };
    Check::warn(
        "service.sandbox",
        format!("{why}: the service's checks ran as you, outside its sandbox"),
        fix,
    )
}

/// The service's checks through `systemd-run`, with the unit's user and sandbox.
fn sandboxed(place: &Place, args: &[String]) -> Result<Vec<Check>, String> {
    let mounts = place.mounts.as_ref().map_err(Clone::clone)?;
    let dsv4d = std::fs::canonicalize(&place.dsv4d).unwrap_or(place.dsv4d.clone());
    let mut cmd = Command::new("systemd-run");
    cmd.args([
        "--pipe",
        "--wait",
        "--quiet",
        "--collect",
        "--service-type=exec",
    ])
    .args(["--unit", &format!("dsv4-doctor-{}", std::process::id())])
    .args(place.unit.sandbox_args())
    .args(mounts)
    .arg("--")
    .arg(&dsv4d)
    .args(args)
    .stdin(std::process::Stdio::null());
    match cmd.output() {
        Err(e) => Err(format!("cannot run systemd-run: {e}")),
        Ok(o) => parse_checks(&o, "the check inside the sandbox"),
    }
}

/// `dsv4d ARGS` run as `user`, with its own group and supplementary groups, by root.
fn as_user(
    dsv4d: &Path,
    args: &[String],
    user: &nix::unistd::User,
) -> std::io::Result<std::process::Output> {
    use std::os::unix::process::CommandExt;
    let name = std::ffi::CString::new(user.name.clone())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let groups = nix::unistd::getgrouplist(&name, user.gid)?;
    let (uid, gid) = (user.uid, user.gid);
    let mut cmd = Command::new(dsv4d);
    cmd.args(args)
        .env("HOME", &user.dir)
        .env("USER", &user.name)
        .current_dir("/")
        .stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec only these three system calls run, each
    // async-signal-safe; the group list was made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setgroups(&groups)?;
            nix::unistd::setgid(gid)?;
            nix::unistd::setuid(uid)?;
            Ok(())
        });
    }
    cmd.output()
}

/// `daemon.bus`: whether dsv4d answers, and in what state.
async fn daemon_check(bus: Bus) -> Check {
    let id = "daemon.bus";
    match crate::bus::Daemon::connect(bus).await {
        Ok(d) => match d.status().await {
            Ok(s) => Check::ok(
                id,
                format!(
                    "dsv4d answers on the {bus} bus: {}, profile {}",
                    s.engine.state.as_str(),
                    s.engine.profile
                ),
            ),
            Err(e) => Check::fail(
                id,
                format!("dsv4d is on the {bus} bus but its Status() failed: {e:?}"),
                "see `journalctl -u dsv4`",
            ),
        },
        Err(_) => Check::ok(
            id,
            format!("dsv4d is not running on the {bus} bus: it starts at the first request"),
        ),
    }
}

/// `service.socket`: the socket that starts it must listen.
fn socket_check() -> Check {
    let id = "service.socket";
    let active = systemctl(&["is-active", SOCKET]);
    match active.as_deref() {
        Some("active") => Check::ok(id, format!("{SOCKET} is listening")),
        state => Check::fail(
            id,
            format!(
                "{SOCKET} is {}: nothing starts dsv4d at a request",
                state.unwrap_or("unknown")
            ),
            format!("`sudo systemctl enable --now {SOCKET}`"),
        ),
    }
}

/// `systemctl ARGS`' first line of output.
fn systemctl(args: &[&str]) -> Option<String> {
    let o = Command::new("systemctl").args(args).output().ok()?;
    let text = String::from_utf8_lossy(&o.stdout);
    text.lines().next().map(|l| l.trim().to_string())
}

/// The person at the keyboard: `$SUDO_USER` under sudo, else the caller.
fn person() -> Option<nix::unistd::User> {
    if is_root() {
        if let Some(name) = std::env::var("SUDO_USER").ok().filter(|n| n != "root") {
            return nix::unistd::User::from_name(&name).ok().flatten();
        }
    }
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
}

/// `user.group`: members of dsv4 may control the daemon.
fn group_check() -> Check {
    let id = "user.group";
    let Some(user) = person() else {
        return Check::skip(id, "cannot tell who you are");
    };
    if user.uid.is_root() {
        return Check::ok(id, "root may control dsv4d");
    }
    let group = dsv4_client::CONTROL_GROUP;
    let Some(g) = nix::unistd::Group::from_name(group).ok().flatten() else {
        return Check::fail(
            id,
            format!("there is no {group} group"),
            "reinstall the package (it makes the group)",
        );
    };
    let name = std::ffi::CString::new(user.name.clone()).unwrap_or_default();
    let member = nix::unistd::getgrouplist(&name, user.gid)
        .map(|gids| gids.contains(&g.gid))
        .unwrap_or(false);
    if member {
        Check::ok(id, format!("{} is in {group}", user.name))
    } else {
        Check::warn(
            id,
            format!(
                "{} is not in {group}: dsv4ctl may read, but not start, stop or switch",
                user.name
            ),
            format!(
                "`sudo usermod -aG {group} {}`, then log in again",
                user.name
            ),
        )
    }
}

/// `user.notify_agent`: desktop notifications need the user unit enabled.
fn notify_check() -> Check {
    let id = "user.notify_agent";
    if systemctl(&["--global", "is-enabled", NOTIFY_UNIT]).as_deref() == Some("enabled") {
        return Check::ok(id, format!("{NOTIFY_UNIT} is enabled for every user"));
    }
    let fix = format!("`systemctl --user enable --now {NOTIFY_UNIT}` as yourself");
    let Some(user) = person() else {
        return Check::skip(id, "cannot tell who you are");
    };
    if user.uid.is_root() {
        return Check::skip(
            id,
            "run as root, not by a person: desktop notifications are per user",
        );
    }
    let state = if is_root() {
        systemctl(&[
            "--user",
            "-M",
            &format!("{}@", user.name),
            "is-enabled",
            NOTIFY_UNIT,
        ])
    } else {
        systemctl(&["--user", "is-enabled", NOTIFY_UNIT])
    };
    match state.as_deref() {
        Some("enabled") => Check::ok(id, format!("{NOTIFY_UNIT} is enabled for {}", user.name)),
        Some(s) if !s.is_empty() => Check::warn(
            id,
            format!(
                "{NOTIFY_UNIT} is {s} for {}: thermal events and alerts show no notification",
                user.name
            ),
            fix,
        ),
        _ => Check::skip(
            id,
            format!("could not ask {}'s systemd about {NOTIFY_UNIT}", user.name),
        ),
    }
}

/// The fixes of the failed or warned checks, one per kind, each composed and checked: what
/// to write in `dsv4.service.d/` (its fixed name, its text), or why nothing is written.
fn composed(checks: &[Check], sysroot: &Path) -> Result<Vec<(&'static str, String)>, Failure> {
    let mut fixes: Vec<Fix> = Vec::new();
    for c in checks.iter().filter(|c| c.verdict >= Verdict::Warn) {
        let Some(fix) = &c.fixable else { continue };
        if !fixes.iter_mut().any(|f| f.merge(fix)) {
            fixes.push(fix.clone());
        }
    }
    let refused = |why: String| {
        Failure::Failed(format!(
            "--fix refused the fix the service's check offered, and wrote nothing: {why}"
        ))
    };
    let mut out = Vec::new();
    for fix in &fixes {
        confirm(fix, sysroot).map_err(refused)?;
        let text = fix.drop_in().map_err(|e| refused(e.0))?;
        out.push((fix.file_name(), text));
    }
    Ok(out)
}

/// What root sees itself, against what the service user's check said: a folder to open is
/// one that exists and that others may not enter; a group to add is one that a GPU device
/// node under `sysroot` belongs to.
fn confirm(fix: &Fix, sysroot: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    match fix {
        Fix::Paths { closed } => {
            for c in closed {
                let meta = std::fs::metadata(&c.folder)
                    .map_err(|e| format!("{}: {e}", c.folder.display()))?;
                if !meta.is_dir() || meta.mode() & 0o001 != 0 {
                    return Err(format!(
                        "{} is not a folder closed to others (mode {:04o}): there is nothing to \
                         open",
                        c.folder.display(),
                        meta.mode() & 0o7777
                    ));
                }
            }
            Ok(())
        }
        Fix::Groups { groups } => {
            let owners = gpu_node_groups(sysroot);
            match groups.iter().find(|g| !owners.contains(*g)) {
                Some(g) => Err(format!(
                    "the group {g:?} owns none of the GPU's device nodes under {}",
                    sysroot.join("dev").display()
                )),
                None => Ok(()),
            }
        }
    }
}

/// The groups (by name, and by number when it has none) of `/dev/kfd` and `/dev/dri/*`
/// under `sysroot`.
fn gpu_node_groups(sysroot: &Path) -> std::collections::BTreeSet<String> {
    use std::os::unix::fs::MetadataExt;
    let dri = sysroot.join("dev/dri");
    let nodes = std::fs::read_dir(&dri)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .chain([sysroot.join("dev/kfd")]);
    let mut out = std::collections::BTreeSet::new();
    for gid in nodes
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.gid())
    {
        let group = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid));
        out.insert(gid.to_string());
        if let Ok(Some(g)) = group {
            out.insert(g.name);
        }
    }
    out
}

/// Writes the drop-ins the failed or warned checks offer, each under its own fixed name in
/// `unit_dir/dsv4.service.d/`; returns what was written.
fn write_fixes(checks: &[Check], unit_dir: &Path, sysroot: &Path) -> Result<Vec<PathBuf>, Failure> {
    let drop_ins = composed(checks, sysroot)?;
    if drop_ins.is_empty() {
        return Ok(Vec::new());
    }
    if !is_root() {
        return Err(Failure::Usage(
            "--fix writes systemd drop-ins: run it as root (sudo dsv4ctl doctor --fix)".into(),
        ));
    }
    let dir = unit_dir.join(format!("{SERVICE}.d"));
    let mut written = Vec::new();
    for (name, text) in drop_ins {
        let path = dir.join(name);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&path, text))
            .map_err(|e| Failure::Failed(format!("cannot write {}: {e}", path.display())))?;
        written.push(path);
    }
    let run = |args: &[&str]| {
        Command::new("systemctl")
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !run(&["daemon-reload"]) {
        return Err(Failure::Failed(
            "wrote the drop-ins, but `systemctl daemon-reload` failed".into(),
        ));
    }
    // A service that failed on them starts again at the next request; one that runs is
    // restarted to take them.
    let _ = run(&["reset-failed", SERVICE, SOCKET]);
    let _ = run(&["try-restart", SERVICE]);
    if systemctl(&["is-active", SOCKET]).as_deref() == Some("failed") {
        let _ = run(&["restart", SOCKET]);
    }
    Ok(written)
}

/// One check as text: the verdict, the id (and profile), what was found; then the fix and
/// the source, indented.
pub fn render(c: &Check) -> String {
    let tag = match c.verdict {
        Verdict::Ok => "ok  ",
        Verdict::Skip => "skip",
        Verdict::Warn => "WARN",
        Verdict::Fail => "FAIL",
    };
    let id = match &c.profile {
        Some(p) => format!("{} [{p}]", c.id),
        None => c.id.clone(),
    };
    let mut s = format!("{tag}  {id:<24} {}", c.found);
    if c.verdict >= Verdict::Warn {
        if let Some(fix) = &c.fix {
            s += &format!("\n      fix: {fix}");
        }
        if let Some(src) = &c.source {
            s += &format!("\n      source: {src}");
        }
    }
    s
}

/// The last line: how many of each.
fn summary(checks: &[Check]) -> String {
    let count = |v| checks.iter().filter(|c| c.verdict == v).count();
    format!(
        "{} checks: {} ok, {} skipped, {} warnings, {} failed",
        checks.len(),
        count(Verdict::Ok),
        count(Verdict::Skip),
        count(Verdict::Warn),
        count(Verdict::Fail)
    )
}

pub async fn run(req: Request, json: bool) -> Result<(), Failure> {
    let place = Place::new(&req).await;
    let mut all = checks(&req, &place).await?;
    if req.fix {
        let written = write_fixes(&all, &req.unit_dir, &place.sysroot)?;
        if written.is_empty() {
            eprintln!("dsv4ctl: nothing to fix with a drop-in");
        } else {
            for path in &written {
                eprintln!("dsv4ctl: wrote {}", path.display());
            }
            eprintln!("dsv4ctl: systemd reloaded; checking again");
            // The unit as systemd now has it, the drop-ins' mounts among its settings.
            let place = Place::new(&req).await;
            all = checks(&req, &place).await?;
        }
    }
    if json {
        crate::print_json(&all)?;
    } else {
        for c in &all {
            crate::println_out(&render(c))?;
        }
        crate::println_out(&summary(&all))?;
    }
    match worst(&all) {
        Verdict::Fail => Err(Failure::Failed(format!(
            "{} failed",
            all.iter()
                .filter(|c| c.verdict == Verdict::Fail)
                .map(|c| c.id.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_systemctl_show_says() {
        let props = parse_show(
            "DeviceAllow=char-drm rw\nDeviceAllow=/dev/kfd rw\nUser=dsv4\nBindPaths=\n\
             ExecStart={ path=/usr/bin/dsv4d ; argv[]=/usr/bin/dsv4d --config /e/s.yaml \
             --sysroot /r ; ignore_errors=no ; start_time=[n/a] }\n",
        );
        let unit = Unit {
            props,
            reachable: true,
        };
        assert_eq!(
            unit.sandbox_args(),
            [
                "-p",
                "User=dsv4",
                "-p",
                "DeviceAllow=char-drm rw",
                "-p",
                "DeviceAllow=/dev/kfd rw"
            ]
        );
        assert_eq!(unit.exec_arg("--config"), Some(PathBuf::from("/e/s.yaml")));
        assert_eq!(unit.exec_arg("--sysroot"), Some(PathBuf::from("/r")));
        assert_eq!(unit.exec_arg("--bus"), None);
    }

    #[test]
    fn a_check_as_a_line() {
        let c = Check::fail("files.model", "cannot reach it", "move it").profile("320k");
        assert_eq!(
            render(&c),
            "FAIL  files.model [320k]       cannot reach it\n      fix: move it"
        );
        assert_eq!(
            render(&Check::ok("a.b", "fine").fix("never shown")),
            format!("ok    {:<24} fine", "a.b")
        );
    }

    /// What root sees itself overrules the service's word: only a folder closed to others
    /// is opened, and only a group of a GPU device node is added.
    #[test]
    fn a_fix_is_confirmed_by_what_root_sees() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = std::env::temp_dir().join(format!("dsv4ctl-confirm-{}", std::process::id()));
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("dev/dri")).unwrap();
        std::fs::write(root.join("dev/kfd"), "").unwrap();
        let gid = std::fs::metadata(root.join("dev/kfd")).unwrap().gid();
        let name = nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
            .unwrap()
            .map_or(gid.to_string(), |g| g.name);
        let groups = |g: &str| Fix::Groups {
            groups: vec![g.to_string()],
        };
        assert_eq!(confirm(&groups(&name), &root), Ok(()));
        assert_eq!(confirm(&groups(&gid.to_string()), &root), Ok(()));
        let e = confirm(&groups("dsv4-no-such-group"), &root).unwrap_err();
        assert!(e.contains("owns none of the GPU's device nodes"), "{e}");

        let closed = dir.join("home");
        std::fs::create_dir_all(&closed).unwrap();
        let paths = Fix::Paths {
            closed: vec![dsv4_client::doctor::Closed {
                folder: closed.clone(),
                file: closed.join("m.gguf"),
            }],
        };
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(confirm(&paths, &root), Ok(()));
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = confirm(&paths, &root).unwrap_err();
        assert!(
            e.contains("not a folder closed to others (mode 0755)"),
            "{e}"
        );
        std::fs::remove_dir_all(&closed).unwrap();
        assert!(confirm(&paths, &root).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
