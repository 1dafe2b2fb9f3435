//! The control interface on D-Bus: `io.github.dsv4.Supervisor1` at
//! `/io/github/dsv4/Supervisor1`.
//!
//! Owns: the bus connection, the caller checks, and turning lifecycle status changes into
//! `PropertiesChanged` and `StateChanged`. Must not: hold lifecycle state of its own; the
//! object keeps only handles (the lifecycle actor's, the config, the statistics), and its
//! methods take `&self`.
//!
//! Reading is open to every caller. `Start`, `Stop`, `StopNow`, `SetProfile`, `DropKv`,
//! `Validate` and `CancelValidation` are allowed for root and the members of the control
//! group only. The check uses the caller's
//! credentials as the bus daemon reports them (`GetConnectionCredentials`), so it holds even
//! under a bus policy that lets everyone call.

use std::sync::Arc;

use anyhow::Context as _;
use dsv4_client::{
    AlertKind, Bus, State, BUS_NAME, ERROR_FAILED, ERROR_START_FAILED, ERROR_UNKNOWN_PROFILE,
    OBJECT_PATH, WAIT_LOGS_MAX_MS,
};
use tokio::sync::{broadcast, watch};
use tokio::time::{Duration, Instant};
use zbus::message::Header;
use zbus::names::ErrorName;
use zbus::object_server::SignalEmitter;
use zbus::Connection;

use crate::actions::ActionError;
use crate::config::Config;
use crate::http::http_error::ApiError;
use crate::lifecycle::alert::Alert;
use crate::lifecycle::{ControlError, Handle, Refused, Status};
use crate::parts::Parts;

/// The most samples one `History()` call returns: an hour at 1 s.
const HISTORY_MAX: usize = 3600;

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
            ControlError::Gone | ControlError::NotSaved { .. } => Fault::failed(e.to_string()),
        }
    }
}

/// The object served at `/io/github/dsv4/Supervisor1` (the D-Bus face of the supervisor; not
/// to be confused with `config::Supervisor`, the settings of supervisor.yaml).
pub struct ControlObject {
    /// The parts the API serves from too; its `actions` are what the methods that change
    /// something call.
    parts: Parts,
    group: ControlGroup,
}

/// What only the control interface has, beside the daemon's [`Parts`].
pub struct Control {
    /// Touched by every method call (`exit_when_idle`).
    pub activity: crate::http::connections::Activity,
    pub group: ControlGroup,
    /// Alerts to raise as `Alert(kind, message)` signals.
    pub alerts: broadcast::Receiver<Alert>,
}

