//! power-profiles-daemon (and tuned-ppd) on the system bus: holding a profile while the
//! engine runs.
//!
//! Follows: power-profiles-daemon's D-Bus API, `org.freedesktop.UPower.PowerProfiles` at
//! `/org/freedesktop/UPower/PowerProfiles` (0.20 and later, and tuned-ppd) or the older
//! `net.hadess.PowerProfiles` at `/net/hadess/PowerProfiles`: `HoldProfile(s profile,
//! s reason, s application_id) -> u cookie`, `ReleaseProfile(u cookie)`, the signal
//! `ProfileReleased(u cookie)` when a hold ends because the user chose a profile, and the
//! property `ActiveProfile`. A hold belongs to the connection that made it: PPD drops it when
//! that connection closes, so a daemon that dies gives the user's profile back by itself.
//! Owns: the calls. Must not: keep state (the power task does).

use zbus::proxy::CacheProperties;
use zbus::Connection;

/// The names power-profiles-daemon answers to, newest first: (service, path, interface).
pub const NAMES: [(&str, &str, &str); 2] = [
    (
        "org.freedesktop.UPower.PowerProfiles",
        "/org/freedesktop/UPower/PowerProfiles",
        "org.freedesktop.UPower.PowerProfiles",
    ),
    (
        "net.hadess.PowerProfiles",
        "/net/hadess/PowerProfiles",
        "net.hadess.PowerProfiles",
    ),
];

/// A power-profiles-daemon found on the bus.
#[derive(Clone)]
pub struct Ppd {
    pub service: &'static str,
    proxy: zbus::Proxy<'static>,
}

impl Ppd {
    /// The first of [`NAMES`] that has an owner on `conn`'s bus.
    pub async fn find(conn: &Connection) -> Result<Option<Ppd>, zbus::Error> {
        let dbus = zbus::fdo::DBusProxy::new(conn).await?;
        for (service, path, interface) in NAMES {
            let name = zbus::names::BusName::try_from(service)?;
            if dbus.name_has_owner(name).await? {
                let proxy = zbus::proxy::Builder::new(conn)
                    .destination(service)?
                    .path(path)?
                    .interface(interface)?
                    .cache_properties(CacheProperties::No)
                    .build()
                    .await?;
                return Ok(Some(Ppd { service, proxy }));
            }
        }
        Ok(None)
    }

    pub async fn hold(&self, profile: &str, reason: &str, app: &str) -> zbus::Result<u32> {
        self.proxy
            .call("HoldProfile", &(profile, reason, app))
            .await
    }

    pub async fn release(&self, cookie: u32) -> zbus::Result<()> {
        self.proxy.call("ReleaseProfile", &(cookie,)).await
    }

    pub async fn active_profile(&self) -> zbus::Result<String> {
        self.proxy.get_property("ActiveProfile").await
    }

    /// `Version` (0.20 and later; older ones have no such property).
    pub async fn version(&self) -> zbus::Result<String> {
        self.proxy.get_property("Version").await
    }

    /// `Actions`: the actions this daemon has (`trickle_charge`, `amdgpu_dpm`, ...).
    pub async fn actions(&self) -> zbus::Result<Vec<String>> {
        self.proxy.get_property("Actions").await
    }

    /// `ActionsInfo` (0.30 and later): each action's `Name` and whether it is `Enabled`,
    /// as far as the daemon says.
    pub async fn actions_enabled(&self) -> zbus::Result<Vec<(String, Option<bool>)>> {
        use std::collections::HashMap;
        use zbus::zvariant::OwnedValue;
        let infos: Vec<HashMap<String, OwnedValue>> =
            self.proxy.get_property("ActionsInfo").await?;
        Ok(infos
            .into_iter()
            .filter_map(|info| {
                let name = String::try_from(info.get("Name")?.try_clone().ok()?).ok()?;
                let enabled = info
                    .get("Enabled")
                    .and_then(|v| bool::try_from(v.try_clone().ok()?).ok());
                Some((name, enabled))
            })
            .collect())
    }

    /// `ProfileReleased(cookie)` from now on.
    pub async fn released(&self) -> zbus::Result<zbus::proxy::SignalStream<'static>> {
        self.proxy.receive_signal("ProfileReleased").await
    }
}
