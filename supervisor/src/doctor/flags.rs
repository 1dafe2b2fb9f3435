//! Which flags an engine's `--help` lists, and which of a profile's `extra_args` it lacks.
//!
//! Both engines print their flags at a line's start, aliases separated by commas or `|`
//! (llama-server: `-t,    --threads N`, `--ui,  --webui, --no-ui, --no-webui`; ds4-server:
//! `  -m, --model FILE`, `  --metal | --cuda | --cpu`), then a description after a wide gap.
//! A flag named inside a description (`Complements --cpu-mask`) is a real flag too, so every
//! word shaped like a flag counts; a negative number (`-1`) is not one. Owns: reading the
//! text. Must not: run the engine (the caller does).

use std::collections::BTreeSet;

/// `-x`, `--long-name`, `--name=VALUE` (the name), `--[no-]name` (both), with a trailing
/// comma or bracket trimmed; `None` for a word that is not a flag.
fn flag_names(word: &str) -> Vec<String> {
    let word = word.trim_end_matches([',', ';', ':', '.', ')', ']']);
    let word = word.trim_start_matches(['(', '[']);
    let word = word.split('=').next().unwrap_or(word);
    if let Some(rest) = word.strip_prefix("--[no-]") {
        return [format!("--{rest}"), format!("--no-{rest}")]
            .into_iter()
            .filter(|f| shaped(f))
            .collect();
    }
    if shaped(word) {
        vec![word.to_string()]
    } else {
        Vec::new()
    }
}

/// One or two dashes, then a letter, then letters, digits, `-` and `_`.
fn shaped(word: &str) -> bool {
    let body = word
        .strip_prefix("--")
        .or_else(|| word.strip_prefix('-'))
        .unwrap_or("");
    let mut chars = body.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

/// Every flag the help text lists.
pub fn listed(help: &str) -> BTreeSet<String> {
    help.split(|c: char| c.is_whitespace() || c == '|' || c == '/')
        .flat_map(flag_names)
        .collect()
}

/// The flags of `args` that `listed` lacks, in order, each once. A word after a flag is its
/// value, unless it is shaped like a flag itself; a negative number is never a flag.
pub fn unknown(args: &[String], listed: &BTreeSet<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for arg in args {
        let name = arg.split('=').next().unwrap_or(arg);
        if !shaped(name) || listed.contains(name) || out.iter().any(|o| o == name) {
            continue;
        }
        out.push(name.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines of llama-server 0.3.36's `--help`.
    const LLAMA: &str = "\
----- common params -----

-h,    --help, --usage                  print usage and exit
--version                               show version and build info
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-C,    --cpu-mask M                     CPU affinity mask: arbitrarily long hex. Complements cpu-range
-ub,   --ubatch-size N                  physical maximum batch size (default: 512)
-lm,   --load-mode MODE                 model loading mode (default: auto)
                                        - auto: mmap, unless a device does not support it
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
-dev,  --device <dev1,dev2,..>          comma-separated list of devices to use for offloading (none = don't
--ui,  --webui, --no-ui, --no-webui     whether to enable the Web UI (default: enabled)
";

    /// Lines of ds4-server's `--help`.
    const DS4: &str = "\
Model And Runtime
  -m, --model FILE               GGUF model path. Default: ds4flash.gguf
  --metal | --cuda | --cpu       Select the backend explicitly.
  -c, --ctx N                    Allocated context tokens.
  --power N                      GPU duty-cycle target, 1..100. Default: 100
  --ssd-streaming-cache-experts N|NGB
      SSD streaming: N is an exact dynamic expert count; NGB is a routed memory budget.
  --kv-disk-dir DIR              Enable disk KV checkpoints in DIR.
";

    fn set(words: &[&str]) -> BTreeSet<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn llama_servers_columns() {
        let l = listed(LLAMA);
        for f in [
            "-h",
            "--help",
            "--usage",
            "--version",
            "-t",
            "--threads",
            "-ub",
            "--ubatch-size",
            "-lm",
            "--load-mode",
            "-fa",
            "--flash-attn",
            "-dev",
            "--device",
            "--no-webui",
            "--webui",
            "--no-ui",
        ] {
            assert!(l.contains(f), "{f} not in {l:?}");
        }
        // Not flags: dashes of a rule, a negative default, a list item.
        for f in ["-1", "-----", "-", "--no-mmap", "--webui-config"] {
            assert!(!l.contains(f), "{f} in {l:?}");
        }
    }

    #[test]
    fn ds4_servers_columns() {
        let l = listed(DS4);
        assert!(
            set(&[
                "-m",
                "--model",
                "--metal",
                "--cuda",
                "--cpu",
                "-c",
                "--ctx",
                "--power",
                "--ssd-streaming-cache-experts",
                "--kv-disk-dir",
            ])
            .is_subset(&l),
            "{l:?}"
        );
    }

    #[test]
    fn the_unknown_flags_of_extra_args() {
        let l = listed(LLAMA);
        let args: Vec<String> = [
            "--no-webui",
            "-ub",
            "2048",
            "--no-mmap",
            "--threads=4",
            "-1",
            "--no-mmap",
            "--mlock",
            "value",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(unknown(&args, &l), ["--no-mmap", "--mlock"]);
        assert!(unknown(&[], &l).is_empty());
        assert_eq!(flag_names("--[no-]warmup"), ["--warmup", "--no-warmup"]);
    }

    /// The real builds' help, when they are there (tests/engine/prepare, the ds4 rig).
    #[test]
    fn the_real_engines_list_their_flags() {
        let Some(home) = std::env::var_os("HOME") else {
            return;
        };
        let cache = std::path::Path::new(&home).join(".cache/dsv4");
        let help = |program: std::path::PathBuf| {
            let out = std::process::Command::new(&program)
                .arg("--help")
                .output()
                .ok()?;
            let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
            text += &String::from_utf8_lossy(&out.stderr);
            Some(text)
        };
        if let Some(text) = help(cache.join("engine/bin/llama-server")) {
            let l = listed(&text);
            for f in [
                "--no-webui",
                "-ub",
                "--ubatch-size",
                "-c",
                "--ctx-size",
                "--port",
            ] {
                assert!(l.contains(f), "llama-server: {f}");
            }
            assert!(!l.contains("--no-such-flag"));
        }
        if let Some(text) = help(cache.join("ds4/ds4-server")) {
            let l = listed(&text);
            for f in [
                "--ctx",
                "--power",
                "--kv-disk-dir",
                "--prefill-chunk",
                "--port",
            ] {
                assert!(l.contains(f), "ds4-server: {f}");
            }
        }
    }
}