impl ControlObject {
    /// Lets root and members of the control group through (and says who asked, for the log);
    /// everyone else gets AccessDenied with a message that says what to do.
    async fn authorize(
        &self,
        header: &Header<'_>,
        conn: &Connection,
        action: &str,
    ) -> Result<String, Fault> {
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
            return Ok(format!(
                "uid {} over D-Bus",
                uid.map_or_else(|| "?".to_string(), |u| u.to_string())
            ));
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

impl From<ActionError> for Fault {
    fn from(e: ActionError) -> Fault {
        match e {
            ActionError::Control(e) => e.into(),
            ActionError::Refused(r) => r.into(),
            e @ (ActionError::Busy(_)
            | ActionError::Invalid(_)
            | ActionError::NotFound(_)
            | ActionError::Failed(_)) => Fault::failed(e.to_string()),
        }
    }
}

impl From<Refused> for Fault {
    fn from(r: Refused) -> Fault {
        // The same words as the HTTP error a waiting request gets.
        Fault {
            name: ERROR_START_FAILED,
            message: ApiError::from(r).message,
        }
    }
}

#[zbus::interface(name = "io.github.dsv4.Supervisor1")]
impl ControlObject {
    async fn start(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        let by = self.authorize(&header, conn, "Start").await?;
        Ok(self.parts.actions.start(&by).await?)
    }

    /// Waits like a request: the lease is let go at once, so the idle time counts from now.
    async fn start_and_wait(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<String, Fault> {
        let by = self.authorize(&header, conn, "StartAndWait").await?;
        Ok(self.parts.actions.start_and_wait(&by).await?)
    }

    async fn stop(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        let by = self.authorize(&header, conn, "Stop").await?;
        Ok(self.parts.actions.stop(false, &by).await?)
    }

    async fn stop_now(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        let by = self.authorize(&header, conn, "StopNow").await?;
        Ok(self.parts.actions.stop(true, &by).await?)
    }

    async fn set_profile(
        &self,
        name: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<(), Fault> {
        let by = self.authorize(&header, conn, "SetProfile").await?;
        Ok(self.parts.actions.set_profile(&name, &by).await?)
    }

    /// Starts a validation run (`dsv4ctl validate`): `request` is a `ValidateRequest` as
    /// JSON; answers the validation profile's name at once. Progress comes as
    /// `ValidationProgress` signals, the result as one `ValidationDone`.
    async fn validate(
        &self,
        request: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<String, Fault> {
        let by = self.authorize(&header, conn, "Validate").await?;
        let req: dsv4_client::validate::ValidateRequest = serde_json::from_str(&request)
            .map_err(|e| Fault::failed(format!("not a validation request: {e}")))?;
        Ok(self.parts.actions.validate(req, &by)?)
    }

    /// Records the drifted canary of `profile` as its reference: a profile held by
    /// `canary.hold` serves again. Answers what was done.
    async fn canary_accept(
        &self,
        profile: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<String, Fault> {
        let by = self.authorize(&header, conn, "CanaryAccept").await?;
        Ok(self.parts.actions.accept_canary(&profile, &by)?)
    }

    /// Ends the running validation (it switches back to the previous profile).
    async fn cancel_validation(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<bool, Fault> {
        let by = self.authorize(&header, conn, "CancelValidation").await?;
        Ok(self.parts.actions.cancel_validation(&by))
    }

    /// The kept validation results of `profile` (every profile's when empty), newest first,
    /// as a JSON array.
    async fn validations(&self, profile: String) -> Result<String, Fault> {
        let profile = (!profile.is_empty()).then_some(profile.as_str());
        serde_json::to_string(&self.parts.validator.saved(profile))
            .map_err(|e| Fault::failed(e.to_string()))
    }

    /// `ValidationProgress(s json)`: a `Progress` of the running validation.
    #[zbus(signal)]
    async fn validation_progress(emitter: &SignalEmitter<'_>, progress: &str) -> zbus::Result<()>;

    /// `ValidationDone(s json)`: the `ValidationResult` of the validation that just ended.
    #[zbus(signal)]
    async fn validation_done(emitter: &SignalEmitter<'_>, result: &str) -> zbus::Result<()>;

    /// The KV checkpoints on disk, every profile's, as a JSON array of `KvCheckpoint`s.
    async fn kv_checkpoints(&self) -> Result<String, Fault> {
        serde_json::to_string(&self.parts.lifecycle.kv().list().await)
            .map_err(|e| Fault::failed(e.to_string()))
    }

    /// Removes the KV checkpoints `what` names (`all`, a profile, an id); the ids removed,
    /// as a JSON array.
    async fn drop_kv(
        &self,
        what: String,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] conn: &Connection,
    ) -> Result<String, Fault> {
        let by = self.authorize(&header, conn, "DropKv").await?;
        let gone = self.parts.actions.drop_kv(&what, &by).await?;
        serde_json::to_string(&gone).map_err(|e| Fault::failed(e.to_string()))
    }

    /// The status JSON, the same document as `GET /status`.
    async fn status(&self) -> Result<String, Fault> {
        let doc = self.parts.status_document().await;
        serde_json::to_string(&doc).map_err(|e| Fault::failed(e.to_string()))
    }

    /// The samples of the host taken at or after `since` (unix s), oldest first, at most
    /// `max` (the newest), as a JSON array of `Sample`s.
    async fn history(&self, since: f64, max: u32) -> Result<String, Fault> {
        let max = (max as usize).min(HISTORY_MAX);
        let samples = self.parts.telemetry.history(since, max);
        let samples: Vec<&dsv4_client::telemetry::Sample> = samples.iter().map(|s| &**s).collect();
        serde_json::to_string(&samples).map_err(|e| Fault::failed(e.to_string()))
    }

    async fn list_profiles(&self) -> Result<String, Fault> {
        let active = self.parts.lifecycle.profile();
        let list = crate::config::profiles::list(&self.parts.config.borrow(), &active);
        serde_json::to_string(&list).map_err(|e| Fault::failed(e.to_string()))
    }

    async fn logs(&self, since: u64, max: u32) -> (u64, Vec<String>) {
        self.parts.lifecycle.logs(since, max as usize)
    }

    async fn wait_logs(&self, since: u64, max: u32, wait_ms: u32) -> (u64, Vec<String>) {
        let wait = std::time::Duration::from_millis(wait_ms.min(WAIT_LOGS_MAX_MS).into());
        self.parts
            .lifecycle
            .wait_logs(since, max as usize, wait)
            .await
    }

    #[zbus(property)]
    async fn state(&self) -> String {
        self.parts.lifecycle.state().as_str().to_string()
    }
    #[zbus(property)]
    async fn profile(&self) -> String {
        self.parts.lifecycle.profile()
    }
    #[zbus(property)]
    async fn engine_profile(&self) -> String {
        self.parts
            .lifecycle
            .status()
            .engine_profile
            .unwrap_or_default()
    }
    #[zbus(property)]
    async fn profiles(&self) -> Vec<String> {
        self.parts
            .config
            .borrow()
            .profile_names()
            .into_iter()
            .map(String::from)
            .collect()
    }
    #[zbus(property)]
    async fn in_flight(&self) -> u32 {
        self.parts.lifecycle.with_status(|s| s.in_flight)
    }
    #[zbus(property)]
    async fn waiting(&self) -> u32 {
        self.parts.lifecycle.with_status(|s| s.waiting as u32)
    }
    #[zbus(property)]
    async fn engine_pid(&self) -> u32 {
        self.parts
            .lifecycle
            .with_status(|s| s.engine_pid.unwrap_or(0))
    }
    #[zbus(property)]
    async fn idle_deadline(&self) -> f64 {
        self.parts
            .lifecycle
            .with_status(|s| s.idle_deadline.unwrap_or(0.0))
    }
    #[zbus(property)]
    async fn last_error(&self) -> String {
        self.parts
            .lifecycle
            .with_status(|s| s.last_error.clone().unwrap_or_default())
    }
    /// The requests in flight with their phases, as the JSON array `in_progress` of the
    /// status. It changes with every token, so no `PropertiesChanged` announces it: a
    /// watcher reads it when it wants it.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn in_progress(&self) -> zbus::fdo::Result<String> {
        let state = self.parts.lifecycle.state();
        serde_json::to_string(&self.parts.in_progress(state))
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
    }

    /// `Alert(kind, message)`: something a desktop user should hear about (a rejected
    /// configuration change, ...).
    #[zbus(signal)]
    async fn alert(emitter: &SignalEmitter<'_>, kind: AlertKind, message: &str)
        -> zbus::Result<()>;

    /// `ThermalEvent(level, sensor, celsius, message)`: see `dsv4_client::Supervisor1Proxy`.
    #[zbus(signal)]
    async fn thermal_event(
        emitter: &SignalEmitter<'_>,
        level: &str,
        sensor: &str,
        celsius: f64,
        message: &str,
    ) -> zbus::Result<()>;

    /// `StateChanged(state, profile)`: the lifecycle state changed. (Named apart in Rust from
    /// the `State` property's own change notifier.)
    #[zbus(signal, name = "StateChanged")]
    async fn lifecycle_changed(
        emitter: &SignalEmitter<'_>,
        state: State,
        profile: &str,
    ) -> zbus::Result<()>;
}

/// Connects to `bus`, serves the object, then asks for the well-known name, and keeps the
/// properties current. The returned connection must be kept for the daemon's life.
pub async fn serve(bus: Bus, parts: Parts, control: Control) -> anyhow::Result<Connection> {
    let builder = match bus {
        Bus::System => zbus::connection::Builder::system(),
        Bus::Session => zbus::connection::Builder::session(),
    }
    .with_context(|| format!("connecting to the {} bus", bus))?;
    let Control {
        activity,
        group,
        alerts,
    } = control;
    let object = ControlObject {
        parts: parts.clone(),
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
                bus
            )
        })?;
    conn.request_name(BUS_NAME).await.with_context(|| {
        format!(
            "taking the name {BUS_NAME} on the {} bus (is another dsv4d running?)",
            bus
        )
    })?;
    tracing::info!("control interface on the {} bus as {BUS_NAME}", bus);
    // Every method call counts as activity: a daemon that is being talked to does not exit.
    let calls = zbus::MessageStream::from(&conn);
    tokio::spawn(async move {
        let mut calls = calls;
        while let Some(Ok(m)) = futures_util::StreamExt::next(&mut calls).await {
            if m.message_type() == zbus::message::Type::MethodCall {
                activity.touch();
            }
        }
    });
    tokio::spawn(announce_validation(
        conn.clone(),
        parts.validator.subscribe(),
    ));
    tokio::spawn(announce_changes(
        conn.clone(),
        parts.lifecycle,
        parts.config,
        alerts,
        parts.thermal.subscribe(),
    ));
    Ok(conn)
}

/// Sends the validation's progress and result as signals.
async fn announce_validation(
    conn: Connection,
    mut events: tokio::sync::broadcast::Receiver<crate::validate::ValidationEvent>,
) {
    use crate::validate::ValidationEvent;
    let Ok(iface) = conn
        .object_server()
        .interface::<_, ControlObject>(OBJECT_PATH)
        .await
    else {
        return;
    };
    loop {
        let event = match events.recv().await {
            Ok(e) => e,
            Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(_) => return,
        };
        let e = iface.signal_emitter();
        let sent = match event {
            ValidationEvent::Progress(p) => {
                let text = serde_json::to_string(&p).unwrap_or_default();
                ControlObject::validation_progress(e, &text).await
            }
            ValidationEvent::Done(r) => {
                let text = serde_json::to_string(&*r).unwrap_or_default();
                ControlObject::validation_done(e, &text).await
            }
        };
        if let Err(err) = sent {
            tracing::debug!("cannot send a validation signal: {err}");
        }
    }
}

/// The least time between two announcements of the per-request figures (`InFlight`,
/// `Waiting`, `IdleDeadline`). Every request moves them twice; announcing each move cost the
/// daemon and the bus daemon more than proxying the request (measured with a bus: 179 us of
/// dsv4d's CPU per small request instead of 108, and 89 us of dbus-daemon's). A watcher
/// sees their latest values at most this late; the state and the profiles are never held.
const FIGURES_GAP: Duration = Duration::from_millis(250);

/// Whether anything but the per-request figures differs.
fn discrete_change(a: &Status, b: &Status) -> bool {
    a.state != b.state
        || a.profile != b.profile
        || a.engine_profile != b.engine_profile
        || a.engine_pid != b.engine_pid
        || a.last_error != b.last_error
}

fn figures_change(a: &Status, b: &Status) -> bool {
    a.in_flight != b.in_flight || a.waiting != b.waiting || a.idle_deadline != b.idle_deadline
}

/// Emits `PropertiesChanged` for each property whose value changed, and `StateChanged` when
/// the state did; the per-request figures at most every [`FIGURES_GAP`].
async fn announce_changes(
    conn: Connection,
    lifecycle: Handle,
    mut config: watch::Receiver<Arc<Config>>,
    mut alerts: broadcast::Receiver<Alert>,
    thermal: (
        Vec<crate::policy::thermal::Signal>,
        broadcast::Receiver<crate::policy::thermal::Signal>,
    ),
) {
    let Ok(iface) = conn
        .object_server()
        .interface::<_, ControlObject>(OBJECT_PATH)
        .await
    else {
        return;
    };
    // What stands already (a machine hot at the daemon's start, before it had its name) is
    // said first: a desktop agent hears it as it would have heard the change.
    let (standing, mut thermal) = thermal;
    for t in standing {
        tracing::debug!("thermal: announcing what stands: {}", t.message);
        thermal_event(iface.signal_emitter(), &t).await;
    }
    let mut rx = lifecycle.watch_status();
    let mut figures = lifecycle.watch_figures();
    let mut old: Status = rx.borrow_and_update().clone();
    let mut figures_sent: Option<Instant> = None;
    // When held-back figures go out.
    let mut figures_due: Option<Instant> = None;
    let mut thermal_open = true;
    loop {
        let hold = async {
            match figures_due {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            changed = figures.changed() => if changed.is_err() { return },
            () = hold => figures_due = None,
            changed = config.changed() => {
                if changed.is_err() {
                    return;
                }
                config.borrow_and_update();
                profiles_changed(&iface).await;
                continue;
            }
            alert = alerts.recv() => {
                match alert {
                    Ok(a) => alert_signal(iface.signal_emitter(), &a).await,
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                }
                continue;
            }
            event = thermal.recv(), if thermal_open => {
                if matches!(event, Err(broadcast::error::RecvError::Closed)) {
                    thermal_open = false;
                }
                if let Ok(t) = event {
                    thermal_event(iface.signal_emitter(), &t).await;
                }
                continue;
            }
        }
        figures.borrow_and_update();
        let new = rx.borrow_and_update().clone();
        if !announce_now(&old, &new, &mut figures_sent, &mut figures_due) {
            continue;
        }
        properties_changed(&iface, &old, &new).await;
        old = new;
    }
}

/// Whether the change from `old` to `new` is announced now: a discrete one at once, the
/// per-request figures at most every [`FIGURES_GAP`] (`sent`: when they last went; `due`:
/// when held-back figures go).
fn announce_now(
    old: &Status,
    new: &Status,
    sent: &mut Option<Instant>,
    due: &mut Option<Instant>,
) -> bool {
    let figures_moved = figures_change(old, new);
    if !discrete_change(old, new) {
        if !figures_moved || due.is_some() {
            return false;
        }
        if let Some(next) = sent.map(|t| t + FIGURES_GAP) {
            if Instant::now() < next {
                *due = Some(next);
                return false;
            }
        }
    }
    *due = None;
    if figures_moved {
        *sent = Some(Instant::now());
    }
    true
}

/// `PropertiesChanged` for `Profiles` (the configuration was reloaded).
async fn profiles_changed(iface: &zbus::object_server::InterfaceRef<ControlObject>) {
    let e = iface.signal_emitter();
    if let Err(err) = iface.get().await.profiles_changed(e).await {
        tracing::debug!("announcing a change on D-Bus failed: {err}");
    }
}

/// An `Alert` of `a`.
async fn alert_signal(e: &SignalEmitter<'_>, a: &Alert) {
    if let Err(err) = ControlObject::alert(e, a.kind, &a.message).await {
        tracing::debug!("sending an Alert on D-Bus failed: {err}");
    }
}

/// A `ThermalEvent` of `t`.
async fn thermal_event(e: &SignalEmitter<'_>, t: &crate::policy::thermal::Signal) {
    let sent =
        ControlObject::thermal_event(e, t.level.as_str(), &t.sensor, t.celsius, &t.message).await;
    if let Err(err) = sent {
        tracing::debug!("sending a ThermalEvent on D-Bus failed: {err}");
    }
}

/// `PropertiesChanged` for each property that differs from `old` to `new`, and
/// `LifecycleChanged` with the state.
async fn properties_changed(
    iface: &zbus::object_server::InterfaceRef<ControlObject>,
    old: &Status,
    new: &Status,
) {
    let e = iface.signal_emitter();
    let obj = iface.get().await;
    let mut results = Vec::new();
    if new.state != old.state {
        results.push(obj.state_changed(e).await);
        results.push(ControlObject::lifecycle_changed(e, new.state, &new.profile).await);
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
}
