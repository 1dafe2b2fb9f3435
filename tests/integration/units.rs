//! The shipped systemd units, offline: `systemd-analyze verify` says nothing about any of
//! them (warnings exit 0, so any output fails), the service's security exposure stays at or
//! below 2.0 (the sysfs helper's at or below 1.0), and the sysusers and tmpfiles entries make the user, group and state folder in
//! a scratch root.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::*;

const DSV4D: &str = env!("CARGO_BIN_EXE_dsv4d-under-test");
const DSV4CTL: &str = env!("CARGO_BIN_EXE_dsv4ctl-under-test");
const DSV4_SYSFS: &str = env!("CARGO_BIN_EXE_dsv4-sysfs-under-test");
const DSV4_WAKE: &str = env!("CARGO_BIN_EXE_dsv4-wake-under-test");

fn units() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../units")
}

/// Copies `files` of `from` into `to`, with the installed binaries' paths pointing at the
/// ones just built (verify checks that ExecStart's program exists).
fn copy_built(from: &Path, files: &[&str], to: &Path) {
    for f in files {
        let text = std::fs::read_to_string(from.join(f)).unwrap();
        let text = text
            .replace("/usr/bin/dsv4d ", &format!("{DSV4D} "))
            .replace("/usr/bin/dsv4ctl ", &format!("{DSV4CTL} "))
            .replace("/usr/libexec/dsv4/dsv4-sysfs ", &format!("{DSV4_SYSFS} "))
            .replace("/usr/libexec/dsv4/dsv4-wake ", &format!("{DSV4_WAKE} "));
        std::fs::write(to.join(f), text).unwrap();
    }
}

fn verify(dir: &Path, files: &[&str], user: bool) {
    let runtime = temp_dir("xdg-runtime");
    let mut cmd = Command::new("systemd-analyze");
    if user {
        cmd.arg("--user").env("XDG_RUNTIME_DIR", runtime.path());
    }
    let out = cmd
        .args(["verify", "--man=no"])
        .args(files)
        .current_dir(dir)
        .output()
        .expect("systemd-analyze");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "{files:?}: {said}"
    );
}

#[test]
fn the_system_units_verify_without_a_word() {
    let dir = temp_dir("units");
    let files = ["dsv4.socket", "dsv4.service", "dsv4-sysfs@.service"];
    copy_built(&units(), &files, dir.path());
    verify(dir.path(), &files, false);
}

/// The cluster's units (docs/cluster.md), each as an instance for a link address (escaped as
/// `systemd-escape` writes it: `verify` takes no `:` in a file name), with the units they
/// start.
#[test]
fn the_cluster_units_verify_without_a_word_and_the_link_is_sandboxed() {
    let dir = temp_dir("cluster-units");
    copy_built(&units(), &["dsv4.socket", "dsv4.service"], dir.path());
    let instance = r"10.77.0.2\x3a8090";
    let mut files = vec!["dsv4.socket".to_string(), "dsv4.service".to_string()];
    for template in [
        "dsv4-peers@.socket",
        "dsv4-link@.socket",
        "dsv4-link@.service",
    ] {
        let name = template.replace('@', &format!("@{instance}"));
        std::fs::copy(units().join(template), dir.path().join(&name)).unwrap();
        files.push(name);
    }
    // The wake helper's instance as dsv4d names it (workers::wake_unit), escaped again for
    // a file name without `:`.
    let wake = r"dsv4-wake@aa\x3abb\x3acc\x3add\x3aee\x3aff-10.77.0.255\x3a9.service";
    copy_built(&units(), &["dsv4-wake@.service"], dir.path());
    std::fs::rename(dir.path().join("dsv4-wake@.service"), dir.path().join(wake)).unwrap();
    files.push(wake.to_string());
    let files: Vec<&str> = files.iter().map(String::as_str).collect();
    verify(dir.path(), &files, false);
    let e = exposure(dir.path(), &format!("dsv4-link@{instance}.service"));
    assert!(e <= 1.5, "dsv4-link@.service: exposure {e}");
    let e = exposure(dir.path(), wake);
    assert!(e <= 1.5, "dsv4-wake@.service: exposure {e}");
    // The peers port goes to dsv4d under the name it takes; the link is the dsv4 user's alone.
    let peers = std::fs::read_to_string(units().join("dsv4-peers@.socket")).unwrap();
    for line in ["FileDescriptorName=peers", "Service=dsv4.service"] {
        assert!(peers.lines().any(|l| l == line), "{line}");
    }
    let link = std::fs::read_to_string(units().join("dsv4-link@.socket")).unwrap();
    for line in ["SocketUser=dsv4", "SocketMode=0600"] {
        assert!(link.lines().any(|l| l == line), "{line}");
    }
}

