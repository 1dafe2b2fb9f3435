//! Control from outside: the D-Bus interface (`dbus`), systemd's notifications and watchdog
//! (`service`), configuration reloads (`reload`), the exit when idle (`idle_exit`), the text
//! of the daemon's log lines (`log_format`; where they go is [`crate::log`]), and the wait of
//! a socket-activated daemon whose configuration cannot be used (`unusable`).

pub mod dbus;
pub mod idle_exit;
pub mod log_format;
pub mod reload;
pub mod service;
pub mod unusable;
