//! Secrets taken out of the engine's words: the engine's own key, and the API and admin keys
//! dsv4d holds, become `<engine key>`, `<api key>` and `<admin key>` in every output line
//! dsv4d keeps, logs, quotes in errors and shows. An engine that prints its arguments or its
//! environment at start (many servers do) would otherwise hand its per-generation secret to
//! any client that reads an error.
//!
//! Owns: the secrets and the replacing. Done once per output line the engine writes, never
//! per proxied chunk. Must not: decide what is a secret (the supervisor sets them).

use std::borrow::Cow;
use std::sync::{Arc, RwLock};

use aho_corasick::{AhoCorasick, MatchKind};

/// A secret shorter than this is not taken out: it would garble the engine's words (a
/// one-letter key would take out every such letter), and dsv4d warns about short keys.
pub const SHORTEST: usize = 8;

/// Which secrets a set is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secrets {
    /// The API keys of `api.api_keys_file`.
    Api,
    /// The admin keys of `api.admin_keys_file`.
    Admin,
    /// The coordinators' keys of `peers.keys_file`.
    Peer,
}

impl Secrets {
    const ALL: [Secrets; 3] = [Secrets::Api, Secrets::Admin, Secrets::Peer];

    fn label(self) -> &'static str {
        match self {
            Secrets::Api => "<api key>",
            Secrets::Admin => "<admin key>",
            Secrets::Peer => "<peer key>",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The label of the engine's own key.
pub const ENGINE_KEY: &str = "<engine key>";

#[derive(Default)]
struct Table {
    /// Each set's secrets, by [`Secrets::index`].
    sets: [Vec<String>; Secrets::ALL.len()],
    /// Every secret of every set (the longest wins where two start at one place), and each
    /// one's label.
    finder: Option<(AhoCorasick, Vec<&'static str>)>,
}

impl Table {
    fn build(&mut self) {
        let mut all: Vec<(&str, &'static str)> = Vec::new();
        for which in Secrets::ALL {
            let set = &self.sets[which.index()];
            all.extend(set.iter().map(|k| (k.as_str(), which.label())));
        }
        self.finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(all.iter().map(|(k, _)| k))
            .ok()
            .filter(|_| !all.is_empty())
            .map(|ac| (ac, all.iter().map(|(_, l)| *l).collect()));
    }
}

/// The secrets of a daemon, shared by every engine it starts; each engine's own key is held
/// beside them by [`Redactor::with_engine_key`].
#[derive(Clone, Default)]
pub struct Redactor {
    shared: Arc<RwLock<Table>>,
    engine_key: Option<Arc<str>>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Redactor")
    }
}

impl Redactor {
    /// Sets the secrets of `which` (keys shorter than [`SHORTEST`] are left out).
    pub fn set(&self, which: Secrets, keys: impl IntoIterator<Item = String>) {
        let keys: Vec<String> = keys.into_iter().filter(|k| k.len() >= SHORTEST).collect();
        let mut t = self.shared.write().unwrap_or_else(|p| p.into_inner());
        let slot = &mut t.sets[which.index()];
        if *slot != keys {
            *slot = keys;
            t.build();
        }
    }

    /// The same secrets, and `key`, an engine's own: for that engine's output.
    pub fn with_engine_key(&self, key: Option<&str>) -> Redactor {
        Redactor {
            shared: self.shared.clone(),
            engine_key: key.filter(|k| k.len() >= SHORTEST).map(Arc::from),
        }
    }

    /// `line` with every secret replaced by its label; borrowed when it holds none.
    pub fn line<'a>(&self, line: &'a str) -> Cow<'a, str> {
        let mut out = Cow::Borrowed(line);
        if let Some(key) = self.engine_key.as_deref() {
            if out.contains(key) {
                out = Cow::Owned(out.replace(key, ENGINE_KEY));
            }
        }
        let t = self.shared.read().unwrap_or_else(|p| p.into_inner());
        if let Some((finder, labels)) = &t.finder {
            if finder.is_match(out.as_ref()) {
                out = Cow::Owned(finder.replace_all(out.as_ref(), labels));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_secret_becomes_its_label_once_per_line() {
        let r = Redactor::default();
        r.set(Secrets::Api, ["sk-api-0123456789".into(), "short".into()]);
        r.set(Secrets::Admin, ["adm-0123456789".into()]);
        r.set(Secrets::Peer, ["peer-0123456789".into()]);
        let e = r.with_engine_key(Some("7f84ae79deadbeef"));
        let table = [
            ("nothing here", "nothing here"),
            (
                "starting with key 7f84ae79deadbeef",
                "starting with key <engine key>",
            ),
            (
                "a=sk-api-0123456789 b=adm-0123456789 c=7f84ae79deadbeef7f84ae79deadbeef",
                "a=<api key> b=<admin key> c=<engine key><engine key>",
            ),
            ("held with peer-0123456789", "held with <peer key>"),
            // A short key is left alone: it would take out the word "short" everywhere.
            ("short answer", "short answer"),
        ];
        for (line, want) in table {
            assert_eq!(e.line(line), want, "{line}");
        }
        assert!(matches!(e.line("nothing here"), Cow::Borrowed(_)));
        // The daemon's own redactor knows no engine key; new keys replace the old.
        assert_eq!(r.line("7f84ae79deadbeef"), "7f84ae79deadbeef");
        r.set(Secrets::Api, ["sk-api-abcdefghij".into()]);
        assert_eq!(
            e.line("sk-api-0123456789 sk-api-abcdefghij"),
            "sk-api-0123456789 <api key>"
        );
        // A key inside a longer one is taken out with the longer one.
        r.set(
            Secrets::Api,
            ["sk-api-abcdefghij".into(), "sk-api-abcdefghij-long".into()],
        );
        assert_eq!(r.line("x sk-api-abcdefghij-long y"), "x <api key> y");
    }
}
