//! llama.cpp's `llama-server`.
//!
//! It binds its port at once and answers `GET /health` with 503 while it loads and 200 when
//! ready. It reads its keys from the file `--api-key-file` names (a key on the command line
//! would show in `/proc/PID/cmdline`, which everyone can read) and then answers 401 to any
//! request without one, except `GET /health`. It can deadlock in its SIGTERM handler with a
//! request in flight; SIGINT still ends it. Its slots are saved and restored by dsv4d
//! through its slot API (`--slot-save-path`).

use std::ffi::OsString;
use std::time::Duration;

use super::{Kind, KvKeeping, ValidationApi};
use nix::sys::signal::Signal;

use crate::adapter::{EngineParams, KeyPassing, Readiness, Stop};

pub const KIND: Kind = Kind {
    name: "llama-server",
    aliases: &[],
    program: "llama-server",
    readiness: |_| Readiness::Get("/health".into()),
    stop: |_| Stop {
        signal: Signal::SIGTERM,
        interrupt_grace: Some(Duration::from_secs(10)),
        grace: None,
    },
    key: |_| KeyPassing::File("--api-key-file"),
    key_protection: |_| "per-generation secret",
    requires_model: true,
    requires: &[],
    reads: &[
        "model",
        "mmproj",
        "context",
        "parallel",
        "batch",
        "ubatch",
        "kv_cache",
        "flash_attn",
        "gpu_layers",
        "kv_checkpoint",
    ],
    ignores: &["prefill_chunk", "kv_disk_dir", "kv_disk_space"],
    kv: KvKeeping::Slots,
    validation: ValidationApi::Native,
    settings_argv,
    address_flags: true,
};

/// `-m -c -np -ctk/-ctv -fa -ngl -b -ub --mmproj --slot-save-path`.
fn settings_argv(p: &EngineParams, _host: &str, _port: u16) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    if let Some(m) = &p.model {
        a.push("-m".into());
        a.push(m.clone().into_os_string());
    }
    let mut push = |s: &str| a.push(OsString::from(s));
    if let Some(c) = p.context {
        push("-c");
        push(&c.to_string());
    }
    if let Some(n) = p.parallel {
        push("-np");
        push(&n.to_string());
    }
    if let Some(kv) = &p.kv_cache {
        push("-ctk");
        push(kv);
        push("-ctv");
        push(kv);
    }
    if let Some(fa) = p.flash_attn {
        push("-fa");
        push(fa.as_str());
    }
    if let Some(ngl) = p.gpu_layers {
        push("-ngl");
        push(&ngl.to_string());
    }
    if let Some(b) = p.batch {
        push("-b");
        push(&b.to_string());
    }
    if let Some(ub) = p.ubatch {
        push("-ub");
        push(&ub.to_string());
    }
    if let Some(mm) = &p.mmproj {
        a.push(OsString::from("--mmproj"));
        a.push(mm.clone().into_os_string());
    }
    if let Some(dir) = &p.slot_save_path {
        a.push(OsString::from("--slot-save-path"));
        a.push(dir.clone().into_os_string());
    }
    a
}
