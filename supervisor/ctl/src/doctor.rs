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

use dsv4_client::doctor::{worst, Check, DropIn, Verdict};
use dsv4_client::Bus;

use crate::error::Failure;

/// The service whose sandbox the checks run in.
const SERVICE: &str = "dsv4.service";
const SOCKET: &str = "dsv4.socket";
const NOTIFY_UNIT: &str = "dsv4-notify.service";
const DEFAULT_CONFIG: &str = "/etc/dsv4/supervisor.yaml";

/// The unit properties that make the service's sandbox, passed on to `systemd-run` as they
/// are (`RuntimeDirectory=` is left out: the transient unit would remove the running
/// service's at its end).
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
    "TemporaryFileSystem",
    "BindPaths",
    "BindReadOnlyPaths",
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

/// The checks `dsv4d --doctor` printed, or the reason there are none.
fn parse_checks(out: &std::process::Output, what: &str) -> Result<Vec<Check>, String> {
    serde_json::from_slice(&out.stdout).map_err(|e| {
        let err = String::from_utf8_lossy(&out.stderr);
        let err = err.trim();
        format!(
            "{what} gave no checks ({}): {}",
            out.status,
            if err.is_empty() {
                e.to_string()
            } else {
                err.to_string()
            }
        )
    })
}

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// One run of every check.
async fn checks(req: &Request) -> Result<Vec<Check>, Failure> {
    let unit = Unit::read();
    let dsv4d = dsv4d_path();
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
    let mut daemon_args: Vec<String> = vec![
        "--doctor".into(),
        "--config".into(),
        config.display().to_string(),
        "--sysroot".into(),
        sysroot.display().to_string(),
    ];
    let mut out = Vec::new();

    // The service's part: in its sandbox when it can be, else as the caller, said so.
    let mut service_args = daemon_args.clone();
    service_args.extend(["--part".into(), "service".into()]);
    let sandboxed = if req.no_sandbox {
        Err("--no-sandbox was given".to_string())
    } else if !unit.loaded() {
        Err(format!("{SERVICE} is not installed"))
    } else if !is_root() {
        Err("only root may run a check as the service user".to_string())
    } else {
        let dsv4d_abs = std::fs::canonicalize(&dsv4d).unwrap_or(dsv4d.clone());
        let mut cmd = Command::new("systemd-run");
        cmd.args([
            "--pipe",
            "--wait",
            "--quiet",
            "--collect",
            "--service-type=exec",
        ])
        .args(["--unit", &format!("dsv4-doctor-{}", std::process::id())])
        .args(unit.sandbox_args())
        .arg("--")
        .arg(&dsv4d_abs)
        .args(&service_args)
        .stdin(std::process::Stdio::null());
        match cmd.output() {
            Err(e) => Err(format!("cannot run systemd-run: {e}")),
            Ok(o) => parse_checks(&o, "the check inside the sandbox"),
        }
    };
    match sandboxed {
        Ok(checks) => {
            let user = unit.one("User").unwrap_or("root").to_string();
            out.push(Check::ok(
                "service.sandbox",
                format!("the service's checks ran as {user} inside {SERVICE}'s sandbox"),
            ));
            out.extend(checks);
        }
        Err(why) => {
            let fix = if unit.loaded() {
                "run `sudo dsv4ctl doctor` to check what the service itself can reach"
            } else {
                "install the package (its dsv4.service), then run `sudo dsv4ctl doctor`"
            };
            out.push(Check::warn(
                "service.sandbox",
                format!("{why}: the service's checks ran as you, outside its sandbox"),
                fix,
            ));
            let o = Command::new(&dsv4d)
                .args(&service_args)
                .stdin(std::process::Stdio::null())
                .output()
                .map_err(|e| {
                    Failure::Usage(format!(
                        "cannot run {}: {e} (set DSV4D to the path of dsv4d)",
                        dsv4d.display()
                    ))
                })?;
            out.extend(parse_checks(&o, "dsv4d --doctor").map_err(Failure::Usage)?);
        }
    }

    // The host's part, as the caller (the kernel's log is not the service's to read).
    daemon_args.extend(["--part".into(), "host".into()]);
    if let Some(log) = &req.kernel_log {
        daemon_args.extend(["--kernel-log".into(), log.display().to_string()]);
    }
    let o = Command::new(&dsv4d)
        .args(&daemon_args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Failure::Usage(format!("cannot run {}: {e}", dsv4d.display())))?;
    out.extend(parse_checks(&o, "dsv4d --doctor --part host").map_err(Failure::Usage)?);

    out.push(daemon_check(req.bus).await);
    if unit.loaded() {
        out.push(socket_check());
    }
    out.push(group_check());
    out.push(notify_check());
    Ok(out)
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

/// Writes each distinct drop-in of a failed or warned check; returns what was written.
fn write_fixes(checks: &[Check], unit_dir: &Path) -> Result<Vec<PathBuf>, Failure> {
    let mut drop_ins: BTreeMap<(String, String), &DropIn> = BTreeMap::new();
    for c in checks.iter().filter(|c| c.verdict >= Verdict::Warn) {
        if let Some(d) = &c.drop_in {
            drop_ins.insert((d.unit.clone(), d.name.clone()), d);
        }
    }
    if drop_ins.is_empty() {
        return Ok(Vec::new());
    }
    if !is_root() {
        return Err(Failure::Usage(
            "--fix writes systemd drop-ins: run it as root (sudo dsv4ctl doctor --fix)".into(),
        ));
    }
    let mut written = Vec::new();
    for ((unit, name), d) in drop_ins {
        let dir = unit_dir.join(format!("{unit}.d"));
        let path = dir.join(&name);
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&path, &d.text))
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
    let mut all = checks(&req).await?;
    if req.fix {
        let written = write_fixes(&all, &req.unit_dir)?;
        if written.is_empty() {
            eprintln!("dsv4ctl: nothing to fix with a drop-in");
        } else {
            for path in &written {
                eprintln!("dsv4ctl: wrote {}", path.display());
            }
            eprintln!("dsv4ctl: systemd reloaded; checking again");
            all = checks(&req).await?;
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
        let unit = Unit { props };
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
}
