//! `dsv4ctl doctor`'s findings: one [`Check`] per promise the machine must keep.
//!
//! `dsv4d --doctor` makes the checks that need the daemon's own code (its configuration
//! loader, its admission rules, its sysfs readers), as the service user inside the service's
//! sandbox when `dsv4ctl doctor` runs it there, and prints them as JSON; `dsv4ctl` adds its
//! own (the daemon over D-Bus, the caller's groups) and prints them all. Owns: the shape of a
//! finding and its verdict. Must not: make a check (the daemon's `doctor` module does).

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How a check came out, from best to worst; a run fails when one check failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The promise holds.
    Ok,
    /// It could not be looked at here (no such hardware, no permission to read the journal):
    /// `found` says why. Not a failure.
    Skip,
    /// It holds, but something is known to go wrong with what was found.
    Warn,
    /// It does not hold: the engine would not start, or would fail once started.
    Fail,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::Skip => "skip",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
        }
    }
}

/// The service the doctor's drop-ins are for.
pub const SERVICE: &str = "dsv4.service";
/// The drop-in that opens closed folders to the service.
pub const PATHS_DROP_IN: &str = "50-doctor-paths.conf";
/// The drop-in that adds the device nodes' groups to the service.
pub const GROUPS_DROP_IN: &str = "50-doctor-groups.conf";

/// A change `dsv4ctl doctor --fix` may make, as data: what the check found, never a file
/// name or a unit's text. dsv4ctl composes the drop-in from it ([`Fix::drop_in`]) and writes
/// it under its own fixed name ([`Fix::file_name`]) in `dsv4.service.d/`: the check runs as
/// the service user, and root takes no file name or unit text from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Fix {
    /// Files the service user cannot reach, each behind a folder it may not enter: each such
    /// folder becomes an empty read-only one holding only what is bound into it.
    Paths { closed: Vec<Closed> },
    /// The groups of the GPU's device nodes, which the service lacks.
    Groups { groups: Vec<String> },
}

/// A file behind a folder the service user may not enter.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Closed {
    /// The folder it may not enter.
    pub folder: PathBuf,
    /// The file the profile names, below it.
    pub file: PathBuf,
}

/// Why a fix cannot be written as a drop-in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused(pub String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Fix {
    /// Its file in `dsv4.service.d/`: fixed by its kind.
    pub fn file_name(&self) -> &'static str {
        match self {
            Fix::Paths { .. } => PATHS_DROP_IN,
            Fix::Groups { .. } => GROUPS_DROP_IN,
        }
    }

    /// `other` taken into this fix of the same kind; `false` (and nothing taken) when it is of
    /// another kind.
    pub fn merge(&mut self, other: &Fix) -> bool {
        match (self, other) {
            (Fix::Paths { closed }, Fix::Paths { closed: more }) => {
                closed.extend(more.iter().cloned());
                closed.sort();
                closed.dedup();
                true
            }
            (Fix::Groups { groups }, Fix::Groups { groups: more }) => {
                groups.extend(more.iter().cloned());
                groups.sort();
                groups.dedup();
                true
            }
            _ => false,
        }
    }

    /// The drop-in's whole text, each path written the way systemd reads it, or why it cannot
    /// be written (a path that is not absolute and plain, holds a control character or is not
    /// UTF-8; a file not below its folder; a group name systemd would not take).
    pub fn drop_in(&self) -> Result<String, Refused> {
        match self {
            Fix::Paths { closed } => paths_drop_in(closed),
            Fix::Groups { groups } => groups_drop_in(groups),
        }
    }
}

fn paths_drop_in(closed: &[Closed]) -> Result<String, Refused> {
    let mut tmpfs = BTreeSet::new();
    let mut binds = BTreeSet::new();
    for c in closed {
        plain(&c.folder)?;
        plain(&c.file)?;
        if c.file == c.folder || !c.file.starts_with(&c.folder) {
            return Err(Refused(format!(
                "{} is not below the folder {}",
                shown(&c.file),
                shown(&c.folder)
            )));
        }
        tmpfs.insert(c.folder.as_path());
        // The file's own folder, or the file when that is the closed one.
        let parent = c.file.parent().unwrap_or(Path::new("/"));
        binds.insert(if parent != c.folder { parent } else { &c.file });
    }
    if tmpfs.is_empty() {
        return Err(Refused("a paths fix that names no file".into()));
    }
    let mut text = String::from(
        "# Written by `dsv4ctl doctor --fix`: the dsv4 user may not enter the folders below.\n\
         # The service sees each as an empty read-only folder holding only what its profiles\n\
         # need. Delete this file to undo it (then `systemctl daemon-reload`).\n[Service]\n",
    );
    for dir in &tmpfs {
        text += &format!(
            "TemporaryFileSystem={}\n",
            tmpfs_entry(dir, "ro", Reader::UnitFile)?
        );
    }
    // A bind inside another bind is there already.
    for bind in binds
        .iter()
        .filter(|b| !binds.iter().any(|o| o != *b && b.starts_with(o)))
    {
        text += &format!(
            "BindReadOnlyPaths={}\n",
            bind_entry(bind, bind, "", Reader::UnitFile)?
        );
    }
    Ok(text)
}

