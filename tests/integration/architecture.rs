//! The shape of the workspace, read from cargo itself: which crate links which.

use std::process::Command;

use crate::support::*;

/// The crates of the workspace a package links (normal and build dependencies, not dev),
/// one name per line as `cargo tree` prints them, without versions.
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--locked", "-e", "normal,build"])
        .args(["--prefix", "none", "--format", "{p}", "-p", package])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_daemon_links_no_terminal_crates_and_the_cli_not_the_daemon() {
    let daemon = linked("dsv4-supervisor");
    assert!(
        daemon.iter().any(|n| n == "hyper"),
        "cargo tree read wrong: {daemon:?}"
    );
    for tui in ["ratatui", "indicatif", "crossterm", "clap_complete"] {
        assert!(
            !daemon.iter().any(|n| n == tui),
            "dsv4d (dsv4-supervisor) links {tui}: the terminal crates belong to dsv4ctl"
        );
    }
    // The configuration is read by dsv4d's own deserializer from saphyr-parser's nodes:
    // no other YAML-to-serde crate, and no crate whose error wording it would depend on.
    for yaml in ["serde_yaml_ng", "serde_yaml", "serde_path_to_error"] {
        assert!(
            !daemon.iter().any(|n| n == yaml),
            "dsv4d (dsv4-supervisor) links {yaml}: the config loader reads YAML itself"
        );
    }
    let cli = linked("dsv4ctl");
    assert!(
        cli.iter().any(|n| n == "ratatui"),
        "cargo tree read wrong: {cli:?}"
    );
    for daemon_only in ["dsv4-supervisor", "dsv4-engine", "hyper"] {
        assert!(
            !cli.iter().any(|n| n == daemon_only),
            "dsv4ctl links {daemon_only}: it must speak to the daemon only through dsv4-client"
        );
    }
}

