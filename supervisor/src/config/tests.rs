//! Loading whole configurations from files.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dsv4_engine::{EngineKind, EngineParams, FlashAttn, GpuLayers};
use proptest::prelude::*;

use super::*;

/// A scratch folder under the system temp folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("dsv4-config-test-{}-{n}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        TempDir(std::path::absolute(dir).unwrap())
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn write(&self, relative: &str, text: &str) -> PathBuf {
        let path = self.0.join(relative);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

const MINIMAL_PROFILE: &str = "engine: llama-server\ncommand: llama-server\nmodel: m.gguf\n";

fn errors(result: Result<Config, ConfigError>) -> Vec<String> {
    match result {
        Ok(config) => panic!("expected problems, got {config:#?}"),
        Err(e) => e.problems.iter().map(Problem::to_string).collect(),
    }
}

#[test]
fn full_config_round_trip() {
    let dir = TempDir::new("full");
    let file = dir.write(
        "supervisor.yaml",
        r#"# every key, none at its default
api:
  listen: "[::1]:9090"
  api_keys_file: keys.txt
  max_body: 1MiB
engine:
  start_timeout: 5m
  idle_timeout: 1h30m
  stop_timeout: 30s
  max_waiting: 8
profiles_dir: my-profiles
default_profile: small
state_dir: state
exit_when_idle: null
power: { cpu: performance, gpu: high, method: cpufreq }
monitor: { interval: 500ms, idle_interval: 1m }
thermal: { warn: 80.5C, critical: 90°C, hysteresis: 2C, on_critical: stop-when-idle }
memory: { reserve: 4GB }
"#,
    );
    dir.write(
        "my-profiles/small.yaml",
        r#"description: small test profile
engine: llama-server
command: llama-server
model: models/a.gguf
mmproj: /abs/mm.gguf
context: 4096
parallel: 2
batch: 1024
ubatch: 256
kv_cache: f16
flash_attn: auto
gpu_layers: 40
extra_args: [--metrics, "--alias", dsv4, --threads, 8]
env: { LLAMA_ARG_THREADS: 8, HOME: /tmp }
planned_memory: 10GiB
"#,
    );
    dir.write(
        "my-profiles/disk.yml",
        "engine: ds4\ncommand: ./bin/ds4-server\nmodel: /srv/m.gguf\ncontext: 327680\n\
         prefill_chunk: 4096\nkv_disk_dir: cache\nkv_disk_space: 20GiB\nflash_attn: false\n",
    );
    dir.write("my-profiles/notes.txt", "not a profile");
    dir.write("my-profiles/.hidden.yaml", "not: a profile");
    fs::create_dir_all(dir.path().join("my-profiles/sub.yaml")).unwrap();

    let config = Config::load(&file).unwrap();
    let base = dir.path();
    let profiles_dir = base.join("my-profiles");
    let want = Config {
        file: file.clone(),
        supervisor: Supervisor {
            api: Api {
                listen: "[::1]:9090".into(),
                api_keys_file: Some(base.join("keys.txt")),
                max_body: 1 << 20,
            },
            engine: EngineLimits {
                start_timeout: Duration::from_secs(300),
                idle_timeout: Duration::from_secs(5400),
                stop_timeout: Duration::from_secs(30),
                max_waiting: 8,
            },
            profiles_dir: profiles_dir.clone(),
            default_profile: "small".into(),
            state_dir: base.join("state"),
            exit_when_idle: None,
            power: Power {
                cpu: CpuPolicy::Performance,
                gpu: GpuPolicy::High,
                method: PowerMethod::Cpufreq,
            },
            monitor: Monitor {
                interval: Duration::from_millis(500),
                idle_interval: Duration::from_secs(60),
            },
            thermal: Thermal {
                warn: 80.5,
                critical: 90.0,
                hysteresis: 2.0,
                on_critical: OnCritical::StopWhenIdle,
            },
            memory: Memory {
                reserve: 4_000_000_000,
            },
        },
        profiles: BTreeMap::from([
            (
                "disk".to_string(),
                Profile {
                    name: "disk".into(),
                    file: profiles_dir.join("disk.yml"),
                    description: None,
                    engine: EngineKind::Ds4,
                    command: profiles_dir.join("./bin/ds4-server"),
                    params: EngineParams {
                        model: Some("/srv/m.gguf".into()),
                        context: Some(327_680),
                        prefill_chunk: Some(4096),
                        kv_disk_dir: Some(profiles_dir.join("cache")),
                        kv_disk_space_mb: Some(20 * 1024),
                        flash_attn: Some(FlashAttn::Off),
                        ..EngineParams::default()
                    },
                    planned_memory: None,
                    env: BTreeMap::new(),
                },
            ),
            (
                "small".to_string(),
                Profile {
                    name: "small".into(),
                    file: profiles_dir.join("small.yaml"),
                    description: Some("small test profile".into()),
                    engine: EngineKind::LlamaServer,
                    command: "llama-server".into(),
                    params: EngineParams {
                        model: Some(profiles_dir.join("models/a.gguf")),
                        mmproj: Some("/abs/mm.gguf".into()),
                        context: Some(4096),
                        parallel: Some(2),
                        batch: Some(1024),
                        ubatch: Some(256),
                        kv_cache: Some("f16".into()),
                        flash_attn: Some(FlashAttn::Auto),
                        gpu_layers: Some(GpuLayers::Count(40)),
                        prefill_chunk: None,
                        kv_disk_dir: None,
                        kv_disk_space_mb: None,
                        extra_args: ["--metrics", "--alias", "dsv4", "--threads", "8"]
                            .map(String::from)
                            .to_vec(),
                    },
                    planned_memory: Some(10 << 30),
                    env: BTreeMap::from([
                        ("HOME".to_string(), "/tmp".to_string()),
                        ("LLAMA_ARG_THREADS".to_string(), "8".to_string()),
                    ]),
                },
            ),
        ]),
    };
    assert_eq!(config, want);
    assert_eq!(config.profile_names(), ["disk", "small"]);
    assert_eq!(config.profile("small").unwrap().context(), Some(4096));
    assert_eq!(config.default_profile().unwrap().name, "small");
    assert!(config.profile("nope").is_none());
}

#[test]
fn an_empty_file_means_every_default() {
    for text in ["", "# only a comment\n", "~\n", "api:\nengine:\npower:\n"] {
        let dir = TempDir::new("defaults");
        let file = dir.write("supervisor.yaml", text);
        dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
        let config = Config::load(&file).unwrap();
        assert_eq!(
            config.supervisor,
            Supervisor::defaults(dir.path()),
            "{text:?}"
        );
        assert_eq!(config.file, file);
    }
    let d = Supervisor::default();
    assert_eq!(d.profiles_dir, Path::new("./profiles"));
    assert_eq!(d.api.listen, "127.0.0.1:8080");
    assert_eq!(d.api.max_body, 64 << 20);
    assert_eq!(d.engine.idle_timeout, Duration::from_secs(900));
    assert_eq!(d.exit_when_idle, Some(Duration::from_secs(1800)));
    assert_eq!(d.memory.reserve, 8 << 30);
    assert_eq!(d.power.cpu, CpuPolicy::PowerSaver);
    assert_eq!(d.thermal.on_critical, OnCritical::Notify);
}

#[test]
fn enum_spellings() {
    assert_eq!("stop-when-idle".parse(), Ok(OnCritical::StopWhenIdle));
    assert_eq!(OnCritical::StopWhenIdle.to_string(), "stop-when-idle");
    assert_eq!("none".parse(), Ok(PowerMethod::None));
    assert_eq!(
        CpuPolicy::NAMES,
        ["power-saver", "balanced", "performance", "keep"]
    );
    assert_eq!(
        "turbo".parse::<GpuPolicy>(),
        Err("invalid value \"turbo\", expected one of: auto, low, high, keep".to_string())
    );
    let dir = TempDir::new("enums");
    let file = dir.write("supervisor.yaml", "power:\n  cpu: turbo\n");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    assert_eq!(
        errors(Config::load(&file)),
        [format!(
            "{}:2:8: power.cpu: unknown variant `turbo`, expected one of `power-saver`, \
             `balanced`, `performance`, `keep`",
            file.display()
        )]
    );
}

#[test]
fn profile_paths_resolve_against_the_profiles_folder() {
    let dir = TempDir::new("paths");
    let elsewhere = TempDir::new("paths-profiles");
    let file = dir.write(
        "etc/supervisor.yaml",
        &format!(
            "profiles_dir: {}\nstate_dir: /var/lib/x\ndefault_profile: p\n",
            elsewhere.path().display()
        ),
    );
    elsewhere.write(
        "p.yaml",
        "engine: llama-server\ncommand: bin/llama-server\nmodel: ../m.gguf\nmmproj: mm.gguf\n",
    );
    let config = Config::load(&file).unwrap();
    let p = config.profile("p").unwrap();
    assert_eq!(p.command, elsewhere.path().join("bin/llama-server"));
    assert_eq!(p.params.model, Some(elsewhere.path().join("../m.gguf")));
    assert_eq!(p.params.mmproj, Some(elsewhere.path().join("mm.gguf")));
    assert_eq!(config.supervisor.state_dir, Path::new("/var/lib/x"));
    assert_eq!(config.supervisor.profiles_dir, elsewhere.path());
}

#[test]
fn unknown_key_is_reported_with_position_and_path() {
    let dir = TempDir::new("unknown");
    let file = dir.write(
        "supervisor.yaml",
        "api:\n  listen: 127.0.0.1:8080\nengine:\n  idle_timout: 15m\n",
    );
    let profile = dir.write(
        "profiles/320k.yaml",
        "engine: ds4\ncommand: ds4-server\nmodle: m.gguf\n",
    );
    let got = errors(Config::load(&file));
    assert_eq!(
        got,
        [
            format!(
                "{}:4:3: engine.idle_timout: unknown key `idle_timout`, expected one of \
                 `start_timeout`, `idle_timeout`, `stop_timeout`, `max_waiting`; \
                 did you mean `idle_timeout`?",
                file.display()
            ),
            format!(
                "{}:3:1: modle: unknown key `modle`, expected one of `description`, `engine`, \
                 `command`, `model`, `mmproj`, `context`, `parallel`, `batch`, `ubatch`, \
                 `kv_cache`, `flash_attn`, `gpu_layers`, `prefill_chunk`, `kv_disk_dir`, \
                 `kv_disk_space`, `planned_memory`, `extra_args`, `env`; did you mean `model`?",
                profile.display()
            ),
        ]
    );
}

#[test]
fn unit_errors_carry_position_and_path() {
    let dir = TempDir::new("units");
    let file = dir.write("supervisor.yaml", "engine:\n  idle_timeout: 90\n");
    let profile = dir.write(
        "profiles/320k.yaml",
        "engine: llama-server\ncommand: x\nmodel: m\nplanned_memory: 87.82 GB2\n",
    );
    let other = dir.write("profiles/other.yaml", "engine: vllm\n");
    let flow = dir.write(
        "profiles/flow.yaml",
        "{engine: ds4, command: x, context: -1}\n",
    );
    assert_eq!(
        errors(Config::load(&file)),
        [
            format!(
                "{}:2:17: engine.idle_timeout: invalid duration \"90\": add a unit (ms, s, m, h, d)",
                file.display()
            ),
            format!(
                "{}:4:17: planned_memory: invalid size \"87.82 GB2\": unknown unit \"GB2\" \
                 (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
                profile.display()
            ),
            format!(
                "{}:1:36: context: invalid type: integer `-1`, expected u32",
                flow.display()
            ),
            format!(
                "{}:1:9: engine: unknown engine `vllm`, expected one of: llama-server, ds4",
                other.display()
            ),
        ]
    );
}

#[test]
fn default_profile_must_exist() {
    let dir = TempDir::new("default");
    let file = dir.write("supervisor.yaml", "# choose\ndefault_profile: 128k\n");
    dir.write("profiles/64k.yaml", MINIMAL_PROFILE);
    dir.write("profiles/320k.yml", MINIMAL_PROFILE);
    assert_eq!(
        errors(Config::load(&file)),
        [format!(
            "{}:2:1: default_profile: no profile named \"128k\" in {}; available: 320k, 64k",
            file.display(),
            dir.path().join("profiles").display()
        )]
    );

    // The default 320k, not written in the file: no position.
    let file = dir.write("supervisor.yaml", "");
    fs::remove_file(dir.path().join("profiles/320k.yml")).unwrap();
    assert_eq!(
        errors(Config::load(&file)),
        [format!(
            "{}: default_profile: no profile named \"320k\" in {}; available: 64k",
            file.display(),
            dir.path().join("profiles").display()
        )]
    );
}

#[test]
fn semantic_problems_are_all_reported() {
    let dir = TempDir::new("semantic");
    let file = dir.write(
        "supervisor.yaml",
        "api:\n  listen: localhost:8080\n  max_body: 0\nengine:\n  start_timeout: 0s\n  \
         stop_timeout: 0ms\n  max_waiting: 0\nexit_when_idle: 0s\n\
         monitor: { interval: 0s }\nthermal: { warn: 95C, critical: 90C, hysteresis: -1C }\n",
    );
    let p = dir.write(
        "profiles/320k.yaml",
        "engine: llama-server\ncommand: ''\ncontext: 100\nparallel: 0\nbatch: 0\n\
         kv_disk_space: 1KiB\nplanned_memory: 0\nenv:\n  'A=B': x\n",
    );
    let empty = dir.write("profiles/empty.yaml", "# nothing yet\n");
    let f = file.display();
    let p = p.display();
    let e = empty.display();
    assert_eq!(
        errors(Config::load(&file)),
        [
            format!(
                "{f}:2:3: api.listen: invalid address \"localhost:8080\": expected IP:port, \
                 e.g. 127.0.0.1:8080 or [::1]:8080"
            ),
            format!("{f}:3:3: api.max_body: must be greater than 0"),
            format!("{f}:5:3: engine.start_timeout: must be greater than 0"),
            format!("{f}:6:3: engine.stop_timeout: must be greater than 0"),
            format!("{f}:7:3: engine.max_waiting: must be at least 1"),
            format!("{f}:8:1: exit_when_idle: must be greater than 0 (null = never exit)"),
            format!("{f}:9:12: monitor.interval: must be greater than 0"),
            format!(
                "{f}:10:12: thermal.warn: thermal.warn (95C) must be below thermal.critical (90C)"
            ),
            format!("{f}:10:38: thermal.hysteresis: must not be negative"),
            format!("{p}:2:1: command: must not be empty"),
            format!("{p}: model: required for engine llama-server"),
            format!("{p}:3:1: context: must be at least 512"),
            format!("{p}:4:1: parallel: must be at least 1"),
            format!("{p}:5:1: batch: must be at least 1"),
            format!("{p}:6:1: kv_disk_space: must be at least 1MiB"),
            format!("{p}:7:1: planned_memory: must be greater than 0"),
            format!("{p}:9:3: env: invalid variable name \"A=B\": must be non-empty, without '=' or NUL"),
            format!("{e}: engine: required: one of llama-server, ds4"),
            format!("{e}: command: required: the engine executable"),
        ]
    );
}

#[test]
fn other_files_are_checked_after_a_parse_error() {
    let dir = TempDir::new("syntax");
    let file = dir.write(
        "supervisor.yaml",
        "profiles_dir: mine\nstate_dir: 'unterminated\n",
    );
    let bad = dir.write(
        "profiles/320k.yaml",
        "engine: ds4\ncommand: x\ncontext: 10\n",
    );
    dir.write("profiles/ok.yaml", MINIMAL_PROFILE);
    let got = errors(Config::load(&file));
    assert_eq!(got.len(), 2, "{got:#?}");
    // The YAML does not parse, so its profiles_dir is unknown: the default folder is used.
    assert_eq!(
        got[0],
        format!(
            "{}:3:1: found unexpected end of stream, while scanning a quoted scalar at line 2 \
             column 12",
            file.display()
        )
    );
    assert_eq!(
        got[1],
        format!("{}:3:1: context: must be at least 512", bad.display())
    );

    // A value error leaves the YAML readable: its profiles_dir is still used.
    let file = dir.write(
        "supervisor.yaml",
        "profiles_dir: mine\nengine: { idle_timeout: soon }\n",
    );
    let mine = dir.write("mine/p.yaml", "engine: ds4\n");
    let got = errors(Config::load(&file));
    assert_eq!(
        got,
        [
            format!(
                "{}:2:25: engine.idle_timeout: invalid duration \"soon\": expected a number \
                 followed by a unit, e.g. 90s or 1h30m",
                file.display()
            ),
            format!(
                "{}: command: required: the engine executable",
                mine.display()
            ),
        ]
    );
}

#[test]
fn profiles_folder_problems() {
    let dir = TempDir::new("folder");
    let file = dir.write("supervisor.yaml", "profiles_dir: nowhere\n");
    let got = errors(Config::load(&file));
    assert_eq!(got.len(), 1);
    let prefix = format!(
        "{}:1:1: profiles_dir: cannot read profiles folder {}: ",
        file.display(),
        dir.path().join("nowhere").display()
    );
    assert!(got[0].starts_with(&prefix), "{got:?}");

    fs::create_dir_all(dir.path().join("nowhere")).unwrap();
    dir.write("nowhere/README", "profiles go here");
    assert_eq!(
        errors(Config::load(&file)),
        [format!(
            "{}:1:1: profiles_dir: no profiles (*.yaml or *.yml files) in {}",
            file.display(),
            dir.path().join("nowhere").display()
        )]
    );

    let missing = dir.path().join("missing.yaml");
    let got = errors(Config::load(&missing));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].starts_with(&format!("{}: cannot read: ", missing.display())),
        "{got:?}"
    );
}

