//! Starting a oneshot unit of dsv4's own through systemd's D-Bus API (`StartUnit`) and
//! waiting for its job: how dsv4d, which runs unprivileged and sandboxed, has a helper unit
//! do what it may not do itself (`dsv4-sysfs@`: a root-owned sysfs file; `dsv4-wake@`: a
//! packet on the host's network). polkit lets the dsv4 user start exactly those units
//! (`units/50-dsv4.rules`).
//!
//! Owns: the start, the wait and the unit's exit status. Must not: say what the unit is for
//! (its caller words the error).

use futures_util::StreamExt;

/// Why a unit's start did not end `done`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitError {
    /// systemd (polkit) refused to start it: its words.
    Refused(String),
    /// systemd could not be asked, or answered otherwise: what it said.
    Bus(String),
    /// The unit ran and failed: its exit status when known, and how its job ended.
    Failed { status: Option<i32>, result: String },
    /// Its job did not end within the time given.
    Timeout(std::time::Duration),
}

impl UnitError {
    /// Why `unit` did not do its work, in words: `allowed` names the units polkit must let
    /// dsv4d's user start (`dsv4-sysfs@*.service`), and `meaning` what an exit code of the
    /// unit's program says, where it says more than its number.
    pub fn describe(
        &self,
        unit: &str,
        allowed: &str,
        meaning: fn(i32) -> Option<&'static str>,
    ) -> String {
        match self {
            UnitError::Refused(text) => format!(
                "systemd refused to start it ({text}): polkit must let dsv4d's user start \
                 {allowed} (/usr/share/polkit-1/rules.d/50-dsv4.rules)"
            ),
            UnitError::Bus(why) => why.clone(),
            UnitError::Failed { status, result } => {
                let why = match status {
                    Some(code) => {
                        meaning(*code).map_or_else(|| format!("exit code {code}"), str::to_string)
                    }
                    None => format!("the job ended {result}"),
                };
                format!("{why} (journalctl -u '{unit}' says more)")
            }
            UnitError::Timeout(within) => format!(
                "{unit} did not finish within {}",
                dsv4_client::duration::format(*within)
            ),
        }
    }
}

/// systemd's manager on `bus`.
pub async fn manager(bus: &zbus::Connection) -> zbus::Result<zbus::Proxy<'static>> {
    zbus::Proxy::new(
        bus,
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
    )
    .await
}

/// Starts `unit` and waits for its job to end, for at most `within`.
pub async fn start_and_wait(
    bus: &zbus::Connection,
    unit: &str,
    within: std::time::Duration,
) -> Result<(), UnitError> {
    tokio::time::timeout(within, start_and_wait_unbounded(bus, unit))
        .await
        .unwrap_or(Err(UnitError::Timeout(within)))
}

async fn start_and_wait_unbounded(bus: &zbus::Connection, unit: &str) -> Result<(), UnitError> {
    let manager = manager(bus)
        .await
        .map_err(|e| UnitError::Bus(format!("no systemd on the system bus ({e})")))?;
    // Listening (and subscribed) before the start: a job that ends at once is not missed.
    let mut removed = manager
        .receive_signal("JobRemoved")
        .await
        .map_err(|e| UnitError::Bus(format!("cannot follow systemd's jobs: {e}")))?;
    let _: Result<(), zbus::Error> = manager.call("Subscribe", &()).await;
    let job: zbus::zvariant::OwnedObjectPath = manager
        .call("StartUnit", &(unit, "replace"))
        .await
        .map_err(|e| match e {
            zbus::Error::MethodError(name, text, _)
                if name.as_str() == "org.freedesktop.DBus.Error.AccessDenied"
                    || name.as_str()
                        == "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired" =>
            {
                UnitError::Refused(text.unwrap_or_default())
            }
            zbus::Error::MethodError(name, text, _) => {
                UnitError::Bus(format!("systemd: {name}: {}", text.unwrap_or_default()))
            }
            e => UnitError::Bus(format!("systemd: {e}")),
        })?;
    let result = loop {
        let Some(msg) = removed.next().await else {
            return Err(UnitError::Bus("the system bus went away".into()));
        };
        let Ok((_, path, _, result)) =
            msg.body()
                .deserialize::<(u32, zbus::zvariant::OwnedObjectPath, String, String)>()
        else {
            continue;
        };
        if path == job {
            break result;
        }
    };
    if result == "done" {
        return Ok(());
    }
    let status = exit_status(bus, &manager, unit).await;
    Err(UnitError::Failed { status, result })
}

/// The unit's exit code, from its `ExecMainStatus`.
async fn exit_status(bus: &zbus::Connection, manager: &zbus::Proxy<'_>, unit: &str) -> Option<i32> {
    let path: zbus::zvariant::OwnedObjectPath = manager.call("GetUnit", &(unit,)).await.ok()?;
    let service = zbus::Proxy::new(
        bus,
        "org.freedesktop.systemd1",
        path,
        "org.freedesktop.systemd1.Service",
    )
    .await
    .ok()?;
    service.get_property("ExecMainStatus").await.ok()
}