fn groups_drop_in(groups: &[String]) -> Result<String, Refused> {
    if groups.is_empty() {
        return Err(Refused("a groups fix that names no group".into()));
    }
    if let Some(bad) = groups.iter().find(|g| !group_name(g)) {
        return Err(Refused(format!(
            "{bad:?} is not a group name systemd takes (letters, digits, _ and -, at most 32)"
        )));
    }
    Ok(format!(
        "# Written by `dsv4ctl doctor --fix`: the GPU's device nodes belong to these groups.\n\
         [Service]\nSupplementaryGroups={}\n",
        groups.join(" ")
    ))
}

/// A group as systemd takes it in `SupplementaryGroups=`: a number, or a name by its
/// "strict" rule (minus the trailing `$` of machine accounts).
fn group_name(name: &str) -> bool {
    if !name.is_empty() && name.len() <= 10 && name.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    let mut chars = name.chars();
    let first = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first && name.len() <= 32 && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn shown(p: &Path) -> String {
    format!("{:?}", p.as_os_str())
}

/// `p` as text, when it is absolute, without `.` or `..` parts, UTF-8 and free of control
/// characters: else why not.
fn plain(p: &Path) -> Result<&str, Refused> {
    let text = p
        .to_str()
        .ok_or_else(|| Refused(format!("the path {} is not UTF-8", shown(p))))?;
    if text.chars().any(char::is_control) {
        return Err(Refused(format!(
            "the path {} holds a control character, which a unit file cannot carry",
            shown(p)
        )));
    }
    let normal = p
        .components()
        .skip(1)
        .all(|c| matches!(c, Component::Normal(_)));
    if !p.is_absolute() || !normal {
        return Err(Refused(format!(
            "the path {} is not absolute and plain (no `.` or `..`)",
            shown(p)
        )));
    }
    Ok(text)
}

/// Where systemd reads a value: a unit file expands specifiers (`%` must be doubled),
/// `systemd-run -p` does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reader {
    UnitFile,
    Run,
}

/// A value in double quotes, as systemd's word splitter reads it: `\` and `"` escaped, and
/// for a unit file `%` doubled.
fn quoted(text: &str, reader: Reader) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '\\' | '"' => {
                out.push('\\');
                out.push(c);
            }
            '%' if reader == Reader::UnitFile => out.push_str("%%"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A path of a bind: quoted, then each `:` escaped inside the quotes, read once
/// (systemd.exec(5): "\:" embeds a colon).
fn bind_path(p: &Path, reader: Reader) -> Result<String, Refused> {
    Ok(quoted(plain(p)?, reader).replace(':', "\\:"))
}

/// A `BindPaths=`/`BindReadOnlyPaths=` entry: `source` bound onto `dest` with `options`
/// (`rbind`, `norbind`; none for the default), `source` alone when it is bound onto itself
/// with the default. Shown with systemd 252, in a unit file and through `systemd-run -p`, to
/// bind exactly paths with blanks, `%`, `:`, `"` and `\` in them.
pub fn bind_entry(
    source: &Path,
    dest: &Path,
    options: &str,
    reader: Reader,
) -> Result<String, Refused> {
    let mut out = bind_path(source, reader)?;
    if dest != source || !options.is_empty() {
        out = format!("{out}:{}", bind_path(dest, reader)?);
    }
    if !options.is_empty() {
        out = format!("{out}:{}", option_words(options)?);
    }
    Ok(out)
}

/// A `TemporaryFileSystem=` entry: systemd reads it twice (the word, then the path and its
/// options split at `:`), so the path's `:` and `\` are escaped for the second reading, then
/// the whole quoted for the first. Shown with systemd 252 like [`bind_entry`].
pub fn tmpfs_entry(path: &Path, options: &str, reader: Reader) -> Result<String, Refused> {
    let path = plain(path)?.replace('\\', "\\\\").replace(':', "\\:");
    let word = match options {
        "" => path,
        options => format!("{path}:{}", option_words(options)?),
    };
    Ok(quoted(&word, reader))
}

/// Mount options as systemd reports them (`ro`, `mode=0755,size=10%`): plain words only.
fn option_words(options: &str) -> Result<&str, Refused> {
    let plain = options
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || ",=_-.%+".contains(c));
    match plain {
        true => Ok(options),
        false => Err(Refused(format!(
            "mount options {options:?} are not plain words"
        ))),
    }
}

