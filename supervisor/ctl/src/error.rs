//! What can go wrong, as the user sees it: one line on stderr and an exit code.
//!
//! Exit codes: 1 when the daemon refused or failed (a D-Bus method error, an engine that did
//! not start), 2 for usage errors and when the daemon cannot be reached (no bus, no owner of
//! the name, no answer in time).

use std::fmt;

use zbus::DBusError;

use dsv4_client::Bus;

/// The standard D-Bus error names dsv4ctl treats specially.
const ACCESS_DENIED: &str = "org.freedesktop.DBus.Error.AccessDenied";
const SERVICE_UNKNOWN: &str = "org.freedesktop.DBus.Error.ServiceUnknown";
const NAME_HAS_NO_OWNER: &str = "org.freedesktop.DBus.Error.NameHasNoOwner";
const NO_REPLY: &str = "org.freedesktop.DBus.Error.NoReply";
const TIMED_OUT: &str = "org.freedesktop.DBus.Error.TimedOut";
const TIMEOUT: &str = "org.freedesktop.DBus.Error.Timeout";
const DISCONNECTED: &str = "org.freedesktop.DBus.Error.Disconnected";

/// Why dsv4ctl gives up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The daemon refused or failed, or the engine did not start (exit 1).
    Failed(String),
    /// The daemon cannot be reached: no bus, no owner of the name, no answer (exit 2).
    Unreachable(String),
    /// The command line or the environment is wrong (exit 2).
    Usage(String),
    /// Standard output was closed (`dsv4ctl logs | head`): stop quietly (exit 0).
    Closed,
}

impl Failure {
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Failed(_) => 1,
            Failure::Unreachable(_) | Failure::Usage(_) => 2,
            Failure::Closed => 0,
        }
    }

    /// The line for stderr (without the `dsv4ctl: ` prefix), if any.
    pub fn message(&self) -> Option<String> {
        match self {
            Failure::Failed(m) | Failure::Unreachable(m) | Failure::Usage(m) => Some(one_line(m)),
            Failure::Closed => None,
        }
    }

    /// Writes the one line to stderr and returns the exit code.
    pub fn report(&self) -> u8 {
        if let Some(m) = self.message() {
            eprintln!("dsv4ctl: {m}");
        }
        self.exit_code()
    }

    pub fn not_running(bus: Bus) -> Failure {
        Failure::Unreachable(format!(
            "dsv4d is not running on the {bus} bus (no owner of {})",
            dsv4_client::BUS_NAME
        ))
    }

    /// A failed D-Bus call: `what` names the call (`Status()`), for errors that need it.
    pub fn from_zbus(e: zbus::Error, bus: Bus, what: &str) -> Failure {
        match e {
            zbus::Error::MethodError(name, msg, _) => {
                Failure::from_dbus_error(name.as_str(), msg.as_deref(), bus)
            }
            zbus::Error::FDO(e) => match *e {
                zbus::fdo::Error::ZBus(inner) => Failure::from_zbus(inner, bus, what),
                e => Failure::from_dbus_error(e.name().as_str(), e.description(), bus),
            },
            e @ (zbus::Error::InputOutput(_)
            | zbus::Error::Connection(..)
            | zbus::Error::Handshake(_)
            | zbus::Error::Address(_)) => {
                Failure::Unreachable(format!("lost the connection to the {bus} bus: {e}"))
            }
            e => Failure::Failed(format!("unexpected answer from dsv4d to {what}: {e}")),
        }
    }

    /// A D-Bus error reply `name` with its message.
    pub fn from_dbus_error(name: &str, msg: Option<&str>, bus: Bus) -> Failure {
        let msg = msg.map(str::trim).filter(|m| !m.is_empty());
        match name {
            SERVICE_UNKNOWN | NAME_HAS_NO_OWNER => Failure::not_running(bus),
            NO_REPLY | TIMED_OUT | TIMEOUT | DISCONNECTED => {
                Failure::Unreachable(format!("dsv4d did not answer: {}", msg.unwrap_or(name)))
            }
            ACCESS_DENIED => Failure::Failed(msg.map(str::to_string).unwrap_or_else(|| {
                format!(
                    "access denied: only root and members of the {} group may do this",
                    dsv4_client::CONTROL_GROUP
                )
            })),
            _ => Failure::Failed(msg.unwrap_or(name).to_string()),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.message() {
            Some(m) => f.write_str(&m),
            None => f.write_str("standard output closed"),
        }
    }
}

