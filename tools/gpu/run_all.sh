#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: the CUDA kernel tests, the kernel benchmarks, then
# the tests again under compute-sanitizer (memcheck). Prints a short summary last.
#   tools/gpu/run_all.sh [BIN_DIR]   BIN_DIR holds test_cuda and bench_cuda_kernels (default build-gpu,
#                                    from `cmake -S tools/gpu -B build-gpu -G Ninja && ninja -C build-gpu`)
# Logs go to $OUT (default /tmp/kiln-gpu). If the prebuilt binaries do not start, builds them here.
set -uo pipefail
OUT=${OUT:-/tmp/kiln-gpu}
BIN=${1:-build-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if ! "$BIN/test_cuda" --gtest_list_tests > /dev/null 2>&1; then
  echo "prebuilt binaries do not start here: $("$BIN/test_cuda" --gtest_list_tests 2>&1 | tail -1)"
  echo "building from source (tools/gpu)"
  BIN=/tmp/kiln-gpu-build
  { cmake -S tools/gpu -B "$BIN" -G Ninja -DCMAKE_BUILD_TYPE=Release && ninja -C "$BIN"; } > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
fi

echo "== tests"
timeout 240 "$BIN/test_cuda" > "$OUT/tests.log" 2>&1
test_rc=$?
echo "== bench"
timeout 300 "$BIN/bench_cuda_kernels" --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1
bench_rc=$?
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
memcheck_rc=skipped
if [ -n "$sanitizer" ] && [ "${KILN_MEMCHECK:-1}" = 1 ]; then
  echo "== memcheck"
  timeout 150 "$sanitizer" --tool memcheck --print-limit 10 "$BIN/test_cuda" \
    --gtest_filter="${KILN_MEMCHECK_FILTER:-*}" > "$OUT/memcheck.log" 2>&1
  memcheck_rc=$?
fi

echo
echo "================ summary ================"
echo "tests rc=$test_rc bench rc=$bench_rc memcheck rc=$memcheck_rc"
grep -E "^\[ err      \]" "$OUT/tests.log" | sed 's/^\[ err      \] //'
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure$" "$OUT/tests.log" | sort | uniq
grep -B2 -A8 "Failure$" "$OUT/tests.log" | head -80
[ -f "$OUT/memcheck.log" ] && grep -E "ERROR SUMMARY|Invalid|out of bounds" "$OUT/memcheck.log" | sort | uniq -c | head -20
tail -5 "$OUT/bench.log"
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
exit 0
