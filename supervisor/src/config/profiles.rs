//! The profiles as clients see them: one list for `GET /v1/models` and `ListProfiles()`.

use dsv4_client::ProfileInfo;

use crate::config::Config;

/// Every profile of `config`, in name order; `active` marks the one the next start uses.
pub fn list(config: &Config, active: &str) -> Vec<ProfileInfo> {
    config
        .profiles
        .values()
        .map(|p| ProfileInfo {
            name: p.name.clone(),
            description: p.description.clone(),
            engine: p.engine.name().to_string(),
            context: p.context(),
            active: p.name == active,
        })
        .collect()
}