/// One finding. Nothing but these fields is taken: a check's JSON with another is refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// A stable name, `group.what`: `files.model`, `memory.fit`, `power.ppd_amdgpu_dpm`.
    pub id: String,
    /// The profile it is about, for a check made once per profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    pub verdict: Verdict,
    /// What was found, with its figures: one line.
    pub found: String,
    /// For a warning or a failure: what to do (the command, the kernel parameter, the
    /// drop-in), exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// Where the advice comes from, when it is other people's finding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The fix `dsv4ctl doctor --fix` may make, as data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixable: Option<Fix>,
}

impl Check {
    pub fn new(id: impl Into<String>, verdict: Verdict, found: impl Into<String>) -> Check {
        Check {
            id: id.into(),
            profile: None,
            verdict,
            found: found.into(),
            fix: None,
            source: None,
            fixable: None,
        }
    }

    pub fn ok(id: impl Into<String>, found: impl Into<String>) -> Check {
        Check::new(id, Verdict::Ok, found)
    }

    pub fn skip(id: impl Into<String>, found: impl Into<String>) -> Check {
        Check::new(id, Verdict::Skip, found)
    }

    pub fn warn(id: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(id, Verdict::Warn, found).fix(fix)
    }

    pub fn fail(id: impl Into<String>, found: impl Into<String>, fix: impl Into<String>) -> Check {
        Check::new(id, Verdict::Fail, found).fix(fix)
    }

    pub fn fix(mut self, fix: impl Into<String>) -> Check {
        self.fix = Some(fix.into());
        self
    }

    pub fn profile(mut self, profile: impl Into<String>) -> Check {
        self.profile = Some(profile.into());
        self
    }

    pub fn source(mut self, source: impl Into<String>) -> Check {
        self.source = Some(source.into());
        self
    }

    pub fn fixable(mut self, fix: Fix) -> Check {
        self.fixable = Some(fix);
        self
    }
}