/// Every method, signal and property the running daemon's D-Bus interface has (as it
/// introspects itself on a private bus) is in `docs/dbus.md` by name in backquotes, alone
/// (`State`) or with its signature (`Start()`), so the reference cannot drift.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dbus_member_is_documented() {
    let bus = PrivateBus::start();
    let d = Daemon::start(&Setup::default().session_bus(&bus));
    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    let xml = {
        let t = std::time::Instant::now();
        loop {
            let proxy = zbus::fdo::IntrospectableProxy::builder(&conn)
                .destination(dsv4_client::BUS_NAME)
                .unwrap()
                .path(dsv4_client::OBJECT_PATH)
                .unwrap()
                .build()
                .await
                .unwrap();
            match proxy.introspect().await {
                Ok(xml) if xml.contains(dsv4_client::INTERFACE) => break xml,
                other => {
                    assert!(
                        t.elapsed() < PATIENCE,
                        "dsv4d never answered Introspect: {other:?}\n{}",
                        d.log()
                    );
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    };
    // The members of our interface only (the standard ones come after it or before it).
    let start = xml
        .find(&format!("<interface name=\"{}\">", dsv4_client::INTERFACE))
        .expect("the interface in the introspection");
    let body = &xml[start..];
    let body = &body[..body.find("</interface>").expect("its end")];
    let mut members = Vec::new();
    for kind in ["method", "signal", "property"] {
        let tag = format!("<{kind} name=\"");
        for (at, _) in body.match_indices(&tag) {
            let rest = &body[at + tag.len()..];
            let name = &rest[..rest.find('"').unwrap()];
            members.push((kind, name.to_string()));
        }
    }
    assert!(
        members.iter().filter(|(k, _)| *k == "method").count() >= 10,
        "too few methods read: {members:?}\n{xml}"
    );
    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/dbus.md");
    let doc = std::fs::read_to_string(&doc_path).expect("docs/dbus.md");
    let missing: Vec<String> = members
        .iter()
        .filter(|(_, name)| {
            !doc.contains(&format!("`{name}`")) && !doc.contains(&format!("`{name}("))
        })
        .map(|(kind, name)| format!("{kind} {name}"))
        .collect();
    assert!(
        missing.is_empty(),
        "not in {}: {missing:?}",
        doc_path.display()
    );
}

/// The daemon's subsystems from the bottom up (the list in `supervisor/src/lib.rs`): a module
/// may import from its own subsystem and from those before it, never from one after it.
const LAYERS: &[&str] = &[
    "log",
    "config",
    "host",
    "kv",
    "lifecycle",
    "observe",
    "policy",
    "validate",
    "actions",
    "parts",
    "http",
    "control",
    "doctor",
    "cli",
];

/// The daemon library's source files (not its binaries), as paths below `supervisor/src`.
fn library_files() -> Vec<std::path::PathBuf> {
    source_files(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../supervisor/src"))
}

/// A crate's source files below `root` (its `bin/` aside), as paths below it.
fn source_files(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let root = root.to_path_buf();
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(&root).unwrap().to_path_buf();
            if rel.starts_with("bin") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

/// The module path of a file (`lifecycle/actor.rs` is `["lifecycle", "actor"]`, a `mod.rs`
/// its folder's).
fn module_of(file: &std::path::Path) -> Vec<String> {
    let mut parts: Vec<String> = file
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts
        .last()
        .is_some_and(|p| p == "mod" || p == "lib" || p == "main")
    {
        parts.pop();
    }
    parts
}

/// The lines of `text` (with their index) outside its inline `#[cfg(test)] mod ... { ... }`
/// modules, which are not the daemon: from the attribute to the module's closing brace.
fn outside_tests(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut in_tests = false;
    let mut out = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        if *line == "#[cfg(test)]" && lines.get(n + 1).is_some_and(|l| l.ends_with(" {")) {
            in_tests = true;
        }
        if in_tests {
            in_tests = *line != "}";
            continue;
        }
        out.push((n, *line));
    }
    out.into_iter()
}

/// Every path that starts at the crate root or a parent module, in code (comments left out),
/// with its line: `crate::kv::Book` as `["kv", "Book"]`, `super::actor::X` as `actor`'s path
/// made absolute. `crate::{a, b::c}` gives one path per item.
fn paths_in(text: &str, module: &[String]) -> Vec<(usize, Vec<String>)> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = Vec::new();
    for (n, line) in outside_tests(text) {
        let code = line.split("//").next().unwrap_or("");
        for anchor in ["crate::", "super::"] {
            for (at, _) in code.match_indices(anchor) {
                if code[..at].ends_with(ident) || code[..at].ends_with("::") {
                    continue;
                }
                let mut base: Vec<String> = match anchor {
                    "crate::" => Vec::new(),
                    _ => {
                        let mut b = module.to_vec();
                        b.pop();
                        b
                    }
                };
                let mut rest = &code[at + anchor.len()..];
                while let Some(r) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = r;
                }
                let groups: Vec<&str> = match rest.strip_prefix('{') {
                    Some(inner) => inner
                        .split('}')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .map(str::trim)
                        .collect(),
                    None => vec![rest],
                };
                for g in groups {
                    let mut path = base.clone();
                    let segs = g.split("::").map(|s| s.trim_matches(|c: char| !ident(c)));
                    for seg in segs {
                        let seg: String = seg.chars().take_while(|c| ident(*c)).collect();
                        if seg.is_empty() || seg == "self" {
                            break;
                        }
                        path.push(seg);
                    }
                    if !path.is_empty() {
                        out.push((n + 1, path));
                    }
                }
            }
        }
    }
    out
}

/// Files that are test modules (`#[cfg(test)] mod tests;`, with or without `#[path]`).
fn test_files(files: &[std::path::PathBuf], root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        // A module's children live in its folder: `a/mod.rs` and `a.rs` both own `a/`.
        let folder = match file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs")
        {
            true => file.parent().unwrap().to_path_buf(),
            false => file.with_extension(""),
        };
        for (n, line) in lines.iter().enumerate() {
            if *line != "#[cfg(test)]" {
                continue;
            }
            let mut next = n + 1;
            let mut named = None;
            if let Some(p) = lines.get(next).and_then(|l| l.strip_prefix("#[path = \"")) {
                named = p.split('"').next().map(|p| file.parent().unwrap().join(p));
                next += 1;
            }
            if let Some(m) = lines.get(next).and_then(|l| l.strip_prefix("mod ")) {
                if let Some(name) = m.strip_suffix(';') {
                    out.push(named.unwrap_or_else(|| folder.join(format!("{name}.rs"))));
                }
            }
        }
    }
    out
}

