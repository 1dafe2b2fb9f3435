//! A socket-activated dsv4d whose configuration cannot be used: every request is answered,
//! and the daemon starts for real once the files are fixed.
//!
//! systemd hands dsv4d the API socket with the request that activated it waiting on it.
//! Exiting would leave that client, and the next ones, with an empty reply or a hang while
//! systemd restarts the service again and again. Instead each request gets 503
//! `config_invalid` with every problem and its place, in the error shape of its path's
//! protocol, and `/health` says the same. The files are read again every second; once they
//! load, the caller executes dsv4d afresh on the same socket (`LISTEN_FDS`), so no
//! connection waiting in its backlog is lost. On D-Bus, `Status()` answers with the same
//! problems. Owns: that waiting state. Must not: start an
//! engine, or read anything but the configuration.

use std::convert::Infallible;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};

use crate::config::Config;
use crate::http::http_error::{ApiError, ErrorCode, ErrorType};
use crate::http::protocol::{Api, ApiProtocol};

/// How often the files are read again.
const LOOK_AGAIN: Duration = Duration::from_secs(1);
/// What a client is told to wait before it asks again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The answer to every request while `problems` stand.
pub fn answer(path: &str, problems: &str) -> Response<Full<Bytes>> {
    let message = format!(
        "dsv4d's configuration cannot be used, so no engine starts until it is fixed (the files \
         are read again every second): {}",
        problems.lines().collect::<Vec<_>>().join("; ")
    );
    let mut r = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorType::Unavailable,
        ErrorCode::ConfigInvalid,
        message,
    )
    .retry_after(RETRY_AFTER)
    .into_response_in(ApiProtocol::of(path));
    r.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    r
}

/// The control interface meanwhile: `Status()` answers with the problems, as an error, so
/// `dsv4ctl status` says what the API says.
struct Unusable {
    problems: std::sync::Arc<std::sync::Mutex<String>>,
}

#[zbus::interface(name = "io.github.dsv4.Supervisor1")]
impl Unusable {
    async fn status(&self) -> zbus::fdo::Result<String> {
        let text = self.problems.lock().map(|p| p.clone()).unwrap_or_default();
        Err(zbus::fdo::Error::Failed(format!(
            "config_invalid: dsv4d's configuration cannot be used, so no engine starts until \
             it is fixed: {}",
            text.lines().collect::<Vec<_>>().join("; ")
        )))
    }
}

/// Takes the daemon's name on `bus` and serves [`Unusable`] there; `None` when it cannot
/// (the reason is logged).
async fn on_bus(
    bus: dsv4_client::Bus,
    problems: std::sync::Arc<std::sync::Mutex<String>>,
) -> Option<zbus::Connection> {
    let builder = match bus {
        dsv4_client::Bus::System => zbus::connection::Builder::system(),
        dsv4_client::Bus::Session => zbus::connection::Builder::session(),
    };
    let built = async {
        builder?
            .name(dsv4_client::BUS_NAME)?
            .serve_at(dsv4_client::OBJECT_PATH, Unusable { problems })?
            .build()
            .await
    };
    match built.await {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(
                "cannot take {} on the {bus} bus: {e}",
                dsv4_client::BUS_NAME
            );
            None
        }
    }
}

/// Answers every request on `listener` (and `Status()` on `bus`) until the configuration at
/// `config` loads; returns then, for the caller to start dsv4d afresh. `problems` are the
/// first load's.
pub async fn serve(
    listener: &tokio::net::TcpListener,
    bus: Option<dsv4_client::Bus>,
    config: &Path,
    problems: String,
) {
    let _ = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("configuration invalid: every request gets 503"),
    ]);
    let problems = std::sync::Arc::new(std::sync::Mutex::new(problems));
    // Kept until this function returns; the program that follows takes the name again.
    let _bus = match bus {
        Some(b) => on_bus(b, problems.clone()).await,
        None => None,
    };
    let mut watchdog = tokio::time::interval(watchdog_every());
    let mut look = tokio::time::interval(LOOK_AGAIN);
    look.tick().await;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let problems = problems.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let text = problems.lock().map(|p| p.clone()).unwrap_or_default();
                        async move { Ok::<_, Infallible>(answer(req.uri().path(), &text)) }
                    });
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(false)
                        .serve_connection(io, service)
                        .await;
                });
            }
            _ = look.tick() => {
                let path = config.to_path_buf();
                let loaded = tokio::task::spawn_blocking(move || Config::load(&path)).await;
                match loaded {
                    Ok(Ok(_)) => {
                        tracing::info!("the configuration loads now: starting afresh");
                        return;
                    }
                    Ok(Err(e)) => {
                        let text = e.to_string();
                        if let Ok(mut p) = problems.lock() {
                            if *p != text {
                                tracing::error!("the configuration still cannot be used: {text}");
                                *p = text;
                            }
                        }
                    }
                    Err(_) => {}
                }
            }
            _ = watchdog.tick() => {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
            }
        }
    }
}

/// Half the service's watchdog interval, or a minute when it has none.
fn watchdog_every() -> Duration {
    sd_notify::watchdog_enabled()
        .filter(|d| !d.is_zero())
        .map_or(Duration::from_secs(60), |d| d / 2)
}

/// Executes this program again with its own arguments, on `fd`, the activated socket, as
/// systemd passes one (fd 3, `LISTEN_FDS=1`, `LISTEN_FDNAMES=api`, `LISTEN_PID` this
/// process). Returns only on failure.
pub fn exec_again(fd: std::os::fd::RawFd) -> std::io::Error {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    const FIRST: std::os::fd::RawFd = 3;
    if fd != FIRST {
        // SAFETY: `fd` is the listener this process owns, and fd 3 is free or taken over:
        // nothing else uses it, and the process is about to be replaced.
        match unsafe { nix::unistd::dup2_raw(std::os::fd::BorrowedFd::borrow_raw(fd), FIRST) } {
            // The new fd lives on into the program that follows.
            Ok(kept) => std::mem::forget(kept),
            Err(e) => return e.into(),
        }
    }
    // A dup2 clears close-on-exec; fd 3 itself may have it (the listener was made so).
    if let Err(e) = nix::fcntl::fcntl(
        unsafe { std::os::fd::BorrowedFd::borrow_raw(FIRST) },
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
    ) {
        return e.into();
    }
    let cstr = |b: &[u8]| CString::new(b).unwrap_or_default();
    let args: Vec<CString> = std::env::args_os().map(|a| cstr(a.as_bytes())).collect();
    let mut env: Vec<CString> = std::env::vars_os()
        .filter(|(k, _)| !k.as_bytes().starts_with(b"LISTEN_"))
        .map(|(k, v)| {
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            cstr(&kv)
        })
        .collect();
    env.push(cstr(
        format!("LISTEN_PID={}", std::process::id()).as_bytes(),
    ));
    env.push(cstr(b"LISTEN_FDS=1"));
    env.push(cstr(b"LISTEN_FDNAMES=api"));
    let exe = cstr(b"/proc/self/exe");
    match nix::unistd::execve(&exe, &args, &env) {
        Err(e) => e.into(),
        Ok(never) => match never {},
    }
}