#[test]
fn the_user_units_verify_without_a_word() {
    let dir = temp_dir("user-units");
    copy_built(
        &units().join("user"),
        &["dsv4.socket", "dsv4.service"],
        dir.path(),
    );
    copy_built(&units(), &["dsv4-notify.service"], dir.path());
    verify(
        dir.path(),
        &["dsv4.socket", "dsv4.service", "dsv4-notify.service"],
        true,
    );
}

/// `systemd-analyze security`'s overall exposure of `unit` (copied into `dir`).
fn exposure(dir: &Path, unit: &str) -> f64 {
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", unit])
        .current_dir(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let overall = text
        .lines()
        .find_map(|l| {
            l.split(&format!("Overall exposure level for {unit}: "))
                .nth(1)
        })
        .unwrap_or_else(|| panic!("no overall exposure: {text}"));
    eprintln!("{unit}: exposure {overall}");
    overall.split_whitespace().next().unwrap().parse().unwrap()
}

#[test]
fn the_services_are_hardened_and_the_engine_keeps_what_it_needs() {
    let dir = temp_dir("security");
    copy_built(
        &units(),
        &["dsv4.socket", "dsv4.service", "dsv4-sysfs@.service"],
        dir.path(),
    );
    let e = exposure(dir.path(), "dsv4.service");
    assert!(e <= 2.0, "dsv4.service: exposure {e}");
    // The root helper is sandboxed further still; an instance of the template stands for it.
    std::fs::copy(
        dir.path().join("dsv4-sysfs@.service"),
        dir.path().join("dsv4-sysfs@gpu:card1:auto.service"),
    )
    .unwrap();
    let e = exposure(dir.path(), "dsv4-sysfs@gpu:card1:auto.service");
    assert!(e <= 1.0, "dsv4-sysfs@.service: exposure {e}");
    // The GPU stays reachable: no PrivateDevices, and the devices the engine needs.
    let unit = std::fs::read_to_string(units().join("dsv4.service")).unwrap();
    assert!(!unit.contains("PrivateDevices="), "{unit}");
    for line in [
        "DeviceAllow=/dev/kfd rw",
        "DeviceAllow=char-drm rw",
        "SupplementaryGroups=render video",
    ] {
        assert!(unit.lines().any(|l| l == line), "{line}");
    }
    // The engine runs under the daemon's syscall filter: the calls behind llama.cpp's
    // --prio, --cpu-mask and --numa (all in @resources) are not denied.
    let denied: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("SystemCallFilter=~"))
        .flat_map(str::split_whitespace)
        .collect();
    assert!(!denied.contains(&"@resources"), "{denied:?}");
    assert!(denied.contains(&"@privileged"), "{denied:?}");
}

/// Runs a systemd tool on the shipped `file` below `root` (`--root=`); it must succeed.
fn in_root(root: &Path, program: &str, args: &[&str], file: &str) {
    let out = Command::new(program)
        .args(args)
        .arg(format!("--root={}", root.display()))
        .arg(units().join(file))
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{program}: {said}");
}

#[test]
fn sysusers_and_tmpfiles_make_the_user_and_the_state_folder() {
    let root = temp_dir("sysroot");
    std::fs::create_dir_all(root.path().join("etc")).unwrap();
    in_root(root.path(), "systemd-sysusers", &[], "dsv4.sysusers");
    let passwd = std::fs::read_to_string(root.path().join("etc/passwd")).unwrap();
    let user = passwd
        .lines()
        .find(|l| l.starts_with("dsv4:"))
        .unwrap_or_else(|| panic!("{passwd}"));
    assert!(user.ends_with(":/var/lib/dsv4:/usr/sbin/nologin"), "{user}");
    let group = std::fs::read_to_string(root.path().join("etc/group")).unwrap();
    assert!(group.lines().any(|l| l.starts_with("dsv4:")), "{group}");
    in_root(
        root.path(),
        "systemd-tmpfiles",
        &["--create"],
        "dsv4.tmpfiles",
    );
    let state = root.path().join("var/lib/dsv4");
    let meta = std::fs::metadata(&state).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.mode() & 0o7777, 0o750);
}
