#!/usr/bin/env bash
# `kiln serve` under load, through the openai npm SDK (tests/js/serve_load.test.mjs,
# serve_overflow.test.mjs): 40 concurrent streams equal the same requests run alone (greedy),
# disconnects free KV capacity (checked on /metrics), a full queue answers 503 + Retry-After.
# Runs the embedded kiln-tiny when the binary has one, else a tiny random-weight fixture model on the
# CPU backend (the same engine and runner code).
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
failures=0
pick_real_model

start_server load "${REAL_MODEL_ARGS[@]}" --max-running-requests 8 --chunked-prefill-size 32
run_node serve_load.test.mjs KILN_URL="$URL_load" KILN_MODEL_KIND="$REAL_MODEL_KIND" || failures=$((failures + 1))
stop_server load TERM
[ "$RC_load" = 0 ] || { echo "FAIL: exit status $RC_load on SIGTERM"; failures=$((failures + 1)); }

start_server small "${REAL_MODEL_ARGS[@]}" --max-running-requests 1 --max-queued-requests 2
run_node serve_overflow.test.mjs KILN_URL="$URL_small" KILN_MODEL_KIND="$REAL_MODEL_KIND" || failures=$((failures + 1))
stop_server small TERM

if [ "$failures" != 0 ]; then
  tail -20 "$LOG_load"
  echo "FAIL: serve_load ($failures)"
  exit 1
fi
echo "PASS: serve_load"
