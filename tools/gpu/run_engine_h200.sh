#!/usr/bin/env bash
# GPU machine: the CUDA engine on the 35B-A3B shape with --load-format dummy (kiln bench-engine, per-op profile),
# plus the CUDA tests. Run from the repo root with a carry folder holding `kiln` and `test_cuda` (built on a CPU
# machine, CUDA 13, sm_90a) and the shared libraries the GPU image lacks under CARRY/lib.
#   OUT=... bash tools/gpu/run_engine_h200.sh CARRY [what: bench,moe,tests,eager,prefill,sample,tiny,smoke]
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=${2:-tests,bench,eager,prefill,tiny}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
# Binaries may travel xz-compressed (the working tree + carry must stay under 64 MiB).
for f in "$CARRY"/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/kiln"
C35=configs/qwen3.5-35b-a3b-nvfp4
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }
has() { [[ ",$WHAT," == *",$1,"* ]]; }

if has bench; then
  echo "== bench-engine 35B-A3B shape, dummy weights, 512-token prompts, graphs on, profile"
  timeout ${BENCH_TIMEOUT:-240} "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch ${BATCHES:-1,4,16,64,128} \
    --input-len 512 --output-len ${OUTLEN:-32} --profile 2>&1 | tee "$OUT/bench35.txt" | grep -v "^\[.*INFO\]"
fi
if has moe; then
  # Each variant: bench-engine flags for the run (MOE_VARIANTS overrides the list; MOE_PREFILL=0 skips the 4k prefill
  # of each).
  echo "== routed-expert variants"
  VARIANTS=${MOE_VARIANTS:-"--moe-runner-backend kiln-grouped-fp32|--moe-runner-backend kiln-grouped"}
  IFS='|' read -ra VLIST <<< "$VARIANTS"
  for v in "${VLIST[@]}"; do
    echo "-- $v"
    timeout 120 "$K" bench-engine $v --device cuda --model-path $C35 --load-format dummy --batch ${MOE_BATCHES:-1,16,64,128} \
      --input-len 512 --output-len 16 --skip-self-check 2>&1 | grep -E "^batch"
    [ "${MOE_PREFILL:-1}" = 1 ] && timeout 90 "$K" bench-engine $v --device cuda --model-path $C35 --load-format dummy \
      --batch 1 --input-len 4096 --output-len 4 --prefill-chunk 4096 --skip-self-check 2>&1 | grep -E "^batch"
  done 2>&1 | tee "$OUT/bench35_moe_variants.txt"
fi
if has tests && [ -x "$CARRY/test_cuda" ]; then
  echo "== test_cuda"
  timeout ${TEST_TIMEOUT:-200} "$CARRY/test_cuda" ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/test_cuda.log" 2>&1
  echo "test_cuda rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|^\[ (graphs|dummy|model|ops) " "$OUT/test_cuda.log" | head -60
fi
if has eager; then
  echo "== bench-engine 35B-A3B, graphs off"
  timeout 90 "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch 1,16 --input-len 512 \
    --output-len 16 --disable-cuda-graph --skip-self-check 2>&1 | grep -E "^batch" | tee "$OUT/bench35_eager.txt"
fi
if has prefill; then
  echo "== bench-engine 35B-A3B prefill, 4096-token prompt"
  timeout 90 "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch 1 --input-len 4096 \
    --output-len 4 --prefill-chunk 4096 --skip-self-check 2>&1 | grep -E "^batch|memory plan" | tee "$OUT/bench35_prefill4k.txt"
fi
if has sample; then
  echo "== bench-engine 35B-A3B, tokens sampled on the device (temperature 0.7, top-p 0.9) vs argmax"
  for s in "--temperature 0.7 --top-p 0.9" "--temperature 0.7 --top-k 50" ""; do
    echo "-- ${s:-argmax}"
    timeout 120 "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch ${SAMPLE_BATCHES:-1,16,64} \
      --input-len 512 --output-len 16 --skip-self-check $s 2>&1 | grep -E "^batch"
  done 2>&1 | tee "$OUT/bench35_sample.txt"
fi
if has tiny; then
  echo "== bench-engine kiln-tiny (graphs on / off)"
  for g in "" --disable-cuda-graph; do
    "$K" bench-engine --device cuda --model-path models/kiln-tiny --batch 1,16,64 --input-len 128 --output-len 64 \
      --skip-self-check $g 2>&1 | grep -E "^batch"
  done | tee "$OUT/bench_tiny.txt"
fi
if has smoke; then
  echo "== kiln serve --device cuda (kiln-tiny) + kiln smoke"
  "$K" serve --device cuda --model-path models/kiln-tiny --port 30000 > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.5; done
  "$K" smoke --url http://127.0.0.1:30000 2>&1 | tail -12 | tee "$OUT/smoke.txt"
  kill -TERM $SERVER; wait $SERVER; echo "serve exit status: $?"
  grep -E "kernels|memory plan" "$OUT/serve.log" | head -3
fi
