//! API keys: who may use the HTTP front when `api.api_keys_file` is set.
//!
//! Owns: reading the key file (and refusing one that group or others may read or write, that
//! another user owns, or whose folder others may write), checking the key a request presents
//! (`Authorization: Bearer KEY` or `x-api-key: KEY`, exactly one), and the cache that ties
//! the keys to the configuration in force. Must not: log, print or echo a
//! key, or let the time a check takes depend on which configured key matched or on how much
//! of a key was right.

use std::fmt;

use std::path::Path;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use http::header::{self, HeaderMap};
use http::StatusCode;
use subtle::Choice;

use crate::config::Config;
pub use crate::host::keys::{owner_problem, ApiKeys, SHORT_KEY};
use crate::http::http_error::{ApiError, ErrorCode, ErrorType};

pub use crate::lifecycle::upstream::X_API_KEY;

/// What a request's headers say about its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthResult {
    /// A presented key is one of the configured ones.
    Ok,
    /// No key was presented.
    Missing,
    /// A key was presented and none of the presented ones is configured.
    Invalid,
    /// More than one credential (`Authorization` and `x-api-key` headers in all): refused,
    /// so that one request cannot try many keys.
    Several,
}

impl ApiKeys {
    /// Checks the key in `Authorization: Bearer KEY` or in `x-api-key: KEY`. More than one
    /// such header in all is refused ([`AuthResult::Several`]); an `Authorization` header of
    /// another scheme, or an empty key, counts as no key.
    pub fn allows(&self, headers: &HeaderMap) -> AuthResult {
        let credentials = headers.get_all(header::AUTHORIZATION).iter().count()
            + headers.get_all(X_API_KEY).iter().count();
        if credentials > 1 {
            return AuthResult::Several;
        }
        let bearer = headers
            .get_all(header::AUTHORIZATION)
            .iter()
            .filter_map(|v| bearer_token(v.as_bytes()));
        let plain = headers
            .get_all(X_API_KEY)
            .iter()
            .map(|v| v.as_bytes().trim_ascii());
        let mut presented = false;
        let mut ok = Choice::from(0);
        for key in bearer.chain(plain).filter(|k| !k.is_empty()) {
            presented = true;
            ok |= self.matches(key);
        }
        match (presented, bool::from(ok)) {
            (false, _) => AuthResult::Missing,
            (true, true) => AuthResult::Ok,
            (true, false) => AuthResult::Invalid,
        }
    }
}

/// Checks the request's key against `keys`, the keys of `file` (`None`: the configuration
/// names no such file, so no key is asked for); on success removes it from the headers. (No
/// client credential reaches the engine either way: the upstream puts the engine's own key
/// in their place.) Fails closed: keys that cannot be read refuse every request with 503.
pub fn require(
    file: KeyFile,
    keys: Option<Result<Arc<ApiKeys>, String>>,
    headers: &mut HeaderMap,
) -> Result<(), ApiError> {
    let what = file.what();
    let keys = match keys {
        None => return Ok(()),
        Some(Ok(keys)) => keys,
        Some(Err(why)) => {
            let refused = match file {
                KeyFile::Admin => "every action",
                KeyFile::Api | KeyFile::Peers => "every request",
            };
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorType::Unavailable,
                ErrorCode::ApiKeysUnavailable,
                format!(
                    "the {what}s cannot be loaded, so {refused} is refused until the key file \
                     is fixed and dsv4d reloaded (SIGHUP, systemctl reload) or restarted: {why}"
                ),
            )
            .retry_after(Duration::from_secs(30)));
        }
    };
    let message = match keys.allows(headers) {
        AuthResult::Ok => {
            headers.remove(header::AUTHORIZATION);
            headers.remove(X_API_KEY);
            return Ok(());
        }
        AuthResult::Missing => {
            format!("missing {what}: send Authorization: Bearer <key> or x-api-key")
        }
        AuthResult::Invalid => format!("invalid {what}"),
        AuthResult::Several => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequest,
                ErrorCode::SeveralCredentials,
                "send one credential: one Authorization or one x-api-key header, not more",
            ))
        }
    };
    let code = match file {
        KeyFile::Admin => ErrorCode::InvalidAdminKey,
        KeyFile::Api | KeyFile::Peers => ErrorCode::InvalidApiKey,
    };
    Err(ApiError::new(
        StatusCode::UNAUTHORIZED,
        ErrorType::InvalidRequest,
        code,
        message,
    ))
}

/// The token of `Bearer TOKEN` (the scheme's case does not matter, RFC 9110 11.1).
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.first()?.is_ascii_whitespace() {
        return None;
    }
    Some(rest.trim_ascii())
}

