//! Loading whole configurations from files.
//!
//! Most kinds of mistake are covered by the fixture cases in `tests/fixtures/config/bad/`
//! (see [`bad_fixtures_report_exactly_the_expected_problems`]); the tests here cover what a
//! fixture cannot hold (permissions, absolute paths, the environment) and the loader's API.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
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

    fn write_mode(&self, relative: &str, text: &str, mode: u32) -> PathBuf {
        let path = self.write(relative, text);
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    /// An executable stand-in for an engine.
    fn program(&self, relative: &str) -> PathBuf {
        self.write_mode(relative, "#!/bin/sh\nexit 0\n", 0o755)
    }

    /// The files [`MINIMAL_PROFILE`] names, in the profiles folder `profiles`.
    fn engine_files(&self, profiles: &str) {
        self.program(&format!("{profiles}/bin/engine"));
        self.write(&format!("{profiles}/m.gguf"), "");
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A valid profile once [`TempDir::engine_files`] has made its files.
const MINIMAL_PROFILE: &str = "engine: llama-server\ncommand: bin/engine\nmodel: m.gguf\n";

fn errors(result: Result<Config, ConfigError>) -> Vec<String> {
    match result {
        Ok(config) => panic!("expected problems, got {config:#?}"),
        Err(e) => e.problems.iter().map(Problem::to_string).collect(),
    }
}

/// Loads without checking that files exist.
fn load_text_only(path: &Path) -> Result<Config, ConfigError> {
    load::load(path, false, false)
}

#[test]
fn full_config_round_trip() {
    let dir = TempDir::new("full");
    let base = dir.path();
    dir.write_mode("keys.txt", "secret\n", 0o600);
    dir.write_mode("admin-keys.txt", "admin secret\n", 0o600);
    dir.program("bin/llama-server");
    dir.write("mm.gguf", "");
    dir.write("m.gguf", "");
    let file = dir.write(
        "supervisor.yaml",
        r#"# every key, none at its default
api:
  listen: "[::1]:9090"
  api_keys_file: keys.txt
  admin_keys_file: admin-keys.txt
  max_body: 1MiB
  body_timeout: 5s
  min_body_rate: 2KiB/s
  max_buffered: 16MiB
  cors_origins: [HTTPS://Chat.Example.com:443, "http://localhost:3000"]
  allowed_hosts: [DSV4.lan, "[0::1]:9090"]
  max_connections: 100
  max_event_streams: 4
  stream_keepalive: 30s
  loading_reasoning: true
engine:
  start_timeout: 5m
  idle_timeout: 1h30m
  stop_timeout: 30s
  max_waiting: 8
profiles_dir: my-profiles
default_profile: small
state_dir: state
exit_when_idle: null
power: { cpu: performance, gpu: high, method: cpufreq, prefill: balanced, prefill_after: 2m }
monitor: { interval: 500ms, idle_interval: 1m }
thermal: { warn: 80.5C, critical: 90°C, hysteresis: 2C, on_critical: stop-when-idle }
memory: { reserve: 4GB }
notify: { long_request: 90s }
canary: { hold: true }
"#,
    );
    dir.write(
        "my-profiles/small.yaml",
        &format!(
            r#"description: small test profile
engine: llama-server
command: llama-server
model: models/a.gguf
mmproj: {base}/mm.gguf
context: 4096
parallel: 2
batch: 1024
ubatch: 256
kv_cache: f16
flash_attn: auto
gpu_layers: 40
extra_args: [--metrics, "--alias", dsv4, --threads, 8]
env: {{ LLAMA_ARG_THREADS: 8, HOME: /tmp, PATH: "/nonexistent:{base}/bin" }}
planned_memory: 10GiB
kv_checkpoint: {{ dir: kv, max_size: 40GiB, save_timeout: 90s }}
"#,
            base = base.display()
        ),
    );
    dir.write("my-profiles/models/a.gguf", "");
    dir.program("my-profiles/bin/ds4-server");
    dir.write(
        "my-profiles/disk.yml",
        &format!(
            "engine: ds4\ncommand: ./bin/ds4-server\nmodel: {}/m.gguf\ncontext: 327680\n\
             prefill_chunk: 4096\nkv_disk_dir: cache\nkv_disk_space: 20GiB\nflash_attn: false\n",
            base.display()
        ),
    );
    dir.write("my-profiles/notes.txt", "not a profile");
    dir.write("my-profiles/.hidden.yaml", "not: a profile");
    fs::create_dir_all(dir.path().join("my-profiles/sub.yaml")).unwrap();

    let config = Config::load(&file).unwrap();
    let profiles_dir = base.join("my-profiles");
    let want = Config {
        file: file.clone(),
        supervisor: Supervisor {
            api: Api {
                listen: "[::1]:9090".into(),
                api_keys_file: Some(base.join("keys.txt")),
                admin_keys_file: Some(base.join("admin-keys.txt")),
                max_body: 1 << 20,
                body_timeout: Duration::from_secs(5),
                min_body_rate: 2 << 10,
                max_buffered: 16 << 20,
                cors_origins: vec![
                    "https://chat.example.com".into(),
                    "http://localhost:3000".into(),
                ],
                allowed_hosts: vec!["dsv4.lan".into(), "[::1]:9090".into()],
                max_connections: 100,
                max_event_streams: 4,
                stream_keepalive: Some(Duration::from_secs(30)),
                loading_reasoning: true,
            },
            engine: EngineLimits {
                start_timeout: Duration::from_secs(300),
                idle_timeout: Duration::from_secs(5400),
                stop_timeout: Duration::from_secs(30),
                max_waiting: 8,
                prewarm: false,
            },
            profiles_dir: profiles_dir.clone(),
            default_profile: "small".into(),
            state_dir: base.join("state"),
            exit_when_idle: None,
            power: PowerSettings {
                cpu: CpuPolicy::Performance,
                gpu: GpuPolicy::High,
                method: Some(PowerMethod::Cpufreq),
                prefill: Some(CpuPolicy::Balanced),
                prefill_after: Duration::from_secs(120),
            },
            monitor: Monitor {
                interval: Duration::from_millis(500),
                idle_interval: Duration::from_secs(60),
            },
            thermal: ThermalSettings {
                warn: 80.5,
                critical: 90.0,
                hysteresis: 2.0,
                on_critical: OnCritical::StopWhenIdle,
            },
            memory: Memory {
                reserve: 4_000_000_000,
                return_timeout: Duration::from_secs(30),
            },
            notify: Notify {
                long_request: Some(Duration::from_secs(90)),
            },
            peers: Default::default(),
            canary: Canary { hold: true },
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
                        model: Some(base.join("m.gguf")),
                        context: Some(327_680),
                        prefill_chunk: Some(4096),
                        kv_disk_dir: Some(profiles_dir.join("cache")),
                        kv_disk_space_mb: Some(20 * 1024),
                        flash_attn: Some(FlashAttn::Off),
                        ..EngineParams::default()
                    },
                    planned_memory: None,
                    env: BTreeMap::new(),
                    kv_checkpoint: None,
                    matrix: None,
                    workers: Vec::new(),
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
                        mmproj: Some(base.join("mm.gguf")),
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
                        slot_save_path: Some(profiles_dir.join("kv")),
                        extra_args: ["--metrics", "--alias", "dsv4", "--threads", "8"]
                            .map(String::from)
                            .to_vec(),
                        ..EngineParams::default()
                    },
                    planned_memory: Some(10 << 30),
                    kv_checkpoint: Some(KvCheckpoint {
                        dir: profiles_dir.join("kv"),
                        max_size: Some(40 << 30),
                        save_timeout: Duration::from_secs(90),
                        restore_timeout: KvCheckpoint::DEFAULT_RESTORE_TIMEOUT,
                    }),
                    matrix: None,
                    workers: Vec::new(),
                    env: BTreeMap::from([
                        ("HOME".to_string(), "/tmp".to_string()),
                        ("LLAMA_ARG_THREADS".to_string(), "8".to_string()),
                        (
                            "PATH".to_string(),
                            format!("/nonexistent:{}/bin", base.display()),
                        ),
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
    assert_eq!(
        config.summary(),
        "supervisor.yaml OK: 2 profiles in my-profiles, default small\n  \
         disk: ds4, context 327680\n  \
         small: llama-server, context 4096, planned memory 10.0 GiB (small test profile)"
    );
}

#[test]
fn an_empty_file_means_every_default() {
    let nulls = "api: ~\nengine: { idle_timeout: }\npower: { cpu: null }\nstate_dir: Null\n";
    for text in [
        "",
        "# only a comment\n",
        "~\n",
        "api:\nengine:\npower:\n",
        nulls,
    ] {
        let dir = TempDir::new("defaults");
        let file = dir.write("supervisor.yaml", text);
        dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
        dir.engine_files("profiles");
        let config = Config::load(&file).unwrap();
        assert_eq!(
            config.supervisor,
            Supervisor::defaults(dir.path()),
            "{text:?}"
        );
        assert_eq!(config.file, file);
        assert_eq!(
            config.summary(),
            "supervisor.yaml OK: 1 profile in profiles, default 320k\n  \
             320k: llama-server, the engine's default context"
        );
    }
    let d = Supervisor::default();
    assert_eq!(d.profiles_dir, Path::new("profiles"));
    assert_eq!(d.api.listen, "127.0.0.1:8080");
    assert_eq!(d.api.max_body, 64 << 20);
    assert_eq!(d.api.body_timeout, Duration::from_secs(30));
    assert_eq!(d.api.max_buffered, 1 << 30);
    assert_eq!(d.api.min_body_rate, 1 << 10);
    assert_eq!(d.api.max_connections, 4096);
    assert_eq!(d.api.max_event_streams, 32);
    assert_eq!(d.api.stream_keepalive, Some(Duration::from_secs(10)));
    assert!(!d.api.loading_reasoning);
    assert_eq!(d.engine.idle_timeout, Duration::from_secs(900));
    assert_eq!(d.exit_when_idle, Some(Duration::from_secs(1800)));
    assert_eq!(d.memory.reserve, 8 << 30);
    assert_eq!(d.notify.long_request, Some(Duration::from_secs(600)));
    assert_eq!(d.power.cpu, CpuPolicy::PowerSaver);
    assert_eq!(d.thermal.on_critical, OnCritical::Notify);
}

/// supervisor.yaml and its drop-ins, in `dir`, with one valid profile.
fn with_dropins(dir: &TempDir, main: &str, dropins: &[(&str, &str)]) -> PathBuf {
    let file = dir.write("supervisor.yaml", main);
    for (name, text) in dropins {
        dir.write(&format!("supervisor.yaml.d/{name}"), text);
    }
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    file
}

#[test]
fn drop_ins_are_laid_over_the_file_in_name_order() {
    let dir = TempDir::new("dropins");
    let main = "engine:\n  idle_timeout: 10m\n  stop_timeout: 30s\nexit_when_idle: 1h\n\
                api:\n  cors_origins: [http://a.example]\n";
    let file = with_dropins(
        &dir,
        main,
        &[
            // Applied second: its idle_timeout wins over 10-a's.
            ("20-b.yaml", "engine:\n  idle_timeout: 7m\n"),
            // A mapping merges; a null changes nothing, unless null is the value (never).
            (
                "10-a.yaml",
                "engine:\n  idle_timeout: 5m\n  stop_timeout: null\nexit_when_idle: null\n",
            ),
            // A list replaces the list before it.
            ("30-c.yaml", "api:\n  cors_origins: [http://b.example]\n"),
            // Not drop-ins: another extension, a hidden file.
            ("40-d.yaml.dpkg-old", "engine: {idle_timeout: 1s}\n"),
            (".50-e.yaml", "engine: {idle_timeout: 2s}\n"),
            // An empty one is no change.
            ("60-f.yaml", "# nothing yet\n"),
        ],
    );
    let config = Config::load(&file).unwrap();
    let s = &config.supervisor;
    assert_eq!(s.engine.idle_timeout, Duration::from_secs(420));
    assert_eq!(s.engine.stop_timeout, Duration::from_secs(30));
    assert_eq!(s.exit_when_idle, None);
    assert_eq!(s.api.cors_origins, ["http://b.example"]);
    assert_eq!(config.dropin_dir(), dir.path().join("supervisor.yaml.d"));
    assert!(
        config.summary().contains(
            "; drop-ins, in order: supervisor.yaml.d/10-a.yaml, supervisor.yaml.d/20-b.yaml, \
             supervisor.yaml.d/30-c.yaml, supervisor.yaml.d/60-f.yaml\n"
        ),
        "{}",
        config.summary()
    );
    // Without the folder, the file alone.
    fs::remove_dir_all(dir.path().join("supervisor.yaml.d")).unwrap();
    let config = Config::load(&file).unwrap();
    assert_eq!(
        config.supervisor.engine.idle_timeout,
        Duration::from_secs(600)
    );
    assert_eq!(config.supervisor.api.cors_origins, ["http://a.example"]);
}

/// A drop-in is held to the key files' rules: one that group or others may write, or that
/// neither root nor dsv4d's user owns, is refused with its name, its mode or owner and the
/// command that mends it; a folder so open refuses every drop-in in it.
#[test]
fn a_drop_in_others_may_write_is_refused() {
    let dir = TempDir::new("dropin-modes");
    let file = with_dropins(
        &dir,
        "engine:\n  idle_timeout: 10m\n",
        &[("10-listen.yaml", "api:\n  listen: 0.0.0.0:18080\n")],
    );
    let folder = dir.path().join("supervisor.yaml.d");
    let dropin = folder.join("10-listen.yaml");
    let mode = |p: &Path, m: u32| fs::set_permissions(p, fs::Permissions::from_mode(m)).unwrap();
    assert_eq!(
        Config::load(&file).unwrap().supervisor.api.listen,
        "0.0.0.0:18080"
    );

    mode(&dropin, 0o666);
    let found = errors(Config::load(&file));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
        found[0].starts_with("supervisor.yaml.d/10-listen.yaml: the drop-in ")
            && found[0].contains("may be written by group or others (mode 0666)")
            && found[0].contains(&format!("sudo chmod go-w {}", dropin.display())),
        "{found:#?}"
    );
    mode(&dropin, 0o644);
    mode(&folder, 0o777);
    let found = errors(Config::load(&file));
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(
        found[0].starts_with("supervisor.yaml.d: the drop-in folder ")
            && found[0].contains("(mode 0777)"),
        "{found:#?}"
    );
    mode(&folder, 0o755);
    if nix::unistd::geteuid().is_root() {
        nix::unistd::chown(&dropin, Some(65534.into()), None).unwrap();
        let found = errors(Config::load(&file));
        assert!(
            found.len() == 1 && found[0].contains("is owned by uid 65534, not by root"),
            "{found:#?}"
        );
    }
}

#[test]
fn a_drop_in_mistake_is_placed_in_its_own_file() {
    let dir = TempDir::new("dropin-mistakes");
    let main = "engine:\n  idle_timeout: 0s\napi:\n  listen: nowhere\n";
    let file = with_dropins(
        &dir,
        main,
        &[
            // Fixes the main file's idle_timeout; its own mistakes are its own.
            (
                "10-a.yaml",
                "engine:\n  idle_timeout: 5m\n  max_waiting: lots\n  idle_timout: 1m\n",
            ),
            ("20-b.yaml", "memory:\n  reserve: [1]\n"),
            ("30-c.yaml", "- a list\n"),
            ("40-d.yaml", "power: {cpu: [\n"),
            // A rule between keys is placed where the key is written last.
            ("50-e.yaml", "api:\n  min_body_rate: 1TiB\n"),
        ],
    );
    let found = errors(Config::load(&file));
    let want = [
        "supervisor.yaml:4:11: api.listen: invalid address",
        "supervisor.yaml.d/10-a.yaml:3:16: engine.max_waiting: invalid type: string \"lots\"",
        "supervisor.yaml.d/10-a.yaml:4:3: engine.idle_timout: unknown key `idle_timout`",
        "supervisor.yaml.d/20-b.yaml:2:12: memory.reserve: invalid type: sequence",
        "supervisor.yaml.d/30-c.yaml:1:1: a drop-in must be a mapping of settings",
        "supervisor.yaml.d/40-d.yaml:2:1: ",
        "supervisor.yaml.d/50-e.yaml:2:18: api.min_body_rate: ",
    ];
    assert_eq!(found.len(), want.len(), "{found:#?}");
    for (found, want) in found.iter().zip(want) {
        assert!(
            found.starts_with(want),
            "{found}\n  does not start with\n{want}"
        );
    }
    // A drop-in that cannot be read is a problem of its own, as a folder in its place is.
    let dir = TempDir::new("dropin-unreadable");
    let file = with_dropins(&dir, "", &[]);
    fs::create_dir_all(dir.path().join("supervisor.yaml.d/10-a.yaml")).unwrap();
    let found = errors(Config::load(&file));
    assert_eq!(
        found,
        ["supervisor.yaml.d/10-a.yaml: is a folder, not a regular file"]
    );
}

#[test]
fn merged_settings_say_where_each_value_comes_from() {
    let dir = TempDir::new("dropins-merged");
    let main =
        "engine:\n  idle_timeout: 10m\n  stop_timeout: 30s\napi:\n  listen: \"127.0.0.1:8080\"\n";
    let file = with_dropins(
        &dir,
        main,
        &[
            (
                "10-a.yaml",
                "engine:\n  idle_timeout: 5m\napi: {listen: \"[::1]:9000\", cors_origins: []}\n",
            ),
            (
                "20-b.yaml",
                "api:\n  cors_origins: ['http://a.example', http://b.example]\n\
                 exit_when_idle: null\nmemory:\n  reserve:\n",
            ),
        ],
    );
    let text = Config::merged(&file).unwrap();
    assert_eq!(
        text,
        "engine:\n  idle_timeout: 5m  # supervisor.yaml.d/10-a.yaml:2\n  \
         stop_timeout: 30s  # supervisor.yaml:3\n\
         api:\n  listen: \"[::1]:9000\"  # supervisor.yaml.d/10-a.yaml:3\n  \
         cors_origins:\n    \
         - http://a.example  # supervisor.yaml.d/20-b.yaml:2\n    \
         - http://b.example  # supervisor.yaml.d/20-b.yaml:2\n\
         exit_when_idle: null  # supervisor.yaml.d/20-b.yaml:3\n\
         memory: {}  # supervisor.yaml.d/20-b.yaml:4\n"
    );
    // Read back as a file of its own, it is the same settings.
    let layered = Config::load(&file).unwrap().supervisor;
    let alone = Config::load(&dir.write("merged.yaml", &text))
        .unwrap()
        .supervisor;
    assert_eq!(alone, layered);
    // A drop-in that is not YAML: no merged settings, and where it fails.
    dir.write("supervisor.yaml.d/30-c.yaml", "a: [\n");
    let found = errors(Config::merged(&file).map(|_| Config::load(&file).unwrap()));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("supervisor.yaml.d/30-c.yaml:2:1: "),
        "{found:?}"
    );
}

#[test]
fn enum_spellings() {
    let read = |text: &str| {
        dsv4_yaml::from_str::<PowerSettings>(text)
            .map(Option::unwrap_or_default)
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        read("{ cpu: keep, gpu: high, method: none }"),
        Ok(PowerSettings {
            cpu: CpuPolicy::Keep,
            gpu: GpuPolicy::High,
            method: Some(PowerMethod::None),
            ..PowerSettings::default()
        })
    );
    // `none` is no prefill profile; `keep` cannot be switched to.
    assert_eq!(read("prefill: none").map(|p| p.prefill), Ok(None));
    assert_eq!(read("{}").map(|p| p.prefill), Ok(None));
    assert_eq!(
        read("prefill: performance").map(|p| (p.prefill, p.prefill_after)),
        Ok((Some(CpuPolicy::Performance), Duration::from_secs(30)))
    );
    assert_eq!(
        read("prefill: keep").unwrap_err(),
        "1:10: prefill: unknown variant `keep`, expected one of `none`, `power-saver`, \
         `balanced`, `performance`"
    );
    assert_eq!(
        dsv4_yaml::from_str::<OnCritical>("stop-when-idle")
            .unwrap()
            .unwrap(),
        OnCritical::StopWhenIdle
    );
    assert_eq!(
        read("gpu: 5").unwrap_err(),
        "1:6: gpu: unknown variant `5`, expected one of `auto`, `low`, `high`, `keep`"
    );
    // `auto` is no method of its own: the one found when the engine starts.
    assert_eq!(read("method: auto").map(|p| p.method), Ok(None));
    assert_eq!(read("{}").map(|p| p.method), Ok(None));
    assert_eq!(
        read("method: ppd").map(|p| p.method),
        Ok(Some(PowerMethod::Ppd))
    );
    assert_eq!(
        read("method: tlp").unwrap_err(),
        "1:9: method: unknown variant `tlp`, expected one of `auto`, `ppd`, `cpufreq`, `none`"
    );
    let dir = TempDir::new("enums");
    let file = dir.write("supervisor.yaml", "power:\n  cpu: turbo\n");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:2:8: power.cpu: unknown variant `turbo`, expected one of \
          `power-saver`, `balanced`, `performance`, `keep`"
        ]
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
    let config = load_text_only(&file).unwrap();
    let p = config.profile("p").unwrap();
    assert_eq!(p.command, elsewhere.path().join("bin/llama-server"));
    assert_eq!(p.params.model, Some(elsewhere.path().join("../m.gguf")));
    assert_eq!(p.params.mmproj, Some(elsewhere.path().join("mm.gguf")));
    assert_eq!(config.supervisor.state_dir, Path::new("/var/lib/x"));
    assert_eq!(config.supervisor.profiles_dir, elsewhere.path());

    // Outside the folder of supervisor.yaml, paths are shown absolute.
    let p = elsewhere.path().join("p.yaml");
    let e = elsewhere.path().display();
    assert_eq!(
        errors(Config::load(&file)),
        [
            format!(
                "{}:2:10: command: {e}/bin/llama-server does not exist",
                p.display()
            ),
            format!("{}:3:8: model: {e}/../m.gguf does not exist", p.display()),
            format!("{}:4:9: mmproj: {e}/mm.gguf does not exist", p.display()),
        ]
    );
}

#[test]
fn messages_show_paths_relative_to_the_config_folder() {
    let dir = TempDir::new("relative");
    let file = dir.write("etc/dsv4/supervisor.yaml", "profiles_dir: ../profiles\n");
    dir.write("etc/profiles/320k.yaml", "engine: ds4\ncommand: x/y\n");
    let shown = dir.path().join("etc/dsv4/../profiles");
    let e = Config::load(&file).unwrap_err();
    assert_eq!(e.dir, dir.path().join("etc/dsv4"));
    assert_eq!(
        e.to_string(),
        format!(
            "{s}/320k.yaml:2:10: command: {s}/x/y does not exist",
            s = shown.display()
        )
    );

    // A relative path to supervisor.yaml: the same messages.
    let dir = TempDir::new("relative-arg");
    let file = dir.write("supervisor.yaml", "engine: { stop_timeout: 0s }\n");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    let cwd = std::env::current_dir().unwrap();
    let relative: PathBuf = std::iter::repeat_n("..", cwd.components().count())
        .collect::<PathBuf>()
        .join(file.strip_prefix("/").unwrap());
    assert_eq!(
        errors(Config::load(&relative)),
        ["supervisor.yaml:1:25: engine.stop_timeout: must be at least 1s"]
    );

    let missing = dir.path().join("missing.yaml");
    let got = errors(Config::load(&missing));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!(
        got[0].starts_with(&format!(
            "missing.yaml: cannot read {}: ",
            missing.display()
        )),
        "{got:?}"
    );
}

#[test]
fn unknown_key_is_reported_with_position_and_path() {
    let dir = TempDir::new("unknown");
    let file = dir.write(
        "supervisor.yaml",
        "api:\n  listen: 127.0.0.1:8080\nengine:\n  idle_timout: 15m\n",
    );
    dir.write(
        "profiles/320k.yaml",
        "engine: ds4\ncommand: ds4-server\nmodle: m.gguf\n",
    );
    assert_eq!(
        errors(load_text_only(&file)),
        [
            "supervisor.yaml:4:3: engine.idle_timout: unknown key `idle_timout`, expected one \
             of `start_timeout`, `idle_timeout`, `stop_timeout`, `max_waiting`, `prewarm`; \
             did you mean `idle_timeout`?",
            "profiles/320k.yaml:3:1: modle: unknown key `modle`, expected one of \
             `description`, `engine`, `command`, `model`, `mmproj`, `context`, `parallel`, \
             `batch`, `ubatch`, `kv_cache`, `flash_attn`, `gpu_layers`, `prefill_chunk`, \
             `kv_disk_dir`, `kv_disk_space`, `planned_memory`, `kv_checkpoint`, `extra_args`, `env`, \
             `matrix`, `args`, `health`, `key_env`, `key_arg`, `stop_signal`, `stop_grace`, `workers`; \
             did you mean `model`?",
        ]
    );
}

#[test]
fn unit_errors_carry_position_and_path() {
    let dir = TempDir::new("units");
    let file = dir.write("supervisor.yaml", "engine:\n  idle_timeout: 90\n");
    dir.write(
        "profiles/320k.yaml",
        "engine: llama-server\ncommand: x\nmodel: m\nplanned_memory: 87.82 GB2\n",
    );
    dir.write("profiles/other.yaml", "engine: vllm\n");
    dir.write(
        "profiles/flow.yaml",
        "{engine: ds4, command: x, context: -1}\n",
    );
    assert_eq!(
        errors(load_text_only(&file)),
        [
            "supervisor.yaml:2:17: engine.idle_timeout: invalid duration \"90\": add a unit \
             (ms, s, m, h, d)",
            "profiles/320k.yaml:4:17: planned_memory: invalid size \"87.82 GB2\": unknown \
             unit \"GB2\" (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)",
            "profiles/flow.yaml:1:36: context: invalid type: integer `-1`, expected u32",
            // The rest of a file is still checked after a value that does not fit.
            "profiles/other.yaml: command: required: the engine executable",
            "profiles/other.yaml:1:9: engine: unknown engine `vllm`, expected one of: \
             llama-server, ds4, openai, rpc-server",
        ]
    );
}

#[test]
fn default_profile_must_exist() {
    let dir = TempDir::new("default");
    let file = dir.write("supervisor.yaml", "# choose\ndefault_profile: 128k\n");
    dir.write("profiles/64k.yaml", MINIMAL_PROFILE);
    dir.write("profiles/320k.yml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:2:18: default_profile: no profile named \"128k\" in profiles; \
          available: 320k, 64k"
        ]
    );

    // The default 320k, not written in the file: no position.
    let file = dir.write("supervisor.yaml", "");
    fs::remove_file(dir.path().join("profiles/320k.yml")).unwrap();
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml: default_profile: no profile named \"320k\" in profiles; \
          available: 64k"
        ]
    );
}

