//! Engines a previous dsv4d left running.
//!
//! Owns: the record of the running engine's process group and mark (`state_dir/engine-group`;
//! the mark every engine process carries in its environment is `DSV4_ENGINE_TAG`, see
//! `dsv4_engine::procs`), and ending, at start-up, the processes that still carry the
//! recorded mark, in the recorded group or not. Must not: signal a process without the mark
//! (the mark, 128 random bits, is what tells our engine from a stranger's), or run once an
//! engine of this daemon exists.
//!
//! Why: the engine child gets `PR_SET_PDEATHSIG`, and under systemd the cgroup goes with the
//! service, but a `command` that is a wrapper script without `exec` outlives neither only by
//! accident: when dsv4d is SIGKILLed outside systemd, the death signal reaches the script
//! (the child) and not the real engine it started, which holds 80 GiB of GTT memory with
//! nobody left to stop it. The engine's process group and mark are written down before it
//! runs, and the next dsv4d ends whatever of it is left before it starts an engine of its own.
//!
//! Process state comes from this machine's own `/proc`, not from `--sysroot` (which is for
//! the hardware readers): the processes to signal are real ones.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_engine::procs;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The environment variable that marks an engine's processes (inherited by what it starts).
pub const TAG_VAR: &str = dsv4_engine::procs::MARK_VAR;
/// The record's file name in `state_dir`.
pub const RECORD: &str = "engine-group";

/// An engine's process group and its mark, as written down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub pgid: u32,
    pub tag: String,
    /// `/proc/sys/kernel/random/boot_id` when it was written: after a reboot nothing is left.
    pub boot: String,
}

impl Record {
    fn text(&self) -> String {
        format!(
            "# The process group of the engine dsv4d runs (removed when it exits).\n\
             pgid={}\ntag={}\nboot={}\n",
            self.pgid, self.tag, self.boot
        )
    }

    fn parse(text: &str) -> Option<Record> {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                .map(str::trim)
                .filter(|v| !v.is_empty())
        };
        Some(Record {
            pgid: field("pgid")?.parse().ok().filter(|p| *p > 1)?,
            tag: field("tag")?.to_string(),
            boot: field("boot")?.to_string(),
        })
    }
}

/// A fresh mark for an engine about to start.
pub fn new_tag() -> io::Result<String> {
    crate::lifecycle::engine_key::random_hex(16)
}

/// This boot's id, from `proc`.
pub(crate) fn boot_id(proc: &Path) -> io::Result<String> {
    Ok(
        std::fs::read_to_string(proc.join("sys/kernel/random/boot_id"))?
            .trim()
            .to_string(),
    )
}

/// Writes down the engine group `pgid` with `tag`, replacing any earlier record.
pub fn write(state_dir: &Path, pgid: u32, tag: &str) -> io::Result<()> {
    let record = Record {
        pgid,
        tag: tag.to_string(),
        boot: boot_id(Path::new("/proc"))?,
    };
    crate::host::state_file::write_atomic(&state_dir.join(RECORD), record.text().as_bytes())
}

/// The record of a running engine's group, removed when dropped (with the engine).
#[derive(Debug)]
pub struct Guard {
    state_dir: PathBuf,
    pgid: u32,
}

impl Guard {
    /// Writes the record (see [`write`]).
    pub fn write(state_dir: &Path, pgid: u32, tag: &str) -> io::Result<Guard> {
        write(state_dir, pgid, tag)?;
        Ok(Guard {
            state_dir: state_dir.to_path_buf(),
            pgid,
        })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        clear(&self.state_dir, self.pgid);
    }
}

/// Removes the record of the group `pgid`, if it is the one written down.
pub fn clear(state_dir: &Path, pgid: u32) {
    let path = state_dir.join(RECORD);
    let ours = crate::host::regular::read_state(&path)
        .and_then(|t| Record::parse(&t))
        .is_some_and(|r| r.pgid == pgid);
    if ours {
        let _ = std::fs::remove_file(&path);
    }
}

/// What [`reap`] found and did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Each process ended: its pid and its command line.
    pub ended: Vec<(u32, String)>,
    /// Those that needed SIGKILL after the grace.
    pub killed: usize,
}

