//! The control interface on D-Bus: `io.github.dsv4.Supervisor1` at
//! `/io/github/dsv4/Supervisor1`.
//!
//! Owns: the bus connection, the caller checks, and turning lifecycle status changes into
//! `PropertiesChanged` and `StateChanged`. Must not: hold lifecycle state of its own; the
//! object keeps only handles (the lifecycle actor's, the config, the statistics), and its
//! methods take `&self`.
//!
//! Reading is open to every caller. `Start`, `Stop`, `StopNow` and `SetProfile` are allowed
//! for root and the members of the control group only. The check uses the caller's
//! credentials as the bus daemon reports them (`GetConnectionCredentials`), so it holds even
//! under a bus policy that lets everyone call.

use std::sync::Arc;

use anyhow::Context as _;
use dsv4_client::{ProfileInfo, BUS_NAME, ERROR_FAILED, ERROR_UNKNOWN_PROFILE, OBJECT_PATH};
use tokio::sync::{broadcast, watch};
use zbus::message::Header;
use zbus::names::ErrorName;
use zbus::object_server::SignalEmitter;
use zbus::Connection;

use crate::config::Config;
use crate::lifecycle::{ControlError, Handle, Status};
use crate::reload::Alert;
use crate::stats::Stats;

/// Which bus to serve on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bus {
    System,
    Session,
}

impl Bus {
    fn name(self) -> &'static str {
        match self {
            Bus::System => "system",
            Bus::Session => "session",
        }
    }
}

/// Who may change the supervisor's state besides root.
#[derive(Debug, Clone)]
pub struct ControlGroup {
    pub name: String,
    /// `None` when no such group exists here: then only root may.
    pub gid: Option<u32>,
}

impl ControlGroup {
    pub fn lookup(name: &str) -> ControlGroup {
        let gid = nix::unistd::Group::from_name(name)
            .ok()
            .flatten()
            .map(|g| g.gid.as_raw());
        ControlGroup {
            name: name.to_string(),
            gid,
        }
    }
}

/// A D-Bus error with its name and message.
#[derive(Debug)]
pub struct Fault {
    name: &'static str,
    message: String,
}

impl Fault {
    fn access_denied(message: String) -> Fault {
        Fault {
            name: "org.freedesktop.DBus.Error.AccessDenied",
            message,
        }
    }
    fn failed(message: impl Into<String>) -> Fault {
        Fault {
            name: ERROR_FAILED,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.name, self.message)
    }
}

impl std::error::Error for Fault {}

impl zbus::DBusError for Fault {
    fn create_reply(&self, call: &Header<'_>) -> zbus::Result<zbus::message::Message> {
        zbus::message::Message::error(call, self.name())?.build(&(self.message.as_str(),))
    }
    fn name(&self) -> ErrorName<'_> {
        ErrorName::from_static_str_unchecked(self.name)
    }
    fn description(&self) -> Option<&str> {
        Some(&self.message)
    }
}

impl From<zbus::Error> for Fault {
    fn from(e: zbus::Error) -> Fault {
        Fault::failed(e.to_string())
    }
}

impl From<ControlError> for Fault {
    fn from(e: ControlError) -> Fault {
        match e {
            ControlError::UnknownProfile { .. } => Fault {
                name: ERROR_UNKNOWN_PROFILE,
                message: e.to_string(),
            },
            ControlError::Gone => Fault::failed(e.to_string()),
        }
    }
}

/// The object served at `/io/github/dsv4/Supervisor1`.
pub struct Supervisor {
    lifecycle: Handle,
    config: watch::Receiver<Arc<Config>>,
    stats: Stats,
    group: ControlGroup,
}

/// What the control interface is made of.
pub struct Parts {
    pub lifecycle: Handle,
    /// The configuration in force (replaced by reloads).
    pub config: watch::Receiver<Arc<Config>>,
    pub stats: Stats,
    pub group: ControlGroup,
    /// Alerts to raise as `Alert(kind, message)` signals.
    pub alerts: broadcast::Receiver<Alert>,
}

