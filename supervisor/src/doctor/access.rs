//! Whether this process may reach a file, told from the mode bits along its path and then
//! tried for real.
//!
//! The doctor's file checks run as the service user inside the service's sandbox, where a
//! real open gives the real answer. The bits give the reason (`/home/ada is 0700, owned by
//! ada`), and they answer for a fixture tree too, since they are read as if root were any
//! other user: the service user never is root. Follows: path_resolution(7) (search
//! permission on every folder on the way, then the owner, group or other class of the
//! file); ACLs are not read (the real open still sees them). Owns: the verdict for one
//! path. Must not: change a mode.

use std::fs::{File, Metadata};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Read, write and search/execute, as mode bits.
pub const READ: u32 = 4;
pub const WRITE: u32 = 2;
pub const EXEC: u32 = 1;

/// Who asks: a user and its groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub uid: u32,
    pub gids: Vec<u32>,
}

impl Who {
    /// This process: its effective user, its group and its supplementary groups.
    pub fn me() -> Who {
        let mut gids: Vec<u32> = nix::unistd::getgroups()
            .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
            .unwrap_or_default();
        gids.push(nix::unistd::getegid().as_raw());
        Who {
            uid: nix::unistd::geteuid().as_raw(),
            gids,
        }
    }

    /// `user (groups a, b)`, by name where the names are known.
    pub fn describe(&self) -> String {
        let user = nix::unistd::User::from_uid(self.uid.into())
            .ok()
            .flatten()
            .map_or_else(|| format!("uid {}", self.uid), |u| u.name);
        let mut groups: Vec<String> = self.gids.iter().map(|g| group_name(*g)).collect();
        groups.dedup();
        format!("{user} (groups {})", groups.join(", "))
    }

    /// The bits of `mode` that apply to this user (owner, else group, else other).
    pub fn bits(&self, meta: &Metadata) -> u32 {
        let mode = meta.mode();
        if meta.uid() == self.uid {
            (mode >> 6) & 7
        } else if self.gids.contains(&meta.gid()) {
            (mode >> 3) & 7
        } else {
            mode & 7
        }
    }
}

/// A group's name, else `gid N`.
pub fn group_name(gid: u32) -> String {
    nix::unistd::Group::from_gid(gid.into())
        .ok()
        .flatten()
        .map_or_else(|| format!("gid {gid}"), |g| g.name)
}

/// A user's name, else `uid N`.
pub fn user_name(uid: u32) -> String {
    nix::unistd::User::from_uid(uid.into())
        .ok()
        .flatten()
        .map_or_else(|| format!("uid {uid}"), |u| u.name)
}

/// Why a path cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// It is not there (or a folder on the way is not).
    Missing,
    /// A folder on the way may not be searched: the first such folder, its mode, owner and
    /// group.
    Folder {
        dir: PathBuf,
        mode: u32,
        owner: u32,
        group: u32,
    },
    /// The file's own bits lack what is wanted.
    File { mode: u32, owner: u32, group: u32 },
    /// The bits allow it, and the system still says no (the sandbox, an ACL, a device
    /// policy): the error it gave.
    System(String),
}

impl Denied {
    /// In words, for `path`.
    pub fn describe(&self, path: &Path, want: u32) -> String {
        let what = match want {
            EXEC => "run",
            WRITE => "write to",
            w if w & WRITE != 0 => "open for writing",
            _ => "read",
        };
        match self {
            Denied::Missing => format!("{} does not exist", path.display()),
            Denied::Folder {
                dir,
                mode,
                owner,
                group,
            } => format!(
                "cannot reach {}: the folder {} is {:04o}, owned by {}:{}",
                path.display(),
                dir.display(),
                mode & 0o7777,
                user_name(*owner),
                group_name(*group)
            ),
            Denied::File { mode, owner, group } => format!(
                "cannot {what} {}: it is {:04o}, owned by {}:{}",
                path.display(),
                mode & 0o7777,
                user_name(*owner),
                group_name(*group)
            ),
            Denied::System(e) => format!("cannot {what} {}: {e}", path.display()),
        }
    }
}

