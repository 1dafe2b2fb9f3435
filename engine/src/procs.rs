//! An engine's processes, and who listens on its port.
//!
//! Owns: the mark every process of an engine carries in its environment
//! ([`MARK_VAR`]`=tag`, inherited by whatever the engine starts), finding the live processes
//! that carry a mark, and telling whose listening socket a loopback port is. Must not: signal
//! anything (the child and the leftover reaper do), or trust a process it cannot read: another
//! user's environment and open files are closed to us, so such a process never counts as the
//! engine's.
//!
//! Why: an engine is not always one process. A `command` that is a wrapper script, one that
//! starts the engine in a session of its own (`setsid engine "$@" & wait`), or an engine that
//! daemonizes all leave the process group the engine was started in. The mark follows them
//! all. And the engine's port is handed over by number (engines bind their own sockets), so
//! another local user who reads that number from `/proc/PID/cmdline` can bind it first: only
//! a listener held by a marked process is the engine.
//!
//! Everything here reads the `proc` given (the real `/proc` in the daemon), never sysfs
//! fixtures: the processes are real ones.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

/// The environment variable that marks an engine's processes.
pub const MARK_VAR: &str = "DSV4_ENGINE_TAG";

/// The live processes (not zombies) that carry `tag`, in pid order.
pub fn marked(proc: &Path, tag: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| is_marked(proc, *pid, tag))
        .collect();
    pids.sort_unstable();
    pids
}

/// The live processes that carry `tag`, each with its start time (see [`Stat::start`]).
fn marked_with_start(proc: &Path, tag: &str) -> Vec<(u32, u64)> {
    marked(proc, tag)
        .into_iter()
        .filter_map(|pid| Some((pid, stat(proc, pid)?.start)))
        .collect()
}

/// How many looks in a row must find none of an engine's processes before it has ended.
///
/// One look can miss a process that is there: while it `exec`s, its environment reads as
/// empty (between the new memory map and the arguments put on its stack), so a launcher that
/// daemonizes through `setsid sh -c 'exec engine'` has moments with no mark to be seen.
/// Two looks a poll apart do not both fall in such a moment.
const EMPTY_LOOKS: u32 = 2;

/// An engine's processes once its first one has exited, followed until the last is gone.
///
/// Each process seen with the mark is followed by pid and start time until it ends, even if
/// its mark can no longer be read (it `exec`s again, or clears its environment): it is still
/// the engine's. The engine has ended when [`EMPTY_LOOKS`] looks in a row find none.
#[derive(Debug, Default)]
pub struct Survivors {
    followed: std::collections::BTreeMap<u32, u64>,
    empty_looks: u32,
}

impl Survivors {
    /// One look at `proc`: whether the engine marked `tag` has ended.
    pub fn look(&mut self, proc: &Path, tag: &str) -> bool {
        let found = marked_with_start(proc, tag);
        self.update(&found, |pid, start| {
            stat(proc, pid).is_some_and(|s| s.start == start && s.state != 'Z' && s.state != 'X')
        })
    }

    /// The rule behind [`Survivors::look`]: `found` are the marked processes seen now,
    /// `lives` says whether a followed one still runs.
    fn update(&mut self, found: &[(u32, u64)], lives: impl Fn(u32, u64) -> bool) -> bool {
        self.followed.extend(found.iter().copied());
        self.followed.retain(|pid, start| lives(*pid, *start));
        if self.followed.is_empty() {
            self.empty_looks += 1;
        } else {
            self.empty_looks = 0;
        }
        self.empty_looks >= EMPTY_LOOKS
    }
}

/// Whether `pid` is alive (not a zombie) and carries `tag`.
pub fn is_marked(proc: &Path, pid: u32, tag: &str) -> bool {
    let dir = proc.join(pid.to_string());
    let alive = stat(proc, pid).is_some_and(|s| s.state != 'Z' && s.state != 'X');
    alive && has_mark(&dir.join("environ"), tag)
}

