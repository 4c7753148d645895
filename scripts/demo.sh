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
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
ready=0
for _ in $(seq 1 240); do
  # Our own server must still be running (a taken port makes it exit at once; another server's
  # /health must not count).
  if ! kill -0 "$server" 2>/dev/null; then echo "kiln serve exited during startup" >&2; exit 1; fi
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then ready=1; break; fi
  sleep 0.5
done
[ "$ready" = 1 ] || { echo "kiln serve did not become healthy within 120 s" >&2; exit 1; }
kill -0 "$server" 2>/dev/null || { echo "kiln serve exited during startup (port $PORT taken?)" >&2; exit 1; }
"$KILN" smoke --url "http://127.0.0.1:$PORT"