/// The worst verdict of `checks` (`Ok` for none).
pub fn worst(checks: &[Check]) -> Verdict {
    checks
        .iter()
        .map(|c| c.verdict)
        .max()
        .unwrap_or(Verdict::Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_order_and_round_trip() {
        let checks = vec![
            Check::ok("a.b", "fine"),
            Check::warn("a.c", "hm", "do this").source("someone"),
        ];
        assert_eq!(worst(&checks), Verdict::Warn);
        assert_eq!(worst(&[]), Verdict::Ok);
        let json = serde_json::to_string(&checks).unwrap();
        assert!(json.contains(r#""verdict":"warn""#), "{json}");
        assert!(!json.contains("fixable"), "{json}");
        let back: Vec<Check> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, checks);
        assert!(Verdict::Fail > Verdict::Warn && Verdict::Warn > Verdict::Skip);
    }

    /// The values systemd 252 was shown to read as exactly these paths (a unit with them, run
    /// under systemd as PID 1, listed the bound folder and read the file in it).
    #[test]
    fn paths_are_written_the_way_systemd_reads_them() {
        let table = [
            ("/home/ada", "\"/home/ada:ro\"", "\"/home/ada\""),
            (
                "/w/cl:o%s d",
                r#""/w/cl\\:o%%s d:ro""#,
                r#""/w/cl\:o%%s d""#,
            ),
            (
                r#"/w/q"b\s:x"#,
                r#""/w/q\"b\\\\s\\:x:ro""#,
                r#""/w/q\"b\\s\:x""#,
            ),
        ];
        let unit = Reader::UnitFile;
        for (path, tmpfs, bind) in table {
            let p = Path::new(path);
            assert_eq!(tmpfs_entry(p, "ro", unit).unwrap(), tmpfs, "{path}");
            assert_eq!(bind_entry(p, p, "", unit).unwrap(), bind, "{path}");
        }
        // Through `systemd-run -p` (shown with systemd 252 likewise): no specifiers.
        let p = Path::new("/w/cl:o%s d");
        assert_eq!(
            tmpfs_entry(p, "ro", Reader::Run).unwrap(),
            r#""/w/cl\\:o%s d:ro""#
        );
        assert_eq!(
            bind_entry(p, Path::new("/b"), "rbind", Reader::Run).unwrap(),
            r#""/w/cl\:o%s d":"/b":rbind"#
        );
        assert!(tmpfs_entry(p, "ro\nUser=root", Reader::Run).is_err());
        for bad in [
            "/m/nl\nExecStartPre=/bin/touch /tmp/pwn\n#",
            "/m/tab\there",
            "m/rel",
            "/m/../etc",
        ] {
            let p = Path::new(bad);
            let e = bind_entry(p, p, "", unit).unwrap_err();
            assert!(e.0.contains(&format!("{:?}", bad)), "{bad}: {e}");
            assert!(tmpfs_entry(p, "ro", unit).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_fix_is_composed_from_data_only() {
        let closed = |folder: &str, file: &str| Closed {
            folder: folder.into(),
            file: file.into(),
        };
        let mut fix = Fix::Paths {
            closed: vec![
                closed("/home/ada", "/home/ada/engine/llama-server"),
                closed("/home/ada", "/home/ada/models/m.gguf"),
                closed("/srv/closed", "/srv/closed/x.gguf"),
            ],
        };
        assert!(fix.merge(&Fix::Paths {
            closed: vec![
                closed("/home/ada", "/home/ada/models/m-2.gguf"),
                closed("/home/b b", "/home/b b/m/x.gguf"),
            ],
        }));
        assert!(!fix.merge(&Fix::Groups {
            groups: vec!["render".into()]
        }));
        assert_eq!(fix.file_name(), "50-doctor-paths.conf");
        let text = fix.drop_in().unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            [
                "[Service]",
                "TemporaryFileSystem=\"/home/ada:ro\"",
                "TemporaryFileSystem=\"/home/b b:ro\"",
                "TemporaryFileSystem=\"/srv/closed:ro\"",
                "BindReadOnlyPaths=\"/home/ada/engine\"",
                "BindReadOnlyPaths=\"/home/ada/models\"",
                "BindReadOnlyPaths=\"/home/b b/m\"",
                "BindReadOnlyPaths=\"/srv/closed/x.gguf\"",
            ]
        );
        // A file that is not below its folder, or a path a unit cannot carry, writes nothing.
        let outside = Fix::Paths {
            closed: vec![closed("/home/ada", "/etc/shadow")],
        };
        assert!(outside.drop_in().unwrap_err().0.contains("not below"));
        let groups = Fix::Groups {
            groups: vec!["render".into(), "video".into()],
        };
        assert_eq!(groups.file_name(), "50-doctor-groups.conf");
        assert!(groups
            .drop_in()
            .unwrap()
            .ends_with("[Service]\nSupplementaryGroups=render video\n"));
        for bad in ["root\nUser=root", "a b", "", "-x", &"g".repeat(33)] {
            let fix = Fix::Groups {
                groups: vec![bad.to_string()],
            };
            assert!(fix.drop_in().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_check_with_a_file_name_or_unit_text_is_refused() {
        let old = r#"[{"id":"x","verdict":"fail","found":"f","drop_in":{"unit":"../../x","name":"evil","text":"[Service]\nUser=root\n"}}]"#;
        assert!(serde_json::from_str::<Vec<Check>>(old).is_err());
        let extra = r#"[{"id":"x","verdict":"fail","found":"f","fixable":{"kind":"groups","groups":["render"],"name":"evil"}}]"#;
        assert!(serde_json::from_str::<Vec<Check>>(extra).is_err());
        let kind = r#"[{"id":"x","verdict":"fail","found":"f","fixable":{"kind":"unit_text","text":"x"}}]"#;
        assert!(serde_json::from_str::<Vec<Check>>(kind).is_err());
        let good = r#"[{"id":"x","verdict":"fail","found":"f","fixable":{"kind":"groups","groups":["render"]}}]"#;
        let checks: Vec<Check> = serde_json::from_str(good).unwrap();
        assert_eq!(
            checks[0].fixable,
            Some(Fix::Groups {
                groups: vec!["render".into()]
            })
        );
    }
}
