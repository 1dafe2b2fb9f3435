//! The engine build itself: does it run, does it know every flag the profile adds, and is
//! each model file a GGUF file it can read?
//!
//! The program is run as the service runs it (the doctor's own user and sandbox, the
//! profile's environment), with `--version` and `--help`, each bounded in time. Owns: these
//! checks. Must not: start the engine for real.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::Profile;
use crate::host::gguf;

use super::{flags, Check, RunError};

/// How long `--version` or `--help` may take.
const RUN_LIMIT: Duration = Duration::from_secs(20);
/// The most output read from one run.
const OUTPUT_LIMIT: usize = 1 << 20;

/// What a run gave: its exit code and its output (stdout then stderr).
struct Ran {
    code: Option<i32>,
    output: String,
}

async fn run(profile: &Profile, command: &Path, arg: &str) -> Result<Ran, String> {
    let mut cmd = tokio::process::Command::new(command);
    cmd.arg(arg).envs(&profile.env);
    match super::run_bounded(cmd, RUN_LIMIT).await {
        Err(RunError::Spawn(e)) => Err(format!("cannot run {} {arg}: {e}", command.display())),
        Err(RunError::Timeout) => Err(format!(
            "{} {arg} did not finish within {}",
            command.display(),
            dsv4_client::duration::format(RUN_LIMIT)
        )),
        Err(RunError::Wait(e)) => Err(format!("{} {arg}: {e}", command.display())),
        Ok(ran) => {
            let mut output = ran.stdout;
            output += &ran.stderr;
            output.truncate(output.floor_char_boundary(OUTPUT_LIMIT));
            Ok(Ran {
                code: ran.status.code(),
                output,
            })
        }
    }
}

/// The last non-empty lines of `text`, joined.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// Whether the build is a Vulkan one: `libggml-vulkan` next to the program or in `../lib`.
pub fn is_vulkan(command: &Path) -> bool {
    let Some(dir) = command.parent() else {
        return false;
    };
    [dir.to_path_buf(), dir.join("../lib")].iter().any(|d| {
        std::fs::read_dir(d).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("libggml-vulkan")
            })
        })
    })
}

/// `engine.runs` and `engine.flags` for a profile whose program is `command`.
pub async fn checks(profile: &Profile, command: &Path) -> Vec<Check> {
    let name = &profile.name;
    let mut out = Vec::new();
    let version = match run(profile, command, "--version").await {
        Err(e) => {
            out.push(
                Check::fail(
                    "engine.runs",
                    e,
                    "check that the program is the engine's build for this machine (`ldd` \
                     lists its missing libraries)",
                )
                .profile(name),
            );
            return out;
        }
        Ok(ran) => ran,
    };
    // The loader's own words: a library the build needs is not there.
    if version.code == Some(127) || version.output.contains("error while loading shared") {
        out.push(
            Check::fail(
                "engine.runs",
                format!(
                    "{} does not start: {}",
                    command.display(),
                    tail(&version.output, 2)
                ),
                format!(
                    "set LD_LIBRARY_PATH in the profile's `env:` to the build's library folder, \
                     or rebuild it (`ldd {}`)",
                    command.display()
                ),
            )
            .profile(name),
        );
        return out;
    }
    let first = version
        .output
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("no output");
    out.push(
        match version.code {
            Some(0) => Check::ok("engine.runs", format!("{}: {first}", command.display())),
            code => Check::warn(
                "engine.runs",
                format!(
                    "{} --version exited with {}: {first}",
                    command.display(),
                    code.map_or_else(|| "a signal".to_string(), |c| c.to_string())
                ),
                "check the engine by hand: it runs, but does not answer --version",
            ),
        }
        .profile(name),
    );
    if profile.params.extra_args.is_empty() {
        out.push(Check::ok("engine.flags", "the profile adds no extra_args").profile(name));
        return out;
    }
    out.push(flag_check(profile, command).await.profile(name));
    out
}

async fn flag_check(profile: &Profile, command: &Path) -> Check {
    let help = match run(profile, command, "--help").await {
        Ok(ran) => ran.output,
        Err(e) => {
            return Check::warn(
                "engine.flags",
                format!("could not list its flags: {e}"),
                "check extra_args against the engine's --help by hand",
            )
        }
    };
    let listed = flags::listed(&help);
    if listed.is_empty() {
        return Check::warn(
            "engine.flags",
            format!("{} --help lists no flags", command.display()),
            "check extra_args against the engine's documentation by hand",
        );
    }
    let unknown = flags::unknown(&profile.params.extra_args, &listed);
    let given = profile.params.extra_args.len();
    if unknown.is_empty() {
        return Check::ok(
            "engine.flags",
            format!("every flag of extra_args ({given} arguments) is one --help lists"),
        );
    }
    Check::fail(
        "engine.flags",
        format!(
            "{} does not list {}: the engine would refuse to start",
            command.display(),
            unknown.join(", ")
        ),
        format!(
            "remove {} from extra_args in {}, or use a build that has {}",
            unknown.join(", "),
            profile.file.display(),
            if unknown.len() == 1 { "it" } else { "them" }
        ),
    )
}

/// `engine.model`: each model file's GGUF header.
pub fn model_checks(profile: &Profile) -> Vec<Check> {
    let name = &profile.name;
    let Some(model) = &profile.params.model else {
        let check = if !profile.engine.describe().requires_model {
            Check::ok("engine.model", "the engine names its model itself")
        } else {
            Check::skip("engine.model", "the profile names no model")
        };
        return vec![check.profile(name)];
    };
    let files: Vec<PathBuf> = crate::config::model_files(model);
    let mut out = Vec::new();
    for file in files {
        out.push(
            match gguf::read(&file) {
                Ok(h) => Check::ok(
                    "engine.model",
                    format!(
                        "{}: GGUF v{}, {}, {} tensors{}",
                        file.display(),
                        h.version,
                        h.architecture
                            .as_deref()
                            .map_or("no architecture".to_string(), |a| format!(
                                "architecture {a}"
                            )),
                        h.tensor_count,
                        match h.split {
                            Some((no, of)) => format!(", split {} of {of}", no + 1),
                            None => String::new(),
                        }
                    ),
                ),
                Err(e) => Check::fail(
                    "engine.model",
                    format!("{}: {e}", file.display()),
                    "download the file again and compare its checksum with the source's",
                ),
            }
            .profile(name),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_of_an_output() {
        assert_eq!(tail("a\n\n b \nc\n", 2), "b | c");
        assert_eq!(tail("", 2), "");
    }
}
