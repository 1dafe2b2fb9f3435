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

/// Why `name` cannot name a profile, if it cannot: profile names appear in the API, the CLI,
/// the state file and the peers' protocol, so they are kept plain.
pub(crate) fn check_profile_name(name: &str) -> Option<String> {
    let plain = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    match name.is_empty() || name.starts_with('-') || !name.chars().all(plain) {
        true => Some(format!(
            "invalid profile name {name:?}: use letters, digits, '.', '_' and '-' (not first)"
        )),
        false => None,
    }
}

/// Why `at` cannot be a worker box's address, if it cannot: `host:port`, the host an IP
/// address or a name.
pub(crate) fn check_peer_address(at: &str) -> Option<String> {
    let hint = "expected host:port, that box's peers.listen, e.g. 10.77.0.2:8090";
    let Some((host, port)) = at.rsplit_once(':') else {
        return Some(format!("invalid address {at:?}: {hint}"));
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let name = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':');
    match (
        port.parse::<u16>(),
        host.is_empty() || !host.chars().all(name),
    ) {
        (Ok(p), false) if p != 0 => None,
        _ => Some(format!("invalid address {at:?}: {hint}")),
    }
}

/// A worker's `wake:`: its MAC (`aa:bb:cc:dd:ee:ff`) and where its magic packet goes
/// (`IP:port`, by default the limited broadcast on the discard port 9). The field and the
/// message when one cannot be read.
pub(crate) fn wake(
    mac: Option<&str>,
    broadcast: Option<&str>,
) -> Result<super::Wake, (&'static str, String)> {
    let mac_text = mac.ok_or(("mac", "required".to_string()))?;
    let parts: Vec<&str> = mac_text.split([':', '-']).collect();
    let bytes: Vec<u8> = parts
        .iter()
        .filter(|p| p.len() == 2)
        .filter_map(|p| u8::from_str_radix(p, 16).ok())
        .collect();
    let mac: [u8; 6] = bytes.try_into().map_err(|_| {
        let message =
            format!("invalid MAC {mac_text:?}: expected six hex pairs, e.g. aa:bb:cc:dd:ee:ff");
        ("mac", message)
    })?;
    let broadcast = match broadcast {
        None => std::net::SocketAddr::from(([255, 255, 255, 255], 9)),
        Some(text) => text.parse().map_err(|_| {
            let message = format!(
                "invalid address {text:?}: expected IP:port, the link's broadcast address, \
                 e.g. 10.77.0.255:9"
            );
            ("broadcast", message)
        })?,
    };
    Ok(super::Wake { mac, broadcast })
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
