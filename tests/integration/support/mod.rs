//! Test harness: the one way the tests start `dsv4d` (a real process, socket-activated or on
//! `--listen`, configured by a `Setup`), driving the fake engine, with a small HTTP client.
#![allow(dead_code)]

use dsv4_client::State;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
pub use tempfile::TempDir;

pub mod boxes;
pub mod ns;
pub mod real;
pub const FAKE_ENGINE: &str = env!("CARGO_BIN_EXE_fake-engine");
pub const DSV4D: &str = env!("CARGO_BIN_EXE_dsv4d-under-test");

/// What a latency bound that is itself the feature ("the lease goes within a second") may take
/// on top of its figure on a loaded machine: the tests run in parallel, each with a daemon and
/// an engine, on two cores that something else may be busy on. Each such bound is measured
/// from the moment its cause happened, and the behaviour it guards against (a lease held for
/// the whole minute of a prefill, a kill only at the next timer) takes far longer than the
/// figure and this margin together, so the test still fails when the feature breaks.
pub const LOAD_MARGIN: Duration = Duration::from_secs(2);

/// How long a test waits for a condition that should come in milliseconds, before it says it
/// never came: a wait ends as soon as its condition holds, so only a failing test pays it.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// How long a child process that does real work (a validation on the real engine, a browser
/// loading a page) may run before the test calls it hung: a guard against a test run that
/// never ends, not a figure of speed. Work that takes a minute on one machine takes three on
/// a slower one.
pub const HANG: Duration = Duration::from_secs(600);

/// `Command::output` with a bound.
pub trait OutputWithin {
    /// Runs the command to its end, as `output` does (stdin empty), but kills it (by its own PID) and fails
    /// the test with what it printed when it runs past `limit`.
    fn output_within(&mut self, limit: Duration) -> Output;
}

impl OutputWithin for Command {
    fn output_within(&mut self, limit: Duration) -> Output {
        output_within(self, limit)
    }
}

fn output_within(cmd: &mut Command, limit: Duration) -> Output {
    use std::io::Read;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {:?}: {e}", cmd.get_program()));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for a child") {
            break st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            let err = stderr.join().unwrap_or_default();
            panic!(
                "{:?} {:?} still ran after {limit:?}: killed\n{}",
                cmd.get_program(),
                cmd.get_args().collect::<Vec<_>>(),
                String::from_utf8_lossy(&err)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// Held by a test that installs the package on this machine, or runs its units under a real
/// systemd (which makes `/etc/dsv4`): one at a time, in this test process and in any other
/// (two checkouts tested at once share the machine's /etc and dpkg). An exclusive `flock` on
/// a file of this machine's, let go when the guard drops (or the process dies).
pub fn package_lock() -> nix::fcntl::Flock<std::fs::File> {
    let path = "/run/lock/dsv4-tests-package.lock";
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .or_else(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open("/tmp/dsv4-tests-package.lock")
        })
        .unwrap_or_else(|e| panic!("cannot open a lock file: {e}"));
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .unwrap_or_else(|(_, e)| panic!("cannot lock {path}: {e}"))
}

/// A benchmark knob: the environment variable `name` as a number, else `default`.
/// The runtime a benchmark's `main` runs on: two workers, as the machine has two cores.
pub fn bench_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Drops `path`'s pages from the page cache, as `dsv4d` never does for a user's load (a page
/// a process maps stays).
pub fn evict(path: &Path) {
    let file = std::fs::File::open(path).unwrap();
    nix::fcntl::posix_fadvise(
        &file,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .unwrap();
}

/// Reads a streamed answer's `body` to its end, calling `on_data` with each `data:` event's
/// JSON as it comes (`null` for one that is not JSON, as `[DONE]`).
pub async fn each_sse_data(
    mut body: hyper::body::Incoming,
    mut on_data: impl FnMut(&serde_json::Value),
) {
    use http_body_util::BodyExt;
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.unwrap().into_data() else {
            continue;
        };
        text.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = text.find("\n\n") {
            let event: String = text.drain(..end + 2).collect();
            if let Some(json) = event.trim().strip_prefix("data: ") {
                on_data(&serde_json::from_str(json).unwrap_or_default());
            }
        }
    }
}

pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The files in `dir` whose names end in `.EXT`.
pub fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == ext))
        .collect()
}

/// Replaces a file whole, as editors save and as sysfs changes a value: a temporary file
/// renamed over it, so that a reader never sees it half written.
pub fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp-save");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// The files of a folder (not its subfolders), by name, with their bytes.
pub fn files_in(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .flatten()
        .filter(|e| e.path().is_file())
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect()
}

/// A fresh folder under the system temp dir, `dsv4-test-TAG-…`, removed on drop.
pub fn temp_dir(tag: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("dsv4-test-{tag}-"))
        .tempdir()
        .expect("a temporary folder")
}

