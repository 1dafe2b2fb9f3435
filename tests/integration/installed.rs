//! The package as installed, under a real systemd: the .deb (`packaging/deb/build`) installed
//! with dpkg, and its units run unchanged, `User=dsv4` and every hardening line, by systemd
//! 252 as PID 1 of its own namespaces (`tests/systemd/ns --net`), with the machine's own
//! D-Bus system bus and polkitd units beside them. Drop-ins change only paths: `ExecStart=`'s
//! configuration and `--sysroot`, and `ReadWritePaths=` for the test's folder.
//!
//! It shows what a user gets on the real box: the GPU's level file, root-owned 0644 and on
//! `low`, is `auto` while the engine runs and `low` again after the idle stop, and the
//! cpufreq policies likewise, written by `dsv4-sysfs@.service` that dsv4d starts through
//! systemd and polkit; the engine under the unit makes the system calls behind llama.cpp's
//! `--prio`, `--cpu-mask` and `--numa` without EPERM; the real llama-server serves; and
//! `/status` shows the open-file limit.
//!
//! It installs a package on this machine, so it runs only in CI (`CI=true`) or with
//! `DSV4_TEST_INSTALL=1`, like the packaging test, and never at the same time as it.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::ns::{base_units, deb, repo, run, Ns};
use crate::support::*;

const FAKE: &str = env!("CARGO_BIN_EXE_fake-engine");

/// The installed package; purged on drop (and the `render` group removed if it made it).
pub(crate) struct Installed {
    made_render: bool,
}

impl Installed {
    pub(crate) fn new() -> Installed {
        let deb = deb();
        run(Command::new("dpkg").args(["-i", deb]));
        // The unit's SupplementaryGroups=render video: a machine with a GPU has both (udev
        // makes render); a container may not.
        let made_render = Command::new("getent")
            .args(["group", "render"])
            .output()
            .is_ok_and(|o| !o.status.success());
        if made_render {
            run(Command::new("groupadd").args(["--system", "render"]));
        }
        Installed { made_render }
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let _ = Command::new("dpkg").args(["-P", "dsv4"]).output();
        if self.made_render {
            let _ = Command::new("groupdel").arg("render").output();
        }
    }
}

/// `curl` inside the namespace: the status and the body.
pub(crate) fn curl(ns: &Ns, args: &str) -> (u16, String) {
    let text = ns.out(&format!(
        "curl -sS --max-time 60 -w '\\n%{{http_code}}' {args}"
    ));
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

pub(crate) fn status(ns: &Ns) -> serde_json::Value {
    let (code, body) = curl(ns, "http://127.0.0.1:8080/status");
    assert_eq!(code, 200, "{body}\n{}", ns.journal());
    serde_json::from_str(&body).unwrap()
}

/// Copies `from` to `to` as root's, readable by all: the dsv4 user reaches it only so.
pub(crate) fn copy_public(from: &Path, to: &Path, mode: u32) {
    std::fs::create_dir_all(to.parent().unwrap()).unwrap();
    std::fs::copy(from, to).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).unwrap();
}

