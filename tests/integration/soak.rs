//! A real-client soak through dsv4d in front of the real llama-server.

mod support;