#[test]
fn profile_names_are_unique_and_plain() {
    let dir = TempDir::new("names");
    let file = dir.write("supervisor.yaml", "default_profile: a\n");
    let first = dir.write("profiles/a.yaml", MINIMAL_PROFILE);
    let second = dir.write("profiles/a.yml", MINIMAL_PROFILE);
    let spaced = dir.write("profiles/b c.yaml", MINIMAL_PROFILE);
    assert_eq!(
        errors(Config::load(&file)),
        [
            format!(
                "{}: profile \"a\" is already defined by {}; remove or rename one of them",
                second.display(),
                first.display()
            ),
            format!(
                "{}: invalid profile name \"b c\": use letters, digits, '.', '_' and '-' (not first)",
                spaced.display()
            ),
        ]
    );
}

#[test]
fn shipped_policies_load() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/supervisor.yaml");
    let config = match Config::load(&path) {
        Ok(config) => config,
        Err(e) => panic!("{e}"),
    };
    let base = path.parent().unwrap();
    // The shipped file spells out every default.
    assert_eq!(
        config.supervisor,
        Supervisor::defaults(&std::path::absolute(base).unwrap())
    );
    assert_eq!(config.profile_names(), ["320k", "64k"]);

    let service = config.profile("320k").unwrap();
    assert_eq!(service.engine, EngineKind::LlamaServer);
    assert_eq!(service.context(), Some(327_680));
    assert_eq!(
        service.planned_memory,
        Some(parse_size("87.82GiB").unwrap())
    );
    assert_eq!(service.command, Path::new("/usr/local/bin/llama-server"));
    let validation = config.profile("64k").unwrap();
    assert_eq!(validation.context(), Some(65_536));
    for p in [service, validation] {
        assert_eq!(p.params.parallel, Some(1));
        assert_eq!(p.params.kv_cache.as_deref(), Some("q8_0"));
        assert_eq!(p.params.flash_attn, Some(FlashAttn::On));
        assert_eq!(p.params.gpu_layers, Some(GpuLayers::All));
        assert_eq!(p.params.batch, Some(2048));
        assert_eq!(p.params.ubatch, Some(512));
        assert_eq!(p.params.extra_args, ["--metrics", "--no-webui"]);
        assert!(p
            .params
            .model
            .as_ref()
            .unwrap()
            .starts_with("/srv/models/dsv4-flash/"));
        assert!(p
            .params
            .mmproj
            .as_ref()
            .unwrap()
            .starts_with("/srv/models/dsv4-flash/"));
    }
}

