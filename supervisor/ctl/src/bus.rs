//! The connection to dsv4d: connect to the bus, check that the name has an owner, and call
//! `io.github.dsv4.Supervisor1` with every call bounded in time.

use std::future::Future;
use std::time::Duration;

use dsv4_client::kv::KvCheckpoint;
use dsv4_client::telemetry::Sample;
use dsv4_client::validate::{ValidateRequest, ValidationResult};
use dsv4_client::{
    Bus, ProfileInfo, StateChangedStream, Status, Supervisor1Proxy, ValidationDoneStream,
    ValidationProgressStream,
};
use zbus::proxy::CacheProperties;

use crate::error::Failure;

/// The bound on connecting and on every single call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// dsv4d, reached over `bus`.
pub struct Daemon {
    bus: Bus,
    proxy: Supervisor1Proxy<'static>,
}

impl Daemon {
    /// Connects to `bus` and checks that dsv4d owns its name there, so that a missing daemon
    /// is reported as such (and never waits on D-Bus activation).
    pub async fn connect(bus: Bus) -> Result<Daemon, Failure> {
        let cannot =
            |why: String| Failure::Unreachable(format!("cannot connect to the {bus} bus: {why}"));
        let builder = match bus {
            Bus::System => zbus::connection::Builder::system(),
            Bus::Session => zbus::connection::Builder::session(),
        }
        .map_err(|e| cannot(e.to_string()))?;
        let conn = match tokio::time::timeout(CALL_TIMEOUT, builder.build()).await {
            Err(_) => {
                return Err(cannot(format!(
                    "no answer within {}s",
                    CALL_TIMEOUT.as_secs()
                )))
            }
            Ok(Err(e)) => return Err(cannot(e.to_string())),
            Ok(Ok(conn)) => conn,
        };

        let dbus = bounded(bus, "the bus's proxy", zbus::fdo::DBusProxy::new(&conn)).await?;
        let name = zbus::names::BusName::try_from(dsv4_client::BUS_NAME)
            .map_err(|e| Failure::Failed(format!("bad bus name: {e}")))?;
        let owned = match tokio::time::timeout(CALL_TIMEOUT, dbus.name_has_owner(name)).await {
            Err(_) => return Err(no_answer("the bus", "NameHasOwner()")),
            Ok(Err(e)) => {
                return Err(Failure::from_zbus(e.into(), bus, "NameHasOwner()"));
            }
            Ok(Ok(owned)) => owned,
        };
        if !owned {
            return Err(Failure::not_running(bus));
        }

        let proxy = bounded(
            bus,
            "the proxy",
            Supervisor1Proxy::builder(&conn)
                .cache_properties(CacheProperties::No)
                .build(),
        )
        .await?;
        Ok(Daemon { bus, proxy })
    }