/// What `/proc/PID/stat` says of a process that matters here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub state: char,
    pub pgrp: u32,
    /// When it started, in clock ticks after boot: with the pid, it names one process (a
    /// pid is used again once its process is gone).
    pub start: u64,
}

/// `/proc/PID/stat`'s state, process group and start time, or `None` for a process that is
/// gone.
pub fn stat(proc: &Path, pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(proc.join(pid.to_string()).join("stat")).ok()?;
    parse_stat(&text)
}

/// The state letter and process group from a `/proc/PID/stat` line (proc(5): the fields after
/// the command, which is in parentheses and may itself hold spaces and parentheses).
pub fn parse_stat(text: &str) -> Option<Stat> {
    let after = &text[text.rfind(')')? + 1..];
    let mut fields = after.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    // After the group: session, tty_nr, tpgid, flags, four fault counts, four times,
    // priority, nice, num_threads and itrealvalue, then starttime (field 22).
    let start = fields.nth(16)?.parse().ok()?;
    Some(Stat { state, pgrp, start })
}

/// Whether the environment file holds `MARK_VAR=tag` (another user's is unreadable, so never
/// marked).
fn has_mark(environ: &Path, tag: &str) -> bool {
    let want = format!("{MARK_VAR}={tag}");
    std::fs::read(environ)
        .map(|env| env.split(|b| *b == 0).any(|v| v == want.as_bytes()))
        .unwrap_or(false)
}

/// A process's command line, its words joined by spaces (empty when it cannot be read).
pub fn cmdline(proc: &Path, pid: u32) -> String {
    let raw = std::fs::read(proc.join(pid.to_string()).join("cmdline")).unwrap_or_default();
    let words: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|w| !w.is_empty())
        .map(|w| String::from_utf8_lossy(w).into_owned())
        .collect();
    words.join(" ")
}

/// A listening TCP socket, from `/proc/net/tcp` or `tcp6`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    pub addr: IpAddr,
    pub uid: u32,
    pub inode: u64,
}

/// The listening sockets of `table` (the text of `/proc/net/tcp`, or of `tcp6` with `v6`)
/// that take connections to `127.0.0.1:port`: those bound to it, to `0.0.0.0`, to `::` and
/// to `::ffff:127.0.0.1`. Lines that do not parse are skipped.
pub fn parse_listeners(table: &str, v6: bool, port: u16) -> Vec<Listener> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let mut f = line.split_ascii_whitespace();
            let _slot = f.next()?;
            let (addr, p) = f.next()?.split_once(':')?;
            let _remote = f.next()?;
            let state = f.next()?;
            let (_queues, _timer, _retransmits) = (f.next()?, f.next()?, f.next()?);
            let uid = f.next()?.parse().ok()?;
            let _timeout = f.next()?;
            let inode = f.next()?.parse().ok()?;
            // 0A is TCP_LISTEN (include/net/tcp_states.h).
            if state != "0A" || u16::from_str_radix(p, 16).ok()? != port {
                return None;
            }
            let addr = parse_addr(addr, v6)?;
            reaches_loopback(addr).then_some(Listener { addr, uid, inode })
        })
        .collect()
}

/// An address as `/proc/net/tcp*` prints it: each 32-bit word of the address in network
/// order, printed as a number of this machine's byte order.
fn parse_addr(hex: &str, v6: bool) -> Option<IpAddr> {
    let words = if v6 { 4 } else { 1 };
    if hex.len() != 8 * words || !hex.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; 16];
    for i in 0..words {
        let word = u32::from_str_radix(&hex[8 * i..8 * i + 8], 16).ok()?;
        bytes[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Some(match v6 {
        false => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        true => IpAddr::V6(Ipv6Addr::from(bytes)),
    })
}

fn reaches_loopback(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => a == Ipv4Addr::LOCALHOST || a.is_unspecified(),
        IpAddr::V6(a) => a.is_unspecified() || a.to_ipv4_mapped() == Some(Ipv4Addr::LOCALHOST),
    }
}