/// Which key file a [`KeyCache`] reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyFile {
    /// `api.api_keys_file`: the keys of the API.
    #[default]
    Api,
    /// `api.admin_keys_file`: the keys of the dashboard's actions.
    Admin,
    /// `peers.keys_file`: the keys of the coordinators that may hold this box.
    Peers,
}

impl KeyFile {
    /// The file `config` names for these keys, if any.
    pub fn path(self, config: &Config) -> Option<&Path> {
        let api = &config.supervisor.api;
        match self {
            KeyFile::Api => api.api_keys_file.as_deref(),
            KeyFile::Admin => api.admin_keys_file.as_deref(),
            KeyFile::Peers => config.supervisor.peers.keys_file.as_deref(),
        }
    }

    /// Reads these keys from `path`, when `config` names it. Admin keys from the API key
    /// file itself (the same file by another path or a link included) are refused: every API
    /// client would hold one.
    pub fn read(self, path: &Path, config: &Config) -> Result<ApiKeys, String> {
        let api = config.supervisor.api.api_keys_file.as_deref();
        if let (KeyFile::Admin, Some(api)) = (self, api) {
            let shown = api.display().to_string();
            if let Some(why) = crate::config::shared_key_file(api, path, &shown) {
                return Err(format!("the admin key file {} {why}", path.display()));
            }
        }
        ApiKeys::load_as(path, self.what())
    }

    /// What the keys are, in messages.
    pub fn what(self) -> &'static str {
        match self {
            KeyFile::Api => "API key",
            KeyFile::Admin => "admin key",
            KeyFile::Peers => "peer key",
        }
    }

    /// What is refused while these keys cannot be read.
    pub fn refused(self) -> &'static str {
        match self {
            KeyFile::Api => "every request but GET /health",
            KeyFile::Admin => "every action of the dashboard",
            KeyFile::Peers => "every coordinator on another box",
        }
    }
}

/// The keys of the configuration in force, read when first asked for and read again when a
/// reload replaces the configuration (the cache is keyed by the `Arc`, which it holds, so
/// the pointer cannot be reused by another configuration while it is cached).
#[derive(Default)]
pub struct KeyCache {
    file: KeyFile,
    slot: Mutex<Option<Cached>>,
    /// Told the keys each time they are read: they are taken out of the engines' output.
    redact: dsv4_engine::Redactor,
}

type Cached = (Arc<Config>, Result<Arc<ApiKeys>, String>);

impl fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeyCache")
    }
}

impl KeyCache {
    /// A cache of the keys in `file`, which tells `redact` the keys it reads.
    pub fn new(file: KeyFile, redact: dsv4_engine::Redactor) -> KeyCache {
        KeyCache {
            file,
            slot: Mutex::default(),
            redact,
        }
    }