/// Errors are exactly one line: a multi-line message (an engine's output) is joined.
pub fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Maps a failed write to standard output: a closed pipe ends dsv4ctl quietly.
pub fn output(e: std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Failure::Closed
    } else {
        Failure::Failed(format!("cannot write to standard output: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn method_error(name: &str, msg: Option<&str>) -> zbus::Error {
        let call = zbus::message::Message::method_call("/", "Status")
            .unwrap()
            .build(&())
            .unwrap();
        zbus::Error::MethodError(
            zbus::names::OwnedErrorName::try_from(name.to_string()).unwrap(),
            msg.map(str::to_string),
            call,
        )
    }

    #[test]
    fn daemon_errors_are_exit_1_with_their_message() {
        let denied = Failure::from_zbus(
            method_error(
                ACCESS_DENIED,
                Some("Start needs root or membership of the dsv4 group"),
            ),
            Bus::System,
            "Start()",
        );
        assert_eq!(
            denied,
            Failure::Failed("Start needs root or membership of the dsv4 group".into())
        );
        assert_eq!(denied.exit_code(), 1);

        let unknown = Failure::from_zbus(
            method_error(
                dsv4_client::ERROR_UNKNOWN_PROFILE,
                Some("no profile \"1m\"; valid: 320k, 64k"),
            ),
            Bus::System,
            "SetProfile()",
        );
        assert_eq!(
            unknown,
            Failure::Failed("no profile \"1m\"; valid: 320k, 64k".into())
        );
        assert_eq!(unknown.exit_code(), 1);

        let failed = Failure::from_zbus(
            method_error(dsv4_client::ERROR_FAILED, None),
            Bus::System,
            "Start()",
        );
        assert_eq!(failed, Failure::Failed(dsv4_client::ERROR_FAILED.into()));
    }

    #[test]
    fn access_denied_without_a_message_names_the_group() {
        let f = Failure::from_dbus_error(ACCESS_DENIED, Some(""), Bus::System);
        assert_eq!(f.exit_code(), 1);
        assert!(f.message().unwrap().contains("dsv4 group"));
    }

    #[test]
    fn fdo_errors_map_like_method_errors() {
        let e = zbus::Error::FDO(Box::new(zbus::fdo::Error::AccessDenied("join dsv4".into())));
        assert_eq!(
            Failure::from_zbus(e, Bus::System, "Stop()"),
            Failure::Failed("join dsv4".into())
        );
        let e = zbus::Error::FDO(Box::new(zbus::fdo::Error::ServiceUnknown("gone".into())));
        assert_eq!(
            Failure::from_zbus(e, Bus::Session, "Status()"),
            Failure::not_running(Bus::Session)
        );
    }

    #[test]
    fn an_absent_or_silent_daemon_is_exit_2() {
        let gone = Failure::from_zbus(
            method_error(
                SERVICE_UNKNOWN,
                Some("The name was not provided by any .service files"),
            ),
            Bus::Session,
            "Status()",
        );
        assert_eq!(gone.exit_code(), 2);
        assert_eq!(
            gone.message().unwrap(),
            "dsv4d is not running on the session bus (no owner of io.github.dsv4.Supervisor1)"
        );
        let silent = Failure::from_zbus(
            method_error(NO_REPLY, Some("Did not receive a reply")),
            Bus::System,
            "Status()",
        );
        assert_eq!(silent.exit_code(), 2);
        let io = zbus::Error::InputOutput(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionReset,
        )));
        assert_eq!(
            Failure::from_zbus(io, Bus::System, "Status()").exit_code(),
            2
        );
    }

    #[test]
    fn other_zbus_errors_are_exit_1() {
        let f = Failure::from_zbus(zbus::Error::InvalidReply, Bus::System, "Logs()");
        assert_eq!(f.exit_code(), 1);
        assert!(f.message().unwrap().contains("Logs()"));
    }

    #[test]
    fn messages_are_one_line() {
        let f = Failure::Failed("engine failed to start: exited 1\nline a\n\nline b\n".into());
        assert_eq!(
            f.message().unwrap(),
            "engine failed to start: exited 1 | line a | line b"
        );
        assert_eq!(Failure::Usage("x".into()).exit_code(), 2);
        assert_eq!(Failure::Closed.exit_code(), 0);
        assert_eq!(Failure::Closed.message(), None);
    }

    #[test]
    fn a_closed_pipe_is_quiet() {
        let e = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert_eq!(output(e), Failure::Closed);
    }
}