/// The fixture tree `tests/fixtures/sysfs/NAME`.
pub fn fixture_tree(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/sysfs")
        .join(name)
}

/// A copy of the fixture tree `name` (symbolic links kept as links), for a test to change
/// while a daemon reads it.
pub fn fixture_copy(name: &str) -> TempDir {
    fn copy(src: &Path, dst: &Path) {
        for entry in std::fs::read_dir(src).unwrap().flatten() {
            let to = dst.join(entry.file_name());
            let kind = entry.file_type().unwrap();
            if kind.is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(entry.path()).unwrap(), &to).unwrap();
            } else if kind.is_dir() {
                std::fs::create_dir_all(&to).unwrap();
                copy(&entry.path(), &to);
            } else {
                std::fs::copy(entry.path(), &to).unwrap();
            }
        }
    }
    let dir = temp_dir(&format!("sysfs-{name}"));
    copy(&fixture_tree(name), dir.path());
    dir
}

/// Runs `dsv4d ARGS` to its end (a configuration check, a configuration it refuses), with
/// its logging off, and returns what it printed and how it exited.
pub fn run_dsv4d<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Output {
    Command::new(DSV4D)
        .args(args)
        .env("DSV4_LOG", "off")
        .stdin(Stdio::null())
        .output_within(HANG)
}

/// A private D-Bus bus daemon (session type, allow-all policy), reachable by every user so
/// tests can call as `nobody`. Killed on drop.
pub struct PrivateBus {
    pub address: String,
    pid: i32,
    _dir: TempDir,
}

impl PrivateBus {
    pub fn start() -> PrivateBus {
        let dir = temp_dir("bus");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.path().join("bus");
        let conf = dir.path().join("bus.conf");
        std::fs::write(
            &conf,
            format!(
                "<!DOCTYPE busconfig PUBLIC \"-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN\" \
                 \"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd\">\n\
                 <busconfig><type>session</type><listen>unix:path={}</listen>\
                 <policy context=\"default\"><allow user=\"*\"/><allow own=\"*\"/>\
                 <allow send_destination=\"*\"/><allow receive_sender=\"*\"/></policy></busconfig>\n",
                socket.display()
            ),
        )
        .unwrap();
        let out = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", conf.display()))
            .args(["--fork", "--print-address=1", "--print-pid=1"])
            .output()
            .expect("dbus-daemon (apt-get install dbus-daemon)");
        assert!(
            out.status.success(),
            "dbus-daemon: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let mut lines = text.lines();
        let address = lines.next().unwrap().to_string();
        let pid = lines.next().unwrap().trim().parse().unwrap();
        PrivateBus {
            address,
            pid,
            _dir: dir,
        }
    }
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
}

/// How the daemon under test gets its API socket.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Listen {
    /// Socket activation: the test binds a loopback listener, as systemd would, and the
    /// daemon gets it as fd 3 named `api`.
    Activated,
    /// `--listen 127.0.0.1:0`: the daemon binds it, and its log says where.
    Flag,
}

/// The API key file `Setup::api_keys_file` writes beside supervisor.yaml.
pub const API_KEYS_FILE: &str = "api-keys";

/// The admin key file `Setup::admin_keys_file` writes beside supervisor.yaml.
pub const ADMIN_KEYS_FILE: &str = "admin-keys";

/// What the daemon under test is configured with, and how it is started.
#[derive(Clone)]
pub struct Setup {
    /// `api:` keys of supervisor.yaml, besides `listen`.
    pub api: BTreeMap<&'static str, String>,
    /// `engine:` keys of supervisor.yaml.
    pub engine: BTreeMap<&'static str, String>,
    /// More top-level keys of supervisor.yaml.
    pub top_level: BTreeMap<&'static str, String>,
    /// FAKE_ENGINE_* knobs per profile (profile name -> knob -> value).
    pub profiles: BTreeMap<String, BTreeMap<&'static str, String>>,
    /// Keys of a generated profile set to other values, or added (profile -> key -> value).
    pub profile_keys: BTreeMap<String, BTreeMap<&'static str, String>>,
    pub default_profile: String,
    /// `engine:` of every profile (the fake engine plays either).
    pub engine_kind: &'static str,
    /// Profiles written as given (name -> YAML) instead of the fake-engine ones.
    pub custom_profiles: BTreeMap<String, String>,
    /// The API key file (text, mode), written beside supervisor.yaml as `API_KEYS_FILE`.
    pub api_keys: Option<(String, u32)>,
    /// The admin key file's text (mode 600), written beside supervisor.yaml as
    /// `ADMIN_KEYS_FILE`.
    pub admin_keys: Option<String>,
    /// Serve the control interface on this (private) session bus; `--bus none` without.
    pub session_bus: Option<String>,
    /// Serve it on this private bus as the system bus (`--bus system`,
    /// `DBUS_SYSTEM_BUS_ADDRESS`), as the system service does.
    pub system_bus: Option<String>,
    pub listen: Listen,
    /// More `dsv4d` arguments.
    pub daemon_args: Vec<String>,
    /// More environment variables for `dsv4d`.
    pub daemon_env: Vec<(String, String)>,
    /// `DSV4_LOG` for the daemon: the test's own `DSV4_LOG`, else `debug`, unless set here.
    pub log_level: Option<String>,
    /// Stop reading the daemon's log once it says where it listens, closing the pipe.
    pub leave_log_once_listening: bool,
    /// The daemon's open-file limits (soft, hard), set before it runs, as `ulimit -n` would.
    pub nofile: Option<(u64, u64)>,
    /// A program (and its arguments) that runs the daemon, as `setpriv ... dsv4d`: it must
    /// exec it, so that the daemon keeps the pid systemd's `LISTEN_PID` names.
    pub wrapper: Vec<String>,
    /// `WATCHDOG_USEC` (with `WATCHDOG_PID` naming the daemon), as systemd sets them.
    pub watchdog_usec: Option<u64>,
}