#[test]
fn a_matrix_is_read_in_order_and_each_mistake_is_placed() {
    let dir = TempDir::new("matrix");
    let file = dir.write("supervisor.yaml", "default_profile: 64k\n");
    dir.engine_files("profiles");
    dir.write(
        "profiles/64k.yaml",
        &format!(
            "{MINIMAL_PROFILE}matrix:\n  ub:\n    - [-ub, '512']\n    - [-ub, '2048']\n  \
             cpu: [power-saver, performance]\n  load: [[], [--no-mmap]]\n"
        ),
    );
    let config = Config::load(&file).unwrap();
    let m = config.profile("64k").unwrap().matrix.clone().unwrap();
    let names: Vec<&str> = m.axes.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["ub", "cpu", "load"], "the order written");
    assert_eq!(m.size(), 8);
    let cells = m.cells(&[]).unwrap();
    assert_eq!(
        cells[1].label(),
        "cpu=power-saver ub=[-ub 512] load=[--no-mmap]"
    );
    assert_eq!(cells[2].label(), "cpu=performance ub=[-ub 512] load=[]");

    dir.write(
        "profiles/64k.yaml",
        &format!(
            "{MINIMAL_PROFILE}matrix:\n  cpu: [power-saver, turbo, power-saver]\n  gpu: []\n  \
             ub: [[-ub, '512'], [--port, '9'], [-ub, '512']]\n"
        ),
    );
    let problems = errors(Config::load(&file));
    assert_eq!(problems.len(), 5, "{problems:#?}");
    let want = [
        (
            "profiles/64k.yaml:5:22: matrix.cpu[1]",
            "`turbo` is not a power profile",
        ),
        (
            "profiles/64k.yaml:5:29: matrix.cpu[2]",
            "`power-saver` is listed twice",
        ),
        ("profiles/64k.yaml:6:8: matrix.gpu", "lists no value"),
        ("matrix.ub[1][0]", "--port"),
        ("matrix.ub[2]", "variant 3 repeats an earlier one"),
    ];
    for ((at, what), got) in want.iter().zip(&problems) {
        assert!(
            got.contains(at) && got.contains(what),
            "{got}: wanted {at} {what}"
        );
    }

    let axes: String = (0..7).map(|i| format!("  a{i}: [[], [-x]]\n")).collect();
    dir.write(
        "profiles/64k.yaml",
        &format!("{MINIMAL_PROFILE}matrix:\n{axes}"),
    );
    let problems = errors(Config::load(&file));
    assert!(
        problems[0].contains("matrix: has 128 cells") && problems[0].contains("at most 64"),
        "{problems:?}"
    );
}