/// Ends the processes a previous daemon's engine left (see the module header), from the
/// record in `state_dir` and the processes in `proc` (`/proc`): SIGTERM to each, SIGKILL to
/// those still there after `grace`. The record goes in any case. A problem reading it is
/// logged, never fatal: a start must not fail over it.
pub async fn reap(state_dir: &Path, proc: &Path, grace: Duration) -> Reaped {
    let path = state_dir.join(RECORD);
    let text = match crate::host::regular::read_text(&path, crate::host::regular::STATE_MAX) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Reaped::default(),
        Err(e) => {
            // Not removed: what is there is not dsv4d's (a FIFO, a folder), so it stays as
            // it was found, said at every start.
            let why = crate::host::regular::shown(&path, &e);
            tracing::warn!("{why}; no engine left by a previous dsv4d is looked for");
            return Reaped::default();
        }
    };
    let _ = std::fs::remove_file(&path);
    let Some(record) = Record::parse(&text) else {
        tracing::warn!("ignored {}: not an engine group record", path.display());
        return Reaped::default();
    };
    if boot_id(proc).ok().as_deref() != Some(record.boot.as_str()) {
        // Written before a reboot: its processes are gone.
        return Reaped::default();
    }
    // In the recorded group or not: an engine started by a `setsid` wrapper, or one that
    // daemonized, left the group but kept the mark.
    let left = procs::marked(proc, &record.tag);
    let mut reaped = Reaped::default();
    for pid in &left {
        let cmdline = procs::cmdline(proc, *pid);
        tracing::warn!(
            pid,
            pgid = record.pgid,
            "ending an engine process a previous dsv4d left running: {cmdline}"
        );
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGTERM);
        reaped.ended.push((*pid, cmdline));
    }
    let deadline = tokio::time::Instant::now() + grace;
    let mut alive: Vec<u32> = left;
    while !alive.is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        alive.retain(|pid| procs::is_marked(proc, *pid, &record.tag));
    }
    for pid in &alive {
        if procs::is_marked(proc, *pid, &record.tag) {
            tracing::warn!(pid, "the leftover engine process ignored SIGTERM: SIGKILL");
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
            reaped.killed += 1;
        }
    }
    // Gone before this returns: its memory is what the next engine needs.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while alive
        .iter()
        .any(|p| procs::is_marked(proc, *p, &record.tag))
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    reaped
}

