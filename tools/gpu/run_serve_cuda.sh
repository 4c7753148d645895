#!/usr/bin/env bash
# GPU machine: kiln serve --device cuda on the embedded kiln-tiny, checked by kiln smoke and measured by
# kiln bench; then kiln bench-engine and the CUDA tests. Run from the repo root with a carry folder
# holding a kiln binary built on a CPU machine (CUDA 13, sm_90a), test_cuda, and the shared libraries
# the GPU image lacks (cpp-httplib, fmt, pcre2, xxhash and their deps) under CARRY/lib.
#   OUT=... bash tools/gpu/run_serve_cuda.sh CARRY
set -uo pipefail
CARRY=${1:-gpu-carry}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
K="$CARRY/kiln"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }

PORT=30000
"$K" serve --device cuda --port $PORT > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
echo "== kiln smoke (cuda)"
"$K" smoke --url "http://127.0.0.1:$PORT" --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.txt"
echo "== kiln bench (cuda)"
"$K" bench --url "http://127.0.0.1:$PORT" --input-len 128 --output-len 128 --max-concurrency 1,4,16 \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | tail -40
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics.txt"
kill -TERM $SERVER; wait $SERVER
echo "serve exit status: $?"
grep -E "device|self-check|runner|ready" "$OUT/serve.log" | head -12

echo "== kiln bench-engine (cuda, kiln-tiny)"
for b in 1 16 64; do
  "$K" bench-engine --device cuda --batch $b --input-len 512 --output-len 64 2>&1 | tail -4
done | tee "$OUT/bench_engine.txt"
if [ -x "$CARRY/test_cuda" ]; then
echo "== test_cuda"
timeout 200 "$CARRY/test_cuda" > "$OUT/test_cuda.log" 2>&1
echo "test_cuda rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]" "$OUT/test_cuda.log"
fi