#[test]
fn semantic_problems_are_all_reported_in_file_order() {
    let dir = TempDir::new("semantic");
    let file = dir.write(
        "supervisor.yaml",
        "api:\n  listen: localhost:8080\n  max_body: 0\n  body_timeout: 0s\nengine:\n  \
         start_timeout: 0s\n  stop_timeout: 0ms\n  max_waiting: 0\nexit_when_idle: 0s\n\
         monitor: { interval: 0s }\nthermal: { warn: 95C, critical: 90C, hysteresis: -1C }\n\
         notify: { long_request: 0s }\n",
    );
    dir.write(
        "profiles/320k.yaml",
        "engine: llama-server\ncommand: ''\ncontext: 100\nparallel: 0\nbatch: 0\n\
         kv_disk_space: 1KiB\nplanned_memory: 0\nenv:\n  'A=B': x\n",
    );
    dir.write("profiles/empty.yaml", "# nothing yet\n");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:2:11: api.listen: invalid address \"localhost:8080\": expected \
             IP:port, e.g. 127.0.0.1:8080 or [::1]:8080",
            "supervisor.yaml:3:13: api.max_body: must be greater than 0",
            "supervisor.yaml:4:17: api.body_timeout: must be greater than 0",
            "supervisor.yaml:6:18: engine.start_timeout: must be greater than 0",
            "supervisor.yaml:7:17: engine.stop_timeout: must be at least 1s",
            "supervisor.yaml:8:16: engine.max_waiting: must be between 1 and 100000",
            "supervisor.yaml:9:17: exit_when_idle: must be greater than 0 (null = never exit)",
            "supervisor.yaml:10:22: monitor.interval: must be greater than 0",
            "supervisor.yaml:11:18: thermal.warn: thermal.warn (95C) must be below \
             thermal.critical (90C)",
            "supervisor.yaml:11:50: thermal.hysteresis: must not be negative",
            "supervisor.yaml:12:25: notify.long_request: must be greater than 0 (null = no \
             alert for long requests)",
            "profiles/320k.yaml: model: required for engine llama-server",
            "profiles/320k.yaml:2:10: command: must not be empty",
            "profiles/320k.yaml:3:10: context: must be at least 512",
            "profiles/320k.yaml:4:11: parallel: must be between 1 and 256",
            "profiles/320k.yaml:5:8: batch: must be at least 1",
            "profiles/320k.yaml:6:16: kv_disk_space: must be at least 1MiB",
            "profiles/320k.yaml:7:17: planned_memory: must be greater than 0",
            "profiles/320k.yaml:9:3: env: invalid variable name \"A=B\": use letters, digits \
             and '_', not starting with a digit",
            "profiles/empty.yaml: engine: required: one of llama-server, ds4, openai, rpc-server",
            "profiles/empty.yaml: command: required: the engine executable",
        ]
    );
}