/// The record's path in `state_dir`, for messages.
pub fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join(RECORD)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let r = Record {
            pgid: 4242,
            tag: "abc".into(),
            boot: "b-1".into(),
        };
        assert_eq!(Record::parse(&r.text()), Some(r));
        for bad in [
            "",
            "pgid=1\ntag=a\nboot=b\n",
            "pgid=x\ntag=a\nboot=b\n",
            "pgid=5\ntag=\nboot=b\n",
            "pgid=5\ntag=a\n",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    /// A shell in a group of its own that starts a `sleep` without `exec` and waits for it,
    /// as a wrapper script does; every process marked with `tag` if given.
    fn wrapper(tag: Option<&str>) -> std::process::Child {
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "sleep 600 & wait"])
            .process_group(0)
            .stdin(Stdio::null());
        if let Some(tag) = tag {
            cmd.env(TAG_VAR, tag);
        }
        cmd.spawn().unwrap()
    }

    fn group_members(pgid: u32) -> Vec<u32> {
        let record = Record {
            pgid,
            tag: String::new(),
            boot: String::new(),
        };
        let mut pids: Vec<u32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|s| dsv4_engine::procs::parse_stat(&s))
                    .is_some_and(|st| st.state != 'Z' && st.pgrp == record.pgid)
            })
            .collect();
        pids.sort_unstable();
        pids
    }

    async fn wait_members(pgid: u32, n: usize) -> Vec<u32> {
        for _ in 0..250 {
            let m = group_members(pgid);
            if m.len() == n {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "group {pgid} never had {n} members: {:?}",
            group_members(pgid)
        );
    }

    #[tokio::test]
    async fn a_recorded_group_is_ended_and_only_its_marked_processes() {
        let state = tempfile::tempdir().unwrap();
        let tag = new_tag().unwrap();
        let mut ours = wrapper(Some(&tag));
        let pgid = ours.id();
        write(state.path(), pgid, &tag).unwrap();
        // Another group, whose processes carry another mark, is left alone.
        let mut stranger = wrapper(Some("another-tag"));
        let members = wait_members(pgid, 2).await;
        wait_members(stranger.id(), 2).await;

        let reaped = reap(state.path(), Path::new("/proc"), Duration::from_secs(5)).await;
        let ended: Vec<u32> = reaped.ended.iter().map(|(p, _)| *p).collect();
        assert_eq!(ended, members);
        assert!(
            reaped.ended.iter().any(|(_, c)| c == "sleep 600"),
            "{reaped:?}"
        );
        assert_eq!(reaped.killed, 0);
        let _ = ours.wait();
        wait_members(pgid, 0).await;
        assert!(!record_path(state.path()).exists());
        assert_eq!(group_members(stranger.id()).len(), 2);

        // A record that names the stranger's group with our mark, as when the group number
        // was reused after our group was gone: nothing there carries the mark.
        write(state.path(), stranger.id(), &tag).unwrap();
        let reaped = reap(state.path(), Path::new("/proc"), Duration::from_secs(5)).await;
        assert_eq!(reaped, Reaped::default());
        assert_eq!(group_members(stranger.id()).len(), 2);
        let _ = nix::sys::signal::killpg(Pid::from_raw(stranger.id() as i32), Signal::SIGKILL);
        let _ = stranger.wait();
    }

    /// A wrapper that starts its engine in a session of its own (`setsid engine & wait`):
    /// the engine is outside the recorded group, with the mark.
    #[tokio::test]
    async fn a_marked_process_that_left_the_recorded_group_is_ended_too() {
        let state = tempfile::tempdir().unwrap();
        let tag = new_tag().unwrap();
        let pidfile = state.path().join("engine.pid");
        let mut cmd = Command::new("/bin/sh");
        cmd.args([
            "-c",
            &format!(
                "setsid sh -c 'echo $$ > {}; exec sleep 600' & wait",
                pidfile.display()
            ),
        ])
        .process_group(0)
        .stdin(Stdio::null())
        .env(TAG_VAR, &tag);
        let mut ours = cmd.spawn().unwrap();
        let pgid = ours.id();
        let mut engine = None;
        for _ in 0..500 {
            engine = std::fs::read_to_string(&pidfile)
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok());
            if engine.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let engine = engine.expect("the engine wrote its pid");
        write(state.path(), pgid, &tag).unwrap();
        let reaped = reap(state.path(), Path::new("/proc"), Duration::from_secs(5)).await;
        let ended: Vec<u32> = reaped.ended.iter().map(|(p, _)| *p).collect();
        assert!(ended.contains(&engine), "{reaped:?} misses pid {engine}");
        assert!(
            !procs::is_marked(Path::new("/proc"), engine, &tag),
            "pid {engine} outside the group is gone"
        );
        let _ = ours.wait();
    }

    #[tokio::test]
    async fn a_record_from_another_boot_or_clear_leaves_processes_alone() {
        let state = tempfile::tempdir().unwrap();
        let tag = new_tag().unwrap();
        let mut ours = wrapper(Some(&tag));
        let pgid = ours.id();
        wait_members(pgid, 2).await;
        let old = Record {
            pgid,
            tag: tag.clone(),
            boot: "another-boot".into(),
        };
        std::fs::write(record_path(state.path()), old.text()).unwrap();
        assert_eq!(
            reap(state.path(), Path::new("/proc"), Duration::from_secs(1)).await,
            Reaped::default()
        );
        assert!(!record_path(state.path()).exists());

        write(state.path(), pgid, &tag).unwrap();
        clear(state.path(), pgid + 1);
        assert!(
            record_path(state.path()).exists(),
            "another group's record stays"
        );
        clear(state.path(), pgid);
        assert!(!record_path(state.path()).exists());
        assert_eq!(
            reap(state.path(), Path::new("/proc"), Duration::from_secs(1)).await,
            Reaped::default()
        );
        assert_eq!(group_members(pgid).len(), 2);
        let _ = nix::sys::signal::killpg(Pid::from_raw(pgid as i32), Signal::SIGKILL);
        let _ = ours.wait();
    }
}
