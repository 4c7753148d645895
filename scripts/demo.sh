#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build kiln, start `kiln serve` on the
# embedded default model (kiln-tiny), prove it with `kiln smoke`, then stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)" --target kiln
KILN="$BUILD/bin/kiln"
PORT=${PORT:-30000}

"$KILN" serve --port "$PORT" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "kiln serve exited during startup" >&2; exit 1; fi
  sleep 0.5
done
"$KILN" smoke --url "http://127.0.0.1:$PORT"