/// The listening sockets that take connections to `127.0.0.1:port`, in this process's
/// network namespace.
pub fn listeners(proc: &Path, port: u16) -> io::Result<Vec<Listener>> {
    let mut all = parse_listeners(&std::fs::read_to_string(proc.join("net/tcp"))?, false, port);
    // A kernel without IPv6 has no tcp6.
    if let Ok(table) = std::fs::read_to_string(proc.join("net/tcp6")) {
        all.extend(parse_listeners(&table, true, port));
    }
    Ok(all)
}

/// The user who owns the `from` end of the TCP connection from `from` to `to` (both on this
/// box), as `table` (the text of `/proc/net/tcp`, or of `tcp6` with `v6`) tells it.
pub fn parse_connection_uid(
    table: &str,
    v6: bool,
    from: SocketAddr,
    to: SocketAddr,
) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let mut f = line.split_ascii_whitespace();
        let _slot = f.next()?;
        let end = |f: &mut std::str::SplitAsciiWhitespace| -> Option<SocketAddr> {
            let (addr, port) = f.next()?.split_once(':')?;
            Some(SocketAddr::new(
                parse_addr(addr, v6)?,
                u16::from_str_radix(port, 16).ok()?,
            ))
        };
        let (local, remote) = (end(&mut f)?, end(&mut f)?);
        let (_state, _queues, _timer, _retransmits) = (f.next()?, f.next()?, f.next()?, f.next()?);
        let uid = f.next()?.parse().ok()?;
        (same(local, from) && same(remote, to)).then_some(uid)
    })
}

/// The same end, whether an IPv4 address is written as such or mapped into IPv6.
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    let v4 = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    };
    a.port() == b.port() && v4(a.ip()) == v4(b.ip())
}

/// The user who owns the `from` end of a TCP connection on this box to `to`, in this
/// process's network namespace; `None` when it is not found there.
pub fn connection_uid(proc: &Path, from: SocketAddr, to: SocketAddr) -> io::Result<Option<u32>> {
    let v4 = parse_connection_uid(
        &std::fs::read_to_string(proc.join("net/tcp"))?,
        false,
        from,
        to,
    );
    if v4.is_some() {
        return Ok(v4);
    }
    match std::fs::read_to_string(proc.join("net/tcp6")) {
        Ok(table) => Ok(parse_connection_uid(&table, true, from, to)),
        Err(_) => Ok(None),
    }
}

/// Whether `pid` has the socket `inode` open.
fn holds(proc: &Path, pid: u32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    let Ok(fds) = std::fs::read_dir(proc.join(pid.to_string()).join("fd")) else {
        return false;
    };
    fds.flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
}

/// Who listens on a loopback port the engine was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortHolder {
    /// Nobody yet.
    Nobody,
    /// A process of the engine (one that carries its mark), and only such.
    Engine,
    /// Someone else.
    Other(Stranger),
}

/// A process that is not the engine's, listening on the engine's port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stranger {
    pub port: u16,
    pub uid: u32,
    /// Unknown when its open files cannot be read (another user's, without root).
    pub pid: Option<u32>,
    pub command: Option<String>,
}

impl fmt::Display for Stranger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "port {} was taken by another process (", self.port)?;
        match self.pid {
            Some(pid) => write!(f, "pid {pid}")?,
            None => f.write_str("pid unknown")?,
        }
        write!(f, ", uid {}", self.uid)?;
        if let Some(c) = self.command.as_deref().filter(|c| !c.is_empty()) {
            let shown: String = c.chars().take(120).collect();
            write!(f, ": {shown}")?;
        }
        f.write_str(")")
    }
}