#[test]
fn a_duration_past_a_hundred_years_is_refused_not_overflowed() {
    let dir = TempDir::new("forever");
    let file = dir.write(
        "supervisor.yaml",
        "engine:\n  idle_timeout: 200000000000000d\n",
    );
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:2:17: engine.idle_timeout: invalid duration (16 characters, not shown): \
             too large (at most 36500d, a hundred years)"
        ]
    );
}

#[test]
fn the_minimum_body_rate_is_a_size_a_second_or_0() {
    let dir = TempDir::new("rate");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    for (text, want) in [("512/s", 512), ("1.5KiB/s", 1536), ("0", 0), ("0/s", 0)] {
        let file = dir.write(
            "supervisor.yaml",
            &format!("api:\n  min_body_rate: {text}\n"),
        );
        let api = Config::load(&file).unwrap().supervisor.api;
        assert_eq!(api.min_body_rate, want, "{text}");
    }
    for (text, why) in [
        (
            "1KiB",
            "invalid rate \"1KiB\": expected a size a second, e.g. 1KiB/s (or 0 for none)",
        ),
        (
            "fast/s",
            "invalid size \"fast\": expected a number followed by a unit, e.g. 8GiB",
        ),
    ] {
        let file = dir.write(
            "supervisor.yaml",
            &format!("api:\n  min_body_rate: {text}\n"),
        );
        assert_eq!(
            errors(Config::load(&file)),
            [format!("supervisor.yaml:2:18: api.min_body_rate: {why}")],
            "{text}"
        );
    }
}

