//! An engine's identity at each start (see [`dsv4_client::identity`]): the program (its size,
//! modification time, SHA-256 and what `--version` says), the model files (size, time and
//! a SHA-256 of each GGUF header), the backend the engine names, the kernel and the GPU's
//! firmware. On Strix Halo a backend computed wrong logits at full speed for months; the
//! user's engines are built from pull requests and patches, and ROCm, Mesa, kernel and
//! firmware change often. What changed since the profile's last start is said at notice.
//!
//! Owns: `state_dir/identity.json` (each profile's identity at its last start), reading an
//! identity (blocking: it hashes and runs the program), and the words for what changed.
//! Must not: hold up a start (it is read once the engine serves), or hash a model's tensor
//! data (80 GiB).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsv4_client::identity::{short_hash, EngineIdentity, FileMark};
use dsv4_engine::BackendReport;
use sha2::{Digest, Sha256};

use crate::host::hw::amdgpu::Card;
use crate::host::sysroot::SysRoot;

/// The longest a `--version` or `--list-devices` run may take (a ROCm build initializes its
/// runtime to list its devices: about a second).
const PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// The first bytes of a model whose residency says whether it was in the page cache.
const HEADER_WINDOW: u64 = 16 << 20;
/// What is hashed of a model file that is not a GGUF one: its start.
const NOT_GGUF: u64 = 64 << 10;

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join("identity.json")
}

/// Each profile's identity at its last start, as kept.
pub fn load(state_dir: &Path) -> BTreeMap<String, EngineIdentity> {
    let file = path(state_dir);
    let Some(text) = super::regular::read_state(&file) else {
        return BTreeMap::new();
    };
    serde_json::from_str(&text).unwrap_or_else(|e| {
        tracing::warn!(
            "{}: {e}; the engines' last identities are forgotten",
            file.display()
        );
        BTreeMap::new()
    })
}

/// Keeps `all` as each profile's identity at its last start.
pub fn save(state_dir: &Path, all: &BTreeMap<String, EngineIdentity>) -> std::io::Result<()> {
    super::state_file::write_json(&path(state_dir), all)
}

/// What an engine is started as: its kind's name and way of telling, its program, its
/// model files and environment.
pub struct Started<'a> {
    pub engine: &'static str,
    pub identify: &'a dsv4_engine::Identify,
    pub program: PathBuf,
    pub models: Vec<PathBuf>,
    pub env: Vec<(String, String)>,
    /// Its log so far, for a kind that names its backend there.
    pub log: Vec<String>,
}

/// The identity of the engine `s` describes. `last` is the profile's last one: a program of
/// the same path, size and time is that program, whose hash, version and device list are
/// taken from it rather than made again.
pub fn read(s: &Started, root: &SysRoot, last: Option<&EngineIdentity>) -> EngineIdentity {
    let same = |m: &FileMark| {
        let now = stat(&s.program);
        now.is_some_and(|(size, time)| m.size == size && m.modified == time)
            && m.path == s.program.display().to_string()
    };
    let known = last.filter(|l| l.engine == s.engine && same(&l.program));
    let (program, version, devices) = match known {
        Some(l) => (l.program.clone(), l.version.clone(), l.backend.clone()),
        None => {
            let version = s.identify.version.and_then(|args| {
                let out = probe(&s.program, args, &s.env)?;
                version_of(&out)
            });
            let devices = match &s.identify.backend {
                BackendReport::Devices { args, read } => {
                    probe(&s.program, args, &s.env).map(|out| {
                        let named: Vec<String> = out.lines().filter_map(read).collect();
                        backends(named)
                    })
                }
                _ => None,
            };
            (mark(&s.program, Hash::Whole), version, devices)
        }
    };
    let backend = match &s.identify.backend {
        BackendReport::Log(read) => s.log.iter().find_map(|l| read(l)),
        BackendReport::Devices { .. } => devices,
        BackendReport::Unknown => None,
    };
    EngineIdentity {
        engine: s.engine.to_string(),
        program,
        version,
        backend,
        models: s.models.iter().map(|m| mark(m, Hash::Header)).collect(),
        kernel: root
            .read("/proc/sys/kernel/osrelease")
            .ok()
            .map(|k| k.trim().to_string()),
        gpu_firmware: firmware(root),
    }
}

