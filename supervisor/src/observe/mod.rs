//! What is measured: the host's samples (`monitor`), the requests' figures (`stats`), and
//! both as OpenMetrics (`metrics`).

pub mod flights;
pub mod metrics;
pub mod monitor;
pub mod stats;
