//! Connections to the engine: every way an engine closes them, back to back.

mod support;