#[test]
fn shipped_policies_document_every_key() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let text = fs::read_to_string(dir.join("supervisor.yaml")).unwrap();
    for key in super::raw::SUPERVISOR_KEYS {
        assert!(super::locate::find_key(&text, &[key]).is_some(), "{key}");
    }
    // The ds4 variant, commented out, uses keys a profile accepts.
    for name in ["64k", "320k"] {
        let text = fs::read_to_string(dir.join(format!("profiles/{name}.yaml"))).unwrap();
        let uncommented: String = text
            .lines()
            .filter_map(|l| {
                l.strip_prefix("# ")
                    .filter(|l| l.contains(": ") && !l.starts_with(' '))
            })
            .filter(|l| {
                l.split(':')
                    .next()
                    .is_some_and(|k| super::raw::PROFILE_KEYS.contains(&k))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(uncommented.contains("engine: ds4"), "{name}: {uncommented}");
        let raw: super::raw::RawProfile = serde_yaml_ng::from_str(&uncommented).unwrap();
        assert_eq!(raw.engine.map(|e| e.0), Some(EngineKind::Ds4));
    }
}

/// YAML-ish text built from real keys, so that the fuzzing reaches the checks.
fn yamlish(keys: &'static [&'static str]) -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just(String::new()),
        Just("null".to_string()),
        "[0-9]{1,12}(\\.[0-9]{1,3})?(ms|s|m|h|d|B|KiB|GiB|GB|C|°C)?",
        "\\PC{0,12}",
        Just("{ cpu: keep, warn: 1C }".to_string()),
        Just("[a, 1, [2]]".to_string()),
    ];
    let line = (
        prop::sample::select(keys),
        prop::sample::select(&["", "  ", "    ", "- "][..]),
        value,
    )
        .prop_map(|(key, indent, value)| format!("{indent}{key}: {value}"));
    prop::collection::vec(line, 0..8).prop_map(|lines| lines.join("\n"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn the_loader_never_panics(
        supervisor in prop_oneof!["\\PC{0,200}", yamlish(super::raw::SUPERVISOR_KEYS)],
        profile in prop_oneof!["\\PC{0,200}", yamlish(super::raw::PROFILE_KEYS)],
    ) {
        let dir = TempDir::new("fuzz");
        let file = dir.write("supervisor.yaml", &supervisor);
        dir.write("profiles/320k.yaml", &profile);
        match Config::load(&file) {
            Ok(config) => prop_assert!(config.profile("320k").is_some()),
            Err(e) => {
                prop_assert!(!e.problems.is_empty());
                prop_assert!(!e.to_string().is_empty());
            }
        }
    }
}