/// Whether `who` may use `path` for `want` (bits of [`READ`], [`WRITE`], [`EXEC`]): the bits
/// of every folder on the way and of the file itself, then, when `try_it`, a real open
/// (read or write) or `access(X_OK)`.
pub fn check(who: &Who, path: &Path, want: u32, try_it: bool) -> Result<Metadata, Denied> {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    // Every folder from the root down to the file's own folder needs search permission.
    let mut ancestors: Vec<&Path> = path.ancestors().skip(1).collect();
    ancestors.reverse();
    for dir in ancestors {
        let meta = match std::fs::metadata(dir) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Denied::Missing),
            Err(e) => return Err(Denied::System(e.to_string())),
        };
        if who.bits(&meta) & EXEC == 0 {
            return Err(Denied::Folder {
                dir: dir.to_path_buf(),
                mode: meta.permissions().mode(),
                owner: meta.uid(),
                group: meta.gid(),
            });
        }
    }
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Denied::Missing),
        Err(e) => return Err(Denied::System(e.to_string())),
    };
    if who.bits(&meta) & want != want {
        return Err(Denied::File {
            mode: meta.permissions().mode(),
            owner: meta.uid(),
            group: meta.gid(),
        });
    }
    if try_it {
        tried(&path, want, &meta).map_err(|e| Denied::System(e.to_string()))?;
    }
    Ok(meta)
}

/// The real thing: open it (read, or read and write) or ask `access(2)` for execution or
/// a folder's use.
fn tried(path: &Path, want: u32, meta: &Metadata) -> io::Result<()> {
    use nix::unistd::AccessFlags;
    if meta.is_dir() || want == EXEC {
        let mut flags = AccessFlags::empty();
        for (bit, flag) in [
            (READ, AccessFlags::R_OK),
            (WRITE, AccessFlags::W_OK),
            (EXEC, AccessFlags::X_OK),
        ] {
            if want & bit != 0 {
                flags |= flag;
            }
        }
        return nix::unistd::access(path, flags).map_err(io::Error::from);
    }
    File::options()
        .read(want & READ != 0)
        .write(want & WRITE != 0)
        .open(path)
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_class_that_applies() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, "x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let meta = std::fs::metadata(&f).unwrap();
        let owner = Who {
            uid: meta.uid(),
            gids: vec![],
        };
        let member = Who {
            uid: meta.uid() + 1,
            gids: vec![meta.gid()],
        };
        let other = Who {
            uid: meta.uid() + 1,
            gids: vec![meta.gid() + 1],
        };
        assert_eq!(owner.bits(&meta), 6);
        assert_eq!(member.bits(&meta), 4);
        assert_eq!(other.bits(&meta), 0);
    }

    #[test]
    fn a_closed_folder_on_the_way_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let models = home.join("models");
        std::fs::create_dir_all(&models).unwrap();
        let model = models.join("m.gguf");
        std::fs::write(&model, "GGUF").unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let meta = std::fs::metadata(&home).unwrap();
        let stranger = Who {
            uid: meta.uid() + 1,
            gids: vec![meta.gid() + 1],
        };
        match check(&stranger, &model, READ, false) {
            Err(Denied::Folder { dir, mode, .. }) => {
                assert_eq!(dir, home);
                assert_eq!(mode & 0o777, 0o700);
            }
            other => panic!("{other:?}"),
        }
        // Its owner passes, and a missing file is missing.
        let me = Who {
            uid: meta.uid(),
            gids: vec![],
        };
        assert!(check(&me, &model, READ, false).is_ok());
        assert_eq!(
            check(&me, &models.join("nope"), READ, false).unwrap_err(),
            Denied::Missing
        );
        // The file's own bits.
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = check(&stranger, &model, READ, false).unwrap_err();
        assert!(matches!(e, Denied::File { .. }), "{e:?}");
        assert!(e.describe(&model, READ).contains("cannot read"), "{e:?}");
    }
}
