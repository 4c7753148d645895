#!/usr/bin/env bash
# The OpenAI API of `kiln serve` through the official openai npm SDK (tests/js/serve_api.test.mjs):
#  1. against the echo dummy runner (byte-level test tokenizer, Qwen3.5 chat template): the "model"
#     repeats the user's message, so reasoning, tool calls, stop strings, usage and logprobs are
#     checked exactly;
#  2. against the embedded kiln-tiny model, when this binary has one (real reasoning in both modes).
# Also checks that SIGTERM stops an idle server with status 0.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
failures=0

make_model_dir "$SERVE_WORK/echo" echo
start_server echo --model-path "$SERVE_WORK/echo" --dummy-runner echo --served-model-name kiln-echo \
  --max-running-requests 8
run_node serve_api.test.mjs KILN_URL="$URL_echo" KILN_MODEL_KIND=echo || failures=$((failures + 1))
stop_server echo TERM
if [ "$RC_echo" != 0 ]; then echo "FAIL: kiln serve exited with $RC_echo on SIGTERM"; failures=$((failures + 1)); fi
grep -q "request id=" "$LOG_echo" || { echo "FAIL: no request log lines"; failures=$((failures + 1)); }

if start_server tiny --max-running-requests 8; then
  run_node serve_api.test.mjs KILN_URL="$URL_tiny" KILN_MODEL_KIND=embedded || failures=$((failures + 1))
  stop_server tiny TERM
else
  echo "note: this kiln binary has no embedded model; the kiln-tiny part is skipped"
fi

if [ "$failures" != 0 ]; then
  echo "--- kiln serve log (echo, tail) ---"
  tail -20 "$LOG_echo"
  echo "FAIL: serve_openai ($failures)"
  exit 1
fi
echo "PASS: serve_openai"