#[test]
fn loading_reasoning_is_true_or_false_and_needs_the_keepalive() {
    let dir = TempDir::new("reasoning");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    let load = |text: &str| {
        let file = dir.write("supervisor.yaml", &format!("api:\n{text}"));
        Config::load(&file)
    };
    for (text, on, keepalive) in [
        ("  loading_reasoning: true\n", true, Some(10)),
        ("  loading_reasoning: false\n", false, Some(10)),
        ("  loading_reasoning: \"true\"\n", true, Some(10)),
        ("  loading_reasoning:\n", false, Some(10)),
        (
            "  loading_reasoning: false\n  stream_keepalive: null\n",
            false,
            None,
        ),
    ] {
        let api = load(text)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"))
            .supervisor
            .api;
        assert_eq!(api.loading_reasoning, on, "{text:?}");
        let keepalive = keepalive.map(Duration::from_secs);
        assert_eq!(api.stream_keepalive, keepalive, "{text:?}");
    }
    for (text, why) in [
        (
            "  loading_reasoning: yes\n",
            "2:22: api.loading_reasoning: invalid value \"yes\": expected true or false",
        ),
        (
            "  loading_reasoning: 1\n",
            "2:22: api.loading_reasoning: invalid value \"1\": expected true or false",
        ),
        (
            "  stream_keepalive: null\n  loading_reasoning: true\n",
            "3:22: api.loading_reasoning: api.loading_reasoning needs api.stream_keepalive (its \
             words go out on the keep-alive's ticks)",
        ),
    ] {
        assert_eq!(
            errors(load(text)),
            [format!("supervisor.yaml:{why}")],
            "{text:?}"
        );
    }
}

#[test]
fn the_body_budget_must_hold_one_largest_body() {
    let dir = TempDir::new("budget");
    let file = dir.write(
        "supervisor.yaml",
        "api:\n  max_body: 8MiB\n  max_buffered: 4MiB\n",
    );
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert_eq!(
        errors(Config::load(&file)),
        ["supervisor.yaml:3:17: api.max_buffered: must be at least api.max_body (8.0 MiB)"]
    );
    dir.write(
        "supervisor.yaml",
        "api:\n  max_body: 8MiB\n  max_buffered: 8MiB\n",
    );
    assert_eq!(
        Config::load(&file).unwrap().supervisor.api.max_buffered,
        8 << 20
    );
}

#[test]
fn other_files_are_checked_after_a_parse_error() {
    let dir = TempDir::new("syntax");
    let file = dir.write(
        "supervisor.yaml",
        "profiles_dir: mine\nstate_dir: 'unterminated\n",
    );
    dir.write(
        "profiles/320k.yaml",
        "engine: ds4\ncommand: bin/engine\ncontext: 10\n",
    );
    dir.write("profiles/ok.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    // The YAML does not parse, so its profiles_dir is unknown: the default folder is used.
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:2:12: while scanning a quoted scalar, found unexpected end of \
             stream",
            "profiles/320k.yaml:3:10: context: must be at least 512",
        ]
    );

    // A value error leaves the YAML readable: its profiles_dir is still used.
    let file = dir.write(
        "supervisor.yaml",
        "profiles_dir: mine\nengine: { idle_timeout: soon }\n",
    );
    dir.write("mine/p.yaml", "engine: ds4\n");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml: default_profile: no profile named \"320k\" in mine; available: p",
            "supervisor.yaml:2:25: engine.idle_timeout: invalid duration \"soon\": expected a \
             number followed by a unit, e.g. 90s or 1h30m",
            "mine/p.yaml: command: required: the engine executable",
        ]
    );
}

#[test]
fn profiles_folder_problems() {
    let dir = TempDir::new("folder");
    let file = dir.write("supervisor.yaml", "profiles_dir: nowhere\n");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "supervisor.yaml:1:15: profiles_dir: cannot read profiles folder nowhere: \
          No such file or directory (os error 2)"
        ]
    );

    fs::create_dir_all(dir.path().join("nowhere")).unwrap();
    dir.write("nowhere/README", "profiles go here");
    assert_eq!(
        errors(Config::load(&file)),
        ["supervisor.yaml:1:15: profiles_dir: no profiles (*.yaml or *.yml files) in nowhere"]
    );
}

#[test]
fn profile_names_are_unique_and_plain() {
    let dir = TempDir::new("names");
    let file = dir.write("supervisor.yaml", "default_profile: a\n");
    dir.write("profiles/a.yaml", MINIMAL_PROFILE);
    dir.write("profiles/a.yml", MINIMAL_PROFILE);
    dir.write("profiles/b c.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert_eq!(
        errors(Config::load(&file)),
        [
            "profiles/a.yml: profile \"a\" is already defined by profiles/a.yaml; remove or \
             rename one of them",
            "profiles/b c.yaml: invalid profile name \"b c\": use letters, digits, '.', '_' \
             and '-' (not first)",
        ]
    );
}

#[test]
fn engine_programs() {
    let dir = TempDir::new("programs");
    let file = dir.write("supervisor.yaml", "default_profile: found\n");
    dir.write("profiles/m.gguf", "");
    dir.program("bin/dsv4-test-engine");
    dir.write_mode("bin/dsv4-test-data", "", 0o644);
    let bin = dir.path().join("bin");
    let b = bin.display();
    let profile = |command: &str, path: &str| {
        format!("engine: llama-server\ncommand: {command}\nmodel: m.gguf\nenv: {{ PATH: \"{path}\" }}\n")
    };
    dir.write(
        "profiles/found.yaml",
        &profile("dsv4-test-engine", &format!("/nonexistent::{b}")),
    );
    dir.write(
        "profiles/not-executable.yaml",
        &profile("dsv4-test-data", &format!("{b}")),
    );
    dir.write("profiles/empty-path.yaml", &profile("dsv4-test-engine", ""));
    dir.program("profiles/local-engine");
    dir.write(
        "profiles/local.yaml",
        &profile("local-engine", "/nonexistent"),
    );
    dir.write(
        "profiles/absolute.yaml",
        &profile(&format!("{b}/dsv4-test-data"), "/bin"),
    );
    assert_eq!(
        errors(Config::load(&file)),
        [
            "profiles/absolute.yaml:2:10: command: bin/dsv4-test-data is not executable \
             (chmod +x it)"
                .to_string(),
            "profiles/empty-path.yaml:2:10: command: dsv4-test-engine is not a path and PATH \
             is empty or not set: write the full path"
                .to_string(),
            "profiles/local.yaml:2:10: command: local-engine not found in PATH (/nonexistent, \
             from env.PATH); for profiles/local-engine, write ./local-engine"
                .to_string(),
            format!(
                "profiles/not-executable.yaml:2:10: command: dsv4-test-data not found in PATH \
                 ({b}, from env.PATH)"
            ),
        ]
    );
}

#[test]
fn api_keys_must_be_private() {
    let dir = TempDir::new("keys");
    let file = dir.write("supervisor.yaml", "api: { api_keys_file: keys }\n");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    let shown = |mode: &str| {
        format!(
            "supervisor.yaml:1:23: api.api_keys_file: keys may be read or written by group \
             or others (mode {mode}); it holds secrets: chmod 600 it"
        )
    };
    dir.write_mode("keys", "k\n", 0o644);
    assert_eq!(errors(Config::load(&file)), [shown("0644")]);
    dir.write_mode("keys", "k\n", 0o620);
    assert_eq!(errors(Config::load(&file)), [shown("0620")]);
    dir.write_mode("keys", "k\n", 0o600);
    assert!(Config::load(&file).is_ok());
    fs::remove_file(dir.path().join("keys")).unwrap();
    fs::create_dir(dir.path().join("keys")).unwrap();
    assert_eq!(
        errors(Config::load(&file)),
        ["supervisor.yaml:1:23: api.api_keys_file: keys is a folder, not a file"]
    );
    // A reload leaves the file to the keys, which fail closed on their own.
    assert!(Config::load_for_reload(&file).is_ok());
    fs::remove_dir(dir.path().join("keys")).unwrap();
    assert!(Config::load_for_reload(&file).is_ok());
}

