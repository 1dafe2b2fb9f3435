//! dsv4: the on-demand supervisor for a local LLM engine.

pub mod lifecycle;