impl Default for Setup {
    /// Two profiles, `320k` (the default) and `64k`, whose fake engine handles connections
    /// as llama-server does: closed after every streamed answer and after 5 s idle. The daemon
    /// is socket-activated and has no bus.
    fn default() -> Self {
        let llama = BTreeMap::from([("connections", "llama".to_string())]);
        let mut profiles = BTreeMap::new();
        profiles.insert("320k".to_string(), llama.clone());
        profiles.insert("64k".to_string(), llama);
        // The power policy acts only where a test asks for it: never on this machine's own
        // CPU, GPU or system bus.
        let top_level = BTreeMap::from([("power", "{ method: none }".to_string())]);
        Setup {
            api: BTreeMap::new(),
            engine: BTreeMap::new(),
            top_level,
            profiles,
            profile_keys: BTreeMap::new(),
            default_profile: "320k".into(),
            engine_kind: "llama-server",
            custom_profiles: BTreeMap::new(),
            api_keys: None,
            admin_keys: None,
            session_bus: None,
            system_bus: None,
            listen: Listen::Activated,
            daemon_args: Vec::new(),
            daemon_env: Vec::new(),
            log_level: None,
            leave_log_once_listening: false,
            nofile: None,
            wrapper: Vec::new(),
            watchdog_usec: None,
        }
    }
}

impl Setup {
    /// Sets an `api:` key of supervisor.yaml.
    pub fn api(mut self, key: &'static str, value: &str) -> Self {
        self.api.insert(key, value.to_string());
        self
    }

    /// Sets an `engine:` key of supervisor.yaml.
    pub fn engine(mut self, key: &'static str, value: &str) -> Self {
        self.engine.insert(key, value.to_string());
        self
    }

    /// Sets a top-level key of supervisor.yaml (one it has not otherwise; `power` is
    /// `{ method: none }` unless set).
    pub fn top_level(mut self, key: &'static str, value: &str) -> Self {
        self.top_level.insert(key, value.to_string());
        self
    }

    /// Sets a fake-engine knob (`load_ms` -> FAKE_ENGINE_LOAD_MS) on every profile.
    pub fn knob(mut self, knob: &'static str, value: &str) -> Self {
        for p in self.profiles.values_mut() {
            p.insert(knob, value.to_string());
        }
        self
    }

    /// Sets `key` of the generated profile `profile` (`context`, ...).
    pub fn profile_key(mut self, profile: &str, key: &'static str, value: &str) -> Self {
        self.profile_keys
            .entry(profile.to_string())
            .or_default()
            .insert(key, value.to_string());
        self
    }

    /// Every profile runs `engine: ds4`, with the fake engine playing ds4-server.
    pub fn ds4(mut self) -> Self {
        self.engine_kind = "ds4";
        self.knob("mode", "ds4").knob("connections", "keep")
    }

    /// API keys required: `text` in the key file, with file mode `mode`.
    pub fn api_keys_file(mut self, text: &str, mode: u32) -> Self {
        self.api_keys = Some((text.to_string(), mode));
        self.api("api_keys_file", API_KEYS_FILE)
    }

    /// Admin keys for the dashboard's actions: `text` in the admin key file (mode 600).
    pub fn admin_keys_file(mut self, text: &str) -> Self {
        self.admin_keys = Some(text.to_string());
        self.api("admin_keys_file", ADMIN_KEYS_FILE)
    }

    /// The control interface on `bus`.
    pub fn session_bus(mut self, bus: &PrivateBus) -> Self {
        self.session_bus = Some(bus.address.clone());
        self
    }

    /// The control interface on `bus`, used as the system bus.
    pub fn system_bus(mut self, bus: &PrivateBus) -> Self {
        self.system_bus = Some(bus.address.clone());
        self
    }

    /// `dsv4d --listen 127.0.0.1:0` instead of socket activation.
    pub fn listen_flag(mut self) -> Self {
        self.listen = Listen::Flag;
        self
    }

