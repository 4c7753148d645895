#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: the CudaOps tests (every op against the CPU backend, whole
# models through the generic Runner on both backends, batch invariance), then the op tests again under
# compute-sanitizer memcheck. Prints a short summary last; full logs go to $OUT (default /tmp/kiln-gpu).
#   tools/gpu/run_cuda_ops.sh [BIN_DIR]   BIN_DIR holds test_cuda from the standalone build
#                                        (cmake -S tools/gpu -B build-gpu -G Ninja && ninja -C build-gpu test_cuda)
set -uo pipefail
OUT=${OUT:-/tmp/kiln-gpu}
BIN=${1:-build-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KILN_LOG=${KILN_LOG:-warn}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
ldd "$BIN/test_cuda" | grep "not found"

start=$(date +%s)
timeout "${KILN_TEST_TIMEOUT:-240}" "$BIN/test_cuda" --gtest_filter="${KILN_FILTER:-*}" \
  > "$OUT/cuda_ops.log" 2>&1
test_rc=$?
echo "tests: rc=$test_rc in $(( $(date +%s) - start )) s"

memcheck_rc=skipped
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$sanitizer" ] && [ "${KILN_MEMCHECK:-1}" = 1 ]; then
  start=$(date +%s)
  timeout "${KILN_MEMCHECK_TIMEOUT:-100}" "$sanitizer" --tool memcheck --print-limit 10 "$BIN/test_cuda" \
    --gtest_filter="${KILN_MEMCHECK_FILTER:-CudaOps.EveryOpMatchesCpuSmall:CudaOps.EveryOpMatchesCpuOddShapes}" \
    > "$OUT/memcheck.log" 2>&1
  memcheck_rc=$?
  echo "memcheck: rc=$memcheck_rc in $(( $(date +%s) - start )) s"
fi

echo
echo "================ summary ================"
echo "tests rc=$test_rc memcheck rc=$memcheck_rc"
grep -E "FAIL" "$OUT/cuda_ops.log" | head -40
grep -E "^\[ (ops|model|batch|describe|device) " "$OUT/cuda_ops.log"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|^\[       OK \]" "$OUT/cuda_ops.log" | sort | uniq | head -40
grep -B3 -A12 "Failure$" "$OUT/cuda_ops.log" | head -60
tail -3 "$OUT/cuda_ops.log"
[ -f "$OUT/memcheck.log" ] && grep -E "ERROR SUMMARY|Invalid|out of bounds|PASSED|FAILED" "$OUT/memcheck.log" | sort | uniq -c | head -20
exit 0
