//! Can the service reach what its profiles name: the engine program, the model files, the
//! vision projector, its state folder, and the GPU's device nodes?
//!
//! Run as the service user inside the service's sandbox, [`access::check`] answers as the
//! engine will be answered. A file behind a folder the service user may not enter (a model
//! in a 0700 home) gets two fixes: move it, or a drop-in that puts an empty read-only folder
//! in place of the closed one, with only the needed folders bound into it
//! (`TemporaryFileSystem=` plus `BindReadOnlyPaths=`, the combination systemd.exec(5)
//! describes for this), which `dsv4ctl doctor --fix` may write. Owns: these checks and that
//! drop-in. Must not: change a mode or move a file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::config::{Config, Profile};
use crate::host::sysroot::SysRoot;

use dsv4_client::doctor::{Closed, Fix, PATHS_DROP_IN, SERVICE};

use super::access::{self, Denied, Who, EXEC, READ, WRITE};
use super::Check;
/// Where models the service can always reach may go.
pub const MODELS_HOME: &str = "/var/lib/dsv4/models";

/// A file a profile needs, and what for.
struct Needed {
    profile: String,
    id: &'static str,
    path: PathBuf,
    want: u32,
    /// The key to edit in the profile when it moves.
    key: &'static str,
    profile_file: PathBuf,
}

fn needed(profile: &Profile) -> Vec<Needed> {
    let item = |id, path: PathBuf, want, key| Needed {
        profile: profile.name.clone(),
        id,
        path,
        want,
        key,
        profile_file: profile.file.clone(),
    };
    let mut out = vec![item(
        "files.command",
        crate::config::resolve_command(profile),
        EXEC,
        "command",
    )];
    if let Some(model) = &profile.params.model {
        for file in crate::config::model_files(model) {
            out.push(item("files.model", file, READ, "model"));
        }
    }
    if let Some(mmproj) = &profile.params.mmproj {
        out.push(item("files.mmproj", mmproj.clone(), READ, "mmproj"));
    }
    out
}

/// The checks for every profile's files and the state folder; the paths drop-in, when one
/// would help, is attached to each check it fixes.
pub fn checks(config: &Config, who: &Who, try_it: bool) -> Vec<Check> {
    let mut out = Vec::new();
    // Profiles may share a model: each file is checked once, for the first profile naming it.
    let mut seen = BTreeSet::new();
    let mut closed: Vec<(usize, Closed)> = Vec::new();
    for profile in config.profiles.values() {
        for n in needed(profile) {
            if !seen.insert((n.id, n.path.clone())) {
                continue;
            }
            let check = match access::check(who, &n.path, n.want, try_it) {
                Ok(meta) if n.want == EXEC && meta.is_dir() => Check::fail(
                    n.id,
                    format!("{} is a folder, not a program", n.path.display()),
                    format!("set `command:` in {} to the engine's program", shown(&n)),
                ),
                Ok(meta) => Check::ok(
                    n.id,
                    format!(
                        "{} ({}){}",
                        n.path.display(),
                        dsv4_client::units::format_size(meta.len()),
                        if n.want == EXEC {
                            ", runs"
                        } else {
                            ", readable"
                        }
                    ),
                ),
                Err(denied) => {
                    let found = denied.describe(&n.path, n.want);
                    let check = Check::fail(n.id, found, fix_for(&n, &denied));
                    if let Denied::Folder { dir, .. } = &denied {
                        let (folder, file) = (dir.clone(), n.path.clone());
                        closed.push((out.len(), Closed { folder, file }));
                    }
                    check
                }
            };
            out.push(check.profile(&n.profile));
        }
    }
    let fix = Fix::Paths {
        closed: closed.iter().map(|(_, c)| c.clone()).collect(),
    };
    for (i, _) in closed.iter().filter(|_| fix.drop_in().is_ok()) {
        let check = &mut out[*i];
        check.fix = Some(format!(
            "{}; or run `sudo dsv4ctl doctor --fix` to write /etc/systemd/system/{SERVICE}.d/\
             {PATHS_DROP_IN} (an empty read-only folder in place of the closed one, with only \
             the needed folders in it)",
            check.fix.take().unwrap_or_default(),
        ));
        check.fixable = Some(fix.clone());
    }
    out.push(state_dir(&config.supervisor.state_dir, who, try_it));
    out
}

fn shown(n: &Needed) -> String {
    n.profile_file.display().to_string()
}

