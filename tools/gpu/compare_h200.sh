#!/usr/bin/env bash
# GPU machine: one binary against another in one call (the same machine, interleaved runs), plus the CUDA
# tests and kiln smoke of the second. For "behaviour and speed stay the same" checks of a refactor.
#   OUT=... bash tools/gpu/compare_h200.sh CARRY [what: tests,bench,smoke]
# CARRY holds lib/ (shared libraries the GPU image lacks, see README.md), base/ and new/, each with `kiln`
# (and new/ with `test_cuda`), stripped and xz-compressed as README.md says.
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=${2:-tests,bench,smoke}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/*/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
has() { [[ ",$WHAT," == *",$1,"* ]]; }
C35=configs/qwen3.5-35b-a3b-nvfp4
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
for b in base new; do [ -e "$CARRY/$b/kiln" ] || continue; "$CARRY/$b/kiln" version || { ldd "$CARRY/$b/kiln" | grep "not found"; exit 1; }; done

if has tests; then
  echo "== test_cuda (new)"
  timeout ${TEST_TIMEOUT:-240} "$CARRY/new/test_cuda" > "$OUT/test_cuda.log" 2>&1
  echo "test_cuda rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]" "$OUT/test_cuda.log" | head -40
fi
if has bench; then
  for round in 1 2; do
    for b in base new; do
      echo "== round $round: $b: bench-engine 35B-A3B shape, dummy weights, 512-token prompts"
      timeout 200 "$CARRY/$b/kiln" bench-engine --device cuda --model-path $C35 --load-format dummy \
        --batch ${BATCHES:-1,16,64,128} --input-len 512 --output-len 32 --skip-self-check 2>&1 | grep -E "^batch" \
        | tee -a "$OUT/bench_$b.txt"
      timeout 120 "$CARRY/$b/kiln" bench-engine --device cuda --model-path $C35 --load-format dummy --batch 1 \
        --input-len 4096 --output-len 4 --prefill-chunk 4096 --skip-self-check 2>&1 | grep -E "^batch" \
        | tee -a "$OUT/bench_$b.txt"
    done
  done
fi
if has smoke; then
  echo "== kiln serve --device cuda (kiln-tiny, new) + kiln smoke"
  "$CARRY/new/kiln" serve --device cuda --model-path models/kiln-tiny --port 30000 > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.5; done
  "$CARRY/new/kiln" smoke --url http://127.0.0.1:30000 2>&1 | tail -12 | tee "$OUT/smoke.txt"
  kill -TERM $SERVER; wait $SERVER; echo "serve exit status: $?"
  grep -E "kernels|memory plan|self-check" "$OUT/serve.log" | head -5
fi
