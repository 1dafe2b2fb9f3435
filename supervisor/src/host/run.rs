//! Running a program for a bounded time, its outputs read whole: how the doctor runs the
//! engine (`--version`, `--help`) and `journalctl`, and a worker box its own doctor.

use std::time::Duration;

/// What a bounded run of a program gave.
#[derive(Debug)]
pub struct Ran {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Why a bounded run gave nothing.
#[derive(Debug)]
pub enum RunError {
    /// It could not be started.
    Spawn(std::io::Error),
    /// Its output could not be read, or its end waited for.
    Wait(std::io::Error),
    /// It did not end within the limit, and was killed.
    Timeout,
}

/// Runs `cmd` with stdin closed and both outputs read, for at most `limit`: past it the
/// program is killed.
pub async fn run_bounded(
    mut cmd: tokio::process::Command,
    limit: Duration,
) -> Result<Ran, RunError> {
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(RunError::Spawn)?;
    match tokio::time::timeout(limit, child.wait_with_output()).await {
        Err(_) => Err(RunError::Timeout),
        Ok(Err(e)) => Err(RunError::Wait(e)),
        Ok(Ok(out)) => Ok(Ran {
            status: out.status,
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }),
    }
}
