//! Rules about what a profile passes to the engine: the flags `extra_args` must leave to
//! dsv4d, environment variable names, and the K/V cache types llama.cpp knows.

/// Flags that dsv4d sets itself, and what to write instead: `None` when dsv4d owns the
/// setting outright (it picks the address the engine listens on), else the profile key.
///
/// Both engines take the last occurrence of a flag and `extra_args` come before `--host` and
/// `--port`, so those would be ignored anyway; the model and context would silently override
/// the profile's (whose context dsv4d reports and checks). llama-server adds up every key it
/// is given: one more would open the engine's port to whoever knows it, and `--api-key`
/// shows the key to every local user in the engine's command line.
const OWNED_FLAGS: &[(&[&str], Option<&str>)] = &[
    (&["--host", "--port"], None),
    (&["--api-key", "--api-key-file"], None),
    (&["-m", "--model"], Some("model")),
    (&["-c", "--ctx-size", "--ctx"], Some("context")),
];

/// The problem with one `extra_args` item, if any. `--flag=value` counts as `--flag`.
pub(crate) fn check_extra_arg(arg: &str) -> Option<String> {
    if arg.contains('\0') {
        return Some(format!("{arg:?} contains a NUL byte"));
    }
    let flag = match arg.split_once('=') {
        Some((flag, _)) if flag.starts_with("--") => flag,
        _ => arg,
    };
    let (_, key) = OWNED_FLAGS
        .iter()
        .find(|(flags, _)| flags.contains(&flag))?;
    Some(match key {
        None => format!("{flag} is set by dsv4d; remove it"),
        Some(key) => format!("{flag} duplicates {key}; set {key} instead"),
    })
}

/// Environment variable names: a letter or `_`, then letters, digits and `_` (POSIX).
pub(crate) fn check_env_name(name: &str) -> Option<String> {
    let mut chars = name.chars();
    let first = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let why = "use letters, digits and '_', not starting with a digit";
    let valid = first && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    (!valid).then(|| format!("invalid variable name {name:?}: {why}"))
}

/// The cache types llama-server accepts for `-ctk`/`-ctv` (llama.cpp `common/arg.cpp`,
/// `kv_cache_types`), each with its size as ggml stores it: bytes per block and elements
/// per block.
const KV_CACHE_TYPES: &[(&str, u64, u64)] = &[
    ("f32", 4, 1),
    ("f16", 2, 1),
    ("bf16", 2, 1),
    ("q8_0", 34, 32),
    ("q4_0", 18, 32),
    ("q4_1", 20, 32),
    ("iq4_nl", 18, 32),
    ("q5_0", 22, 32),
    ("q5_1", 24, 32),
];

pub(crate) fn check_kv_cache(kv: &str) -> Option<String> {
    let names: Vec<&str> = KV_CACHE_TYPES.iter().map(|(n, _, _)| *n).collect();
    let known = names.contains(&kv);
    let types = names.join(", ");
    (!known).then(|| format!("unknown cache type {kv:?}: expected one of {types}"))
}

/// A KV cache type's size: (bytes, per this many elements); `None` for a type llama-server
/// does not accept.
pub fn kv_cache_type_size(kv: &str) -> Option<(u64, u64)> {
    KV_CACHE_TYPES
        .iter()
        .find(|(n, _, _)| *n == kv)
        .map(|(_, bytes, per)| (*bytes, *per))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_flags() {
        assert_eq!(
            check_extra_arg("--port").as_deref(),
            Some("--port is set by dsv4d; remove it")
        );
        assert_eq!(
            check_extra_arg("--host=0.0.0.0").as_deref(),
            Some("--host is set by dsv4d; remove it")
        );
        assert_eq!(
            check_extra_arg("-c").as_deref(),
            Some("-c duplicates context; set context instead")
        );
        assert_eq!(
            check_extra_arg("--model=x.gguf").as_deref(),
            Some("--model duplicates model; set model instead")
        );
        assert_eq!(
            check_extra_arg("--api-key=sk-1").as_deref(),
            Some("--api-key is set by dsv4d; remove it")
        );
        assert_eq!(
            check_extra_arg("--api-key-file").as_deref(),
            Some("--api-key-file is set by dsv4d; remove it")
        );
        for fine in [
            "--metrics",
            "--no-webui",
            "-cb",
            "--ctx-shift",
            "-mu",
            "--portable",
            "8080",
            "-c=1",
            "",
        ] {
            assert_eq!(check_extra_arg(fine), None, "{fine}");
        }
        assert!(check_extra_arg("a\0b").is_some());
    }

    #[test]
    fn env_names() {
        for good in ["A", "_", "HIP_VISIBLE_DEVICES", "a1", "_1"] {
            assert_eq!(check_env_name(good), None, "{good}");
        }
        for bad in ["", "1A", "A-B", "A=B", "A B", "É", "A\0"] {
            assert!(check_env_name(bad).is_some(), "{bad:?}");
        }
    }

    #[test]
    fn kv_cache_types() {
        assert_eq!(check_kv_cache("q8_0"), None);
        assert_eq!(
            check_kv_cache("q8").as_deref(),
            Some(
                "unknown cache type \"q8\": expected one of f32, f16, bf16, q8_0, q4_0, q4_1, \
                 iq4_nl, q5_0, q5_1"
            )
        );
    }
}