    /// More `dsv4d` arguments.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.daemon_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// An environment variable for `dsv4d` (`RUNTIME_DIRECTORY`, as systemd sets it).
    pub fn daemon_env(mut self, name: &str, value: &str) -> Self {
        self.daemon_env.push((name.to_string(), value.to_string()));
        self
    }

    /// Starts the daemon with these open-file limits (soft, hard).
    pub fn nofile(mut self, soft: u64, hard: u64) -> Self {
        self.nofile = Some((soft, hard));
        self
    }

    /// Runs the daemon through `program args...` (which must exec it).
    pub fn wrapper(mut self, program_and_args: &[&str]) -> Self {
        self.wrapper = program_and_args.iter().map(|a| a.to_string()).collect();
        self
    }

    /// The daemon's `DSV4_LOG`.
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = Some(level.to_string());
        self
    }

    /// Stop reading the daemon's log once it says where it listens (its stderr is then a
    /// closed pipe).
    pub fn leave_log_once_listening(mut self) -> Self {
        self.leave_log_once_listening = true;
        self
    }

    /// The text of supervisor.yaml, for a config folder `dir`.
    pub fn supervisor_yaml(&self, dir: &Path) -> String {
        let block = |name: &str, keys: &BTreeMap<&str, String>| -> String {
            if keys.is_empty() {
                return String::new();
            }
            let mut b = format!("{name}:\n");
            for (k, v) in keys {
                b.push_str(&format!("  {k}: {v}\n"));
            }
            b
        };
        let mut yaml = "api:\n  listen: 127.0.0.1:0\n".to_string();
        for (k, v) in &self.api {
            yaml.push_str(&format!("  {k}: {v}\n"));
        }
        yaml.push_str(&block("engine", &self.engine));
        for (k, v) in &self.top_level {
            yaml.push_str(&format!("{k}: {v}\n"));
        }
        yaml.push_str(&format!(
            "profiles_dir: profiles\ndefault_profile: {}\nstate_dir: {}\n",
            self.default_profile,
            dir.join("state").display()
        ));
        yaml
    }

    /// The text of the profile `name`: as given in `custom_profiles`, else a fake engine's
    /// that logs to `fake_log`.
    pub fn profile_yaml(&self, name: &str, fake_log: &Path) -> String {
        if let Some(yaml) = self.custom_profiles.get(name) {
            return yaml.clone();
        }
        let context = if name == "64k" { "65536" } else { "327680" };
        let mut keys: Vec<(&str, String)> = vec![
            ("description", format!("test profile {name}")),
            ("engine", self.engine_kind.to_string()),
            ("command", FAKE_ENGINE.to_string()),
            ("model", format!("models/{name}.gguf")),
            ("context", context.to_string()),
            ("parallel", "1".to_string()),
            ("kv_cache", "q8_0".to_string()),
            ("flash_attn", "on".to_string()),
            ("gpu_layers", "all".to_string()),
        ];
        for (key, value) in self.profile_keys.get(name).into_iter().flatten() {
            match keys.iter_mut().find(|(k, _)| k == key) {
                Some(kv) => kv.1 = value.clone(),
                None => keys.push((key, value.clone())),
            }
        }
        let mut yaml: String = keys.iter().map(|(k, v)| format!("{k}: {v}\n")).collect();
        yaml.push_str(&format!(
            "env:\n  FAKE_ENGINE_LOG_FILE: \"{}\"\n",
            fake_log.display()
        ));
        for (k, v) in self.profiles.get(name).into_iter().flatten() {
            yaml.push_str(&format!("  FAKE_ENGINE_{}: \"{v}\"\n", k.to_uppercase()));
        }
        yaml
    }

    /// Writes supervisor.yaml, the profiles and the key file into `dir`; returns the config
    /// path.
    pub fn write(&self, dir: &Path, fake_log: &Path) -> PathBuf {
        let profiles = dir.join("profiles");
        std::fs::create_dir_all(&profiles).unwrap();
        std::fs::write(dir.join("supervisor.yaml"), self.supervisor_yaml(dir)).unwrap();
        // The fake engine reads no model, but the config loader checks that the file is there.
        std::fs::create_dir_all(profiles.join("models")).unwrap();
        // Written once: a restarted daemon finds the same file (KV checkpoints know a model
        // file by its time too).
        for name in self.profiles.keys() {
            let model = profiles.join(format!("models/{name}.gguf"));
            if !model.exists() {
                std::fs::write(model, b"GGUF").unwrap();
            }
        }
        let names: Vec<&String> = if self.custom_profiles.is_empty() {
            self.profiles.keys().collect()
        } else {
            self.custom_profiles.keys().collect()
        };
        for name in names {
            let path = profiles.join(format!("{name}.yaml"));
            std::fs::write(path, self.profile_yaml(name, fake_log)).unwrap();
        }
        if let Some((text, mode)) = &self.api_keys {
            let path = dir.join(API_KEYS_FILE);
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode)).unwrap();
        }
        if let Some(text) = &self.admin_keys {
            let path = dir.join(ADMIN_KEYS_FILE);
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        dir.join("supervisor.yaml")
    }
}