    /// The keys `config` asks for: `None` when it names no such key file (no key needed, or
    /// for admin keys no action allowed), else the keys or why they cannot be had. A failure
    /// is logged once per configuration.
    pub fn get(&self, config: &Arc<Config>) -> Option<Result<Arc<ApiKeys>, String>> {
        let path = self.file.path(config)?;
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((cached, keys)) = slot.as_ref() {
            if Arc::ptr_eq(cached, config) {
                return Some(keys.clone());
            }
        }
        let what = self.file.what();
        let keys = self.file.read(path, config).map(Arc::new);
        match &keys {
            Ok(k) => {
                let which = match self.file {
                    KeyFile::Api => dsv4_engine::Secrets::Api,
                    KeyFile::Admin => dsv4_engine::Secrets::Admin,
                    KeyFile::Peers => dsv4_engine::Secrets::Peer,
                };
                self.redact.set(which, k.texts());
                tracing::info!(
                    "{what}s required: {} key(s) from {}",
                    k.count(),
                    path.display()
                );
                if !k.short_lines().is_empty() {
                    let lines: Vec<String> =
                        k.short_lines().iter().map(|n| n.to_string()).collect();
                    tracing::warn!(
                        "the {what} on line(s) {} of {} is shorter than {SHORT_KEY} characters \
                         and could be guessed; use a long random key (openssl rand -hex 32)",
                        lines.join(", "),
                        path.display()
                    );
                }
            }
            Err(e) => tracing::error!("{e}; {} is refused", self.file.refused()),
        }
        *slot = Some((config.clone(), keys.clone()));
        Some(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A file with `text` and `mode` in a fresh folder, removed on drop.
    struct KeyFile(PathBuf);

    impl KeyFile {
        fn new(text: &str, mode: u32) -> KeyFile {
            static N: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "dsv4-auth-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("api-keys");
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
                .unwrap();
            f.write_all(text.as_bytes()).unwrap();
            // Set after creation: the umask does not apply to chmod.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            KeyFile(path)
        }
    }

    impl Drop for KeyFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.parent().unwrap());
        }
    }

    fn keys(text: &str) -> ApiKeys {
        ApiKeys::parse(text).unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn is(keys: &ApiKeys, candidate: &str) -> bool {
        bool::from(keys.matches(candidate.as_bytes()))
    }

    #[test]
    fn parsing_skips_blanks_and_comments_and_trims() {
        let k = keys("# team keys\n\n  sk-one  \n\t# indented comment\nsk-two\r\n   \n");
        assert_eq!(k.count(), 2);
        assert!(is(&k, "sk-one"));
        assert!(is(&k, "sk-two"));
        assert!(!is(&k, "  sk-one  "));
        assert!(!is(&k, "# team keys"));
    }

    #[test]
    fn a_file_without_keys_is_refused() {
        for text in ["", "\n\n", "# only a comment\n   \n#another\n"] {
            let e = ApiKeys::parse(text).unwrap_err();
            assert!(e.contains("holds no key"), "{e}");
        }
    }

    #[test]
    fn a_key_with_a_control_character_is_refused_without_showing_it() {
        let e = ApiKeys::parse("good\nsecret\x01part\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn debug_does_not_print_keys() {
        let k = keys("sk-very-secret\nsk-other\n");
        let shown = format!("{k:?}");
        assert_eq!(shown, "ApiKeys(2 redacted)");
    }

    #[test]
    fn a_private_file_loads() {
        let f = KeyFile::new("# keys\nsk-a\nsk-b\n", 0o600);
        let k = ApiKeys::load(&f.0).unwrap();
        assert_eq!(k.count(), 2);
        assert!(is(&k, "sk-b"));
        // Read-only for the owner is fine too.
        let f = KeyFile::new("sk-a\n", 0o400);
        assert_eq!(ApiKeys::load(&f.0).unwrap().count(), 1);
    }

    #[test]
    fn a_file_open_to_group_or_others_is_refused_with_the_fix() {
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
            let f = KeyFile::new("sk-a\n", mode);
            let e = ApiKeys::load(&f.0).unwrap_err();
            let path = f.0.display().to_string();
            assert!(e.contains(&format!("chmod 600 {path}")), "{mode:o}: {e}");
            assert!(e.contains(&format!("(mode {mode:04o})")), "{e}");
            assert!(!e.contains("sk-a"), "{e}");
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let f = KeyFile::new("sk-a\n", 0o600);
        let gone = f.0.with_file_name("nope");
        let e = ApiKeys::load(&gone).unwrap_err();
        assert!(
            e.contains(&format!("cannot open the API key file {}", gone.display())),
            "{e}"
        );
    }

    #[test]
    fn a_folder_is_not_a_key_file() {
        let f = KeyFile::new("sk-a\n", 0o600);
        let dir = f.0.parent().unwrap();
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = ApiKeys::load(dir).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn admin_keys_from_the_api_key_file_itself_fail_closed() {
        let f = KeyFile::new("0123456789abcdef0123\n", 0o600);
        let hard = f.0.with_file_name("hard-link");
        std::fs::hard_link(&f.0, &hard).unwrap();
        let mut config = crate::config::Config {
            file: PathBuf::from("supervisor.yaml"),
            supervisor: Default::default(),
            profiles: Default::default(),
        };
        config.supervisor.api.api_keys_file = Some(f.0.clone());
        let admin = super::KeyFile::Admin;
        for path in [&f.0, &hard] {
            let e = admin.read(path, &config).unwrap_err();
            assert!(e.contains("is the same file as api.api_keys_file"), "{e}");
            assert!(e.contains(&path.display().to_string()), "{e}");
        }
        // The API keys themselves, and admin keys of a file of their own, are read.
        assert!(super::KeyFile::Api.read(&f.0, &config).is_ok());
        let other = KeyFile::new("fedcba9876543210fedc\n", 0o600);
        assert!(admin.read(&other.0, &config).is_ok());
    }

    #[test]
    fn an_empty_private_file_names_the_file() {
        let f = KeyFile::new("\n# nothing yet\n", 0o600);
        let e = ApiKeys::load(&f.0).unwrap_err();
        assert!(e.contains(&f.0.display().to_string()), "{e}");
        assert!(e.contains("holds no key"), "{e}");
    }

    #[test]
    fn every_key_matches_and_nothing_near_one_does() {
        let k = keys("first-key\nsecond\nthe-third-and-longest-key\n");
        assert!(is(&k, "first-key"));
        assert!(is(&k, "second"));
        assert!(is(&k, "the-third-and-longest-key"));
        for near in [
            "",
            "first-ke",
            "first-key ",
            "first-kez",
            "First-key",
            "secondsecond",
            "the-third-and-longest-kex",
            "x",
        ] {
            assert!(!is(&k, near), "{near:?} matched");
        }
    }

    #[test]
    fn bearer_and_x_api_key_are_both_accepted() {
        let k = keys("sk-good\n");
        for h in [
            headers(&[("authorization", "Bearer sk-good")]),
            headers(&[("authorization", "bearer sk-good")]),
            headers(&[("authorization", "BEARER   sk-good  ")]),
            headers(&[("x-api-key", "sk-good")]),
            headers(&[("x-api-key", " sk-good ")]),
        ] {
            assert_eq!(k.allows(&h), AuthResult::Ok, "{h:?}");
        }
    }

    #[test]
    fn more_than_one_credential_is_refused_whatever_they_hold() {
        let k = keys("sk-good\n");
        for h in [
            headers(&[("authorization", "Bearer nope"), ("x-api-key", "sk-good")]),
            headers(&[("x-api-key", "nope"), ("x-api-key", "sk-good")]),
            headers(&[
                ("authorization", "Bearer sk-good"),
                ("authorization", "Bearer sk-good"),
            ]),
            headers(&[("authorization", "Basic x"), ("x-api-key", "sk-bad")]),
        ] {
            assert_eq!(k.allows(&h), AuthResult::Several, "{h:?}");
        }
        let many: Vec<(&str, &str)> = (0..96).map(|_| ("x-api-key", "guess")).collect();
        assert_eq!(k.allows(&headers(&many)), AuthResult::Several);
    }

    #[test]
    fn short_keys_are_noted_by_line() {
        let k = keys("# keys\nsk-short\n\n0123456789abcdef\nabc\n");
        assert_eq!(k.short_lines(), [2, 5]);
        assert!(keys("0123456789abcdef0123\n").short_lines().is_empty());
    }

    #[test]
    fn the_file_and_its_folder_are_dsv4ds_users_or_roots() {
        let me = 1000;
        assert_eq!(owner_problem(me, me, 0o700, me), None);
        assert_eq!(owner_problem(0, 0, 0o755, me), None);
        assert_eq!(owner_problem(me, 0, 0o1755, me), None);
        let problem = |f, d, m| owner_problem(f, d, m, me).unwrap();
        assert_eq!(
            problem(1001, me, 0o700),
            "is owned by uid 1001, not by dsv4d's user (uid 1000) or root"
        );
        assert!(problem(me, 1001, 0o700).starts_with("is in a folder owned by uid 1001"));
        assert!(problem(me, me, 0o775).contains("(mode 0775)"));
        assert!(problem(me, 0, 0o1777).contains("(mode 1777)"));
    }

    #[test]
    fn no_key_is_missing_and_a_wrong_one_invalid() {
        let k = keys("sk-good\n");
        for h in [
            headers(&[]),
            headers(&[("authorization", "Basic c2stZ29vZDo=")]),
            headers(&[("authorization", "Bearer")]),
            headers(&[("authorization", "Bearer   ")]),
            headers(&[("authorization", "Bearersk-good")]),
            headers(&[("x-api-key", "")]),
            headers(&[("api-key", "sk-good")]),
        ] {
            assert_eq!(k.allows(&h), AuthResult::Missing, "{h:?}");
        }
        for h in [
            headers(&[("authorization", "Bearer sk-bad")]),
            headers(&[("authorization", "Bearer sk-good-and-more")]),
            headers(&[("x-api-key", "sk-goo")]),
            headers(&[("x-api-key", "Bearer sk-good")]),
        ] {
            assert_eq!(k.allows(&h), AuthResult::Invalid, "{h:?}");
        }
    }

    #[test]
    fn the_cache_follows_the_configuration_in_force() {
        let f = KeyFile::new("sk-a\n", 0o600);
        let mut config = Config {
            file: PathBuf::from("/nonexistent/supervisor.yaml"),
            supervisor: Default::default(),
            profiles: Default::default(),
        };
        let cache = KeyCache::default();
        assert!(cache.get(&Arc::new(config.clone())).is_none());

        config.supervisor.api.api_keys_file = Some(f.0.clone());
        let first = Arc::new(config.clone());
        let a = cache.get(&first).unwrap().unwrap();
        assert_eq!(a.count(), 1);
        // Same configuration: the same keys, not read again.
        std::fs::write(&f.0, "sk-a\nsk-b\n").unwrap();
        let again = cache.get(&first).unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &again));
        // A reload (a new Arc) reads the file again.
        let second = Arc::new(config.clone());
        assert_eq!(cache.get(&second).unwrap().unwrap().count(), 2);
        // and a broken file then fails closed.
        std::fs::set_permissions(&f.0, std::fs::Permissions::from_mode(0o644)).unwrap();
        let third = Arc::new(config);
        let e = cache.get(&third).unwrap().unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
    }
}