/// The backends of a device list, one name each in the order listed; none is the CPU.
fn backends(mut named: Vec<String>) -> String {
    named.dedup();
    match named.is_empty() {
        true => "CPU".to_string(),
        false => named.join("+"),
    }
}

/// A version's first line as the program says it (`version: 8123 (0c1e570)` is `8123
/// (0c1e570)`).
fn version_of(out: &str) -> Option<String> {
    let line = out
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("version:"))
        .or_else(|| out.lines().map(str::trim).find(|l| !l.is_empty()))?;
    let v = line.strip_prefix("version:").unwrap_or(line).trim();
    (!v.is_empty()).then(|| v.chars().take(200).collect())
}

enum Hash {
    Whole,
    /// A GGUF file's header (its metadata and tensor descriptions); the start of a file that
    /// is not one.
    Header,
}

fn stat(path: &Path) -> Option<(u64, (i64, u32))> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.len(), (m.mtime(), m.mtime_nsec() as u32)))
}

fn mark(path: &Path, hash: Hash) -> FileMark {
    let (size, modified) = stat(path).unwrap_or_default();
    FileMark {
        path: path.display().to_string(),
        size,
        modified,
        sha256: sha256_of(path, hash).unwrap_or_default(),
    }
}

/// SHA-256 of `path`, whole or its header. A model's header is read without readahead, and
/// when none of its first pages were in the page cache, what was read is dropped again: the
/// identity leaves the page cache as it found the model (an idle stop may have left it out).
fn sha256_of(path: &Path, hash: Hash) -> std::io::Result<String> {
    use nix::fcntl::{posix_fadvise, PosixFadviseAdvice};
    use std::io::{BufReader, Seek};
    let mut file = std::fs::File::open(path)?;
    let (upto, cold) = match hash {
        Hash::Whole => (u64::MAX, false),
        Hash::Header => {
            let window = file.metadata()?.len().min(HEADER_WINDOW);
            let cold = window > 0
                && crate::host::pagecache::resident_in(&file, 0, window).is_ok_and(|r| r == 0);
            posix_fadvise(&file, 0, 0, PosixFadviseAdvice::POSIX_FADV_RANDOM)
                .map_err(std::io::Error::from)?;
            let header = crate::host::gguf::parse(BufReader::with_capacity(1 << 16, &file));
            file.rewind()?;
            (header.map_or(NOT_GGUF, |h| h.header_bytes), cold)
        }
    };
    let mut hasher = Sha256::new();
    let read = std::io::copy(&mut (&file).take(upto), &mut hasher)?;
    if cold {
        // The parse read ahead of the header by up to its buffer.
        let len = nix::libc::off_t::try_from(read + (1 << 16)).unwrap_or(0);
        posix_fadvise(&file, 0, len, PosixFadviseAdvice::POSIX_FADV_DONTNEED)
            .map_err(std::io::Error::from)?;
    }
    Ok(hex::encode(hasher.finalize()))
}

/// What `program args` prints (its output and errors together), when it exits within the
/// probe's time; `None` when it cannot be run or does not exit. Runs on the runtime of the
/// blocking thread it is called from.
fn probe(program: &Path, args: &[&str], env: &[(String, String)]) -> Option<String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
    let ran = tokio::runtime::Handle::try_current()
        .ok()?
        .block_on(super::run::run_bounded(cmd, PROBE_TIMEOUT));
    match ran {
        Ok(r) if r.status.success() => Some(format!("{}{}", r.stdout, r.stderr)),
        Ok(r) => {
            tracing::debug!(
                "{} {}: {}; its answer is not part of the engine's identity",
                program.display(),
                args.join(" "),
                r.status
            );
            None
        }
        Err(e) => {
            tracing::warn!(
                "{} {}: {e:?}; its answer is not part of the engine's identity",
                program.display(),
                args.join(" ")
            );
            None
        }
    }
}

