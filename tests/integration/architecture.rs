//! The shape of the workspace, read from cargo itself: which crate links which.

use std::process::Command;

/// The crates of the workspace a package links (normal and build dependencies, not dev),
/// one name per line as `cargo tree` prints them, without versions.
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--locked", "-e", "normal,build"])
        .args(["--prefix", "none", "--format", "{p}", "-p", package])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_daemon_links_no_terminal_crates_and_the_cli_not_the_daemon() {
    let daemon = linked("dsv4-supervisor");
    assert!(
        daemon.iter().any(|n| n == "hyper"),
        "cargo tree read wrong: {daemon:?}"
    );
    for tui in ["ratatui", "indicatif", "crossterm", "clap_complete"] {
        assert!(
            !daemon.iter().any(|n| n == tui),
            "dsv4d (dsv4-supervisor) links {tui}: the terminal crates belong to dsv4ctl"
        );
    }
    let cli = linked("dsv4ctl");
    assert!(
        cli.iter().any(|n| n == "ratatui"),
        "cargo tree read wrong: {cli:?}"
    );
    for daemon_only in ["dsv4-supervisor", "dsv4-engine", "hyper"] {
        assert!(
            !cli.iter().any(|n| n == daemon_only),
            "dsv4ctl links {daemon_only}: it must speak to the daemon only through dsv4-client"
        );
    }
}