    /// `Status()`, parsed (so it is validated against the client's types).
    pub async fn status(&self) -> Result<Status, Failure> {
        let json = bounded(self.bus, "Status()", self.proxy.status()).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered Status() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    /// `ListProfiles()`, parsed.
    pub async fn list_profiles(&self) -> Result<Vec<ProfileInfo>, Failure> {
        let json = bounded(self.bus, "ListProfiles()", self.proxy.list_profiles()).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered ListProfiles() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    /// `History(since, max)`, parsed: the daemon's samples of the host, oldest first.
    pub async fn history(&self, since: f64, max: u32) -> Result<Vec<Sample>, Failure> {
        let json = bounded(self.bus, "History()", self.proxy.history(since, max)).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered History() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    /// `KvCheckpoints()`, parsed.
    pub async fn kv_checkpoints(&self) -> Result<Vec<KvCheckpoint>, Failure> {
        let json = bounded(self.bus, "KvCheckpoints()", self.proxy.kv_checkpoints()).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered KvCheckpoints() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    /// `DropKv(what)`: the ids removed.
    pub async fn drop_kv(&self, what: &str) -> Result<Vec<String>, Failure> {
        let json = bounded(self.bus, "DropKv()", self.proxy.drop_kv(what)).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered DropKv() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    /// `CanaryAccept(profile)`: what was done.
    pub async fn canary_accept(&self, profile: &str) -> Result<String, Failure> {
        bounded(
            self.bus,
            "CanaryAccept()",
            self.proxy.canary_accept(profile),
        )
        .await
    }

    pub async fn start(&self) -> Result<(), Failure> {
        bounded(self.bus, "Start()", self.proxy.start()).await
    }

    /// `StartAndWait()`: the profile of the engine once it is ready. Not bounded in time here
    /// (an engine may load for minutes; the daemon answers within `engine.start_timeout`): the
    /// caller bounds it when the user asks for a timeout.
    pub async fn start_and_wait(&self) -> Result<String, Failure> {
        self.proxy
            .start_and_wait()
            .await
            .map_err(|e| Failure::from_zbus(e, self.bus, "StartAndWait()"))
    }

    /// The `StateChanged` signals from now on.
    pub async fn state_changes(&self) -> Result<StateChangedStream, Failure> {
        bounded(
            self.bus,
            "the StateChanged subscription",
            self.proxy.receive_lifecycle_changed(),
        )
        .await
    }

    /// The validation signals from now on: progress lines and the final result.
    pub async fn validation_signals(
        &self,
    ) -> Result<(ValidationProgressStream, ValidationDoneStream), Failure> {
        let progress = bounded(
            self.bus,
            "the ValidationProgress subscription",
            self.proxy.receive_validation_progress(),
        )
        .await?;
        let done = bounded(
            self.bus,
            "the ValidationDone subscription",
            self.proxy.receive_validation_done(),
        )
        .await?;
        Ok((progress, done))
    }

    /// The unique bus name of the daemon that owns the name now (it changes when another
    /// dsv4d takes its place); `None` when none does.
    pub async fn owner(&self) -> Option<String> {
        let conn = self.proxy.inner().connection();
        let dbus = zbus::fdo::DBusProxy::new(conn).await.ok()?;
        let name = zbus::names::BusName::try_from(dsv4_client::BUS_NAME).ok()?;
        let owner = tokio::time::timeout(CALL_TIMEOUT, dbus.get_name_owner(name))
            .await
            .ok()?
            .ok()?;
        Some(owner.to_string())
    }

    /// `Validate(request)`: the validation profile.
    pub async fn validate(&self, request: &ValidateRequest) -> Result<String, Failure> {
        let text = serde_json::to_string(request).unwrap_or_default();
        bounded(self.bus, "Validate()", self.proxy.validate(&text)).await
    }

    pub async fn cancel_validation(&self) -> Result<bool, Failure> {
        bounded(
            self.bus,
            "CancelValidation()",
            self.proxy.cancel_validation(),
        )
        .await
    }

    /// `Validations(profile)`, parsed: the kept results, newest first.
    pub async fn validations(&self, profile: &str) -> Result<Vec<ValidationResult>, Failure> {
        let json = bounded(self.bus, "Validations()", self.proxy.validations(profile)).await?;
        serde_json::from_str(&json).map_err(|e| {
            Failure::Failed(format!(
                "dsv4d answered Validations() with a document dsv4ctl does not understand: {e}"
            ))
        })
    }

    pub async fn stop(&self) -> Result<(), Failure> {
        bounded(self.bus, "Stop()", self.proxy.stop()).await
    }

    pub async fn stop_now(&self) -> Result<(), Failure> {
        bounded(self.bus, "StopNow()", self.proxy.stop_now()).await
    }

    pub async fn set_profile(&self, name: &str) -> Result<(), Failure> {
        bounded(self.bus, "SetProfile()", self.proxy.set_profile(name)).await
    }

    /// `Logs(since, max)`: the number to ask from next time, and the lines.
    pub async fn logs(&self, since: u64, max: u32) -> Result<(u64, Vec<String>), Failure> {
        bounded(self.bus, "Logs()", self.proxy.logs(since, max)).await
    }

    /// `WaitLogs(since, max, wait)`: as [`logs`](Self::logs), waiting up to `wait` for a line.
    pub async fn wait_logs(
        &self,
        since: u64,
        max: u32,
        wait: Duration,
    ) -> Result<(u64, Vec<String>), Failure> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        let call = self.proxy.wait_logs(since, max, wait_ms);
        match tokio::time::timeout(wait + CALL_TIMEOUT, call).await {
            Err(_) => Err(no_answer("dsv4d", "WaitLogs()")),
            Ok(Err(e)) => Err(Failure::from_zbus(e, self.bus, "WaitLogs()")),
            Ok(Ok(v)) => Ok(v),
        }
    }
}

/// Runs one D-Bus interaction of dsv4d's for at most [`CALL_TIMEOUT`].
async fn bounded<T>(
    bus: Bus,
    what: &str,
    call: impl Future<Output = zbus::Result<T>>,
) -> Result<T, Failure> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Err(_) => Err(no_answer("dsv4d", what)),
        Ok(Err(e)) => Err(Failure::from_zbus(e, bus, what)),
        Ok(Ok(v)) => Ok(v),
    }
}

fn no_answer(who: &str, what: &str) -> Failure {
    Failure::Unreachable(format!(
        "{who} did not answer {what} within {}s",
        CALL_TIMEOUT.as_secs()
    ))
}