/// Who listens on `127.0.0.1:port`: the engine marked `tag` only when every socket that
/// takes connections there is held by one of its processes.
pub fn port_holder(proc: &Path, port: u16, tag: &str) -> io::Result<PortHolder> {
    let listening = listeners(proc, port)?;
    if listening.is_empty() {
        return Ok(PortHolder::Nobody);
    }
    let ours = marked(proc, tag);
    for l in &listening {
        if ours.iter().any(|pid| holds(proc, *pid, l.inode)) {
            continue;
        }
        let pid = pids(proc)
            .into_iter()
            .find(|pid| holds(proc, *pid, l.inode));
        return Ok(PortHolder::Other(Stranger {
            port,
            uid: l.uid,
            pid,
            command: pid.map(|p| cmdline(proc, p)),
        }));
    }
    Ok(PortHolder::Engine)
}

fn pids(proc: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .collect()
}

#[cfg(test)]
mod connection_tests {
    use super::*;

    /// A table as the kernel writes it (two ends of one loopback connection, and a listener).
    #[test]
    fn the_owner_of_a_connections_end_is_read() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 100 1 0 100 0 0 10 0
   1: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000   998        0 200 1 0 20 4 30 10 -1
   2: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 300 1 0 20 4 30 10 -1
";
        let a = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        assert_eq!(
            parse_connection_uid(table, false, a(0xD431), a(0x1F90)),
            Some(998)
        );
        assert_eq!(
            parse_connection_uid(table, false, a(0x1F90), a(0xD431)),
            Some(0)
        );
        assert_eq!(
            parse_connection_uid(table, false, a(0xD432), a(0x1F90)),
            None
        );
    }

    /// This process's own connection, found in the real table.
    #[test]
    fn a_real_connections_owner_is_this_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(to).unwrap();
        let from = client.local_addr().unwrap();
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(
            connection_uid(Path::new("/proc"), from, to).unwrap(),
            Some(me)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from Linux 6.x (x86_64): a listener on 127.0.0.1:8080 (1F90), one on
    // 0.0.0.0:8080, one on 127.0.0.1:8081, an established connection to 8080, and a line cut
    // short.
    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 41001 1 0000000000000000 100 0 0 10 0
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 41002 1 0000000000000000 100 0 0 10 0
   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 41003 1 0000000000000000 100 0 0 10 0
   3: 0100007F:1F90 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  1000        0 41004 1 0000000000000000 20 4 30 10 -1
   4: 0100007F:1F90 00000000:0000 0A 00000000:00000000
";
    // tcp6: `::` on 8080, `::1` on 8080 (does not take 127.0.0.1), ::ffff:127.0.0.1 on 8080.
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 51001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 51002 1 0000000000000000 100 0 0 10 0
   2: 0000000000000000FFFF00000100007F:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000    33        0 51003 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn the_listeners_that_take_loopback_connections_to_a_port() {
        let le = cfg!(target_endian = "little");
        if !le {
            return; // the captures are of a little-endian machine
        }
        let v4 = parse_listeners(TCP, false, 8080);
        assert_eq!(
            v4,
            vec![
                Listener {
                    addr: "127.0.0.1".parse().unwrap(),
                    uid: 1000,
                    inode: 41001
                },
                Listener {
                    addr: "0.0.0.0".parse().unwrap(),
                    uid: 65534,
                    inode: 41002
                },
            ]
        );
        assert_eq!(parse_listeners(TCP, false, 8081).len(), 1);
        assert!(parse_listeners(TCP, false, 9).is_empty());
        let v6 = parse_listeners(TCP6, true, 8080);
        let got: Vec<(String, u32, u64)> = v6
            .iter()
            .map(|l| (l.addr.to_string(), l.uid, l.inode))
            .collect();
        assert_eq!(
            got,
            vec![
                ("::".to_string(), 0, 51001),
                ("::ffff:127.0.0.1".to_string(), 33, 51003)
            ]
        );
    }

    #[test]
    fn stat_lines_with_odd_command_names() {
        // Shaped like a real line (proc(5)), with starttime 123456.
        let s = parse_stat(
            "42 (a) b (c)) S 1 777 777 0 -1 4194560 120 0 0 0 1 2 0 0 20 0 1 0 123456 \
             8392704 250 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0",
        )
        .unwrap();
        assert_eq!(
            s,
            Stat {
                state: 'S',
                pgrp: 777,
                start: 123456,
            }
        );
        let zombie = "42 (x) Z 1 9 9 0 -1 4227084 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0";
        assert_eq!(parse_stat(zombie).unwrap().state, 'Z');
        // Cut before the start time, or not a stat line at all.
        assert_eq!(parse_stat("42 (x) Z 1 9"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn our_own_stat_line_parses() {
        let me = std::process::id();
        let s = stat(Path::new("/proc"), me).unwrap();
        assert_ne!(s.state, 'Z');
        assert!(s.start > 0, "{s:?}");
    }

    #[test]
    fn survivors_end_after_looks_in_a_row_that_find_none() {
        // Each step: the marked processes a look finds, the followed ones that live on, and
        // whether the engine has ended after it.
        type Step = (&'static [(u32, u64)], &'static [(u32, u64)], bool);
        let cases: &[(&str, &[Step])] = &[
            (
                "nothing was ever left",
                &[(&[], &[], false), (&[], &[], true)],
            ),
            (
                "a process execs while the first look is made",
                &[
                    (&[], &[], false),
                    (&[(7, 100)], &[(7, 100)], false),
                    (&[], &[], false),
                    (&[], &[], true),
                ],
            ),
            (
                "a followed process whose mark cannot be read is still the engine's",
                &[
                    (&[(7, 100)], &[(7, 100)], false),
                    (&[], &[(7, 100)], false),
                    (&[], &[(7, 100)], false),
                    (&[], &[], false),
                    (&[], &[], true),
                ],
            ),
            (
                "its pid used again by another process is not followed",
                &[
                    (&[(7, 100)], &[(7, 100)], false),
                    (&[], &[(7, 555)], false),
                    (&[], &[(7, 555)], true),
                ],
            ),
            (
                "a child seen after its parent ended keeps the engine alive",
                &[
                    (&[(7, 100)], &[(7, 100)], false),
                    (&[], &[], false),
                    (&[(9, 140)], &[(9, 140)], false),
                    (&[], &[], false),
                    (&[], &[], true),
                ],
            ),
        ];
        for (name, steps) in cases {
            let mut s = Survivors::default();
            for (i, (found, living, ended)) in steps.iter().enumerate() {
                let got = s.update(found, |pid, start| living.contains(&(pid, start)));
                assert_eq!(got, *ended, "{name}: look {i}");
            }
        }
    }

    #[test]
    fn a_stranger_is_named_with_what_is_known() {
        let s = Stranger {
            port: 40001,
            uid: 65534,
            pid: Some(77),
            command: Some("python3 grab.py".into()),
        };
        assert_eq!(
            s.to_string(),
            "port 40001 was taken by another process (pid 77, uid 65534: python3 grab.py)"
        );
        let s = Stranger {
            pid: None,
            command: None,
            ..s
        };
        assert_eq!(
            s.to_string(),
            "port 40001 was taken by another process (pid unknown, uid 65534)"
        );
    }

    /// The real thing: a socket this test listens on is found, held by this process, and is
    /// not an engine's unless this process carries the mark (it does not).
    #[test]
    fn a_listener_of_this_process_is_found_and_is_not_the_engines() {
        let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let proc = Path::new("/proc");
        let found = listeners(proc, port).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(holds(proc, std::process::id(), found[0].inode));
        match port_holder(proc, port, "no-such-mark").unwrap() {
            PortHolder::Other(s) => {
                assert_eq!(s.pid, Some(std::process::id()));
                assert_eq!(s.uid, nix::unistd::getuid().as_raw());
            }
            other => panic!("expected a stranger, got {other:?}"),
        }
        drop(l);
        assert_eq!(
            port_holder(proc, port, "no-such-mark").unwrap(),
            PortHolder::Nobody
        );
    }
}
