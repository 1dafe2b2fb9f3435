#!/usr/bin/env bash
# Runs dsv4d on 127.0.0.1:8080 (DSV4_DEMO_PORT to change), socket-activated the way systemd
# does it, in front of a real llama-server with a tiny generated model, and prints requests
# to try. The engine starts on the first request and stops after 2 minutes without one.
# Ctrl-C drains and stops everything.
#
# The first run builds llama-server from source (about 5 minutes on 2 cores) and caches it
# with the model in ${DSV4_CACHE:-~/.cache/dsv4}/engine; later runs start in seconds.
# Config and state live in ${DSV4_CACHE:-~/.cache/dsv4}/demo.
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${DSV4_DEMO_PORT:-8080}
CACHE=${DSV4_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4}
DEMO=$CACHE/demo

command -v cargo >/dev/null || { echo "run.sh: cargo not found: install Rust (https://rustup.rs)" >&2; exit 2; }
ENGINE=$(tests/engine/prepare "$CACHE/engine")
LLAMA_SERVER=$(sed -n 's/^llama-server=//p' <<<"$ENGINE")
MODEL=$(sed -n 's/^model=//p' <<<"$ENGINE")
cargo build --release --locked --bin dsv4d
BIN=$(pwd)/target/release

# The demo owns this folder: profiles left from an earlier run must not linger.
rm -rf "$DEMO/profiles"
mkdir -p "$DEMO/profiles" "$DEMO/state"
cat > "$DEMO/supervisor.yaml" <<YAML
# Written by tests/demo/run.sh; rewritten on every run.
api:
  listen: 127.0.0.1:$PORT
engine:
  start_timeout: 1m
  idle_timeout: 2m
  stop_timeout: 10s
profiles_dir: profiles
default_profile: tiny
state_dir: $DEMO/state
YAML
cat > "$DEMO/profiles/tiny.yaml" <<YAML
description: tiny generated test model on llama-server (answers a, b, c, ...)
engine: llama-server
command: $LLAMA_SERVER
model: $MODEL
context: 4096
parallel: 1
# The idle stop saves the KV cache here; the next start restores it (see dsv4ctl kv).
kv_checkpoint: { dir: $DEMO/kv }
extra_args: [--no-webui, --metrics]
YAML

cat <<MSG

dsv4d listens on http://127.0.0.1:$PORT; llama-server starts on the first request.
Try, in another terminal:
  curl -N http://127.0.0.1:$PORT/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":26,"stream":true}'
  curl http://127.0.0.1:$PORT/status
Ctrl-C stops it.

MSG
ARGS=(--config "$DEMO/supervisor.yaml" --bus none)
if command -v systemd-socket-activate >/dev/null; then
    # Like a .socket unit: the port is open now, dsv4d starts on the first connection.
    exec systemd-socket-activate -l "127.0.0.1:$PORT" --fdname=api "$BIN/dsv4d" "${ARGS[@]}"
fi
exec "$BIN/dsv4d" "${ARGS[@]}"