#[test]
fn a_key_file_may_be_a_systemd_credential() {
    use load::Credentials;
    let dir = TempDir::new("credential");
    let text =
        "api:\n  api_keys_file: credential:api-keys\n  admin_keys_file: credential:admin-keys\n";
    let file = dir.write("supervisor.yaml", text);
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    // The service's folder of credentials, as systemd makes it: each file 0400.
    let creds = dir.path().join("credentials");
    dir.write_mode("credentials/api-keys", "k\n", 0o400);
    dir.write_mode("credentials/admin-keys", "a\n", 0o400);
    let load = |c: &Credentials| load::load_with(&file, true, true, c);
    let config = load(&Credentials::In(creds.clone())).unwrap();
    assert_eq!(
        config.supervisor.api.api_keys_file,
        Some(creds.join("api-keys"))
    );
    assert_eq!(
        config.supervisor.api.admin_keys_file,
        Some(creds.join("admin-keys"))
    );
    // systemd 254 and later show group bits (an ACL mask): the folder is the service's alone,
    // so the mode is not held against a credential; what is there must still be a file.
    dir.write_mode("credentials/api-keys", "k\n", 0o440);
    assert!(load(&Credentials::In(creds.clone())).is_ok());
    fs::remove_file(creds.join("api-keys")).unwrap();
    fs::create_dir(creds.join("api-keys")).unwrap();
    let found = errors(load(&Credentials::In(creds.clone())));
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("supervisor.yaml:2:18: api.api_keys_file: ")
            && found[0].ends_with("is a folder, not a file"),
        "{found:?}"
    );
    // Without the service's credentials: a problem that says what the unit needs...
    let found = errors(load(&Credentials::Missing));
    assert_eq!(
        found[0],
        "supervisor.yaml:2:18: api.api_keys_file: names the systemd credential \"api-keys\", \
         but there are none ($CREDENTIALS_DIRECTORY is not set): give dsv4.service \
         LoadCredential=api-keys:/etc/dsv4/api-keys (a drop-in; see docs/security.md)"
    );
    // ...or, for a check by hand, left to the service's own check, and said so.
    let config = load(&Credentials::Elsewhere).unwrap();
    assert!(
        config.summary().contains(
            "\n  api.api_keys_file: the systemd credential \"api-keys\", which only the \
             service has: checked by `systemctl reload dsv4`"
        ),
        "{}",
        config.summary()
    );
    // One credential for both is one file for both.
    dir.write("supervisor.yaml", &text.replace("admin-keys", "api-keys"));
    let found = errors(load(&Credentials::Elsewhere));
    assert!(
        found[0].contains("is the same file as api.api_keys_file"),
        "{found:?}"
    );
    // A name, not a path.
    for bad in ["", "../keys", "a/b", "."] {
        let text = format!("api: {{api_keys_file: \"credential:{bad}\"}}\n");
        dir.write("supervisor.yaml", &text);
        let found = errors(load(&Credentials::In(creds.clone())));
        assert!(
            found[0].contains("credential: must be followed by a credential's name"),
            "{bad}: {found:?}"
        );
    }
}

#[test]
fn one_file_cannot_hold_both_the_api_and_the_admin_keys() {
    let dir = TempDir::new("shared-keys");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    dir.write_mode("keys", "k\n", 0o600);
    dir.write_mode("admin", "a\n", 0o600);
    std::os::unix::fs::symlink("keys", dir.path().join("link")).unwrap();
    fs::hard_link(dir.path().join("keys"), dir.path().join("hard")).unwrap();
    let config = |admin: &str| {
        let text = format!("api: {{ api_keys_file: keys, admin_keys_file: {admin} }}\n");
        dir.write("supervisor.yaml", &text)
    };
    let shared = |column: usize| {
        format!(
            "supervisor.yaml:1:{column}: api.admin_keys_file: is the same file as \
             api.api_keys_file (keys), so every API client would hold an admin key: give the \
             admin keys a file of their own"
        )
    };
    // The same path, another spelling of it, a symbolic link and a hard link.
    for admin in ["keys", "./keys", "link", "hard"] {
        let file = config(admin);
        assert_eq!(errors(Config::load(&file)), [shared(46)], "{admin}");
        assert_eq!(
            errors(Config::load_for_reload(&file)),
            [shared(46)],
            "{admin}"
        );
    }
    assert!(Config::load(&config("admin")).is_ok());
}

#[test]
fn a_profile_linked_out_of_the_profiles_folder_is_refused() {
    let dir = TempDir::new("linked-profile");
    let file = dir.write("supervisor.yaml", "default_profile: inside\n");
    dir.engine_files("profiles");
    dir.write("profiles/inside.yaml", MINIMAL_PROFILE);
    // A link to a file inside the folder (or a folder below it) is a profile like any other.
    dir.write("profiles/shared/base.yaml", MINIMAL_PROFILE);
    std::os::unix::fs::symlink("shared/base.yaml", dir.path().join("profiles/alias.yaml")).unwrap();
    let config = Config::load(&file).unwrap();
    assert_eq!(
        config.profiles.keys().collect::<Vec<_>>(),
        ["alias", "inside"]
    );
    // One to a key file beside supervisor.yaml is not read at all: its text is never shown.
    let secret = "3f9a0c6e1b2d4f5a6c7e8d9b0a1c2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d";
    let keys = dir.write_mode("admin-keys", &format!("{secret}\n"), 0o600);
    std::os::unix::fs::symlink(&keys, dir.path().join("profiles/keys.yaml")).unwrap();
    let found = errors(Config::load(&file));
    assert_eq!(
        found,
        [
            "profiles/keys.yaml: is a symbolic link to admin-keys, outside the profiles folder \
             profiles: a profile must be a file in that folder (copy it there, or link to a \
             file inside it)"
        ]
    );
    assert!(
        found.iter().all(|p| !p.contains(&secret[..13])),
        "{found:?}"
    );
}

#[test]
fn shipped_policies_fail_only_on_the_example_paths() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/supervisor.yaml");
    // Where the example paths exist (the machine is set up like the examples), they are
    // not problems.
    let missing = |p: &str| !Path::new(p).exists();
    let note = "this is the example path shipped in the profile: edit it to point at your";
    let mut want = Vec::new();
    for (file, command, model, mmproj) in [
        ("320k", (8, 10), (9, 8), (10, 9)),
        ("64k", (9, 10), (10, 8), (11, 9)),
    ] {
        let at = |(line, column): (usize, usize)| format!("profiles/{file}.yaml:{line}:{column}");
        let command_path = "/usr/local/bin/llama-server";
        if missing(command_path) {
            want.push(format!(
                "{}: command: {command_path} does not exist ({note} llama-server)",
                at(command)
            ));
        }
        let model_path = "/srv/models/dsv4-flash/IQ2_XXS-00001-of-00004.gguf";
        if missing(model_path) {
            want.push(format!(
                "{}: model: {model_path} does not exist ({note} model)",
                at(model)
            ));
        }
        let mmproj_path = "/srv/models/dsv4-flash/mmproj-F16.gguf";
        if missing(mmproj_path) {
            want.push(format!(
                "{}: mmproj: {mmproj_path} does not exist ({note} vision projector, or remove \
                 mmproj)",
                at(mmproj)
            ));
        }
    }
    match Config::load(&path) {
        Ok(_) => assert!(want.is_empty(), "expected {want:#?}"),
        Err(e) => {
            let got: Vec<String> = e.problems.iter().map(Problem::to_string).collect();
            assert_eq!(got, want);
        }
    }

    // Every other key is valid, and they say what the brief says.
    let config = match load_text_only(&path) {
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
        let kv = p.kv_checkpoint.as_ref().unwrap();
        assert_eq!(kv.dir, Path::new("/var/lib/dsv4/kv"));
        assert_eq!(kv.max_size, Some(40 << 30));
        assert_eq!(kv.save_timeout, Duration::from_secs(120));
        assert_eq!(p.params.slot_save_path.as_deref(), Some(kv.dir.as_path()));
        assert!(p
            .params
            .model
            .as_ref()
            .unwrap()
            .starts_with(files::EXAMPLE_MODEL_DIR));
        assert!(p
            .params
            .mmproj
            .as_ref()
            .unwrap()
            .starts_with(files::EXAMPLE_MODEL_DIR));
    }
    assert_eq!(
        config.summary(),
        "supervisor.yaml OK: 2 profiles in profiles, default 320k\n  \
         320k: llama-server, context 327680, planned memory 87.8 GiB (320K service profile)\n  \
         64k: llama-server, context 65536, planned memory 86.0 GiB (64K validation profile)"
    );
}

