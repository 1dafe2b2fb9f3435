//! The API: the listener, the front door (`front`: Host and web pages; `auth`: keys), request
//! bodies (`intake`, `body`), client connections, the path rules, the accept loop (`serve`),
//! the router (`router`), forwarding to the engine (`forward`) and the answers' bodies
//! (`answer`), read once (`events`: the one event-stream parser; `watch`: its observers; one
//! row per API in `protocol`), the streamed answers kept from going silent (`keepalive`,
//! `sse`, `opening`) and the prefill's progress read from them (`progress`), the dashboard
//! (`dashboard`, `ui_actions`), and the errors dsv4d itself answers with.

pub mod answer;
pub mod auth;
pub mod body;
pub mod connections;
pub mod ctx;
pub mod dashboard;
pub mod events;
pub mod forward;
pub mod front;
pub mod http_error;
pub mod intake;
pub mod keepalive;
pub mod listener;
pub mod opening;
pub mod path;
pub mod peers;
pub mod progress;
pub mod protocol;
pub mod router;
pub mod serve;
pub mod sse;
pub mod ui_actions;
pub mod watch;
pub mod watchers;
