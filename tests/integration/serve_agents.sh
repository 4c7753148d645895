#!/usr/bin/env bash
# The Anthropic Messages and OpenAI Responses APIs of `kiln serve` through the official SDKs
# (tests/js/serve_agents.test.mjs): on the echo dummy runner (exact texts), then on the embedded kiln-tiny
# when this binary has one (structure, forced tool calls and json_schema answers valid against their schemas).
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
if [ ! -d "$ROOT/tests/js/node_modules/@anthropic-ai/sdk" ]; then
  echo "SKIP: the @anthropic-ai/sdk npm package is missing: run scripts/setup.sh (npm install in tests/js)"
  exit 0
fi
failures=0

make_model_dir "$SERVE_WORK/echo" echo
start_server echo --model-path "$SERVE_WORK/echo" --dummy-runner echo --served-model-name kiln-echo \
  --max-running-requests 8
run_node serve_agents.test.mjs KILN_URL="$URL_echo" KILN_MODEL_KIND=echo || failures=$((failures + 1))
stop_server echo TERM

if start_server tiny --max-running-requests 8; then
  run_node serve_agents.test.mjs KILN_URL="$URL_tiny" KILN_MODEL_KIND=embedded || failures=$((failures + 1))
  stop_server tiny TERM
else
  echo "note: this kiln binary has no embedded model; the kiln-tiny part is skipped"
fi

if [ "$failures" != 0 ]; then
  echo "--- kiln serve log (echo, tail) ---"
  tail -20 "$LOG_echo"
  echo "FAIL: serve_agents ($failures)"
  exit 1
fi
echo "PASS: serve_agents"