/// Puts the listening socket `fd` on fd 3 of the program `cmd` runs, without FD_CLOEXEC,
/// as systemd hands it over (the command sets `LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`).
pub fn hand_over_listener(cmd: &mut Command, fd: std::os::fd::RawFd) {
    // SAFETY: dup2 and fcntl are async-signal-safe; they run in the forked child before
    // exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0);
            }
            Ok(())
        });
    }
}

/// A running `dsv4d`, killed on drop (its engine goes with it).
pub struct Daemon {
    pub child: Child,
    pub addr: SocketAddr,
    /// Its config and state; taken by `stop`.
    dir: Option<TempDir>,
    pub fake_log: PathBuf,
    log: Arc<Mutex<String>>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Daemon {
    /// Starts `dsv4d` as `setup` says, with its config and state in a fresh folder.
    pub fn start(setup: &Setup) -> Daemon {
        Daemon::start_in(setup, temp_dir("daemon"))
    }

    /// Starts `dsv4d` with its config and state in `dir` (which may hold a previous run's).
    pub fn start_in(setup: &Setup, dir: TempDir) -> Daemon {
        // Not next to supervisor.yaml: the daemon watches that folder, and the engine writes
        // this log on every request.
        let _ = std::fs::create_dir_all(dir.path().join("logs"));
        let fake_log = dir.path().join("logs/fake-engine.log");
        let config = setup.write(dir.path(), &fake_log);
        let mut listener = None;
        let mut cmd = match setup.listen {
            Listen::Activated => {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let fd = l.as_raw_fd();
                listener = Some(l);
                let mut cmd = Command::new("/bin/sh");
                // `exec` keeps the shell's pid, so LISTEN_PID=$$ names the daemon itself.
                let watchdog = setup
                    .watchdog_usec
                    .map(|u| format!("WATCHDOG_PID=$$ WATCHDOG_USEC={u} "))
                    .unwrap_or_default();
                cmd.arg("-c")
                    .arg(format!(
                        "LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=api {watchdog}exec \"$0\" \"$@\""
                    ))
                    .args(&setup.wrapper)
                    .arg(DSV4D);
                hand_over_listener(&mut cmd, fd);
                cmd
            }
            Listen::Flag => {
                let mut cmd = match setup.wrapper.split_first() {
                    Some((program, args)) => {
                        let mut c = Command::new(program);
                        c.args(args).arg(DSV4D);
                        c
                    }
                    None => Command::new(DSV4D),
                };
                cmd.args(["--listen", "127.0.0.1:0"]);
                cmd
            }
        };
        let log_level = setup
            .log_level
            .clone()
            .unwrap_or_else(|| std::env::var("DSV4_LOG").unwrap_or_else(|_| "debug".into()));
        cmd.args(["--config", config.to_str().unwrap()])
            .args(match (&setup.session_bus, &setup.system_bus) {
                (Some(_), _) => ["--bus", "session"],
                (None, Some(_)) => ["--bus", "system"],
                (None, None) => ["--bus", "none"],
            })
            .args(&setup.daemon_args)
            .envs(setup.daemon_env.iter().map(|(k, v)| (k, v)))
            .env("DSV4_LOG", log_level)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(addr) = &setup.session_bus {
            cmd.env("DBUS_SESSION_BUS_ADDRESS", addr);
        }
        if let Some(addr) = &setup.system_bus {
            cmd.env("DBUS_SYSTEM_BUS_ADDRESS", addr);
        }
        if let Some((soft, hard)) = setup.nofile {
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: setrlimit is async-signal-safe; it runs in the forked child before exec,
            // and the limits are kept across exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("spawn dsv4d");
        let bound = listener.map(|l| l.local_addr().unwrap());

        // Its log, line by line; the address it says it listens on, the first time.
        let log = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        let leave = setup.leave_log_once_listening;
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stderr).lines();
            while let Some(Ok(line)) = lines.next() {
                sink.lock().unwrap().push_str(&format!("{line}\n"));
                let listening = line.split("listening on http://").nth(1);
                if let Some(addr) = listening.and_then(|a| a.trim().parse::<SocketAddr>().ok()) {
                    if leave {
                        // Closed before the test hears where to connect.
                        drop(lines);
                        let _ = addr_tx.send(addr);
                        return;
                    }
                    let _ = addr_tx.send(addr);
                }
            }
        });
        let mut d = Daemon {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir: Some(dir),
            fake_log,
            log,
            client: Client::builder(TokioExecutor::new()).build_http(),
        };
        d.addr = match bound {
            Some(addr) => addr,
            None => addr_rx
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|_| panic!("dsv4d did not listen:\n{}", d.log())),
        };
        d
    }

    /// The folder with its config and state.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("the daemon's folder").path()
    }

    /// What `setup` writes to `file` (`supervisor.yaml`, `profiles/NAME.yaml`) in this
    /// daemon's folder: for tests that change the configuration under a running daemon.
    pub fn config_text(&self, setup: &Setup, file: &str) -> String {
        match file
            .strip_prefix("profiles/")
            .and_then(|f| f.strip_suffix(".yaml"))
        {
            Some(name) => setup.profile_yaml(name, &self.fake_log),
            None => {
                assert_eq!(file, "supervisor.yaml");
                setup.supervisor_yaml(self.dir())
            }
        }
    }

    /// Writes `setup`'s supervisor.yaml over this daemon's and waits until the daemon has it
    /// in force (it logs `configuration reloaded` once the new one is published).
    pub async fn reconfigure(&self, setup: &Setup) {
        const RELOADED: &str = "configuration reloaded";
        let before = self.log().matches(RELOADED).count();
        let file = "supervisor.yaml";
        replace_file(&self.dir().join(file), &self.config_text(setup, file));
        let t = Instant::now();
        while self.log().matches(RELOADED).count() == before {
            assert!(t.elapsed() < PATIENCE, "never reloaded:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// What the daemon has logged so far. Its lines reach the test a moment after the daemon
    /// acts (its log writer, then a pipe): to assert on a line, wait for it with
    /// [`Daemon::log_with`].
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The daemon's log once it has every one of `needles` (for PATIENCE at most).
    pub async fn log_with(&self, needles: &[&str]) -> String {
        self.log_until(|log| {
            let missing: Vec<&&str> = needles.iter().filter(|n| !log.contains(**n)).collect();
            (!missing.is_empty()).then(|| format!("{missing:?}"))
        })
        .await
    }

    /// The daemon's log once `needle` is in it `n` times or more (for PATIENCE at most).
    pub async fn log_with_count(&self, needle: &str, n: usize) -> String {
        self.log_until(|log| {
            (log.matches(needle).count() < n).then(|| format!("{needle:?} {n} times"))
        })
        .await
    }

    /// The daemon's log once `lacks` finds nothing lacking in it (for PATIENCE at most; then
    /// what it says is lacking is the failure).
    async fn log_until(&self, lacks: impl Fn(&str) -> Option<String>) -> String {
        let t = Instant::now();
        loop {
            let log = self.log();
            let Some(lacking) = lacks(&log) else {
                return log;
            };
            assert!(
                t.elapsed() < PATIENCE,
                "dsv4d never logged {lacking}:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What the fake engine wrote to its event log (all generations).
    pub fn fake_log(&self) -> String {
        std::fs::read_to_string(&self.fake_log).unwrap_or_default()
    }

    /// The fake engine's start lines (`start pid=... argv=...`), one per engine process.
    pub fn starts(&self) -> Vec<String> {
        self.fake_log()
            .lines()
            .filter(|l| l.starts_with("start pid="))
            .map(String::from)
            .collect()
    }

    /// How many engine processes were started.
    pub fn spawns(&self) -> usize {
        self.starts().len()
    }

    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let req = hyper::Request::get(self.url(path))
            .body(Full::default())
            .unwrap();
        let resp = self.client.request(req).await.expect("GET");
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
        )
    }

    pub async fn status(&self) -> serde_json::Value {
        self.get("/status").await.1
    }

    /// Sends a POST and returns the response head with its body still streaming.
    pub async fn post(&self, path: &str, body: serde_json::Value) -> hyper::Response<Incoming> {
        let req = hyper::Request::post(self.url(path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        self.client.request(req).await.expect("POST")
    }

    /// Sends `method path` with `headers` (and a JSON body when given); returns status,
    /// headers and the body as JSON (or as a JSON string when it is not JSON).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<serde_json::Value>,
    ) -> (u16, hyper::HeaderMap, serde_json::Value) {
        let req = hyper::Request::builder().method(method).uri(self.url(path));
        let resp = self
            .client
            .request(with_json(req, headers, body))
            .await
            .expect("request");
        body_json(resp).await
    }

    /// Waits until `/status` says `state`.
    pub async fn wait_state(&self, state: State, within: Duration) {
        let t = Instant::now();
        loop {
            let s = self.status().await;
            if s["state"] == state.as_str() {
                return;
            }
            assert!(
                t.elapsed() < within,
                "state {state} not reached in {within:?}; status {s}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the fake engine's log has a line containing `needle`.
    pub async fn wait_fake_log(&self, needle: &str, within: Duration) {
        self.wait_fake_log_count(needle, 1, within).await;
    }

    /// Waits until the fake engine's log has `needle` at least `count` times; returns how many.
    pub async fn wait_fake_log_count(&self, needle: &str, count: usize, within: Duration) -> usize {
        let t = Instant::now();
        loop {
            let seen = self.fake_log().matches(needle).count();
            if seen >= count {
                return seen;
            }
            assert!(
                t.elapsed() < within,
                "fake engine logged {needle:?} {seen} times, not {count}, in {within:?}:\n{}",
                self.fake_log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }

    /// SIGTERM, wait for the exit, and hand back the folder with its config and state.
    pub async fn stop(mut self) -> TempDir {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let st = self.wait_exit(Duration::from_secs(15)).await;
        assert_eq!(st.code(), Some(0), "{}", self.log());
        self.dir.take().expect("the daemon's folder")
    }

    /// Kills the daemon (SIGKILL, as a crash) and hands back its folder, as it left it.
    pub async fn kill_and_keep_dir(mut self) -> TempDir {
        self.signal(nix::sys::signal::Signal::SIGKILL);
        self.wait_exit(Duration::from_secs(5)).await;
        self.dir.take().expect("the daemon's folder")
    }

    /// Waits for the daemon to exit, at most `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                t.elapsed() < within,
                "dsv4d did not exit within {within:?}\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Its engine goes with it (PR_SET_PDEATHSIG).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One streamed response, read event by event.
pub struct Stream {
    pub body: Incoming,
    buf: String,
}

impl Stream {
    pub fn new(body: Incoming) -> Stream {
        Stream {
            body,
            buf: String::new(),
        }
    }

    /// The next SSE event's text (without the trailing blank line), or None at the end.
    pub async fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let ev = self.buf[..i].to_string();
                self.buf.drain(..i + 2);
                return Some(ev);
            }
            match self.body.frame().await {
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.push_str(&String::from_utf8_lossy(&d));
                    }
                }
                Some(Err(e)) => panic!("stream broke: {e}"),
                None => return None,
            }
        }
    }

    /// Reads to the end; returns the concatenated `delta.content` and whether `[DONE]` came.
    pub async fn collect_chat(&mut self) -> (String, bool, usize) {
        let mut content = String::new();
        let mut done = false;
        let mut events = 0;
        while let Some(ev) = self.next_event().await {
            events += 1;
            let Some(data) = ev.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data).expect("chunk JSON");
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                content.push_str(c);
            }
        }
        (content, done, events)
    }
}

/// One client connection of its own (no pool), with TCP_NODELAY, driven by a task.
pub async fn one_connection(
    addr: SocketAddr,
) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.set_nodelay(true).unwrap();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    sender
}

/// A chat request (2 tokens) on a blocking connection of its own that asks to be closed
/// after the answer, as a short-lived client sends it; the answer's status code.
pub fn chat_on_fresh_connection(addr: SocketAddr) -> Result<u16, String> {
    use std::io::{Read, Write};
    let body = chat(2, false).to_string();
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    answer
        .get(9..12)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("no answer: {answer:?}"))
}

pub fn chat(max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

pub async fn body_json(
    resp: hyper::Response<Incoming>,
) -> (u16, hyper::HeaderMap, serde_json::Value) {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(&body).into()));
    (status, headers, v)
}

