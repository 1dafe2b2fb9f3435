//! Several boxes on this machine: one network namespace per box, the coordinator's joined to
//! each worker's by a veth pair on a private range (TESTING.md §9). Each box has its own
//! loopback, so each dsv4d and engine keep their own `127.0.0.1` ports. Removed on drop,
//! with whatever still runs in them (only processes the test started run there).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{real, Daemon, Setup, TempDir};

/// The boxes of one test: box 0 the coordinator, boxes 1.. its workers.
pub struct Boxes {
    names: Vec<String>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Boxes {
    /// A coordinator box and `workers` worker boxes, each worker linked to the coordinator:
    /// worker `i` is `10.231.i.2`, the coordinator `10.231.i.1` on that link.
    pub fn new(workers: u8) -> Boxes {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}x{n}", std::process::id());
        let names: Vec<String> = (0..=workers).map(|i| format!("dsv4-{tag}-{i}")).collect();
        let boxes = Boxes { names };
        for name in &boxes.names {
            ip(&["netns", "add", name]);
            ip(&["-n", name, "link", "set", "lo", "up"]);
        }
        for i in 1..=workers {
            // Interface names are at most 15 bytes: short, and unique per test.
            let (c, w) = (format!("c{tag}{i}"), format!("w{tag}{i}"));
            let (c, w) = (shorten(&c), shorten(&w));
            let coordinator = &boxes.names[0];
            let worker = &boxes.names[i as usize];
            ip(&[
                "link",
                "add",
                &c,
                "netns",
                coordinator,
                "type",
                "veth",
                "peer",
                "name",
                &w,
                "netns",
                worker,
            ]);
            ip(&[
                "-n",
                coordinator,
                "addr",
                "add",
                &format!("10.231.{i}.1/24"),
                "dev",
                &c,
            ]);
            ip(&[
                "-n",
                worker,
                "addr",
                "add",
                &format!("10.231.{i}.2/24"),
                "dev",
                &w,
            ]);
            ip(&["-n", coordinator, "link", "set", &c, "up"]);
            ip(&["-n", worker, "link", "set", &w, "up"]);
        }
        boxes
    }

    /// The namespace of box `i`.
    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    /// The address of worker `i` on its link.
    pub fn worker(&self, i: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, i, 2)
    }

    /// The coordinator's address on the link to worker `i`.
    pub fn coordinator(&self, i: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 231, i, 1)
    }

    /// A command prefix that runs a program in box `i`.
    pub fn exec(&self, i: usize) -> Vec<String> {
        ["ip", "netns", "exec", &self.names[i]]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// Runs `program args` in box `i` and returns its exit status and output.
    pub fn run(&self, i: usize, program: &str, args: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.names[i], program])
            .args(args)
            .output()
            .expect("run in a box")
    }

    /// The pids of the processes running in box `i`.
    pub fn pids(&self, i: usize) -> Vec<u32> {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.names[i]])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// The TCP ports box `i` listens on, each with its address (from its `/proc/net/tcp`).
    pub fn listening(&self, i: usize) -> Vec<(Ipv4Addr, u16)> {
        let out = self.run(i, "cat", &["/proc/net/tcp"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .skip(1)
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                // st 0A: LISTEN.
                if f.get(3) != Some(&"0A") {
                    return None;
                }
                let (addr, port) = f.get(1)?.split_once(':')?;
                let addr = u32::from_str_radix(addr, 16).ok()?;
                let port = u16::from_str_radix(port, 16).ok()?;
                Some((Ipv4Addr::from(u32::from_be(addr)), port))
            })
            .collect()
    }
}

/// The worker's peers port, on its link.
pub const PEERS_PORT: u16 = 7070;
/// The key both sides hold.
pub const KEY: &str = "a-coordinators-key-of-32-characters!";

/// A key file of `key` in `dir`, private.
pub fn key_file(dir: &TempDir, name: &str, key: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path().join(name);
    std::fs::write(&path, format!("{key}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// A test's key files, both holding [`KEY`]: a worker box's `peers.keys_file` and the
/// coordinator's `key_file` for it.
pub struct Keys {
    _dir: TempDir,
    pub worker: PathBuf,
    pub coordinator: PathBuf,
}

impl Keys {
    pub fn new() -> Keys {
        let dir = super::temp_dir("cluster-keys");
        Keys {
            worker: key_file(&dir, "peers.keys", KEY),
            coordinator: key_file(&dir, "worker.key", KEY),
            _dir: dir,
        }
    }
}

/// A worker box's dsv4d, in box `i`: its only profile, `rpc`, runs the real rpc-server; it
/// lends to the coordinators whose keys are in `keys`. Returned once its peers port is open.
pub async fn worker(boxes: &Boxes, i: u8, keys: &Path) -> Daemon {
    start_worker(&worker_setup(boxes, i, keys)).await
}

/// The setup of [`worker`], to change before it starts.
pub fn worker_setup(boxes: &Boxes, i: u8, keys: &Path) -> Setup {
    let mut s = Setup::default()
        .engine("idle_timeout", "2s")
        .engine("stop_timeout", "5s")
        .top_level(
            "peers",
            &format!(
                "{{ listen: \"{}:{PEERS_PORT}\", keys_file: {} }}",
                boxes.worker(i),
                keys.display()
            ),
        );
    s.custom_profiles.insert(
        "rpc".into(),
        format!(
            "engine: rpc-server\ncommand: {}\n",
            real::rpc_server().display()
        ),
    );
    s.default_profile = "rpc".into();
    s.wrapper = boxes.exec(i as usize);
    s
}

/// A worker box's dsv4d as `s` says, returned once its peers port is open.
pub async fn start_worker(s: &Setup) -> Daemon {
    let d = Daemon::start(s);
    // Its API socket is the test's, open before dsv4d runs; the peers port is its own.
    d.log_with(&["lending to coordinators on other boxes at"])
        .await;
    d
}

/// The coordinator's dsv4d, in box 0: its profile `tiny` runs the real llama-server on the
/// tiny model with every layer on its workers, held with `key_file`.
pub fn coordinator(boxes: &Boxes, workers: &[u8], key_file: &Path) -> Daemon {
    Daemon::start(&coordinator_setup(boxes, workers, key_file))
}

/// The setup of [`coordinator`], to change before it starts.
pub fn coordinator_setup(boxes: &Boxes, workers: &[u8], key_file: &Path) -> Setup {
    let mut s = real::setup_with_args(&["-ngl", "99", "-lv", "4"]);
    let list: Vec<String> = workers
        .iter()
        .map(|i| {
            format!(
                "  - {{ at: \"{}:{PEERS_PORT}\", profile: rpc, key_file: {} }}\n",
                boxes.worker(*i),
                key_file.display()
            )
        })
        .collect();
    let profile = s.custom_profiles.get_mut("tiny").unwrap();
    profile.push_str(&format!("workers:\n{}", list.concat()));
    s.wrapper = boxes.exec(0);
    s
}

/// At most 15 bytes, as the kernel wants an interface name: the end kept (it is unique).
fn shorten(name: &str) -> String {
    let skip = name.len().saturating_sub(15);
    name[skip..].to_string()
}

impl Drop for Boxes {
    fn drop(&mut self) {
        for i in 0..self.names.len() {
            // Only this test's processes run in its boxes.
            for pid in self.pids(i) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}
