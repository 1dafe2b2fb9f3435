//! The real engine: llama-server built by `tests/engine/prepare` and the tiny generated model,
//! whose output is known (letters run a, b, c, ..., digits count up to 9, then stop).
//!
//! They come from `DSV4_LLAMA_SERVER` and `DSV4_TINY_MODEL`, or else from the cache that
//! `tests/engine/prepare` fills. Tests that need them fail, with that hint, when neither has
//! them: they never pass by skipping.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{temp_dir, Setup, TempDir};

/// `${DSV4_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4}/SUB`, as the prepare scripts have it.
pub fn cache_dir_of(sub: &str) -> PathBuf {
    if let Some(d) = std::env::var_os("DSV4_CACHE") {
        return PathBuf::from(d).join(sub);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("dsv4").join(sub)
}

/// Where `tests/engine/prepare` keeps the engine and the model.
pub fn cache_dir() -> PathBuf {
    cache_dir_of("engine")
}

/// The real engine and the tiny model.
pub fn engine() -> (PathBuf, PathBuf) {
    let server = std::env::var_os("DSV4_LLAMA_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/llama-server"));
    let model = std::env::var_os("DSV4_TINY_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("models/tiny.gguf"));
    assert!(
        server.is_file() && model.is_file(),
        "no real llama-server at {} or no tiny model at {}: run tests/engine/prepare first \
         (or set DSV4_LLAMA_SERVER and DSV4_TINY_MODEL)",
        server.display(),
        model.display()
    );
    (server, model)
}

/// llama.cpp's rpc-server, built beside the engine (`DSV4_RPC_SERVER`, or the cache).
pub fn rpc_server() -> PathBuf {
    let server = std::env::var_os("DSV4_RPC_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join("bin/rpc-server"));
    assert!(
        server.is_file(),
        "no rpc-server at {}: run tests/engine/prepare first (or set DSV4_RPC_SERVER)",
        server.display()
    );
    server
}

/// The tiny model with a context of `ctx` tokens, made once into the engine's cache (by the
/// generator `tests/engine/prepare` runs, with the venv it made).
pub fn tiny_with_context(ctx: u32) -> PathBuf {
    let out = cache_dir().join(format!("models/tiny-ctx{ctx}.gguf"));
    if !out.is_file() {
        generate_tiny(&out, &["--ctx", &ctx.to_string()]);
    }
    out
}

/// The tiny model with the weights of `seed`, the same shape (and the same GGUF header), at
/// `out`: another model file of the same name, as a user's download of a new quantization.
pub fn tiny_with_seed(out: &Path, seed: u32) {
    generate_tiny(out, &["--seed", &seed.to_string()]);
}

/// Runs the tiny model's generator with `args` into `out`, written beside and renamed: a run
/// cut short leaves no half model.
fn generate_tiny(out: &Path, args: &[&str]) {
    let tmp = out.with_extension(format!("tmp.{}", std::process::id()));
    let generator = Path::new(env!("CARGO_MANIFEST_DIR")).join("engine/make_tiny_gguf.py");
    let o = Command::new(cache_dir().join("venv/bin/python"))
        .arg(&generator)
        .arg(&tmp)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", generator.display()));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::rename(&tmp, out).unwrap();
}

/// Arguments every test engine gets: no web page, and one thread. The tests run many engines
/// at once on a small machine, and llama.cpp's threads wait for each other by spinning, which
/// makes an engine with more threads than free cores many times slower.
const TEST_ARGS: [&str; 5] = ["--no-webui", "--threads", "1", "--threads-batch", "1"];

/// `args` as YAML strings.
fn quoted(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| format!("{a:?}")).collect()
}

/// A profile of the real engine on `model` with one slot of `context` tokens, with the
/// YAML lines `more` (each ending in a newline).
pub fn profile(model: &Path, context: u32, more: &str) -> String {
    let (server, _) = engine();
    format!(
        "engine: llama-server\ncommand: {}\nmodel: {}\ncontext: {context}\nparallel: 1\n\
         {more}extra_args: [{}]\n",
        server.display(),
        model.display(),
        quoted(&TEST_ARGS).join(", ")
    )
}

/// A daemon setup whose only profile, `tiny`, runs the real engine on the tiny model; an idle
/// engine stops after 1 s.
pub fn setup() -> Setup {
    setup_with_args(&[])
}

/// `setup()`, with more llama-server arguments in the profile's `extra_args`.
pub fn setup_with_args(extra_args: &[&str]) -> Setup {
    let (server, model) = engine();
    let extra_args = quoted(&[&TEST_ARGS[..], extra_args].concat());
    let mut s = Setup::default()
        .engine("idle_timeout", "1s")
        .engine("stop_timeout", "5s");
    s.custom_profiles.insert(
        "tiny".into(),
        format!(
            "description: tiny test model\nengine: llama-server\ncommand: {}\nmodel: {}\n\
             context: 1024\nparallel: 1\nextra_args: [{}]\n",
            server.display(),
            model.display(),
            extra_args.join(", ")
        ),
    );
    s.default_profile = "tiny".into();
    s
}

/// The real llama-server on the tiny model with no dsv4d in front: to check that a test's
/// clients and expectations hold against the engine itself. Killed on drop.
pub struct LlamaServer {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    log: PathBuf,
    _dir: TempDir,
}

impl LlamaServer {
    /// Starts it as `tests/engine/prepare`'s smoke test does (port 0: the kernel picks one,
    /// which the server prints once the model is loaded); waits up to 30 s for that.
    pub fn start() -> LlamaServer {
        LlamaServer::start_with_args(&[])
    }

    /// `start()`, with more llama-server arguments.
    pub fn start_with_args(extra_args: &[&str]) -> LlamaServer {
        let (_, model) = engine();
        LlamaServer::start_with(&model, 1024, extra_args)
    }

    /// `start()` on `model` with a slot of `context` tokens.
    pub fn start_on(model: &Path, context: u32) -> LlamaServer {
        LlamaServer::start_with(model, context, &[])
    }

    fn start_with(model: &Path, context: u32, extra_args: &[&str]) -> LlamaServer {
        let (server, _) = engine();
        let dir = temp_dir("llama-server");
        let log = dir.path().join("llama-server.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(&server)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["-c", &context.to_string(), "-np", "1"])
            .args(TEST_ARGS)
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
        let mut s = LlamaServer {
            child,
            url: String::new(),
            log,
            _dir: dir,
        };
        let t = Instant::now();
        loop {
            let text = s.log();
            if let Some(i) = text.find("listening on http://") {
                let rest = &text[i + "listening on ".len()..];
                s.url = rest.split_whitespace().next().unwrap_or_default().into();
                return s;
            }
            if let Some(st) = s.child.try_wait().unwrap() {
                panic!("llama-server exited while starting ({st}):\n{text}");
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "llama-server did not listen within 30 s:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// What it has written so far.
    pub fn log(&self) -> String {
        let bytes = std::fs::read(&self.log).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The real ds4-server (antirez's DwarfStar 4 on its CPU path) and its tiny generated model,
/// which answers every chat "Hi!" (reasoning "ok"): from `DSV4_DS4_SERVER` and
/// `DSV4_DS4_MODEL`, else from the cache that `../shared/rigs/ds4/build.sh` fills (`.ci/run`
/// runs it when that rig is there). `None` when neither names one: the real-ds4 tier is then
/// skipped, and `test` says so and why. Named but missing files fail the test.
pub fn ds4_engine(test: &str) -> Option<(PathBuf, PathBuf)> {
    let named = |var: &str| std::env::var_os(var).map(PathBuf::from);
    let (server, model) = match (named("DSV4_DS4_SERVER"), named("DSV4_DS4_MODEL")) {
        (Some(s), Some(m)) => (s, m),
        _ => {
            let dir = cache_dir_of("ds4");
            (dir.join("ds4-server"), dir.join("tiny.gguf"))
        }
    };
    if std::env::var_os("DSV4_DS4_SERVER").is_some() {
        assert!(
            server.is_file() && model.is_file(),
            "DSV4_DS4_SERVER/DSV4_DS4_MODEL name {} and {}, which are not both files",
            server.display(),
            model.display()
        );
    }
    if server.is_file() && model.is_file() {
        return Some((server, model));
    }
    eprintln!(
        "SKIPPED {test} (real-ds4 tier): no ds4-server at {} or no model at {}; set \
         DSV4_DS4_SERVER and DSV4_DS4_MODEL, or run ../shared/rigs/ds4/build.sh (which .ci/run \
         does when that folder exists)",
        server.display(),
        model.display()
    );
    None
}

/// The environment a ds4-server needs here: the tiny model's shape allowed, and a lock file
/// of its own in `dir` (it takes a machine-wide one at /tmp/ds4.lock otherwise).
pub fn ds4_env(dir: &Path) -> Vec<(String, String)> {
    vec![
        ("DS4_ALLOW_TEST_SHAPE".into(), "1".into()),
        (
            "DS4_LOCK_FILE".into(),
            dir.join("ds4.lock").display().to_string(),
        ),
    ]
}

/// A daemon setup, to be started in `dir`, whose only profile, `ds4`, runs the real
/// ds4-server on its tiny model (context 4096) with its checkpoints in `profiles/kv` from 16
/// tokens on; its engine stops after `idle` idle.
pub fn ds4_setup(server: &Path, model: &Path, dir: &Path, idle: &str) -> Setup {
    let env: String = ds4_env(dir)
        .iter()
        .map(|(k, v)| format!("  {k}: {v:?}\n"))
        .collect();
    let mut s = Setup::default()
        .engine("idle_timeout", idle)
        .engine("stop_timeout", "30s");
    s.custom_profiles.insert(
        "ds4".into(),
        format!(
            "description: tiny ds4 model\nengine: ds4\ncommand: {}\nmodel: {}\ncontext: 4096\n\
             kv_disk_dir: kv\nextra_args: [--kv-cache-min-tokens, \"16\"]\nenv:\n{env}",
            server.display(),
            model.display(),
        ),
    );
    s.default_profile = "ds4".into();
    s
}
