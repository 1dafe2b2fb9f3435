//! Control from outside: the D-Bus interface (`dbus`), systemd's notifications and watchdog
//! (`service`), configuration reloads (`reload`), and the exit when idle (`idle_exit`).

pub mod dbus;
pub mod idle_exit;
pub mod reload;
pub mod service;
