//! The Debian package: it builds (`packaging/deb/build`), holds the expected files, and, in
//! CI (or with `DSV4_TEST_INSTALL=1`: it installs the package on this machine), installs,
//! gives `dsv4ctl --version` and its manual page, and purges without leaving anything.

use std::path::Path;
use std::process::Command;

use crate::support::ns::{deb, run};
use crate::support::*;

const EXPECTED: &[&str] = &[
    "./usr/bin/dsv4d",
    "./usr/bin/dsv4ctl",
    "./usr/libexec/dsv4/dsv4-sysfs",
    "./usr/libexec/dsv4/dsv4-wake",
    "./usr/lib/systemd/system/dsv4.socket",
    "./usr/lib/systemd/system/dsv4.service",
    "./usr/lib/systemd/system/dsv4-sysfs@.service",
    "./usr/lib/systemd/system/dsv4-peers@.socket",
    "./usr/lib/systemd/system/dsv4-link@.socket",
    "./usr/lib/systemd/system/dsv4-link@.service",
    "./usr/lib/systemd/system/dsv4-wake@.service",
    "./usr/lib/systemd/user/dsv4.socket",
    "./usr/lib/systemd/user/dsv4.service",
    "./usr/lib/systemd/user/dsv4-notify.service",
    "./usr/share/dbus-1/system.d/io.github.dsv4.Supervisor1.conf",
    "./usr/share/dbus-1/system-services/io.github.dsv4.Supervisor1.service",
    "./usr/share/polkit-1/rules.d/50-dsv4.rules",
    "./usr/lib/sysusers.d/dsv4.conf",
    "./usr/lib/tmpfiles.d/dsv4.conf",
    "./etc/dsv4/supervisor.yaml",
    "./etc/dsv4/supervisor.yaml.d/",
    "./etc/dsv4/profiles/64k.yaml",
    "./etc/dsv4/profiles/320k.yaml",
    "./usr/share/man/man8/dsv4d.8.gz",
    "./usr/share/man/man5/supervisor.yaml.5.gz",
    "./usr/share/man/man1/dsv4ctl.1.gz",
    "./usr/share/bash-completion/completions/dsv4ctl",
    "./usr/share/zsh/vendor-completions/_dsv4ctl",
    "./usr/share/fish/vendor_completions.d/dsv4ctl.fish",
    "./usr/share/doc/dsv4/copyright",
    "./usr/share/doc/dsv4/README.md",
    "./usr/share/doc/dsv4/docs/configuration.md",
    "./usr/share/doc/dsv4/docs/security.md",
];

#[test]
fn the_deb_builds_installs_and_purges_clean() {
    let deb = deb();
    let listing = run(Command::new("dpkg-deb").args(["-c", deb]));
    let files: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .collect();
    for want in EXPECTED {
        assert!(
            files.contains(want),
            "{want} not in the package:\n{listing}"
        );
    }
    let conffiles = run(Command::new("dpkg-deb").args(["-I", deb, "conffiles"]));
    assert_eq!(
        conffiles.lines().collect::<Vec<_>>(),
        [
            "/etc/dsv4/profiles/320k.yaml",
            "/etc/dsv4/profiles/64k.yaml",
            "/etc/dsv4/supervisor.yaml"
        ]
    );
    let control = run(Command::new("dpkg-deb").args(["-f", deb, "Package", "Version"]));
    assert!(control.contains("Package: dsv4"), "{control}");

    let install = std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("DSV4_TEST_INSTALL").is_ok_and(|v| v == "1");
    if !install {
        eprintln!(
            "the package was built and checked; installing it on this machine runs only in CI \
             (CI=true) or with DSV4_TEST_INSTALL=1"
        );
        return;
    }
    let _one_at_a_time = package_lock();
    run(Command::new("dpkg").args(["-i", deb]));
    let version = run(Command::new("/usr/bin/dsv4ctl").arg("--version"));
    assert!(version.starts_with("dsv4ctl "), "{version}");
    let page = run(Command::new("man").args(["-w", "dsv4ctl"]));
    assert_eq!(page.trim(), "/usr/share/man/man1/dsv4ctl.1.gz");
    let page = run(Command::new("man").args(["-w", "8", "dsv4d"]));
    assert_eq!(page.trim(), "/usr/share/man/man8/dsv4d.8.gz");
    let page = run(Command::new("man").args(["-w", "5", "supervisor.yaml"]));
    assert_eq!(page.trim(), "/usr/share/man/man5/supervisor.yaml.5.gz");
    assert!(
        Path::new("/etc/dsv4/supervisor.yaml.d").is_dir(),
        "no drop-in folder"
    );
    assert!(Path::new("/var/lib/dsv4").is_dir(), "no state folder");
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    assert!(
        passwd.lines().any(|l| l.starts_with("dsv4:")),
        "no dsv4 user"
    );
    // The installed configuration is the shipped one, and dsv4d reads it (it names the
    // example model paths, which are not on this machine).
    let check = Command::new("/usr/bin/dsv4d")
        .args(["--check-config", "--config", "/etc/dsv4/supervisor.yaml"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(said.contains("this is the example path shipped"), "{said}");

    run(Command::new("dpkg").args(["-P", "dsv4"]));
    for gone in [
        "/usr/bin/dsv4ctl",
        "/usr/bin/dsv4d",
        "/etc/dsv4",
        "/var/lib/dsv4",
        "/usr/lib/systemd/system/dsv4.service",
        "/usr/share/man/man1/dsv4ctl.1.gz",
    ] {
        assert!(!Path::new(gone).exists(), "{gone} left after purge");
    }
}
