//! dsv4: the on-demand supervisor for a local LLM engine.

pub mod config;
pub mod http_error;
pub mod lifecycle;
pub mod listener;
pub mod proxy;
pub mod stats;
pub mod upstream;
