//! Two boxes as installed: the .deb's units, unchanged, under two real systemds (each PID 1
//! of its own namespaces, `tests/systemd/ns --net`), their networks joined by a veth pair as
//! a USB4 or Ethernet link would join two boxes. Drop-ins change only paths, as in
//! `installed.rs`.
//!
//! It shows what the shipped units give a user with two boxes: the worker's peers port is
//! `dsv4-peers@ADDRESS.socket`, handed to its dsv4d (which runs in a network of its own) as
//! `peers`; the coordinator's dsv4d (also in a network of its own) reaches the worker through
//! `dsv4-link@ADDRESS.socket` and systemd-socket-proxyd; the first request wakes the
//! sleeping worker box through `dsv4-wake@` (dsv4d's own network reaches no box), then
//! starts the worker's rpc-server under its own power policy, then the coordinator's llama-server with
//! its layers on it; on the link, the worker box has only its peers port open; after the idle
//! time both engines are gone and each box's power settings are back.
//!
//! It installs the package, so it runs only in CI (`CI=true`) or with `DSV4_TEST_INSTALL=1`.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crate::installed::{
    copy_public, curl, install_allowed, lay_out, status, unit_folder, write_public, Installed,
};
use crate::support::ns::{run, Ns};
use crate::support::*;

const KEY: &str = "a-coordinators-key-of-32-characters!";
const WORKER: &str = "10.232.0.2";
const COORDINATOR: &str = "10.232.0.1";
const PEERS: &str = "10.232.0.2:7070";
const MAC: &str = "aa:bb:cc:dd:ee:01";
const LEVEL: &str =
    "root/sys/devices/pci0000:00/0000:00:08.1/0000:c5:00.0/power_dpm_force_performance_level";

/// A key file as the key files' rules want it: the dsv4 user's, mode 0600.
fn key_file(path: &Path) {
    write_public(path, &format!("{KEY}\n"));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    run(Command::new("chown").arg("dsv4:dsv4").arg(path));
}

/// The worker box's files: its one profile runs the real rpc-server; it lends to the
/// coordinator's key. The peers port comes from the socket unit, not `peers.listen`.
fn lay_out_worker(w: &Path) {
    lay_out(w);
    copy_public(&real::rpc_server(), &w.join("bin/rpc-server"), 0o755);
    key_file(&w.join("etc/peer-keys"));
    write_public(
        &w.join("etc/supervisor.yaml"),
        &format!(
            "api:\n  listen: 127.0.0.1:8080\n\
             engine:\n  idle_timeout: 3s\n  stop_timeout: 10s\n  start_timeout: 1m\n\
             power: {{ method: auto, cpu: power-saver, gpu: auto }}\n\
             monitor: {{ interval: 500ms, idle_interval: 500ms }}\n\
             memory: {{ reserve: 0GiB }}\n\
             peers: {{ keys_file: {} }}\n\
             profiles_dir: profiles\ndefault_profile: rpc\nstate_dir: /var/lib/dsv4\n",
            w.join("etc/peer-keys").display()
        ),
    );
    write_public(
        &w.join("etc/profiles/rpc.yaml"),
        &format!(
            "engine: rpc-server\ncommand: {}\n",
            w.join("bin/rpc-server").display()
        ),
    );
}

/// The coordinator box's files: its profile `tiny` runs the real llama-server with every
/// layer on the worker.
fn lay_out_coordinator(w: &Path) {
    lay_out(w);
    key_file(&w.join("etc/worker-key"));
    write_public(
        &w.join("etc/profiles/tiny.yaml"),
        &format!(
            "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: 1024\nparallel: 1\n\
             extra_args: [--no-webui, -ngl, \"99\", -lv, \"4\"]\n\
             workers:\n  - {{ at: \"{PEERS}\", profile: rpc, key_file: {}, \
             wake: {{ mac: \"{MAC}\", broadcast: \"{WORKER}:9\" }} }}\n",
            w.join("bin/llama-server").display(),
            w.join("models/tiny.gguf").display(),
            w.join("etc/worker-key").display()
        ),
    );
}