pub(crate) fn write_public(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

const DEVICE: &str = "sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0";

/// The unit folder: the boot's special units stubbed, journald, D-Bus and polkit as this
/// machine has them, the installed dsv4 units unchanged, and drop-ins that change only paths.
pub(crate) fn unit_folder(w: &Path) -> PathBuf {
    let units = base_units(w, &["dbus.socket", "dbus.service", "polkit.service"]);
    // The installed units, as dpkg put them.
    let installed = Path::new("/usr/lib/systemd/system");
    for u in ["dsv4.socket", "dsv4.service", "dsv4-sysfs@.service"] {
        std::fs::copy(installed.join(u), units.join(u))
            .unwrap_or_else(|e| panic!("{} not installed: {e}", u));
    }
    let sysroot = w.join("root");
    let paths = |unit: &str, exec: String, more: String| {
        let d = units.join(format!("{unit}.d"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(
            d.join("paths.conf"),
            format!(
                "[Service]\nExecStart=\nExecStart={exec}\nReadWritePaths={}\n{more}",
                sysroot.display()
            ),
        )
        .unwrap();
    };
    let config = w.join("etc/supervisor.yaml");
    paths(
        "dsv4.service",
        format!(
            "/usr/bin/dsv4d --config {} --sysroot {}",
            config.display(),
            sysroot.display()
        ),
        format!(
            "ExecReload=\nExecReload=/usr/bin/dsv4d --check-config --config {}\n\
             ExecReload=/bin/kill -HUP $MAINPID\n",
            config.display()
        ),
    );
    paths(
        "dsv4-sysfs@.service",
        format!(
            "/usr/libexec/dsv4/dsv4-sysfs --sysroot {} %i",
            sysroot.display()
        ),
        String::new(),
    );
    units
}

/// The test's files, all root's and readable by all: the engines, the model, the
/// configuration and a Strix Halo sysroot whose GPU is on `low`.
pub(crate) fn lay_out(w: &Path) {
    let (server, model) = real::engine();
    copy_public(&server, &w.join("bin/llama-server"), 0o755);
    copy_public(Path::new(FAKE), &w.join("bin/fake-engine"), 0o755);
    copy_public(&model, &w.join("models/tiny.gguf"), 0o644);
    copy_public(&model, &w.join("models/probe.gguf"), 0o644);
    // cp -a keeps the tree's symlinks (class/drm/card1 -> ../../devices/...).
    run(Command::new("cp")
        .arg("-a")
        .arg(fixture_tree("strix-halo"))
        .arg(w.join("root")));
    run(Command::new("chown")
        .args(["-R", "root:root"])
        .arg(w.join("root")));
    run(Command::new("chmod")
        .args(["-R", "u=rwX,go=rX"])
        .arg(w.join("root")));
    std::fs::write(
        w.join("root")
            .join(DEVICE)
            .join("power_dpm_force_performance_level"),
        "low\n",
    )
    .unwrap();
    write_public(
        &w.join("etc/supervisor.yaml"),
        "api:\n  listen: 127.0.0.1:8080\n\
         engine:\n  idle_timeout: 3s\n  stop_timeout: 10s\n  start_timeout: 1m\n\
         power: { method: auto, cpu: power-saver, gpu: auto }\n\
         monitor: { interval: 500ms, idle_interval: 500ms }\n\
         memory: { reserve: 0GiB }\n\
         profiles_dir: profiles\ndefault_profile: tiny\nstate_dir: /var/lib/dsv4\n",
    );
    write_public(
        &w.join("etc/profiles/tiny.yaml"),
        &format!(
            "description: the real llama-server on the tiny model\nengine: llama-server\n\
             command: {}\nmodel: {}\ncontext: 1024\nparallel: 1\nextra_args: [--no-webui]\n",
            w.join("bin/llama-server").display(),
            w.join("models/tiny.gguf").display()
        ),
    );
    write_public(
        &w.join("etc/profiles/probe.yaml"),
        &format!(
            "description: the fake engine, making an engine's system calls\n\
             engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\nparallel: 1\n\
             env:\n  FAKE_ENGINE_PROBE_SYSCALLS: \"1\"\n  \
             FAKE_ENGINE_LOG_FILE: /var/lib/dsv4/probe.log\n",
            w.join("bin/fake-engine").display(),
            w.join("models/probe.gguf").display()
        ),
    );
}

/// The impostor's folder (its log and its moves), below the test's folder.
fn impostor_dir(w: &Path) -> PathBuf {
    w.join("impostor")
}

/// A profile `taken` whose llama-server starts only once the impostor (see `port_taken.rs`)
/// has made its move on the port it is given, and the impostor's script and folder.
fn lay_out_impostor(w: &Path) {
    let dir = impostor_dir(w);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    copy_public(
        &repo().join("tests/fixtures/impostor.py"),
        &w.join("bin/impostor.py"),
        0o644,
    );
    write_public(
        &w.join("bin/port-wrapper"),
        &format!(
            "#!/bin/sh
             port=; prev=
             for a in \"$@\"; do [ \"$prev\" = --port ] && port=$a; prev=$a; done
             i=0
             while [ ! -e '{dir}/seen-'\"$port\" ]; do
             \x20 i=$((i + 1))
             \x20 if [ $i -gt 3000 ]; then echo \"the impostor never saw port $port\" >&2; exit 3; fi
             \x20 sleep 0.01
             done
             exec {engine} \"$@\"
",
            dir = dir.display(),
            engine = w.join("bin/llama-server").display(),
        ),
    );
    std::fs::set_permissions(
        w.join("bin/port-wrapper"),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    write_public(
        &w.join("etc/profiles/taken.yaml"),
        &format!(
            "description: the real llama-server, behind a wrapper that lets an impostor move \
             first\nengine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\n\
             parallel: 1\nextra_args: [--no-webui]\n",
            w.join("bin/port-wrapper").display(),
            w.join("models/tiny.gguf").display()
        ),
    );
}

pub(crate) fn install_allowed() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("DSV4_TEST_INSTALL").is_ok_and(|v| v == "1")
}

#[test]
fn the_installed_units_run_as_shipped_under_a_real_systemd() {
    if !install_allowed() {
        eprintln!(
            "not run: it installs the package on this machine, which happens only in CI \
             (CI=true) or with DSV4_TEST_INSTALL=1"
        );
        return;
    }
    let _one_at_a_time = package_lock();
    let _installed = Installed::new();
    // Below /var/cache: not /tmp or /var/tmp (PrivateTmp=), /home or /root (ProtectHome=),
    // nor /run or /var/lib (the namespace's own tmpfs).
    let w = tempfile::Builder::new()
        .prefix("dsv4-installed-")
        .tempdir_in("/var/cache")
        .unwrap();
    std::fs::set_permissions(w.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    lay_out(w.path());
    lay_out_impostor(w.path());
    let units = unit_folder(w.path());
    let ns = Ns::boot(&units, "test.target", &w.path().join("console.log"), true);
    let level_file = w
        .path()
        .join("root")
        .join(DEVICE)
        .join("power_dpm_force_performance_level");
    let level = || {
        std::fs::read_to_string(&level_file)
            .unwrap()
            .trim()
            .to_string()
    };
    let governor_file = w
        .path()
        .join("root/sys/devices/system/cpu/cpufreq/policy1/scaling_governor");
    let governor = || {
        std::fs::read_to_string(&governor_file)
            .unwrap()
            .trim()
            .to_string()
    };
    let governor_before = governor();
    assert_ne!(
        governor_before, "powersave",
        "the fixture must start elsewhere"
    );
    assert_eq!(level(), "low");

    // The real llama-server serves through the socket-activated daemon, as the dsv4 user.
    ns.wait("dsv4.socket listening", || {
        ns.out("systemctl is-active dsv4.socket") == "active"
    });
    let chat = r#"-H 'content-type: application/json' -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8}' http://127.0.0.1:8080/v1/chat/completions"#;
    let (code, body) = curl(&ns, chat);
    assert_eq!(code, 200, "{body}\n{}", ns.journal());
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let user = ns.out("ps -o user= -p $(systemctl show -p MainPID --value dsv4.service)");
    assert_eq!(user, "dsv4");

    // The journal's fields: the engine's own lines under its profile and stream.
    ns.wait("the engine's lines under its profile", || {
        ns.out("journalctl --no-pager -o cat -u dsv4 PROFILE=tiny ENGINE_STREAM=stderr")
            .contains("listening")
    });
    let tiny = ns.out("journalctl --no-pager -o cat -u dsv4 PROFILE=tiny");
    assert!(tiny.contains("starting engine"), "{tiny}");

    // A reload checks the edit first, as the service: a bad one fails `systemctl reload`,
    // says why in the journal at error priority, and the daemon keeps serving.
    let config = w.path().join("etc/supervisor.yaml");
    let good = std::fs::read_to_string(&config).unwrap();
    write_public(&config, &format!("{good}bogus_key: 1\n"));
    let o = ns.sh("systemctl reload dsv4.service");
    assert!(!o.status.success(), "a bad edit reloaded");
    ns.wait("the check's words at error priority", || {
        ns.out("journalctl --no-pager -o cat -p err -u dsv4")
            .contains("bogus_key: unknown key `bogus_key`")
    });
    write_public(&config, &good);
    // So does a bad drop-in, named with its own file.
    let dropin = w.path().join("etc/supervisor.yaml.d/50-local.yaml");
    write_public(&dropin, "engine:\n  max_waiting: lots\n");
    let o = ns.sh("systemctl reload dsv4.service");
    assert!(!o.status.success(), "a bad drop-in reloaded");
    ns.wait("the drop-in's mistake at error priority", || {
        ns.out("journalctl --no-pager -o cat -p err -u dsv4")
            .contains("supervisor.yaml.d/50-local.yaml:2:16: engine.max_waiting: invalid type")
    });
    std::fs::remove_file(&dropin).unwrap();
    let o = ns.sh("systemctl reload dsv4.service");
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        ns.journal()
    );

    // While it runs: the GPU on auto and the CPU policies on powersave, written through
    // dsv4-sysfs@ (dsv4d itself cannot: the files are root's and /sys is read-only to it).
    ns.wait("the GPU level on auto", || level() == "auto");
    ns.wait("policy1 on powersave", || governor() == "powersave");
    // dsv4d learns the helper's work when systemd says its job ended, and journald files
    // the helper's lines on its own time: both are waited for, not read once.
    ns.wait("the status saying the GPU level is auto", || {
        status(&ns)["power"]["gpu_level"] == "auto"
    });
    let s = status(&ns);
    assert_eq!(s["power"]["method"], "cpufreq", "{}", s["power"]);
    ns.wait("the helper's journal lines", || {
        let helper = ns.out("journalctl --no-pager -u 'dsv4-sysfs@*'");
        helper.contains("wrote auto to") && helper.contains("wrote powersave to")
    });
    // The open-file limit: the shipped unit leaves systemd's 1024:524288, raised to the hard.
    let limits = &s["limits"];
    assert_eq!(limits["open_files"], limits["open_files_hard"], "{limits}");
    assert!(limits["open_files"].as_u64().unwrap() > 1024, "{limits}");

    // The idle stop gives both back.
    ns.wait("the idle stop", || {
        status(&ns)["state"] == dsv4_client::State::Stopped.as_str()
    });
    ns.wait("the GPU level back on low", || level() == "low");
    ns.wait("policy1 back", || governor() == governor_before);

    // An engine under the unit makes the calls behind --prio, --cpu-mask and --numa.
    let o = ns.sh("dsv4ctl profile probe && dsv4ctl start --wait");
    assert!(
        o.status.success(),
        "{}{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
        ns.journal()
    );
    // The namespace's /var/lib is its own tmpfs: read the log from inside.
    let probe = ns.out("cat /var/lib/dsv4/probe.log");
    // The filter would answer EPERM; anything else is the kernel's own answer (mbind on a
    // kernel without NUMA says ENOSYS), and the call got through.
    for call in ["setpriority", "sched_setaffinity", "setrlimit", "mbind"] {
        let line = probe
            .lines()
            .find(|l| l.starts_with(&format!("syscall {call} ")))
            .unwrap_or_else(|| panic!("no {call} in the probe's log:\n{probe}"));
        assert!(!line.contains("EPERM"), "{line}\n{probe}");
    }
    for call in ["setpriority", "sched_setaffinity", "setrlimit"] {
        assert!(probe.contains(&format!("syscall {call} ok")), "{probe}");
    }

    // Another local user, outside the service, takes the engine's port as it reads it from
    // /proc. The service's network is its own: the engine binds the same port there, serves,
    // and the impostor gets nothing.
    let dir = impostor_dir(w.path());
    let o = ns.sh(&format!(
        "setpriv --reuid 65534 --regid 65534 --clear-groups /usr/bin/python3 {} {} {} 1 \
         >/dev/null 2>{}/impostor.err </dev/null &",
        w.path().join("bin/impostor.py").display(),
        dir.display(),
        w.path().join("bin/port-wrapper").display(),
        w.path().display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let t = std::time::Instant::now();
    while !dir.join("impostor.log").exists() {
        let err = std::fs::read_to_string(w.path().join("impostor.err")).unwrap_or_default();
        assert!(t.elapsed() < PATIENCE, "the impostor did not start: {err}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let o = ns.sh("dsv4ctl stop && dsv4ctl profile taken");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, body) = curl(&ns, chat);
    assert_eq!(code, 200, "{body}\n{}", ns.journal());
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let moves: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("seen-"))
        .map(|e| {
            std::fs::read_to_string(e.path())
                .unwrap()
                .trim()
                .to_string()
        })
        .collect();
    assert_eq!(
        moves,
        ["taken"],
        "the impostor held the port outside the service"
    );
    let seen = std::fs::read_to_string(dir.join("impostor.log")).unwrap();
    assert!(seen.trim().is_empty(), "the impostor got: {seen}");
    let journal = ns.out("journalctl --no-pager -u dsv4");
    assert!(
        !journal.contains("was taken by another process"),
        "the service's port was not its own:\n{journal}"
    );

    // Each line goes to the journal at its level's priority: a start refused for memory is
    // a warning; the daemon's info lines are not.
    write_public(
        &w.path().join("etc/profiles/huge.yaml"),
        &format!(
            "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\n\
             planned_memory: 500GiB\n",
            w.path().join("bin/llama-server").display(),
            w.path().join("models/tiny.gguf").display()
        ),
    );
    // And an engine that crashes as it starts, with a last word.
    write_public(
        &w.path().join("bin/crash-engine"),
        // Before its last word, a burst of lines, each of which the journal keeps.
        "#!/bin/sh\ni=0\nwhile [ $i -lt 3000 ]; do echo \"burst line $i\"; i=$((i+1)); done >&2\n\
         echo 'crash-engine: giving up' >&2\nexit 3\n",
    );
    run(Command::new("chmod")
        .arg("0755")
        .arg(w.path().join("bin/crash-engine")));
    write_public(
        &w.path().join("etc/profiles/crash.yaml"),
        &format!(
            "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\n",
            w.path().join("bin/crash-engine").display(),
            w.path().join("models/tiny.gguf").display()
        ),
    );
    let o = ns.sh("dsv4ctl stop && systemctl reload dsv4.service");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    ns.wait("the reloaded profiles", || {
        ns.out("dsv4ctl profiles").contains("huge")
    });
    let o = ns.sh("dsv4ctl profile huge");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, body) = curl(&ns, chat);
    assert_eq!(code, 503, "{body}");
    ns.wait("the refusal at warning priority, under its profile", || {
        ns.out("journalctl --no-pager -o cat -p warning -u dsv4 PROFILE=huge")
            .contains("not enough memory to start profile huge")
    });
    // The crash: a warning under its profile, and its last word under its profile, pid
    // and stream.
    let o = ns.sh("dsv4ctl profile crash");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, body) = curl(&ns, chat);
    assert!(code >= 500, "{code} {body}");
    ns.wait("the crash at warning priority, under its profile", || {
        ns.out("journalctl --no-pager -o cat -p warning -u dsv4 PROFILE=crash")
            .contains("exit code 3")
    });
    let word = ns.out("journalctl --no-pager -o export -u dsv4 PROFILE=crash ENGINE_STREAM=stderr");
    assert!(word.contains("MESSAGE=crash-engine: giving up"), "{word}");
    // Each start's burst whole and in order, under that engine's pid (entries in the export
    // format are separated by a blank line).
    let mut bursts: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for entry in word.split("\n\n") {
        let field = |name: &str| {
            entry
                .lines()
                .find_map(|l| l.strip_prefix(name).map(str::to_string))
        };
        if let (Some(pid), Some(m)) = (field("ENGINE_PID="), field("MESSAGE=burst line ")) {
            bursts.entry(pid).or_default().push(m);
        }
    }
    assert!(!bursts.is_empty(), "no burst in the journal");
    let whole: Vec<String> = (0..3000).map(|i| i.to_string()).collect();
    for (pid, lines) in &bursts {
        assert!(
            lines == &whole,
            "engine {pid}: {} of 3000 burst lines",
            lines.len()
        );
    }
    assert!(word.contains("ENGINE_PID="), "{word}");
    assert!(word.contains("GENERATION="), "{word}");
    assert!(word.contains("PRIORITY=6"), "{word}");
    let warnings = ns.out("journalctl --no-pager -o cat -p warning -u dsv4");
    assert!(
        !warnings.contains("listening on socket-activated fd"),
        "{warnings}"
    );
    assert!(
        !warnings.contains("giving up"),
        "the engine's lines are at info priority: {warnings}"
    );
    let all = ns.out("journalctl --no-pager -o cat -u dsv4");
    assert!(all.contains("listening on socket-activated fd"), "{all}");
}

/// The engine and the model in a folder of another user (0700, as Debian makes homes), as a
/// new user puts them: the installed doctor, run as root, checks them as the dsv4 user, first
/// on this machine, where no systemd runs (so without the sandbox, said so), then in the
/// service's sandbox, and names them; its --fix writes the drop-in, and the engine then
/// starts through the socket as shipped. The folders' names hold what a unit file reads
/// specially (`:`, `%`, a blank): the drop-in binds exactly them.
#[test]
fn the_doctor_names_a_model_in_a_closed_home_and_its_fix_lets_the_engine_start() {
    if !install_allowed() {
        eprintln!("not run: it installs the package (CI=true or DSV4_TEST_INSTALL=1)");
        return;
    }
    let _one_at_a_time = package_lock();
    let _installed = Installed::new();
    let w = tempfile::Builder::new()
        .prefix("dsv4-doctor-")
        .tempdir_in("/var/cache")
        .unwrap();
    std::fs::set_permissions(w.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    lay_out(w.path());
    // A healthy box's kernel, firmware and device nodes in the sysroot.
    let root = w.path().join("root");
    run(Command::new("cp")
        .arg("-a")
        .arg(repo().join("tests/fixtures/doctor/healthy/."))
        .arg(&root));
    for node in ["dev/kfd", "dev/dri/renderD128"] {
        write_public(&root.join(node), "");
        std::fs::set_permissions(root.join(node), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    std::fs::create_dir_all("/home").unwrap();
    let home = tempfile::Builder::new()
        .prefix("dsv4-doctor:%-")
        .tempdir_in("/home")
        .unwrap();
    let models = "mo:d%els x";
    let (server, model) = real::engine();
    copy_public(&server, &home.path().join("engine/llama-server"), 0o755);
    copy_public(&model, &home.path().join(models).join("tiny.gguf"), 0o644);
    for d in ["engine", models] {
        std::fs::set_permissions(home.path().join(d), std::fs::Permissions::from_mode(0o755))
            .unwrap();
    }
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::remove_file(w.path().join("etc/profiles/probe.yaml")).unwrap();
    write_public(
        &w.path().join("etc/profiles/tiny.yaml"),
        &format!(
            "description: the real llama-server, from a home folder\nengine: llama-server\n\
             command: \"{}\"\nmodel: \"{}\"\ncontext: 1024\nparallel: 1\n\
             extra_args: [--no-webui]\n",
            home.path().join("engine/llama-server").display(),
            home.path().join(models).join("tiny.gguf").display()
        ),
    );
    let log = root.join("kernel.log");

    // Here, where no systemd runs: root still checks as dsv4, and says the sandbox could
    // not be applied.
    let o = Command::new("dsv4ctl")
        .arg("doctor")
        .arg("--config")
        .arg(w.path().join("etc/supervisor.yaml"))
        .arg("--sysroot")
        .arg(&root)
        .arg("--kernel-log")
        .arg(&log)
        .env(
            "DBUS_SYSTEM_BUS_ADDRESS",
            "unix:path=/nonexistent/dsv4-no-bus",
        )
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let sandbox = text
        .lines()
        .find(|l| l.starts_with("WARN  service.sandbox"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(sandbox.contains("no running systemd"), "{sandbox}");
    assert!(sandbox.contains("ran as dsv4 (uid"), "{sandbox}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("ok    service.user") && l.contains("checked as dsv4")),
        "{text}"
    );
    let model_line = text
        .lines()
        .find(|l| l.starts_with("FAIL  files.model [tiny]"))
        .unwrap_or_else(|| panic!("no FAIL files.model:\n{text}"));
    assert!(
        model_line.contains(&format!("the folder {} is 0700", home.path().display())),
        "{model_line}"
    );

    let units = unit_folder(w.path());
    let ns = Ns::boot(&units, "test.target", &w.path().join("console.log"), true);
    ns.wait("dsv4.socket listening", || {
        ns.out("systemctl is-active dsv4.socket") == "active"
    });
    let doctor = |more: &str| {
        let o = ns.sh(&format!(
            "dsv4ctl doctor --kernel-log {} {more}",
            log.display()
        ));
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };

    // Before: it ran as dsv4 in the sandbox, and names the program and the model.
    let (code, text, err) = doctor("");
    assert_eq!(code, Some(1), "{text}{err}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("ok    service.sandbox") && l.contains("as dsv4 inside")),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("ok    service.user")
            && l.contains("checked as dsv4 (groups ")
            && l.contains("render")
            && l.contains("video")),
        "{text}"
    );
    for id in ["files.command [tiny]", "files.model [tiny]"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("FAIL  {id}")))
            .unwrap_or_else(|| panic!("no FAIL {id}:\n{text}"));
        assert!(
            line.contains(&format!("the folder {} is 0700", home.path().display())),
            "{line}"
        );
    }
    assert!(text.contains("sudo dsv4ctl doctor --fix"), "{text}");
    // The engine cannot start meanwhile.
    let chat = r#"-H 'content-type: application/json' -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8}' http://127.0.0.1:8080/v1/chat/completions"#;
    let (code, body) = curl(&ns, &format!("--max-time 10 {chat}"));
    // ...and the client is told why.
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("config_invalid"), "{body}");
    assert!(body.contains("Permission denied"), "{body}");

    // The fix: the drop-in, systemd reloaded, the checks again: nothing fails now.
    let (code, text, err) = doctor(&format!("--fix --unit-dir {}", units.display()));
    assert_eq!(code, Some(0), "{text}{err}\n{}", ns.journal());
    let drop_in = units.join("dsv4.service.d/50-doctor-paths.conf");
    assert!(
        err.contains(&format!("wrote {}", drop_in.display())),
        "{err}"
    );
    let written = std::fs::read_to_string(&drop_in).unwrap();
    // The closed folder, its `:` escaped for systemd's second reading and `%` doubled.
    let escaped = home
        .path()
        .display()
        .to_string()
        .replace(':', "\\\\:")
        .replace('%', "%%");
    assert!(
        written.contains(&format!("TemporaryFileSystem=\"{escaped}:ro\"")),
        "{written}"
    );
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(units.join("dsv4.service"))
        .env("SYSTEMD_UNIT_PATH", format!("{}:", units.display()))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&verify.stderr);
    assert!(
        !said.contains("50-doctor-paths.conf"),
        "systemd-analyze verify on the drop-in: {said}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("ok    files.model [tiny]")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("ok    power.gpu_helper")),
        "{text}"
    );

    // And the engine starts and serves, as the dsv4 user, through the socket.
    ns.wait("dsv4.socket listening", || {
        ns.out("systemctl is-active dsv4.socket") == "active"
    });
    let (code, body) = curl(&ns, chat);
    assert_eq!(code, 200, "{body}\n{}", ns.journal());
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
}
