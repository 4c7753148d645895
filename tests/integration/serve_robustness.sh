#!/usr/bin/env bash
# Broken and hostile clients against `kiln serve` (tests/js/serve_robustness.test.mjs): malformed
# requests, random bytes, truncated bodies, oversized bodies, slow clients, mid-stream disconnects.
# Afterwards the same request must give the same answer and /metrics must show no capacity held.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
pick_real_model
start_server rob "${REAL_MODEL_ARGS[@]}" --max-running-requests 8
if ! run_node serve_robustness.test.mjs KILN_URL="$URL_rob" KILN_MODEL_KIND="$REAL_MODEL_KIND"; then
  tail -20 "$LOG_rob"
  echo "FAIL: serve_robustness"
  exit 1
fi
kill -0 "$PID_rob" || { echo "FAIL: kiln serve died"; exit 1; }
stop_server rob TERM
[ "$RC_rob" = 0 ] || { echo "FAIL: exit status $RC_rob on SIGTERM"; exit 1; }
echo "PASS: serve_robustness"