/// The box's unit folder with `more` of the installed units beside the usual ones.
fn units_with(w: &Path, more: &[&str]) -> std::path::PathBuf {
    let units = unit_folder(w);
    for u in more {
        std::fs::copy(Path::new("/usr/lib/systemd/system").join(u), units.join(u))
            .unwrap_or_else(|e| panic!("{u} not installed: {e}"));
    }
    units
}

/// Joins the two boxes' networks: the coordinator is `COORDINATOR`, the worker `WORKER`.
fn link(coordinator: &Ns, worker: &Ns) {
    run(Command::new("ip").args([
        "link",
        "add",
        "dsv4c",
        "netns",
        coordinator.pid(),
        "type",
        "veth",
        "peer",
        "name",
        "dsv4w",
        "netns",
        worker.pid(),
    ]));
    for (ns, dev, addr) in [
        (coordinator, "dsv4c", COORDINATOR),
        (worker, "dsv4w", WORKER),
    ] {
        let o = ns.sh(&format!(
            "ip addr add {addr}/24 dev {dev} && ip link set {dev} up"
        ));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

fn scratch(prefix: &str) -> tempfile::TempDir {
    // Below /var/cache, where the units' sandboxes let the service read (see installed.rs).
    let w = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/var/cache")
        .unwrap();
    std::fs::set_permissions(w.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    w
}

#[test]
fn two_boxes_run_one_engine_with_the_units_as_shipped() {
    if !install_allowed() {
        eprintln!("not run: it installs the package (CI=true or DSV4_TEST_INSTALL=1)");
        return;
    }
    let _one_at_a_time = package_lock();
    let _installed = Installed::new();
    let (wc, ww) = (scratch("dsv4-coord-"), scratch("dsv4-worker-"));
    lay_out_coordinator(wc.path());
    lay_out_worker(ww.path());
    let c = Ns::boot(
        &units_with(
            wc.path(),
            &[
                "dsv4-link@.socket",
                "dsv4-link@.service",
                "dsv4-wake@.service",
            ],
        ),
        "test.target",
        &wc.path().join("console.log"),
        true,
    );
    let w = Ns::boot(
        &units_with(ww.path(), &["dsv4-peers@.socket"]),
        "test.target",
        &ww.path().join("console.log"),
        true,
    );
    link(&c, &w);
    let start = |ns: &Ns, unit: String| {
        let o = ns.sh(&format!("systemctl start '{unit}'"));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    start(&c, format!("dsv4-link@{PEERS}.socket"));
    let level = |w: &Path| {
        std::fs::read_to_string(w.join(LEVEL))
            .unwrap()
            .trim()
            .to_string()
    };
    assert_eq!(level(ww.path()), "low");

    // The worker box sleeps (its peers port is not open yet), its network card listening.
    let packet = ww.path().join("magic-packet");
    let o = w.sh(&format!(
        "(python3 -c 'import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); \
         s.bind((\"{WORKER}\", 9)); s.settimeout(120); d, _ = s.recvfrom(512); \
         open(\"{0}.tmp\", \"w\").write(d.hex())' && mv {0}.tmp {0}) \
         </dev/null >/dev/null 2>{0}.err &",
        packet.display()
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    w.wait("the card listening", || {
        let err = std::fs::read_to_string(packet.with_extension("err")).unwrap_or_default();
        assert!(err.is_empty(), "the card: {err}");
        w.out("ss -lunH").contains(&format!("{WORKER}:9"))
    });

    // The first request wakes it (through dsv4-wake@, from the coordinator's host network),
    // then holds it once it is up: the worker's engine, then the coordinator's, with its
    // layers there.
    let chat = r#"-H 'content-type: application/json' -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8,"temperature":0}' http://127.0.0.1:8080/v1/chat/completions"#;
    let (code, body) = std::thread::scope(|scope| {
        let answer = scope.spawn(|| curl(&c, chat));
        let t = std::time::Instant::now();
        while !packet.exists() {
            assert!(
                t.elapsed() < PATIENCE,
                "no magic packet at the worker box:\n{}",
                c.out("journalctl --no-pager -o cat -u dsv4 -u 'dsv4-wake@*' -u 'dsv4-link@*'")
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        start(&w, format!("dsv4-peers@{PEERS}.socket"));
        answer.join().unwrap()
    });
    let mac: String = MAC.split(':').collect();
    assert_eq!(
        std::fs::read_to_string(&packet).unwrap(),
        format!("{}{}", "ff".repeat(6), mac.repeat(16)),
        "the magic packet"
    );
    let wake = c.out("journalctl --no-pager -o cat -u 'dsv4-wake@*'");
    assert!(
        wake.contains(&format!("sent the magic packet of {MAC}/{WORKER}:9")),
        "{wake}"
    );
    assert_eq!(
        code,
        200,
        "{body}\n{}\n--- worker:\n{}",
        c.journal(),
        w.journal()
    );
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "abcdefgh", "{v}");
    let journal = c.out("journalctl --no-pager -o cat -u dsv4");
    let held = journal
        .find(&format!("worker box {WORKER} held"))
        .unwrap_or_else(|| panic!("{journal}"));
    let started = journal.find("starting engine:").unwrap();
    assert!(held < started, "{journal}");
    assert!(
        journal.contains("RPC0[127.0.0.1:") && journal.contains("model buffer size"),
        "the coordinator's engine has no layers on the worker:\n{journal}"
    );
    // Both through the shipped units: the worker's dsv4d took its peers port from systemd,
    // and the coordinator's went out through its link unit.
    let worker_journal = w.out("journalctl --no-pager -o cat -u dsv4");
    assert!(
        worker_journal.contains(&format!(
            "lending to coordinators on other boxes at {PEERS}"
        )),
        "{worker_journal}"
    );
    assert!(
        worker_journal.contains(&format!("peer {COORDINATOR}:")),
        "the hold did not come over the link:\n{worker_journal}"
    );
    assert_eq!(c.active(&format!("dsv4-link@{PEERS}.service")), "active");
    for ns in [&c, &w] {
        let user = ns.out("ps -o user= -p $(systemctl show -p MainPID --value dsv4.service)");
        assert_eq!(user, "dsv4");
    }

    // The worker box: held by the coordinator, under its own power policy, and on the link
    // nothing but its peers port (its engine is in dsv4d's own network).
    let s = status(&w);
    assert_eq!(s["holds"][0]["from"], COORDINATOR, "{s}");
    w.wait("the worker's GPU on auto", || level(ww.path()) == "auto");
    let open = w.out("ss -ltnH | awk '{print $4}' | sort");
    assert_eq!(
        open.lines().collect::<Vec<_>>(),
        ["10.232.0.2:7070", "127.0.0.1:8080"],
        "the worker box's listening ports"
    );

    // The idle stop, on both boxes: the coordinator's engine, then its hold, then the
    // worker's engine after its own idle time; each box's settings back.
    c.wait("the coordinator's idle stop", || {
        status(&c)["state"] == dsv4_client::State::Stopped.as_str()
    });
    w.wait("the worker let go and stopped", || {
        let s = status(&w);
        s["state"] == dsv4_client::State::Stopped.as_str() && s.get("holds").is_none()
    });
    w.wait("the worker's GPU back on low", || level(ww.path()) == "low");
    c.wait("the coordinator's GPU back on low", || {
        level(wc.path()) == "low"
    });
    for ns in [&c, &w] {
        let engines = ns.out("pgrep -x 'llama-server|rpc-server' || true");
        assert!(engines.is_empty(), "engines left: {engines}");
    }
}
