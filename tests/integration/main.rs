//! The integration tests, built as one binary: a module per topic, and `support`, the harness
//! they share (the proxy benchmark builds it too), compiled once.
//!
//! `cargo test -p dsv4-tests --test integration` runs them all; a module name as the filter
//! runs one topic (`cargo test -p dsv4-tests --test integration soak`).

mod support;

mod actor;
mod agents;
mod api_access;
mod architecture;
mod bodies;
mod canary;
mod canary_after_change;
mod cluster;
mod connections;
mod control;
mod cors;
mod dashboard;
mod doctor;
mod ds4;
mod ds4_real;
mod engine_connections;
mod engine_key;
mod escaped_engine;
mod event_streams;
mod identity;
mod idle_exit;
mod in_flight;
mod in_flight_shown;
mod installed;
mod installed_cluster;
mod keepalive;
mod kv;
mod lifecycle;
mod matrix;
mod notify;
mod openai_kind;
mod packaging;
mod page_cache;
mod port_taken;
mod power;
mod prefill_power;
mod protocol_errors;
mod protocols;
mod real_engine;
mod reload;
mod service;
mod soak;
mod state_files;
mod stats;
mod systemd;
mod telemetry;
mod thermal;
mod top;
mod units;
mod validate;