/// What to do about a file the service cannot use.
fn fix_for(n: &Needed, denied: &Denied) -> String {
    let name = n
        .path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    match denied {
        Denied::Missing => format!("set `{}:` in {} to a file that exists", n.key, shown(n)),
        Denied::Folder { dir, .. } if n.key == "command" => {
            // A build keeps its libraries beside the program: the folder moves whole.
            let folder = n.path.parent().unwrap_or(Path::new("/"));
            let folder_name = folder
                .file_name()
                .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            format!(
                "install the build where the service can run it (`sudo cp -a {} /opt/`, then \
                 set `command:` in {} to /opt/{folder_name}/{name}), or give the dsv4 user \
                 search permission on {}",
                folder.display(),
                shown(n),
                dir.display()
            )
        }
        Denied::Folder { dir, .. } => format!(
            "move it where the service can read it (`sudo mkdir -p {MODELS_HOME} && sudo mv {} \
             {MODELS_HOME}/`, then set `{}:` in {} to {MODELS_HOME}/{name}), or give the \
             dsv4 user search permission on {}",
            n.path.display(),
            n.key,
            shown(n),
            dir.display()
        ),
        Denied::File { .. } if n.want == EXEC => {
            format!("`sudo chmod a+rx {}`", n.path.display())
        }
        Denied::File { .. } => format!("`sudo chmod a+r {}`", n.path.display()),
        Denied::System(_) => format!(
            "move it where the service can read it ({MODELS_HOME}) and set `{}:` in {}",
            n.key,
            shown(n)
        ),
    }
}

/// `state_dir` must be the service's to write.
fn state_dir(dir: &Path, who: &Who, try_it: bool) -> Check {
    let id = "files.state_dir";
    match access::check(who, dir, READ | WRITE | EXEC, try_it) {
        Ok(_) => Check::ok(id, format!("{} is writable", dir.display())),
        Err(denied) => Check::fail(
            id,
            denied.describe(dir, WRITE),
            format!(
                "leave `state_dir` at the unit's StateDirectory (/var/lib/dsv4), or make {} the \
                 dsv4 user's (`sudo chown dsv4:dsv4 {}`)",
                dir.display(),
                dir.display()
            ),
        ),
    }
}

/// The GPU's device nodes under `root`: `/dev/kfd` (ROCm) and each `/dev/dri/renderD*`, and
/// the `/dev/dri/card*` nodes when `vulkan` (a Vulkan build opens them too).
pub fn devices(root: &SysRoot, who: &Who, try_it: bool, vulkan: bool) -> Vec<Check> {
    let id = "gpu.devices";
    if crate::host::hw::amdgpu::Card::find(root).is_none() {
        return vec![Check::skip(id, "no AMD GPU found under /sys/class/drm")];
    }
    let dri = root.list("/dev/dri");
    let mut nodes: Vec<String> = vec!["/dev/kfd".into()];
    nodes.extend(
        dri.iter()
            .filter(|n| n.starts_with("renderD") || (vulkan && n.starts_with("card")))
            .map(|n| format!("/dev/dri/{n}")),
    );
    let (mut ok, mut missing_kfd, mut problems, mut groups) =
        (Vec::new(), false, Vec::new(), BTreeSet::new());
    for node in &nodes {
        let path = root.path(node);
        match access::check(who, &path, READ | WRITE, try_it) {
            Ok(_) => ok.push(node.clone()),
            Err(Denied::Missing) if node == "/dev/kfd" => missing_kfd = true,
            Err(Denied::Missing) => problems.push(format!("{node} does not exist")),
            Err(denied) => {
                if let Denied::File { group, .. } = &denied {
                    groups.insert(access::group_name(*group));
                }
                problems.push(denied.describe(Path::new(node), READ | WRITE));
            }
        }
    }
    if !dri.iter().any(|n| n.starts_with("renderD")) {
        problems.push("no /dev/dri/renderD* node".into());
    }
    let mut out = Vec::new();
    if problems.is_empty() {
        out.push(Check::ok(
            id,
            format!("{} open for reading and writing", ok.join(", ")),
        ));
    } else {
        let fix = if groups.is_empty() {
            "check that the amdgpu driver is loaded (`lsmod | grep amdgpu`) and that the unit's \
             DeviceAllow= lines name the nodes"
                .to_string()
        } else {
            let list: Vec<&str> = groups.iter().map(String::as_str).collect();
            format!(
                "add the nodes' group to the service: a drop-in with `[Service]` \
                 `SupplementaryGroups={}` (`sudo dsv4ctl doctor --fix` writes it)",
                list.join(" ")
            )
        };
        let mut check = Check::fail(
            id,
            format!("as {}: {}", who.describe(), problems.join("; ")),
            fix,
        );
        if !groups.is_empty() {
            check = check.fixable(Fix::Groups {
                groups: groups.iter().cloned().collect(),
            });
        }
        out.push(check);
    }
    if missing_kfd {
        out.push(Check::warn(
            "gpu.kfd",
            "no /dev/kfd: a ROCm (HIP) build of the engine cannot reach the GPU; a Vulkan build \
             does not need it",
            "load amdgpu with its compute support (a kernel with CONFIG_HSA_AMD), or use a \
             Vulkan build",
        ));
    }
    out
}
