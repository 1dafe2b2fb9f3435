//! (replaced by the flag reader)
use std::collections::BTreeSet;
pub fn listed(_help: &str) -> BTreeSet<String> {
    BTreeSet::new()
}
pub fn unknown(_args: &[String], _listed: &BTreeSet<String>) -> Vec<String> {
    vec![]
}
