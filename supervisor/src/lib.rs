//! dsv4: the on-demand supervisor for a local LLM engine.

pub mod alert;
pub mod auth;
pub mod body;
pub mod config;
pub mod connections;
pub mod dbus;
pub mod engine_key;
pub mod front;
pub mod http_error;
pub mod hw;
pub mod intake;
pub mod leftover;
pub mod lifecycle;
pub mod listener;
pub mod metrics;
pub mod monitor;
pub mod oversize;
pub mod power;
pub mod profiles;
pub mod proxy;
pub mod reload;
pub mod state_file;
pub mod stats;
pub mod sysroot;
pub mod thermal;
pub mod upstream;