/// A process's argv, from `/proc/PID/cmdline` (which every local user can read).
pub fn argv_of(pid: i64) -> Vec<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// The value after the last `flag` in `argv` (engines take the last one).
pub fn flag_value<'a>(argv: &'a [String], flag: &str) -> Option<&'a str> {
    let i = argv.iter().rposition(|a| a == flag)?;
    argv.get(i + 1).map(String::as_str)
}

/// The running engine as another local user could find it (`/status` for its pid, then its
/// argv), with the secret dsv4d gave it read from its key file.
#[derive(Debug, Clone)]
pub struct EngineSeen {
    pub pid: i64,
    pub argv: Vec<String>,
    pub addr: SocketAddr,
    /// `--api-key-file`, when the engine was given one.
    pub key_file: Option<PathBuf>,
    /// The file's one line.
    pub secret: Option<String>,
}

impl EngineSeen {
    /// The engine of `d` (whose `/status` needs no key).
    pub async fn of(d: &Daemon) -> EngineSeen {
        let status = d.status().await;
        let pid = status["engine_pid"]
            .as_i64()
            .unwrap_or_else(|| panic!("no engine runs: {status}"));
        EngineSeen::of_pid(pid)
    }

    /// The engine process `pid`.
    pub fn of_pid(pid: i64) -> EngineSeen {
        let argv = argv_of(pid);
        let port: u16 = flag_value(&argv, "--port")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no --port N in engine {pid}'s argv: {argv:?}"));
        let key_file = flag_value(&argv, "--api-key-file").map(PathBuf::from);
        let secret = key_file.as_ref().map(|f| {
            let text = std::fs::read_to_string(f)
                .unwrap_or_else(|e| panic!("the engine's key file {}: {e}", f.display()));
            text.strip_suffix('\n')
                .unwrap_or_else(|| panic!("{text:?} is not one line"))
                .to_string()
        });
        EngineSeen {
            pid,
            argv,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            key_file,
            secret,
        }
    }