/// docs/design.md's layout of the daemon's library names every folder and file of
/// `supervisor/src` (`lib.rs`, the list of subsystems, aside), and nothing that is not there.
#[test]
fn the_design_names_every_part_of_the_library() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let design = std::fs::read_to_string(here.join("../docs/design.md")).unwrap();
    let at = design
        .find("The daemon's library, `supervisor/src/`")
        .expect("the library's layout in docs/design.md");
    let block = design[at..].split("```").nth(1).unwrap();
    let named: std::collections::BTreeSet<String> = block
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.is_empty())
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect();
    let actual: std::collections::BTreeSet<String> =
        std::fs::read_dir(here.join("../supervisor/src"))
            .unwrap()
            .flatten()
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                match e.path().is_dir() {
                    true => format!("{name}/"),
                    false => name,
                }
            })
            .filter(|n| n != "lib.rs")
            .collect();
    assert_eq!(
        named, actual,
        "docs/design.md's layout against supervisor/src"
    );
}

/// The imports between the daemon's subsystems run only downward, and no file imports
/// (through a chain of files) one that imports it back: read from the source itself.
#[test]
fn imports_run_only_downward_and_in_no_circle() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../supervisor/src");
    let mut files = library_files();
    assert!(files.len() > 40, "too few source files found: {files:?}");
    let tests = test_files(&files, &root);
    assert!(tests.len() > 3, "too few test modules found: {tests:?}");
    files.retain(|f| !tests.contains(f));
    let layer = |name: &str| LAYERS.iter().position(|l| *l == name);
    let mut wrong = Vec::new();
    for file in &files {
        let module = module_of(file);
        let Some(own) = module.first() else {
            continue; // lib.rs: the list of subsystems
        };
        let Some(own_layer) = layer(own) else {
            wrong.push(format!(
                "supervisor/src/{}: the subsystem `{own}` is in no layer (add it to LAYERS \
                 here and to the list in lib.rs)",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for (line, path) in paths_in(&text, &module) {
            let target = &path[0];
            if let Some(l) = layer(target).filter(|l| *l > own_layer) {
                wrong.push(format!(
                    "supervisor/src/{}:{line}: `{own}` (layer {}) imports crate::{} from `{target}` \
                     (layer {}), which is above it",
                    file.display(),
                    own_layer + 1,
                    path.join("::"),
                    l + 1
                ));
            }
        }
    }
    wrong.extend(import_circle(&root, &files));
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// An import circle among `files` (below `root`): a file that imports, through a chain of
/// files, one that imports it back. A module's own folder (declarations, re-exports) is no
/// edge. The circle, in words, if there is one.
fn import_circle(root: &std::path::Path, files: &[std::path::PathBuf]) -> Option<String> {
    let modules: std::collections::BTreeMap<Vec<String>, &std::path::PathBuf> =
        files.iter().map(|f| (module_of(f), f)).collect();
    let index = |f: &std::path::PathBuf| files.iter().position(|g| g == f).unwrap();
    let mut edges: std::collections::BTreeMap<usize, std::collections::BTreeSet<usize>> =
        Default::default();
    for file in files {
        let module = module_of(file);
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for (_, path) in paths_in(&text, &module) {
            // The file the path leads to: its longest prefix that is a module.
            let found = (1..=path.len())
                .rev()
                .find_map(|k| modules.get(&path[..k]).map(|f| (k, *f)));
            if let Some((k, to)) = found {
                let into_own_folder = module.len() < k && path[..module.len()] == module[..];
                if to != file && !into_own_folder {
                    edges.entry(index(file)).or_default().insert(index(to));
                }
            }
        }
    }
    // A circle: a depth-first search that meets a file still on its stack.
    fn circle(
        at: usize,
        edges: &std::collections::BTreeMap<usize, std::collections::BTreeSet<usize>>,
        state: &mut Vec<u8>,
        stack: &mut Vec<usize>,
    ) -> Option<Vec<usize>> {
        state[at] = 1;
        stack.push(at);
        for &next in edges.get(&at).into_iter().flatten() {
            if state[next] == 1 {
                let from = stack.iter().position(|&s| s == next).unwrap();
                let mut c = stack[from..].to_vec();
                c.push(next);
                return Some(c);
            }
            if state[next] == 0 {
                if let Some(c) = circle(next, edges, state, stack) {
                    return Some(c);
                }
            }
        }
        stack.pop();
        state[at] = 2;
        None
    }
    let mut state = vec![0u8; files.len()];
    for start in 0..files.len() {
        if state[start] == 0 {
            if let Some(c) = circle(start, &edges, &mut state, &mut Vec::new()) {
                let shown: Vec<String> =
                    c.iter().map(|&i| files[i].display().to_string()).collect();
                return Some(format!("an import circle: {}", shown.join(" -> ")));
            }
        }
    }
    None
}

/// No file of any crate of the workspace imports, through a chain of files, one that imports
/// it back (the daemon's library is held by the test above, with its layers).
#[test]
fn no_crate_has_an_import_circle() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    for krate in [
        "engine/src",
        "supervisor/client/src",
        "supervisor/ctl/src",
        "supervisor/yaml/src",
    ] {
        let root = here.join("..").join(krate);
        let mut files = source_files(&root);
        assert!(!files.is_empty(), "no source files in {krate}");
        let tests = test_files(&files, &root);
        files.retain(|f| !tests.contains(f));
        wrong.extend(import_circle(&root, &files).map(|c| format!("{krate}: {c}")));
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// The lifecycle actor's own file holds its event loop and what the rules ask of it; its
/// parts (the way in, the inbox, spawning, probing, KV steps, memory, publishing) live in
/// named files beside it, and it stays under 600 lines.
#[test]
fn the_actor_stays_small_with_its_parts_in_named_files() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../supervisor/src/lifecycle/actor");
    let lines = std::fs::read_to_string(dir.join("mod.rs"))
        .unwrap()
        .lines()
        .count();
    assert!(
        lines < 600,
        "lifecycle/actor/mod.rs has {lines} lines; move a part out"
    );
    for part in [
        "handle", "messages", "events", "spawn", "probe", "kv", "memory", "publish",
    ] {
        assert!(dir.join(format!("{part}.rs")).is_file(), "{part}.rs");
    }
}

/// A library file names what it imports: a glob of its parent's namespace (`use super::*`)
/// hides which parts a module leans on, and lets one impl spread over files unseen. Test
/// modules may, as they test their parent.
#[test]
fn library_modules_import_by_name_not_their_parents_namespace() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../supervisor/src");
    let files = library_files();
    let tests = test_files(&files, &root);
    let globbing: Vec<String> = files
        .iter()
        .filter(|f| !tests.contains(f))
        .filter(|f| {
            let text = std::fs::read_to_string(root.join(f)).unwrap();
            // A test module inside a file may glob.
            let globs = outside_tests(&text).any(|(_, l)| l.trim() == "use super::*;");
            globs
        })
        .map(|f| format!("supervisor/src/{}", f.display()))
        .collect();
    assert!(
        globbing.is_empty(),
        "these files import their parent's whole namespace; name what they use: {globbing:?}"
    );
}

/// Every `.rs` file below `root` (binaries too), as paths below it.
fn rust_files(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

/// Where a line names an engine kind rather than asking its description: a variant of
/// `EngineKind` (which any `match` on the kind needs), or a kind's name as a string literal
/// (which any comparison with the name needs). `None` for a line that does neither.
fn names_a_kind(code: &str) -> Option<String> {
    for (at, _) in code.match_indices("EngineKind::") {
        let rest = &code[at + "EngineKind::".len()..];
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // Variants are CamelCase; associated constants (`ALL`) and functions are not.
        let variant = ident.starts_with(|c: char| c.is_ascii_uppercase())
            && ident.contains(|c: char| c.is_ascii_lowercase());
        if variant || rest.starts_with('*') || rest.starts_with('{') {
            return Some(format!("EngineKind::{ident}"));
        }
    }
    [
        "\"llama-server\"",
        "\"ds4\"",
        "\"ds4-server\"",
        "\"openai\"",
    ]
    .into_iter()
    .find(|name| code.contains(name))
    .map(str::to_string)
}

/// What the daemon and the CLI know about an engine kind, they ask its description in the
/// engine crate (`dsv4_engine::kinds`): outside `engine/`, no code (tests aside) names a
/// kind, so no `match` on the kind and no comparison with a kind's name, and a new kind
/// touches only the engine crate and the profile keys it reads.
#[test]
fn only_the_engine_crate_tells_engine_kinds_apart() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    let mut read = 0;
    for tree in ["supervisor/src", "supervisor/ctl/src"] {
        let root = manifest.join("..").join(tree);
        let files = rust_files(&root);
        let tests = test_files(&files, &root);
        for file in files.iter().filter(|f| !tests.contains(f)) {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            read += 1;
            for (n, line) in outside_tests(&text) {
                let code = line.split("//").next().unwrap_or("");
                if let Some(named) = names_a_kind(code) {
                    wrong.push(format!(
                        "{tree}/{}:{}: names an engine kind ({named}): ask its description \
                         (EngineKind::describe) instead",
                        file.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(read > 50, "too few source files read: {read}");
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// The rule above catches what it is meant to, and lets through what asks the description.
#[test]
fn a_named_kind_is_caught() {
    for caught in [
        "        if p.engine == EngineKind::Ds4 {",
        "            EngineKind::LlamaServer => Api::Native,",
        "use dsv4_engine::EngineKind::*;",
        "        None if p.engine == \"ds4\" => format!(",
        "            \"llama-server\" => {",
        "    if name != \"ds4-server\" {",
        "        if kind.name == \"openai\" {",
        "            EngineKind::OpenAi => None,",
    ] {
        assert!(names_a_kind(caught).is_some(), "not caught: {caught}");
    }
    for passed in [
        "        let kind = engine.map(EngineKind::describe);",
        "        let names = EngineKind::names().join(\", \");",
        "    for kind in EngineKind::ALL {",
        "        \"{program} stopped {seconds:.1} s after SIGTERM; it said: {said}\"",
    ] {
        assert_eq!(names_a_kind(passed), None, "{passed}");
    }
}

/// Where a line prints a time with a unit of its own rather than through the project's one
/// duration format (`dsv4_client::duration`: `format` for settings, `brief` for what was
/// measured): a placeholder followed by ` s`, ` min`, ` h` or `s` right after a precision
/// (`{:.1}s`). `None` for a line that does neither.
fn prints_its_own_time(code: &str) -> Option<&str> {
    let mut rest = code;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let spec = &rest[open..open + close + 1];
        let after = &rest[open + close + 1..];
        let unit = [" s", " min", " h"]
            .into_iter()
            .find(|u| after.strip_prefix(u).is_some_and(ends_a_word));
        let precise = spec.contains(":.") && after.strip_prefix('s').is_some_and(ends_a_word);
        if unit.is_some() || precise {
            return Some(spec);
        }
        rest = after;
    }
    None
}

fn ends_a_word(after: &str) -> bool {
    !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
}

/// Every time dsv4 shows is printed by one of the two functions of its one duration format,
/// so that its messages, logs, streams and tables read alike, and read back with the
/// configuration's grammar.
#[test]
fn times_are_printed_in_one_format() {
    let manifest = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut wrong = Vec::new();
    let mut read = 0;
    for tree in [
        "supervisor/src",
        "supervisor/ctl/src",
        "supervisor/client/src",
        "engine/src",
    ] {
        let root = manifest.join("..").join(tree);
        let files = rust_files(&root);
        let tests = test_files(&files, &root);
        for file in files.iter().filter(|f| !tests.contains(f)) {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            read += 1;
            for (n, line) in outside_tests(&text) {
                let code = line.split("//").next().unwrap_or("");
                if let Some(spec) = prints_its_own_time(code) {
                    wrong.push(format!(
                        "{tree}/{}:{}: prints a time of its own ({spec}): use \
                         dsv4_client::duration::brief (or format, for a setting)",
                        file.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(read > 50, "too few source files read: {read}");
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// The rule above catches what it is meant to, and lets through what it should.
#[test]
fn a_time_of_its_own_is_caught() {
    for caught in [
        "        \"{program} stopped {seconds:.1} s after SIGTERM; it said: {said}\"",
        "            format!(\"dsv4 waiting for the engine's answer: {waited} s\")",
        "                    \"{} {arg} did not finish within {} s\",",
        "         {}: {got} of {} bytes came in {:.1}s\",",
        "        (0, min, sec) => format!(\"{min} min {sec} s\"),",
        "        (h, 0, _) => format!(\"{h} h\"),",
    ] {
        assert!(
            prints_its_own_time(caught).is_some(),
            "not caught: {caught}"
        );
    }
    for passed in [
        "        \"{program} stopped {took} after SIGTERM; it said: {said}\"",
        "    format!(\"{} {}s\", a, b)",
        "            format!(\"{name} says\")",
        "        format!(\"{w:.1} W\")",
        "        format!(\"{n} secrets\")",
    ] {
        assert_eq!(prints_its_own_time(passed), None, "{passed}");
    }
}

/// The workspace's `rust-version` is true: no locked dependency needs a newer Rust (as
/// `cargo metadata` tells each package's own `rust-version`). clippy's `incompatible_msrv`
/// keeps the workspace's own code to it.
#[test]
fn no_locked_dependency_needs_a_newer_rust_than_the_workspace_declares() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // The packages built for this machine (dsv4 is Linux's): the lock also names some for
    // other targets (r-efi), which are never downloaded.
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let host = std::process::Command::new(rustc)
        .arg("-vV")
        .output()
        .expect("rustc -vV");
    let host = String::from_utf8_lossy(&host.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("the host triple from rustc -vV");
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", &host])
        .current_dir(&root)
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // `1.85` is `1.85.0`.
    let version = |v: &str| -> [u64; 3] {
        let mut parts = v.split('.').map(|n| n.parse().unwrap_or(0));
        [(); 3].map(|()| parts.next().unwrap_or(0))
    };
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let declared = manifest
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = "))
        .map(|v| v.trim().trim_matches('"').to_string())
        .expect("rust-version in the workspace's Cargo.toml");
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let mut newer: Vec<String> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| !members.contains(&p["id"].as_str().unwrap_or_default()))
        .filter_map(|p| {
            let needs = p["rust_version"].as_str()?;
            (version(needs) > version(&declared))
                .then(|| format!("{} {} needs Rust {needs}", p["name"], p["version"]))
        })
        .collect();
    newer.sort();
    assert!(
        newer.is_empty(),
        "the workspace declares rust-version {declared}, but: {newer:#?}"
    );
}

/// Each function of `text` (its production code: inline test modules aside), by name, with
/// its line and its length in lines from its signature to its closing brace (a body's brace
/// at the signature's indentation).
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<(usize, &str)> = outside_tests(text).collect();
    let mut out = Vec::new();
    for (i, (n, line)) in lines.iter().enumerate() {
        let code = line.trim_start();
        let indent = line.len() - code.len();
        let signature = [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "async ",
            "const ",
            "unsafe ",
        ]
        .iter()
        .fold(code, |c, p| c.strip_prefix(p).unwrap_or(c));
        let Some(rest) = signature.strip_prefix("fn ") else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // Its body opens where the signature ends; a declaration without one has none.
        let Some(open) = lines[i..]
            .iter()
            .position(|(_, l)| l.trim_end().ends_with('{') || l.trim_end().ends_with(';'))
        else {
            continue;
        };
        if lines[i + open].1.trim_end().ends_with(';') {
            continue;
        }
        let close = format!("{}}}", " ".repeat(indent));
        if let Some(end) = lines[i + open..].iter().position(|(_, l)| *l == close) {
            let (last, _) = lines[i + open + end];
            out.push((name, n + 1, last - n + 1));
        }
    }
    out
}

/// No production function of 120 lines or more, and at most 15 of 80 or more, in the
/// daemon, dsv4ctl, the client and the engine crates: long ones split along their concerns
/// (build, serve, shut down), as `dsv4d`'s run was.
#[test]
fn no_production_function_is_a_long_room() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut long = Vec::new();
    for dir in [
        "supervisor/src",
        "supervisor/ctl/src",
        "supervisor/client/src",
        "engine/src",
    ] {
        for file in rust_files(&root.join(dir)) {
            if file
                .file_name()
                .is_some_and(|f| f.to_string_lossy().ends_with("tests.rs"))
            {
                continue;
            }
            let text = std::fs::read_to_string(root.join(dir).join(&file)).unwrap();
            for (name, line, len) in function_lengths(&text) {
                if len >= 80 {
                    long.push((len, format!("{dir}/{}:{line} {name}", file.display())));
                }
            }
        }
    }
    long.sort_by(|a, b| b.cmp(a));
    let shown: Vec<String> = long.iter().map(|(n, f)| format!("{n} {f}")).collect();
    let huge = long.iter().filter(|(n, _)| *n >= 120).count();
    assert_eq!(
        huge,
        0,
        "functions of 120 lines or more:\n{}",
        shown.join("\n")
    );
    assert!(
        long.len() <= 15,
        "{} functions of 80 lines or more (at most 15):\n{}",
        long.len(),
        shown.join("\n")
    );
}

#[test]
fn a_long_function_is_measured_from_its_signature_to_its_brace() {
    let body = "    x();\n".repeat(5);
    let text = format!(
        "fn short() {{\n{body}}}\n\nimpl A {{\n    pub(crate) async fn method(\n        a: u8,\n    ) {{\n    {body}    }}\n\n    fn declared(&self);\n}}\n\n#[cfg(test)]\nmod tests {{\nfn hidden() {{\n}}\n}}\n"
    );
    let got = function_lengths(&text);
    assert_eq!(
        got,
        [("short".to_string(), 1, 7), ("method".to_string(), 10, 9)],
        "{text}"
    );
}
