#!/usr/bin/env bash
# GPU machine: tensor parallelism on one H200 (issue "Several GPUs"): the CUDA TP tests, kiln smoke against
# `kiln serve --tp 2 --gpu-id-step 0` on kiln-tiny, the all-reduce latency (bench_allreduce), and the single-rank
# 397B decode benchmark (rank 0 of TP 2 alone, all-reduces as copies of the same size).
#   OUT=... bash tools/gpu/tp_h200.sh CARRY [what: tests,smoke,allreduce,rank397]
# CARRY holds lib/ and new/ (kiln, test_cuda, bench_allreduce; stripped, xz-compressed; see README.md).
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=${2:-tests,smoke,allreduce,rank397}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/*/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
has() { [[ ",$WHAT," == *",$1,"* ]]; }
K="$CARRY/new/kiln"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }

if has tests; then
  echo "== test_cuda: tensor parallel"
  timeout ${TP_TEST_TIMEOUT:-300} "$CARRY/new/test_cuda" --gtest_filter='CudaTensorParallel.*' > "$OUT/test_tp.log" 2>&1
  echo "test_cuda (tp) rc=$?"
  grep -E "^\[ (tp|nccl) |^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|OK \]" "$OUT/test_tp.log" | head -60
  if [ -n "${FULL_TESTS:-}" ]; then
    echo "== test_cuda: all others"
    timeout ${TEST_TIMEOUT:-300} "$CARRY/new/test_cuda" --gtest_filter='-CudaTensorParallel.*' > "$OUT/test_cuda.log" 2>&1
    echo "test_cuda rc=$?"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]" "$OUT/test_cuda.log" | head -40
  fi
fi
if has smoke; then
  for tp in 2 4; do
    echo "== kiln serve --device cuda --tp $tp --gpu-id-step 0 (kiln-tiny) + kiln smoke"
    "$K" serve --device cuda --model-path models/kiln-tiny --tp $tp --gpu-id-step 0 --port 30000 > "$OUT/serve_tp$tp.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 240); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.5; done
    timeout 300 "$K" smoke --url http://127.0.0.1:30000 2>&1 | tail -12 | tee "$OUT/smoke_tp$tp.txt"
    kill -TERM $SERVER; wait $SERVER; echo "serve exit status: $?"
    grep -E "tensor parallel|memory plan|all-reduce" "$OUT/serve_tp$tp.log" | head -6
  done
fi
if has allreduce; then
  echo "== bench_allreduce: 2 and 8 ranks on GPU 0 (the GPU-waiting kernel, no link)"
  for n in 2 8; do timeout 120 "$CARRY/new/bench_allreduce" --ranks $n 2>&1 | tee -a "$OUT/allreduce.txt"; done
fi
if has rank397; then
  echo "== bench-engine: 397B shape, rank 0 of TP 2 alone (dummy weights)"
  timeout 420 "$K" bench-engine --device cuda --model-path configs/qwen3.5-397b-a17b-nvfp4 --load-format dummy \
    --tp 2 --single-rank 0 --batch ${BATCHES:-1,8,32} --input-len 512 --output-len 32 --skip-self-check \
    --mem-fraction-static 0.95 \
    > "$OUT/rank397.log" 2>&1
  echo "rc=$?"
  grep -E "^batch|memory plan|single-rank|error" "$OUT/rank397.log" | head -20
fi
