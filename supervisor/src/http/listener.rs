//! The API listener: taken from systemd socket activation, or bound from the config.
//!
//! Owns: the choice of listening socket. With `LISTEN_FDS`/`LISTEN_PID` (sd_listen_fds(3))
//! the socket named `api` (`FileDescriptorName=api`), or else the first stream socket, is the
//! API listener and `--listen`/`api.listen` are ignored. Must run before any thread starts:
//! the activation variables are removed from the environment so the engine does not inherit
//! them, and the fds are made close-on-exec so the engine does not inherit the listener.

use std::net::TcpListener as StdListener;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use anyhow::{bail, Context, Result};
use nix::sys::socket::{getsockopt, sockopt};

/// Where the API listener came from, for the log.
#[derive(Debug)]
pub enum Origin {
    Activated { fd: RawFd, name: String },
    Bound { addr: String },
}

/// The listening fds systemd passed, each with its name, taken out of the environment.
///
/// # Safety
///
/// Must be called while the process has a single thread (from `main`, before the async
/// runtime, the log writer or anything else starts a thread): it removes `LISTEN_PID`,
/// `LISTEN_FDS` and `LISTEN_FDNAMES` from the environment, which races with any other thread
/// reading the environment. Call it at most once: the fds it wraps are then owned (and
/// closed) by what it returns.
pub unsafe fn take_activation_fds() -> Result<Vec<(OwnedFd, String)>> {
    // SAFETY: single-threaded, by this function's contract, as `remove_var` inside requires.
    let fds = unsafe { sd_notify::listen_fds_with_names_and_unset_env() }
        .context("reading the sockets passed by systemd (LISTEN_FDS)")?;
    Ok(fds
        .map(|(fd, name)| {
            // SAFETY: sd_listen_fds(3): fds from 3 to 3+LISTEN_FDS-1 are ours and open; each is
            // wrapped once, so it is closed exactly once.
            (unsafe { OwnedFd::from_raw_fd(fd) }, name)
        })
        .collect())
}

/// Takes the activated fd named `name` (`peers`) out of `activated`, as a listener.
pub fn take_named(
    activated: &mut Vec<(OwnedFd, String)>,
    name: &str,
) -> Result<Option<StdListener>> {
    let Some(at) = activated.iter().position(|(_, n)| n == name) else {
        return Ok(None);
    };
    let (fd, _) = activated.remove(at);
    let listener = StdListener::from(fd);
    listener
        .set_nonblocking(true)
        .with_context(|| format!("setting the activated socket `{name}` non-blocking"))?;
    Ok(Some(listener))
}

/// Picks the API listener: the activated fd named `api`, else the first stream socket among
/// the activated fds, else a fresh bind of `listen`.
pub fn api_listener(
    activated: Vec<(OwnedFd, String)>,
    listen: &str,
) -> Result<(StdListener, Origin)> {
    if !activated.is_empty() {
        let mut chosen = None;
        let mut first_stream = None;
        for (fd, name) in activated {
            let stream = getsockopt(&fd, sockopt::SockType)
                .is_ok_and(|t| t == nix::sys::socket::SockType::Stream);
            let listening = getsockopt(&fd, sockopt::AcceptConn).unwrap_or(false);
            if !(stream && listening) {
                tracing::warn!("ignoring passed fd `{name}`: not a listening stream socket");
                continue;
            }
            if name == "api" {
                chosen = Some((fd, name));
                break;
            }
            first_stream.get_or_insert((fd, name));
        }
        let Some((fd, name)) = chosen.or(first_stream) else {
            bail!("systemd passed sockets (LISTEN_FDS) but none is a listening stream socket");
        };
        use std::os::fd::AsRawFd;
        let raw = fd.as_raw_fd();
        let listener = StdListener::from(fd);
        listener
            .set_nonblocking(true)
            .context("setting the activated socket non-blocking")?;
        return Ok((listener, Origin::Activated { fd: raw, name }));
    }
    let listener = StdListener::bind(listen)
        .with_context(|| format!("binding the API listener on {listen}"))?;
    listener
        .set_nonblocking(true)
        .context("setting the API listener non-blocking")?;
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| listen.to_string());
    Ok((listener, Origin::Bound { addr }))
}
