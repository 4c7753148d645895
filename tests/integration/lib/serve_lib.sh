#!/usr/bin/env bash
# Shared helpers for tests/integration/serve_*.sh (sourced, not a test itself).
#
#   source "$ROOT/tests/integration/lib/serve_lib.sh"
#   serve_init "$KILN" "$ROOT"                  # work dir + cleanup trap; SKIPs without node / openai SDK
#   make_model_dir DIR echo|hash|fixture       # a model folder built from tests/fixtures
#   start_server NAME ARGS...                   # kiln serve on a free port; sets URL_<NAME>, PID_<NAME>
#   pick_real_model                             # REAL_MODEL_ARGS: the embedded kiln-tiny, else a fixture model
#   stop_server NAME [SIGNAL]                   # kill + wait; sets RC_<NAME> to the exit status
#   wait_server NAME                            # wait only
#   run_node FILE [ENV=VALUE...]                # node --test tests/js/FILE
set -euo pipefail

SERVE_WORK=""
SERVE_PIDS=()

serve_cleanup() {
  local pid
  for pid in "${SERVE_PIDS[@]:-}"; do
    [ -n "$pid" ] || continue
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  [ -n "$SERVE_WORK" ] && rm -rf "$SERVE_WORK"
}

serve_init() {
  KILN=$1
  ROOT=$2
  SERVE_WORK=$(mktemp -d)
  trap serve_cleanup EXIT
  "$KILN" --help > "$SERVE_WORK/help.txt" 2>&1 || true
  if ! grep -qE '^ +serve( |$)' "$SERVE_WORK/help.txt"; then
    echo "SKIP: 'kiln serve' is not a subcommand of this kiln binary"
    exit 0
  fi
  if ! command -v node > /dev/null; then
    echo "SKIP: node is not installed (scripts/setup.sh installs it)"
    exit 0
  fi
  if [ ! -d "$ROOT/tests/js/node_modules/openai" ]; then
    echo "SKIP: the openai npm package is missing: run scripts/setup.sh (npm install in tests/js)"
    exit 0
  fi
}

# make_model_dir DIR KIND: echo / hash: a config + the byte-level test tokenizer + the Qwen3.5 chat
# template (served with --dummy-runner KIND); fixture: the same with real tiny random weights
# (tests/fixtures/reference/qwen3_5_moe_bf16) for the CPU backend.
make_model_dir() {
  local dir=$1 kind=$2
  mkdir -p "$dir"
  cp "$ROOT/tests/fixtures/reference/qwen3_5_moe_bf16/model/config.json" "$dir/"
  cp "$ROOT/tests/fixtures/reference/byte_tokenizer/tokenizer.json" "$dir/"
  cp "$ROOT/tests/fixtures/reference/byte_tokenizer/tokenizer_config.json" "$dir/"
  cp "$ROOT/tests/fixtures/templates/Qwen3.5-4B.jinja" "$dir/chat_template.jinja"
  if [ "$kind" = fixture ]; then
    cp "$ROOT/tests/fixtures/reference/qwen3_5_moe_bf16/model/"*.safetensors "$dir/"
    cp "$ROOT/tests/fixtures/reference/qwen3_5_moe_bf16/model/generation_config.json" "$dir/"
  fi
}

# start_server NAME ARGS...: starts `kiln serve --port <free> ARGS`, waits for /health = 200.
# Returns 3 (after printing why) when the binary has no embedded model and no --model-path was given.
start_server() {
  local name=$1
  shift
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local log="$SERVE_WORK/$name.log"
  "$KILN" --log-level info serve --port "$port" "$@" > "$log" 2>&1 &
  local pid=$!
  SERVE_PIDS+=("$pid")
  printf -v "PID_$name" '%s' "$pid"
  printf -v "URL_$name" '%s' "http://127.0.0.1:$port"
  printf -v "LOG_$name" '%s' "$log"
  for _ in $(seq 1500); do
    if ! kill -0 "$pid" 2>/dev/null; then
      if grep -qi "no embedded model" "$log"; then return 3; fi
      echo "FAIL: kiln serve $* exited before becoming healthy:"
      tail -30 "$log"
      exit 1
    fi
    if curl -sf -o /dev/null "http://127.0.0.1:$port/health"; then
      echo "started: kiln serve $* on port $port"
      return 0
    fi
    sleep 0.2
  done
  echo "FAIL: kiln serve $* did not become healthy in 300 s"
  tail -30 "$log"
  exit 1
}

# stop_server NAME [SIGNAL]: signals the server, waits for it; RC_<NAME> = exit status.
stop_server() {
  local name=$1 sig=${2:-TERM}
  local pid_var="PID_$name"
  kill -s "$sig" "${!pid_var}" 2>/dev/null || true
  wait_server "$name"
}

# wait_server NAME: waits for the server to exit by itself; RC_<NAME> = exit status.
wait_server() {
  local pid_var="PID_$1"
  local rc=0
  wait "${!pid_var}" 2>/dev/null || rc=$?
  printf -v "RC_$1" '%s' "$rc"
}

# REAL_MODEL_ARGS / REAL_MODEL_KIND: the embedded kiln-tiny when this binary has one, else the tiny
# random-weight fixture model on the CPU backend (the same code path, meaningless text).
pick_real_model() {
  if start_server probe --max-running-requests 2; then
    stop_server probe
    REAL_MODEL_ARGS=()
    REAL_MODEL_KIND=embedded
  else
    echo "note: no embedded model in this binary; using the tiny fixture model (random weights, CPU backend)"
    make_model_dir "$SERVE_WORK/fixture" fixture
    REAL_MODEL_ARGS=(--model-path "$SERVE_WORK/fixture" --threads 2)
    REAL_MODEL_KIND=fixture
  fi
}

# run_node FILE [NAME=VALUE...]: runs one node:test file with the given environment.
run_node() {
  local file=$1
  shift
  (cd "$ROOT/tests/js" && env "$@" node --test --test-reporter=spec "$file")
}