    /// `Authorization: Bearer <secret>`.
    pub fn bearer(&self) -> String {
        format!(
            "Bearer {}",
            self.secret.as_deref().expect("the engine's secret")
        )
    }

    /// `method path` straight to the engine's port, on a connection of its own, with
    /// `headers` (and a JSON body when given).
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<serde_json::Value>,
    ) -> (u16, hyper::HeaderMap, serde_json::Value) {
        let mut conn = one_connection(self.addr).await;
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", self.addr.to_string());
        let resp = conn
            .send_request(with_json(req, headers, body))
            .await
            .expect("a response from the engine");
        body_json(resp).await
    }
}

/// `req` with `headers`, and `body` as JSON when given.
fn with_json(
    mut req: hyper::http::request::Builder,
    headers: &[(&str, &str)],
    body: Option<serde_json::Value>,
) -> hyper::Request<Full<Bytes>> {
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let body = match body {
        Some(v) => {
            req = req.header("content-type", "application/json");
            Full::new(Bytes::from(v.to_string()))
        }
        None => Full::default(),
    };
    req.body(body).unwrap()
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: i64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// A proxy of the daemon `d` serves on `bus`, once it is there, that reads properties from
/// the daemon itself (not from a cache that follows PropertiesChanged).
pub async fn live_proxy(bus: &PrivateBus, d: &Daemon) -> dsv4_client::Supervisor1Proxy<'static> {
    let conn = zbus::connection::Builder::address(bus.address.as_str())
        .unwrap()
        .build()
        .await
        .unwrap();
    let t = Instant::now();
    loop {
        let p = dsv4_client::Supervisor1Proxy::builder(&conn)
            .cache_properties(zbus::proxy::CacheProperties::No)
            .build()
            .await;
        if let Ok(p) = p {
            if p.state().await.is_ok() {
                return p;
            }
        }
        assert!(t.elapsed() < PATIENCE, "no daemon on the bus\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The doctor's check `id` of `profile`, as `dsv4d --doctor --part service` gives it with the
/// configuration of `d`.
pub fn doctor_check(d: &Daemon, id: &str, profile: &str) -> serde_json::Value {
    let out = std::process::Command::new(DSV4D)
        .args(["--doctor", "--part", "service", "--config"])
        .arg(d.dir().join("supervisor.yaml"))
        .env("DSV4_LOG", "off")
        .stdin(std::process::Stdio::null())
        .output_within(PATIENCE);
    let checks: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no checks ({e}): {}", String::from_utf8_lossy(&out.stderr)));
    checks
        .iter()
        .find(|c| c["id"] == id && c["profile"] == profile)
        .cloned()
        .unwrap_or_else(|| panic!("no {id} check of {profile}: {checks:?}"))
}

/// The `identity` part of `d`'s status, once the engine's identity is read (it is read once
/// the engine serves, beside the answer).
pub async fn shown_identity(d: &Daemon) -> serde_json::Value {
    let t = Instant::now();
    loop {
        let s = d.status().await;
        if !s["identity"].is_null() {
            return s["identity"].clone();
        }
        assert!(
            t.elapsed() < PATIENCE,
            "no identity in the status: {s}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What an `Alert` signal said.
pub struct Alerted {
    pub kind: dsv4_client::AlertKind,
    pub message: String,
}

/// The next `Alert` of `alerts`, within [`PATIENCE`]; none is a failure with `d`'s log.
pub async fn next_alert(alerts: &mut dsv4_client::AlertStream, d: &Daemon) -> Alerted {
    use futures_util::StreamExt;
    let alert = tokio::time::timeout(PATIENCE, alerts.next())
        .await
        .unwrap_or_else(|_| panic!("no Alert\n{}", d.log()))
        .expect("the Alert stream ended");
    let args = alert.args().expect("an Alert without its arguments");
    Alerted {
        kind: args.kind,
        message: args.message.to_string(),
    }
}

/// The `Alert` signals of the daemon `d` serves on `bus`, from once it is there.
pub async fn alert_stream(bus: &PrivateBus, d: &Daemon) -> dsv4_client::AlertStream {
    live_proxy(bus, d).await.receive_alert().await.unwrap()
}

/// Loads `url` in Debian's Chromium, headless, lets it run until it is done with the page
/// (5 s of the browser's virtual time at most), and returns the page as it then stands.
pub fn chromium(url: &str) -> String {
    let profile = temp_dir("chromium");
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--virtual-time-budget=5000",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(url)
        .output_within(HANG);
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// POSTs `body` as it is, byte for byte, to `url` with `headers` on a fresh client: the status
/// and the whole answer as text (an event stream read to its end).
pub async fn post_text(url: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let mut req = hyper::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Bytes of `path` in the page cache, as `fincore` (util-linux) says: not dsv4d's own figure.
pub fn fincore(path: &Path) -> u64 {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore (util-linux)");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}
