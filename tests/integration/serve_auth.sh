#!/usr/bin/env bash
# `kiln serve --api-key`: 401 without the right Bearer key, /health and /metrics open
# (tests/js/serve_auth.test.mjs), on the echo dummy runner.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
make_model_dir "$SERVE_WORK/echo" echo
KEY="test-key-$RANDOM$RANDOM"
start_server auth --model-path "$SERVE_WORK/echo" --dummy-runner echo --api-key "$KEY"
run_node serve_auth.test.mjs KILN_URL="$URL_auth" KILN_API_KEY="$KEY" || { echo "FAIL: serve_auth"; exit 1; }
if grep -q "$KEY" "$LOG_auth"; then echo "FAIL: the API key appears in the server log"; exit 1; fi
echo "PASS: serve_auth"
