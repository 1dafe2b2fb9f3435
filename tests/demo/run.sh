#!/usr/bin/env bash
# Runs dsv4d on 127.0.0.1:8080 (DSV4_DEMO_PORT to change), socket-activated the way systemd
# does it, with a demo profile, and prints a request to try. The engine starts on the first
# request and stops after 2 minutes without one. Ctrl-C drains and stops everything.
#
# The demo engine is the workspace's fake llama-server (tests/fake-engine): it loads for
# 2 s and streams tokens at 20 per second, so the on-demand start and the streaming can be
# seen. Config and state live in ${XDG_CACHE_HOME:-~/.cache}/dsv4/demo.
set -euo pipefail
cd "$(dirname "$0")/../.."
PORT=${DSV4_DEMO_PORT:-8080}
DEMO=${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/demo

command -v cargo >/dev/null || { echo "run.sh: cargo not found: install Rust (https://rustup.rs)" >&2; exit 2; }
cargo build --release --locked --bin dsv4d --bin fake-engine
BIN=$(pwd)/target/release

mkdir -p "$DEMO/profiles" "$DEMO/state"
cat > "$DEMO/supervisor.yaml" <<YAML
# Written by tests/demo/run.sh; edit freely, it is rewritten on the next run.
api:
  listen: 127.0.0.1:$PORT
engine:
  start_timeout: 1m
  idle_timeout: 2m
  stop_timeout: 10s
profiles_dir: profiles
default_profile: demo
state_dir: $DEMO/state
YAML
cat > "$DEMO/profiles/demo.yaml" <<YAML
description: demo profile (fake llama-server)
engine: llama-server
command: $BIN/fake-engine
model: /models/demo.gguf
context: 4096
parallel: 1
env:
  FAKE_ENGINE_LOAD_MS: "2000"
  FAKE_ENGINE_TOKEN_MS: "50"
YAML

cat <<MSG

dsv4d listens on http://127.0.0.1:$PORT; the engine starts on the first request.
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