#[test]
fn shipped_policies_document_every_key() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let text = fs::read_to_string(dir.join("supervisor.yaml")).unwrap();
    let shipped: BTreeMap<String, serde::de::IgnoredAny> =
        dsv4_yaml::from_str(&text).unwrap().unwrap();
    let keys = keys_of::<Supervisor>();
    assert_eq!(keys.len(), 13);
    for key in keys {
        assert!(shipped.contains_key(key), "{key}");
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
                    .is_some_and(|k| keys_of::<super::raw::RawProfile>().contains(&k))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(uncommented.contains("engine: ds4"), "{name}: {uncommented}");
        let raw: super::raw::RawProfile = dsv4_yaml::from_str(&uncommented).unwrap().unwrap();
        assert_eq!(raw.engine, Some(EngineKind::Ds4));
    }
}

// The fixture cases: `tests/fixtures/config/{bad,good}/<case>/` each hold a `supervisor.yaml`,
// usually a `profiles/` folder, and `expected.txt`: for a bad case the exact problems, one a
// line; for a good case the summary. A case may list in `requires-missing.txt` absolute
// paths (one a line, `#` comments) that must not exist for it to hold; where one exists the
// case is skipped. Run with DSV4_BLESS=1 to rewrite `expected.txt` from what the loader says.

fn fixture_cases(kind: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/config");
    let mut cases: Vec<PathBuf> = fs::read_dir(root.join(kind))
        .unwrap_or_else(|e| panic!("{}: {e}", root.join(kind).display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.is_dir())
        .collect();
    cases.sort();
    cases
}

/// Why the case does not hold on this machine, if it does not.
fn skip_reason(case: &Path) -> Option<String> {
    let list = fs::read_to_string(case.join("requires-missing.txt")).ok()?;
    list.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .find(|p| Path::new(p).exists())
        .map(|p| format!("{p} exists"))
}

/// Compares `got` with the case's `expected.txt`; on a mismatch, a readable diff.
fn check_expected(case: &Path, got: &str) -> Result<(), String> {
    let file = case.join("expected.txt");
    if std::env::var_os("DSV4_BLESS").is_some() {
        fs::write(&file, format!("{got}\n")).unwrap();
        return Ok(());
    }
    let want = fs::read_to_string(&file).unwrap_or_default();
    let want = want.strip_suffix('\n').unwrap_or(&want);
    if want == got {
        return Ok(());
    }
    Err(format!(
        "{}: output differs from expected.txt (- expected, + got):\n{}",
        case.display(),
        line_diff(want, got)
    ))
}

/// A line diff by longest common subsequence: ` ` both, `-` only `a`, `+` only `b`.
fn line_diff(a: &str, b: &str) -> String {
    let a: Vec<&str> = a.lines().collect();
    let b: Vec<&str> = b.lines().collect();
    // common[i][j]: length of the LCS of a[i..] and b[j..].
    let mut common = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            common[i][j] = if a[i] == b[j] {
                common[i + 1][j + 1] + 1
            } else {
                common[i + 1][j].max(common[i][j + 1])
            };
        }
    }
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out.push(format!("  {}", a[i]));
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || common[i][j + 1] >= common[i + 1][j]) {
            out.push(format!("+ {}", b[j]));
            j += 1;
        } else {
            out.push(format!("- {}", a[i]));
            i += 1;
        }
    }
    out.join("\n")
}

#[test]
fn line_diffs() {
    assert_eq!(line_diff("a\nb\nc", "a\nc\nd"), "  a\n- b\n  c\n+ d");
    assert_eq!(line_diff("", "x"), "+ x");
    assert_eq!(line_diff("x", ""), "- x");
}

#[test]
fn bad_fixtures_report_exactly_the_expected_problems() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in fixture_cases("bad") {
        if let Some(why) = skip_reason(&case) {
            eprintln!("skipping {}: {why}", case.display());
            continue;
        }
        let got = match Config::load(&case.join("supervisor.yaml")) {
            Ok(config) => format!("(no problems)\n{}", config.summary()),
            Err(e) => e.to_string(),
        };
        if let Err(diff) = check_expected(&case, &got) {
            failures.push(diff);
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} bad cases");
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

#[test]
fn good_fixtures_load() {
    let mut failures = Vec::new();
    let cases = fixture_cases("good");
    assert!(!cases.is_empty());
    for case in cases {
        match Config::load(&case.join("supervisor.yaml")) {
            Ok(config) => {
                if let Err(diff) = check_expected(&case, &config.summary()) {
                    failures.push(diff);
                }
            }
            Err(e) => failures.push(format!("{}:\n{e}", case.display())),
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n\n"));
}

/// The keys serde reads in a `T` (as the deserializer is told them: no error text is read).
fn keys_of<T: serde::de::DeserializeOwned>() -> Vec<&'static str> {
    dsv4_yaml::keys_of::<T>().to_vec()
}

/// The sections of `supervisor.yaml` and the keys of each.
fn sections() -> [(&'static str, Vec<&'static str>); 8] {
    [
        ("api", keys_of::<Api>()),
        ("engine", keys_of::<EngineLimits>()),
        ("power", keys_of::<PowerSettings>()),
        ("monitor", keys_of::<Monitor>()),
        ("thermal", keys_of::<ThermalSettings>()),
        ("memory", keys_of::<Memory>()),
        ("peers", keys_of::<super::Peers>()),
        ("canary", keys_of::<super::Canary>()),
    ]
}

/// YAML-ish text built from real keys, so that the fuzzing reaches the checks.
fn yamlish(keys: Vec<&'static str>) -> impl Strategy<Value = String> {
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

/// Any YAML value, with scalars that come close to valid ones: numbers at the edges of the
/// ranges, values with units, paths that exist or not, flags dsv4d owns.
fn yaml_value() -> impl Strategy<Value = serde_yaml_ng::Value> {
    use serde_yaml_ng::Value;
    let text = prop_oneof![
        prop::sample::select(
            &[
                "",
                "0",
                "1",
                "0s",
                "1s",
                "500ms",
                "90",
                "15m",
                "1h30m",
                "-5s",
                "0B",
                "64MiB",
                "87.82GiB",
                "1KiB",
                "85C",
                "95C",
                "-1C",
                "150C",
                "151C",
                "auto",
                "all",
                "on",
                "llama-server",
                "ds4",
                "keep",
                "stop",
                "q8_0",
                "q8",
                "/",
                ".",
                "..",
                "/bin/sh",
                "/etc",
                "/nonexistent/x",
                "/srv/models/dsv4-flash/x.gguf",
                "/usr/local/bin/llama-server",
                "sh",
                "bin/x",
                "a-00001-of-00002.gguf",
                "a-00002-of-00002.gguf",
                "--port",
                "--host=x",
                "-c",
                "--metrics",
                "A=B",
                "1A",
                "127.0.0.1:8080",
                "[::1]:0",
                "localhost",
                "320k",
                "a\0b",
                "é",
            ][..]
        )
        .prop_map(str::to_string),
        "\\PC{0,16}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop::sample::select(&[0i64, -1, 1, 511, 512, 256, 257, 100_000, 100_001][..])
            .prop_map(|n| Value::Number(n.into())),
        any::<i64>().prop_map(|n| Value::Number(n.into())),
        any::<u64>().prop_map(|n| Value::Number(n.into())),
        any::<f64>().prop_map(|n| Value::Number(n.into())),
        text.prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Sequence),
            prop::collection::vec(("[A-Za-z_=1 -]{0,6}", inner), 0..4).prop_map(|entries| {
                Value::Mapping(
                    entries
                        .into_iter()
                        .map(|(k, v)| (Value::String(k), v))
                        .collect(),
                )
            }),
        ]
    })
}