/// The GPU's firmware versions (amdgpu's `device/fw_version/*_fw_version` files), as
/// `name=value` pairs in name order.
fn firmware(root: &SysRoot) -> Option<String> {
    let card = Card::find(root)?;
    let dir = format!("{}/fw_version", card.device);
    let mut names = root.list(&dir);
    names.sort();
    let pairs: Vec<String> = names
        .iter()
        .filter_map(|n| {
            let value = root.read(&format!("{dir}/{n}")).ok()?;
            let short = n.strip_suffix("_fw_version").unwrap_or(n);
            Some(format!("{short}={}", value.trim()))
        })
        .collect();
    (!pairs.is_empty()).then(|| pairs.join(" "))
}

/// What differs between a profile's last start and this one, in words.
pub fn changes(old: &EngineIdentity, new: &EngineIdentity) -> Vec<String> {
    let mut out = Vec::new();
    if old.engine != new.engine || old.version != new.version {
        out.push(format!("{} -> {}", old.brief(), new.brief()));
    } else if old.program.sha256 != new.program.sha256 || old.program.path != new.program.path {
        out.push(format!(
            "{} program {} ({}) -> {} ({}), same version",
            new.engine,
            old.program.path,
            short_hash(&old.program.sha256),
            new.program.path,
            short_hash(&new.program.sha256)
        ));
    } else if old.backend != new.backend {
        let shown = |b: &Option<String>| b.clone().unwrap_or_else(|| "unknown".into());
        out.push(format!(
            "backend {} -> {}",
            shown(&old.backend),
            shown(&new.backend)
        ));
    }
    let model_changes =
        new.models
            .iter()
            .filter_map(|m| match old.models.iter().find(|o| o.path == m.path) {
                None => Some(format!("model {} is new", m.path)),
                Some(o) if o.sha256 != m.sha256 => {
                    Some(format!("model {}: another header", m.path))
                }
                Some(o) if (o.size, o.modified) != (m.size, m.modified) => Some(format!(
                    "model {}: written since (size {} -> {})",
                    m.path, o.size, m.size
                )),
                Some(_) => None,
            });
    out.extend(model_changes);
    for (what, a, b) in [
        ("kernel", &old.kernel, &new.kernel),
        ("GPU firmware", &old.gpu_firmware, &new.gpu_firmware),
    ] {
        if a != b {
            let shown = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
            out.push(format!("{what} {} -> {}", shown(a), shown(b)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> EngineIdentity {
        let file = |path: &str, sha: &str| FileMark {
            path: path.into(),
            size: 10,
            modified: (1, 0),
            sha256: sha.into(),
        };
        EngineIdentity {
            engine: "llama-server".into(),
            program: file("/opt/llama/llama-server", "aaaaaaaaaaaaaaaa"),
            version: Some("6801 (3a798bf2)".into()),
            backend: Some("ROCm".into()),
            models: vec![file("/m/ds4.gguf", "cccc")],
            kernel: Some("6.18.4".into()),
            gpu_firmware: Some("mec=0x1 smc=0x2".into()),
        }
    }

    #[test]
    fn each_change_is_said_in_words() {
        type Edit = fn(&mut EngineIdentity);
        let rows: &[(Edit, &[&str])] = &[
            (|_| {}, &[]),
            (
                |i| i.version = Some("6922 (b81c)".into()),
                &["llama-server 6801 (3a798bf2) (ROCm) -> llama-server 6922 (b81c) (ROCm)"],
            ),
            (
                |i| i.program.sha256 = "bbbbbbbbbbbbbbbb".into(),
                &[
                    "llama-server program /opt/llama/llama-server (sha256:aaaaaaaaaaaa) -> \
                   /opt/llama/llama-server (sha256:bbbbbbbbbbbb), same version",
                ],
            ),
            (
                |i| i.backend = Some("Vulkan".into()),
                &["backend ROCm -> Vulkan"],
            ),
            (
                |i| i.models[0].sha256 = "dddd".into(),
                &["model /m/ds4.gguf: another header"],
            ),
            (
                |i| i.models[0].modified = (2, 0),
                &["model /m/ds4.gguf: written since (size 10 -> 10)"],
            ),
            (
                |i| i.models[0].path = "/m/other.gguf".into(),
                &["model /m/other.gguf is new"],
            ),
            (
                |i| i.kernel = Some("6.18.5".into()),
                &["kernel 6.18.4 -> 6.18.5"],
            ),
            (
                |i| {
                    i.gpu_firmware = None;
                    i.kernel = None;
                },
                &[
                    "kernel 6.18.4 -> none",
                    "GPU firmware mec=0x1 smc=0x2 -> none",
                ],
            ),
        ];
        for (edit, want) in rows {
            let mut new = id();
            edit(&mut new);
            assert_eq!(changes(&id(), &new), *want);
        }
    }

    #[test]
    fn versions_and_device_lists_are_read_as_the_programs_print_them() {
        let llama = "version: 8123 (0c1e57098)\nbuilt with GNU 12.2.0 for Linux x86_64\n";
        assert_eq!(version_of(llama).as_deref(), Some("8123 (0c1e57098)"));
        assert_eq!(version_of("ds4 1.2\n").as_deref(), Some("ds4 1.2"));
        assert_eq!(version_of("\n\n"), None);
        assert_eq!(backends(vec![]), "CPU");
        assert_eq!(backends(vec!["ROCm".into(), "ROCm".into()]), "ROCm");
        assert_eq!(
            backends(vec!["ROCm".into(), "Vulkan".into()]),
            "ROCm+Vulkan"
        );
    }

    #[test]
    fn a_model_out_of_the_page_cache_stays_out_of_it() {
        use crate::host::pagecache::{evict, residency};
        // On the disk: a tmpfs file's pages are the file.
        let dir = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let path = dir.path().join("m.gguf");
        let mut bytes = b"GGUF".to_vec();
        bytes.resize(4 << 20, 1);
        std::fs::write(&path, &bytes).unwrap();
        std::fs::File::open(&path).unwrap().sync_all().unwrap();
        evict(&path).unwrap();
        assert_eq!(residency(&path).unwrap().resident, 0);
        let m = mark(&path, Hash::Header);
        assert_eq!(
            m.sha256,
            hex::encode(Sha256::digest(&bytes[..NOT_GGUF as usize]))
        );
        assert_eq!(residency(&path).unwrap().resident, 0);
        // A model in the page cache is left there.
        let _ = std::fs::read(&path).unwrap();
        let before = residency(&path).unwrap().resident;
        mark(&path, Hash::Header);
        assert_eq!(residency(&path).unwrap().resident, before);
    }

    #[test]
    fn the_gpu_firmware_is_read_from_amdgpus_fw_version_files() {
        // The fixture's `fw_version` files are shaped as amdgpu writes them (`0x%08x`); their
        // values are not a capture.
        let tree =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sysfs/strix-halo");
        let root = SysRoot::new(tree).unwrap();
        let fw = firmware(&root).unwrap();
        assert!(
            fw.starts_with("imu=0x0b352300 me=0x00000a1c mec=0x00000a24 "),
            "{fw}"
        );
        assert!(fw.ends_with(" vcn=0x0911900c"), "{fw}");
        let bare = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/sysfs/bare");
        assert_eq!(firmware(&SysRoot::new(bare).unwrap()), None);
    }

    #[test]
    fn a_models_header_is_hashed_not_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(3u32.to_le_bytes());
        bytes.extend(0u64.to_le_bytes());
        bytes.extend(0u64.to_le_bytes());
        let header = bytes.clone();
        bytes.extend([7u8; 4096]);
        std::fs::write(&path, &bytes).unwrap();
        let m = mark(&path, Hash::Header);
        assert_eq!(m.sha256, hex::encode(Sha256::digest(&header)));
        assert_eq!(m.size, bytes.len() as u64);
        // The data changes, the header's hash does not; the whole file's does.
        bytes[30] = 9;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(mark(&path, Hash::Header).sha256, m.sha256);
        assert_ne!(
            mark(&path, Hash::Whole).sha256,
            mark(&path, Hash::Header).sha256
        );
    }
}
