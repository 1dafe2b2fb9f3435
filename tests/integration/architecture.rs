//! The shape of the workspace, read from cargo itself: which crate links which.

use std::process::Command;

use crate::support::*;

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

/// Every method, signal and property the running daemon's D-Bus interface has (as it
/// introspects itself on a private bus) is in `docs/dbus.md` by name in backquotes, alone
/// (`State`) or with its signature (`Start()`), so the reference cannot drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dbus_member_is_documented() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&Setup::default().session_bus(&bus));
    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    let xml = {
        let t = std::time::Instant::now();
        loop {
            let proxy = zbus::fdo::IntrospectableProxy::builder(&conn)
                .destination(dsv4_client::BUS_NAME)
                .unwrap()
                .path(dsv4_client::OBJECT_PATH)
                .unwrap()
                .build()
                .await
                .unwrap();
            match proxy.introspect().await {
                Ok(xml) if xml.contains(dsv4_client::INTERFACE) => break xml,
                other => {
                    assert!(
                        t.elapsed() < PATIENCE,
                        "dsv4d never answered Introspect: {other:?}\n{}",
                        d.log()
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    };
    // The members of our interface only (the standard ones come after it or before it).
    let start = xml
        .find(&format!("<interface name=\"{}\">", dsv4_client::INTERFACE))
        .expect("the interface in the introspection");
    let body = &xml[start..];
    let body = &body[..body.find("</interface>").expect("its end")];
    let mut members = Vec::new();
    for kind in ["method", "signal", "property"] {
        let tag = format!("<{kind} name=\"");
        for (at, _) in body.match_indices(&tag) {
            let rest = &body[at + tag.len()..];
            let name = &rest[..rest.find('"').unwrap()];
            members.push((kind, name.to_string()));
        }
    }
    assert!(
        members.iter().filter(|(k, _)| *k == "method").count() >= 10,
        "too few methods read: {members:?}\n{xml}"
    );
    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dbus.md");
    let doc = std::fs::read_to_string(&doc_path).expect("docs/dbus.md");
    let missing: Vec<String> = members
        .iter()
        .filter(|(_, name)| {
            !doc.contains(&format!("`{name}`")) && !doc.contains(&format!("`{name}("))
        })
        .map(|(kind, name)| format!("{kind} {name}"))
        .collect();
    assert!(
        missing.is_empty(),
        "not in {}: {missing:?}",
        doc_path.display()
    );
}
