#!/usr/bin/env bash
# `kiln serve` flag checks (issue 29): a --context-length past the model's max_position_embeddings, and 0 for
# --context-length / --threads / --max-running-requests, are errors before the port is bound; --help offers no
# float16; --api-key-file (the newline trimmed; empty / unreadable files refused) with the Bearer scheme in any
# case; --log-format json lines with ISO-8601 UTC timestamps. On the echo dummy runner.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
make_model_dir "$SERVE_WORK/echo" echo
MODEL=(--model-path "$SERVE_WORK/echo" --dummy-runner echo)
MPE=$(python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c.get("text_config", c)["max_position_embeddings"])' \
  "$SERVE_WORK/echo/config.json")

# expect_refused NAME MESSAGE ARGS...: kiln serve ARGS exits non-zero, says MESSAGE, and never listened.
expect_refused() {
  local name=$1 message=$2
  shift 2
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  if timeout 60 "$KILN" --log-level info serve --port "$port" "$@" > "$SERVE_WORK/$name.log" 2>&1; then
    fail "$name: accepted"
    return
  fi
  grep -qF -- "$message" "$SERVE_WORK/$name.log" || fail "$name: no '$message' in: $(tail -3 "$SERVE_WORK/$name.log")"
  grep -q "listening on" "$SERVE_WORK/$name.log" && fail "$name: the port was bound before the flag was refused"
  return 0
}

expect_refused context_over "is more than the model's max_position_embeddings ($MPE); use at most $MPE" \
  "${MODEL[@]}" --context-length $((MPE + 1))
expect_refused context_zero "--context-length" "${MODEL[@]}" --context-length 0
expect_refused threads_zero "--threads" "${MODEL[@]}" --threads 0
expect_refused running_zero "--max-running-requests" "${MODEL[@]}" --max-running-requests 0
expect_refused dtype_f16 "--dtype" "${MODEL[@]}" --dtype float16
expect_refused dtype_cpu_bf16 "the CPU backend always runs fp32" --model-path "$SERVE_WORK/echo" --device cpu \
  --dtype bfloat16
"$KILN" serve --help > "$SERVE_WORK/help" 2>&1
# Only --dtype's own entry (--mamba-ssm-dtype's text says "half the state bytes").
grep -A 1 -E -- "^ +--dtype " "$SERVE_WORK/help" | grep -qwE "float16|half" && fail "serve --help still offers float16 for --dtype"
grep -qE -- "^ +--dtype " "$SERVE_WORK/help" || fail "serve --help has no --dtype entry"

# --api-key-file.
: > "$SERVE_WORK/empty_key"
expect_refused key_empty "is empty" "${MODEL[@]}" --api-key-file "$SERVE_WORK/empty_key"
expect_refused key_missing "cannot read --api-key-file" "${MODEL[@]}" --api-key-file "$SERVE_WORK/no_such_file"
KEY="file-key-$RANDOM$RANDOM"
printf '%s\n' "$KEY" > "$SERVE_WORK/key"
start_server keyfile "${MODEL[@]}" --api-key-file "$SERVE_WORK/key" --log-format json
code() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
[ "$(code "$URL_keyfile/v1/models")" = 401 ] || fail "api-key-file: no key was not 401"
[ "$(code -H "Authorization: bearer $KEY" "$URL_keyfile/v1/models")" = 200 ] || fail "api-key-file: lower-case bearer refused"
[ "$(code -H "Authorization: Bearer $KEY" "$URL_keyfile/v1/models")" = 200 ] || fail "api-key-file: Bearer refused"
stop_server keyfile TERM
grep -q "$KEY" "$LOG_keyfile" && fail "the API key appears in the server log"
# --log-format json: every log line is one object with an ISO-8601 UTC time.
python3 - "$LOG_keyfile" << 'PY' || fail "--log-format json: $(grep -m3 '^{' "$LOG_keyfile")"
import json, re, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
assert len(lines) >= 2, "no JSON log lines"
for l in lines:
    j = json.loads(l)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", j["time"]), j
    assert j["level"] in ("trace", "debug", "info", "warn", "error"), j
    assert isinstance(j["message"], str), j
assert any("request rejected" in json.loads(l)["message"] for l in lines), "no rejected-request line"
PY

if [ "$failures" != 0 ]; then
  echo "FAIL: serve_flags ($failures)"
  exit 1
fi
echo "PASS: serve_flags"