/// A mapping of some of `keys`, each with a value from `value`.
fn mapping_of<S>(keys: Vec<&'static str>, value: S) -> BoxedStrategy<serde_yaml_ng::Value>
where
    S: Strategy<Value = serde_yaml_ng::Value> + 'static,
{
    prop::collection::vec((prop::sample::select(keys), value), 0..8)
        .prop_map(|entries| {
            serde_yaml_ng::Value::Mapping(
                entries
                    .into_iter()
                    .map(|(k, v)| (serde_yaml_ng::Value::String(k.to_string()), v))
                    .collect(),
            )
        })
        .boxed()
}

/// `supervisor.yaml` with known keys: sections hold known keys with any values.
fn supervisor_values() -> impl Strategy<Value = serde_yaml_ng::Value> {
    let sections: Vec<BoxedStrategy<(String, serde_yaml_ng::Value)>> = sections()
        .into_iter()
        .map(|(section, keys)| {
            mapping_of(keys, yaml_value())
                .prop_map(move |m| (section.to_string(), m))
                .boxed()
        })
        .collect();
    let section = prop::strategy::Union::new(sections);
    let scalar = (prop::sample::select(keys_of::<Supervisor>()), yaml_value())
        .prop_map(|(k, v)| (k.to_string(), v));
    prop::collection::vec(prop_oneof![section, scalar], 0..8).prop_map(|entries| {
        serde_yaml_ng::Value::Mapping(
            entries
                .into_iter()
                .map(|(k, v)| (serde_yaml_ng::Value::String(k), v))
                .collect(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn the_loader_never_panics(
        supervisor in prop_oneof!["\\PC{0,200}", yamlish(keys_of::<Supervisor>())],
        profile in prop_oneof!["\\PC{0,200}", yamlish(keys_of::<super::raw::RawProfile>())],
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

    #[test]
    fn any_values_in_known_keys_never_panic(
        supervisor in supervisor_values(),
        profile in mapping_of(keys_of::<super::raw::RawProfile>(), yaml_value()),
        flow in any::<bool>(),
    ) {
        let dir = TempDir::new("values");
        dir.engine_files("profiles");
        dir.write("profiles/a-00001-of-00002.gguf", "");
        let render = |value: &serde_yaml_ng::Value| {
            let text = serde_yaml_ng::to_string(value).unwrap();
            // Also one flow document on a line, for the position scan.
            if flow { serde_json::to_string(value).unwrap_or(text) } else { text }
        };
        let file = dir.write("supervisor.yaml", &render(&supervisor));
        dir.write("profiles/320k.yaml", &render(&profile));
        match Config::load(&file) {
            Ok(config) => {
                prop_assert!(config.profile("320k").is_some());
                prop_assert!(!config.summary().is_empty());
            }
            Err(e) => {
                prop_assert!(!e.problems.is_empty());
                for p in &e.problems {
                    prop_assert!(!p.message.is_empty());
                    prop_assert!(p.line.is_none() || p.line.unwrap() >= 1);
                }
            }
        }
    }
}

#[test]
fn aliases_and_deep_nesting_stop_at_the_first_mistake() {
    let dir = TempDir::new("odd");
    let file = dir.write("supervisor.yaml", "");
    dir.engine_files("profiles");
    // Setting an entry aside could break an alias to it: only serde's first mistake is
    // certain. An unknown key is found in the parsed document itself, so it is reported too.
    dir.write(
        "profiles/320k.yaml",
        "engine: &e llama-server\ncommand: bin/engine\nmodel: m.gguf\ncontext: lots\n\
         paralel: 2\ndescription: *e\n",
    );
    let deep = format!("context: {}{}\n", "[".repeat(300), "]".repeat(300));
    dir.write("profiles/deep.yaml", &deep);
    let got = errors(Config::load(&file));
    assert_eq!(got.len(), 3, "{got:#?}");
    assert_eq!(
        got[0],
        "profiles/320k.yaml:4:10: context: invalid type: string \"lots\", expected u32"
    );
    assert!(
        got[1].starts_with("profiles/320k.yaml:5:1: paralel: unknown key `paralel`"),
        "{got:#?}"
    );
    assert!(got[2].starts_with("profiles/deep.yaml:1:"), "{got:#?}");
}

#[test]
fn files_that_would_cost_the_loader_dearly_are_refused_quickly_and_clearly() {
    let dir = TempDir::new("shape");
    let file = dir.write("supervisor.yaml", "");
    dir.write("profiles/320k.yaml", MINIMAL_PROFILE);
    dir.engine_files("profiles");
    assert!(Config::load(&file).is_ok());
    // Aliases of aliases: nine levels of ten expand to a billion values.
    let mut laughs = String::from("description: &a0 [\"ha\"]\n");
    for i in 1..10 {
        let prev = format!("*a{}", i - 1);
        let list = [prev.as_str(); 10].join(", ");
        laughs.push_str(&format!("x{i}: &a{i} [{list}]\n"));
    }
    dir.write("profiles/laughs.yaml", &laughs);
    let e = errors(Config::load(&file));
    assert!(
        e.iter().any(|m| m.starts_with("profiles/laughs.yaml:")
            && m.contains(": its aliases expand to more than 100000 values")),
        "{e:?}"
    );
    fs::remove_file(dir.path().join("profiles/laughs.yaml")).unwrap();
    // Nested deeper than any setting is.
    let deep = format!("extra_args: {}1{}\n", "[".repeat(5000), "]".repeat(5000));
    dir.write("profiles/deep.yaml", &deep);
    let e = errors(Config::load(&file));
    assert!(
        e.iter()
            .any(|m| m.starts_with("profiles/deep.yaml:1:")
                && m.contains(": nested more than 32 deep")),
        "{e:?}"
    );
    fs::remove_file(dir.path().join("profiles/deep.yaml")).unwrap();
    // Larger than a configuration file may be.
    let big = format!("description: {}\n", "x".repeat(300 << 10));
    dir.write("profiles/big.yaml", &big);
    let e = errors(Config::load(&file));
    assert!(
        e.iter()
            .any(|m| m.contains("big.yaml") && m.contains("the file is larger than 256 KiB")),
        "{e:?}"
    );
}

/// Every key a configuration file may hold is in `docs/configuration.md`, by its full name
/// in backquotes (`api.listen`, `kv_checkpoint.dir`), so the reference cannot drift from
/// what the loader reads.
#[test]
fn every_config_key_is_documented() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configuration.md");
    let doc = fs::read_to_string(&doc_path).expect("docs/configuration.md");
    let mut keys = Vec::new();
    let mut add = |prefix: &str, fields: &[&str]| {
        keys.extend(fields.iter().map(|f| format!("{prefix}{f}")));
    };
    let sections = sections();
    for field in keys_of::<Supervisor>() {
        match sections.iter().find(|(name, _)| *name == field) {
            Some((name, fields)) => add(&format!("{name}."), fields),
            None => add("", &[field]),
        }
    }
    for field in keys_of::<raw::RawProfile>() {
        match field {
            "kv_checkpoint" => add("kv_checkpoint.", &keys_of::<raw::RawKvCheckpoint>()),
            f => add("", &[f]),
        }
    }
    assert!(keys.len() > 40, "too few keys found: {keys:?}");
    let missing: Vec<&String> = keys
        .iter()
        .filter(|k| !doc.contains(&format!("`{k}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "not in {}: {missing:?}",
        doc_path.display()
    );
}

#[test]
fn a_profile_reads_as_json_as_written() {
    assert_eq!(
        super::yaml_to_json("context: 4096\nmmproj: null\nextra_args: [--x, 1.5]\nname: '64'\n"),
        Some(serde_json::json!({
            "context": 4096, "mmproj": null, "extra_args": ["--x", 1.5], "name": "64"
        }))
    );
    assert_eq!(super::yaml_to_json("a: [unclosed\n"), None);
}

/// The settings the engine kinds declare ([`dsv4_engine::Setting`]) are keys a profile
/// takes: a kind's `reads`, `requires` and `ignores` name real keys, and the config reader's
/// checks by those names find them.
#[test]
fn every_setting_an_engine_kind_declares_is_a_profile_key() {
    let err = dsv4_yaml::from_str::<raw::RawProfile>("no_such_key: 1")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    let (_, listed) = err
        .split_once("expected one of ")
        .unwrap_or_else(|| panic!("{err}"));
    let keys: Vec<&str> = listed
        .split(|c: char| c == '`' || c == ',' || c.is_whitespace() || c == ';')
        .filter(|k| !k.is_empty())
        .collect();
    for setting in dsv4_engine::Setting::ALL {
        assert!(
            keys.contains(&setting.key()),
            "{setting:?} ({}) is no profile key: {keys:?}",
            setting.key()
        );
    }
    // And every kind's declarations are settings the profile gives.
    for kind in EngineKind::ALL {
        let d = kind.describe();
        let declared = d
            .reads
            .iter()
            .chain(d.ignores)
            .chain(d.requires.iter().map(|(s, _)| s));
        for s in declared {
            assert!(dsv4_engine::Setting::ALL.contains(s), "{}: {s:?}", d.name);
        }
    }
}
