//! The holds in force on this box: the coordinators on other boxes whose engines use this
//! box's engine (`crate::http::peers`), for the status.

use std::sync::{Arc, Mutex};

/// The holds in force on this box, for its status.
#[derive(Debug, Clone, Default)]
pub struct Holders(Arc<Mutex<Vec<dsv4_client::Hold>>>);

impl Holders {
    /// The holds in force.
    pub fn list(&self) -> Vec<dsv4_client::Hold> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Lists `hold` until what this returns is dropped.
    pub fn add(&self, hold: dsv4_client::Hold) -> HoldEntry {
        let mut list = self.0.lock().unwrap_or_else(|p| p.into_inner());
        list.push(hold.clone());
        HoldEntry {
            holders: self.clone(),
            hold,
        }
    }
}

/// A hold listed while it lasts.
pub struct HoldEntry {
    holders: Holders,
    hold: dsv4_client::Hold,
}

impl Drop for HoldEntry {
    fn drop(&mut self) {
        let mut list = self.holders.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = list.iter().position(|h| *h == self.hold) {
            list.remove(at);
        }
    }
}
