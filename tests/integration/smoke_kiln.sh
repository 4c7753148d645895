#!/usr/bin/env bash
# The real thing: `kiln serve` (the embedded kiln-tiny model) checked by `kiln smoke` and measured by
# `kiln bench`. Strict: every smoke check must pass.
# Usage: smoke_kiln.sh KILN_BINARY [REPO_ROOT]
# Environment: KILN_SMOKE_TESTS (comma list for kiln smoke --tests; default: all checks),
#              KILN_SERVE_ARGS (extra arguments for kiln serve), KILN_SERVE_WAIT_S (default 600).
set -euo pipefail
KILN=${1:?usage: smoke_kiln.sh KILN_BINARY [REPO_ROOT]}
WAIT_S=${KILN_SERVE_WAIT_S:-600}
WORK=$(mktemp -d)
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
# shellcheck disable=SC2086
"$KILN" serve --port "$PORT" ${KILN_SERVE_ARGS:-} > "$WORK/serve.log" 2>&1 &
SERVER_PID=$!
echo "started: kiln serve --port $PORT (pid $SERVER_PID)"

healthy=0
for _ in $(seq $((WAIT_S * 5))); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    wait "$SERVER_PID" 2>/dev/null && rc=0 || rc=$?
    SERVER_PID=""
    echo "FAIL: kiln serve exited (status $rc) before becoming healthy:"
    tail -30 "$WORK/serve.log"
    exit 1
  fi
  if python3 - "$URL/health" <<'PY' 2>/dev/null; then
import sys, urllib.request
sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=2).status == 200 else 1)
PY
    healthy=1
    break
  fi
  sleep 0.2
done
if [ "$healthy" != 1 ]; then
  echo "FAIL: kiln serve did not answer GET /health with 200 within $WAIT_S s:"
  tail -30 "$WORK/serve.log"
  exit 1
fi
echo "healthy: $URL"

failures=0
SMOKE_ARGS=(--url "$URL" --json "$WORK/smoke.json")
if [ -n "${KILN_SMOKE_TESTS:-}" ]; then SMOKE_ARGS+=(--tests "$KILN_SMOKE_TESTS"); fi
if "$KILN" smoke "${SMOKE_ARGS[@]}"; then
  echo "ok: kiln smoke"
else
  echo "FAIL: kiln smoke (see the table above)"
  failures=$((failures + 1))
fi

if "$KILN" bench --url "$URL" --input-len 64 --output-len 32 --num-prompts 8 --max-concurrency 1,4 --no-progress \
     --json "$WORK/bench.json"; then
  if python3 - "$WORK/bench.json" <<'PY'; then
import json, sys
r = json.load(open(sys.argv[1]))
errors = []
for l in r["levels"]:
    tag = f"c={l['max_concurrency']}:"
    if l["completed"] != 8 or l["failed"] != 0: errors.append(f"{tag} completed {l['completed']} failed {l['failed']}")
    if l["total_output_tokens"] != 8 * 32: errors.append(f"{tag} {l['total_output_tokens']} output tokens, expected 256 (ignore_eos)")
    if not l["ttft_ms"]["median"] > 0: errors.append(f"{tag} TTFT median {l['ttft_ms']['median']}")
    if not l["output_throughput"] > 0: errors.append(f"{tag} output tok/s {l['output_throughput']}")
if errors:
    print("\n".join("  " + e for e in errors)); sys.exit(1)
PY
    echo "ok: kiln bench"
  else
    echo "FAIL: kiln bench numbers"
    failures=$((failures + 1))
  fi
else
  echo "FAIL: kiln bench"
  failures=$((failures + 1))
fi

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "FAIL: kiln serve died during the tests:"
  tail -30 "$WORK/serve.log"
  failures=$((failures + 1))
fi
if [ "$failures" != 0 ]; then
  echo "--- kiln serve log (tail) ---"
  tail -40 "$WORK/serve.log"
  exit 1
fi
echo "PASS: smoke_kiln"