impl Supervisor {
    /// Lets root and members of the control group through; everyone else gets AccessDenied
    /// with a message that says what to do.
    async fn authorize(
        &self,
        header: &Header<'_>,
        conn: &Connection,
        action: &str,
    ) -> Result<(), Fault> {
        let sender = header
            .sender()
            .ok_or_else(|| Fault::access_denied("the call has no sender".into()))?;
        let dbus = zbus::fdo::DBusProxy::new(conn).await?;
        let creds = dbus
            .get_connection_credentials(sender.clone().into())
            .await
            .map_err(zbus::Error::from)?;
        let uid = creds.unix_user_id();
        let groups = creds
            .unix_group_ids()
            .map(|g| g.to_vec())
            .unwrap_or_default();
        if uid == Some(0) || self.group.gid.is_some_and(|gid| groups.contains(&gid)) {
            return Ok(());
        }
        let who = uid
            .map(|u| format!("uid {u}"))
            .unwrap_or_else(|| "an unknown user".into());
        tracing::warn!(caller = %sender, "{action} refused for {who}");
        Err(Fault::access_denied(match self.group.gid {
            Some(_) => format!(
                "{action} needs root or membership of the `{0}` group, and {who} has neither; \
                 join it with `sudo usermod -aG {0} $USER`, then log in again",
                self.group.name
            ),
            None => format!(
                "{action} needs root or membership of the `{0}` group, which does not exist on this \
                 system; create it with `sudo groupadd --system {0}` and join it",
                self.group.name
            ),
        }))
    }
}

#[zbus::interface(name = "io.github.dsv4.Supervisor1")]
impl Supervisor {
    async fn start(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        self.authorize(&header, conn, "Start").await?;
        Ok(self.lifecycle.start().await?)
    }

    async fn stop(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        self.authorize(&header, conn, "Stop").await?;
        Ok(self.lifecycle.stop(false).await?)
    }

    async fn stop_now(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        self.authorize(&header, conn, "StopNow").await?;
        Ok(self.lifecycle.stop(true).await?)
    }

    async fn set_profile(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        self.authorize(&header, conn, "SetProfile").await?;
        Ok(self.lifecycle.set_profile(&name).await?)
    }

    /// The status JSON, the same document as `GET /status`.
    async fn status(&self) -> Result<String, Fault> {
        crate::proxy::status_document(&self.lifecycle, &self.stats)
            .map(|v| v.to_string())
            .map_err(|e| Fault::failed(e.to_string()))
    }

    async fn list_profiles(&self) -> Result<String, Fault> {
        let active = self.lifecycle.status().profile;
        let config = self.config.borrow().clone();
        let list: Vec<ProfileInfo> = config
            .profiles
            .values()
            .map(|p| ProfileInfo {
                name: p.name.clone(),
                description: p.description.clone(),
                engine: p.engine.name().to_string(),
                context: p.context(),
                active: p.name == active,
            })
            .collect();
        serde_json::to_string(&list).map_err(|e| Fault::failed(e.to_string()))
    }

    async fn logs(&self, since: u64, max: u32) -> (u64, Vec<String>) {
        self.lifecycle.logs(since, max as usize)
    }

    #[zbus(property)]
    async fn state(&self) -> String {
        self.lifecycle.status().state.to_string()
    }
    #[zbus(property)]
    async fn profile(&self) -> String {
        self.lifecycle.status().profile
    }
    #[zbus(property)]
    async fn engine_profile(&self) -> String {
        self.lifecycle.status().engine_profile.unwrap_or_default()
    }
    #[zbus(property)]
    async fn profiles(&self) -> Vec<String> {
        self.config
            .borrow()
            .profile_names()
            .into_iter()
            .map(String::from)
            .collect()
    }
    #[zbus(property)]
    async fn in_flight(&self) -> u32 {
        self.lifecycle.status().in_flight
    }
    #[zbus(property)]
    async fn waiting(&self) -> u32 {
        self.lifecycle.status().waiting as u32
    }
    #[zbus(property)]
    async fn engine_pid(&self) -> u32 {
        self.lifecycle.status().engine_pid.unwrap_or(0)
    }
    #[zbus(property)]
    async fn idle_deadline(&self) -> f64 {
        self.lifecycle.status().idle_deadline.unwrap_or(0.0)
    }
    #[zbus(property)]
    async fn last_error(&self) -> String {
        self.lifecycle.status().last_error.unwrap_or_default()
    }

