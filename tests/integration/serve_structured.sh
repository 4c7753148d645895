#!/usr/bin/env bash
# Constrained decoding (response_format json_object / json_schema, tool_choice required / named) on a real
# model: tests/js/serve_structured.test.mjs validates the sampled outputs with ajv.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
pick_real_model
start_server real --device cpu --max-running-requests 8 "${REAL_MODEL_ARGS[@]}"
rc=0
run_node serve_structured.test.mjs KILN_URL="$URL_real" KILN_MODEL_KIND="$REAL_MODEL_KIND" || rc=1
stop_server real TERM
if [ "$rc" != 0 ]; then
  tail -20 "$LOG_real"
  echo "FAIL: serve_structured"
  exit 1
fi
echo "PASS: serve_structured"