    /// `StateChanged(state, profile)`: the lifecycle state changed. (Named apart in Rust from
    /// the `State` property's own change notifier.)
    /// `Alert(kind, message)`: something a desktop user should hear about (a rejected
    /// configuration change, ...).
    #[zbus(signal)]
    async fn alert(emitter: &SignalEmitter<'_>, kind: &str, message: &str) -> zbus::Result<()>;

    #[zbus(signal, name = "StateChanged")]
    async fn lifecycle_changed(
        emitter: &SignalEmitter<'_>,
        state: &str,
        profile: &str,
    ) -> zbus::Result<()>;
}

/// Connects to `bus`, serves the object, then asks for the well-known name, and keeps the
/// properties current. The returned connection must be kept for the daemon's life.
pub async fn serve(bus: Bus, parts: Parts) -> anyhow::Result<Connection> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Session => zbus::connection::Builder::session(),
    }
    .with_context(|| format!("connecting to the {} bus", bus.name()))?;
    let Parts {
        lifecycle,
        config,
        stats,
        group,
        alerts,
    } = parts;
    let object = Supervisor {
        lifecycle: lifecycle.clone(),
        config: config.clone(),
        stats,
        group,
    };
    let conn = builder
        .serve_at(OBJECT_PATH, object)
        .context("serving the control object")?
        .build()
        .await
        .with_context(|| {
            format!(
                "connecting to the {} bus (use --bus none to run without D-Bus)",
                bus.name()
            )
        })?;
    conn.request_name(BUS_NAME).await.with_context(|| {
        format!(
            "taking the name {BUS_NAME} on the {} bus (is another dsv4d running?)",
            bus.name()
        )
    })?;
    tracing::info!("control interface on the {} bus as {BUS_NAME}", bus.name());
    tokio::spawn(announce_changes(conn.clone(), lifecycle, config, alerts));
    Ok(conn)
}

/// Emits `PropertiesChanged` for each property whose value changed, and `StateChanged` when
/// the state did.
async fn announce_changes(
    conn: Connection,
    lifecycle: Handle,
    mut config: watch::Receiver<Arc<Config>>,
    mut alerts: broadcast::Receiver<Alert>,
) {
    let Ok(iface) = conn
        .object_server()
        .interface::<_, Supervisor>(OBJECT_PATH)
        .await
    else {
        return;
    };
    let mut rx = lifecycle.watch_status();
    let mut old: Status = rx.borrow_and_update().clone();
    loop {
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            changed = config.changed() => {
                if changed.is_err() {
                    return;
                }
                config.borrow_and_update();
                let e = iface.signal_emitter();
                if let Err(err) = iface.get().await.profiles_changed(e).await {
                    tracing::debug!("announcing a change on D-Bus failed: {err}");
                }
                continue;
            }
            alert = alerts.recv() => {
                match alert {
                    Ok(a) => {
                        if let Err(err) = Supervisor::alert(iface.signal_emitter(), a.kind, &a.message).await {
                            tracing::debug!("sending an Alert on D-Bus failed: {err}");
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                }
                continue;
            }
        }
        let new = rx.borrow_and_update().clone();
        let e = iface.signal_emitter();
        let obj = iface.get().await;
        let mut results = Vec::new();
        if new.state != old.state {
            results.push(obj.state_changed(e).await);
            results.push(Supervisor::lifecycle_changed(e, new.state, &new.profile).await);
        }
        if new.profile != old.profile {
            results.push(obj.profile_changed(e).await);
        }
        if new.engine_profile != old.engine_profile {
            results.push(obj.engine_profile_changed(e).await);
        }
        if new.in_flight != old.in_flight {
            results.push(obj.in_flight_changed(e).await);
        }
        if new.waiting != old.waiting {
            results.push(obj.waiting_changed(e).await);
        }
        if new.engine_pid != old.engine_pid {
            results.push(obj.engine_pid_changed(e).await);
        }
        if new.idle_deadline != old.idle_deadline {
            results.push(obj.idle_deadline_changed(e).await);
        }
        if new.last_error != old.last_error {
            results.push(obj.last_error_changed(e).await);
        }
        drop(obj);
        for r in results {
            if let Err(err) = r {
                tracing::debug!("announcing a change on D-Bus failed: {err}");
            }
        }
        old = new;
    }
}
