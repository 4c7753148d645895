#!/usr/bin/env bash
# GPU machine: issues "Multi-token prediction" (position checkpoints, verify graphs) and "Prefill at tensor-core
# speed" in one call, on one binary (A/B by flags), from the repository root:
#   OUT=... bash tools/gpu/spec_prefill_h200.sh CARRY [what: train,tests,smoke,spec35,tiny,tinyeval,tinyengine,prefill,lines,images]
# CARRY holds lib/ and new/ (kiln, test_cuda; stripped, xz-compressed; see README.md).
# Variables: TEST_FILTER, TEST_TIMEOUT, SPEC_BATCHES (35B spec sweep batches), PREFILL_VARIANTS ('|'-separated flag
# sets for the prefill A/B), PREFILL_SHAPES (input-len:batch pairs), TRAIN_SECONDS (train: tools/tiny/train_mtp.py in
# the background while the other steps run; the new head's mtp.* tensors come back as $OUT/mtp_head.safetensors;
# tools/tiny/merge_mtp_head.py puts them into models/kiln-tiny; with tinyeval in the same call, the new model is
# served after the training ends), TINY_MODEL (tinyeval's model folder), TINY_VARIANTS (tinyeval's '|'-separated serve
# flag sets; default none, NEXTN, NEXTN --speculative-fixed-steps),
# SPEC_SWEEP (spec35: draft lengths, default 1,2,3), LINES (lines: a file of `label|kiln bench-engine arguments`, one
# run per line, its output in $OUT/lines.txt), images (tests/integration/serve_images.sh on the CPU and CUDA).
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=${2:-tests,smoke,spec35,tiny,prefill}
OUT=${OUT:-/tmp/kiln-gpu}
source "$(dirname "$0")/carry.sh"
K="$CARRY/new/kiln"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }
C35=configs/qwen3.5-35b-a3b-nvfp4

if has train; then
  echo "== tools/tiny/train_mtp.py, ${TRAIN_SECONDS:-300} s, in the background"
  ( PYTHONUNBUFFERED=1 python3 tools/tiny/train_mtp.py --model models/kiln-tiny --out /tmp/mtpout \
      --train-seconds ${TRAIN_SECONDS:-300} ${TRAIN_FLAGS:---skip-eval-before} --eval-conversations 16 --eval-positions 6 \
      > "$OUT/train_mtp.log" 2>&1
    python3 -c "
import sys
from safetensors.torch import load_file, save_file
t = load_file('/tmp/mtpout/model/model.safetensors')
save_file({k: v for k, v in t.items() if k.startswith('mtp.')}, sys.argv[1], metadata={'format': 'pt'})
" "$OUT/mtp_head.safetensors" >> "$OUT/train_mtp.log" 2>&1
    cp /tmp/mtpout/train_mtp_meta.json "$OUT/" 2>/dev/null ) &
  TRAIN_PID=$!
fi

if has tests && [ -x "$CARRY/new/test_cuda" ]; then
  echo "== test_cuda ${TEST_FILTER:-(all)}"
  timeout ${TEST_TIMEOUT:-360} "$CARRY/new/test_cuda" ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/test_cuda.log" 2>&1
  echo "test_cuda rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|tests ran" "$OUT/test_cuda.log" | head -40
fi
serve_bench() {  # $1: label, rest: serve flags; kiln-tiny on the GPU, then smoke or bench per $MODE
  local label=$1; shift
  # The server's log stays on the machine (a call returns at most 8 files); its tail is printed if it exits non-zero.
  "$K" serve --device cuda --model-path "${TINY_MODEL:-models/kiln-tiny}" "$@" --port 30000 > "/tmp/serve_$label.log" 2>&1 &
  local server=$!
  for _ in $(seq 240); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.5; done
  if [ "$MODE" = smoke ]; then
    timeout 300 "$K" smoke --url http://127.0.0.1:30000 2>&1 | tail -3
  elif [ "$MODE" = dataset ]; then
    timeout 300 "$K" bench --url http://127.0.0.1:30000 --dataset-path tools/tiny/eval_prompts.json --dataset-shuffle \
      --num-prompts ${DATASET_PROMPTS:-240} --output-len 512 --max-concurrency 1,8 --no-progress 2>&1 \
      | tee "$OUT/bench_$label.txt" | grep -E "concurrency|TPOT|tok/s|accept|draft|Mean output" | head -16
    curl -s http://127.0.0.1:30000/metrics | grep -E "^kiln.spec" | grep -v "_bucket" | head -12
  else
    timeout 300 "$K" bench --url http://127.0.0.1:30000 --input-len 128 --output-len 256 --max-concurrency 1,8 \
      --num-prompts 8 2>&1 | tee "$OUT/bench_$label.txt" | grep -E "concurrency|TPOT|tok/s|accept" | head -12
    curl -s http://127.0.0.1:30000/metrics | grep -E "^kiln.spec" | grep -v "_bucket" | head -12
  fi
  kill -TERM $server; wait $server; local rc=$?; echo "serve exit status: $rc"
  [ $rc -ne 0 ] && tail -n 20 "/tmp/serve_$label.log"
}
if has smoke; then
  MODE=smoke
  for s in "" "--kv-cache-dtype fp8_e4m3" "--tp 2 --gpu-id-step 0" "--speculative-algorithm none"; do
    echo "== kiln serve --device cuda $s (kiln-tiny) + kiln smoke"
    serve_bench smoke $s
  done
fi
if has spec35; then
  for g in "--disable-cuda-graph-verify" ""; do
    echo "== 35B-A3B dummy: spec sweep (replay path and position checkpoints, one binary) $g"
    timeout 300 "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch ${SPEC_BATCHES:-1,8} \
      --input-len 256 --output-len 32 --skip-self-check --spec-sweep ${SPEC_SWEEP:-1,2,3} $g > "$OUT/spec35${g:+_eager}.txt" 2>&1
    echo "rc=$?"; grep -E "^batch|spec K" "$OUT/spec35${g:+_eager}.txt"
  done
fi
if has tiny; then
  MODE=bench
  for s in "--speculative-algorithm none" "--speculative-algorithm NEXTN --disable-cuda-graph-verify" "--speculative-algorithm NEXTN"; do
    echo "== kiln-tiny serve $s: kiln bench 128/256 at concurrency 1, 8"
    serve_bench "tiny_$(echo $s | tr -c 'a-zA-Z0-9' _)" $s
  done
fi
if has tinyeval; then
  MODE=dataset
  # With `train` in the same call: wait for it, then serve the model it wrote (the new head) unless TINY_MODEL says.
  if [ -n "${TRAIN_PID:-}" ]; then wait $TRAIN_PID; TINY_MODEL=${TINY_MODEL:-/tmp/mtpout/model}; fi
  IFS='|' read -ra TV <<< "${TINY_VARIANTS:---speculative-algorithm none|--speculative-algorithm NEXTN|--speculative-algorithm NEXTN --speculative-fixed-steps}"
  for s in "${TV[@]}"; do
    echo "== kiln-tiny (${TINY_MODEL:-models/kiln-tiny}) serve $s: kiln bench on tools/tiny/eval_prompts.json at concurrency 1, 8"
    serve_bench "tinyeval_$(echo $s | tr -c 'a-zA-Z0-9' _)" $s
  done
fi
if has tinyengine; then
  # TINY_ENGINE_BINS: the carried binaries to time in turn (e.g. "base new new base": an A/B interleaved); graphs on.
  # Without it: the new binary with and without verify graphs.
  if [ -n "${TINY_ENGINE_BINS:-}" ]; then runs=(); for b in $TINY_ENGINE_BINS; do runs+=("$b|"); done
  else runs=("new|--disable-cuda-graph-verify" "new|"); fi
  i=0
  for r in "${runs[@]}"; do
    b=${r%%|*}; g=${r#*|}; i=$((i + 1))
    echo "== kiln-tiny bench-engine spec sweep ($b) $g"
    timeout 200 "$CARRY/$b/kiln" bench-engine --device cuda --model-path models/kiln-tiny --batch ${TINY_BATCHES:-1,8} \
      --input-len 128 --output-len 64 --skip-self-check --spec-sweep ${TINY_SWEEP:-1,2,3} $g >> "$OUT/tinyengine.txt" 2>&1
    echo "rc=$?"; tail -n 40 "$OUT/tinyengine.txt" | grep -E "^batch|spec K" | cut -c1-260 | tail -${TINY_LINES:-30}
  done
fi
if has lines && [ -f "${LINES:-}" ]; then
  while IFS='|' read -r label args; do
    [ -z "$label" ] && continue
    echo "== $label: kiln bench-engine $args" | tee -a "$OUT/lines.txt"
    timeout 300 "$K" bench-engine --device cuda --skip-self-check $args >> "$OUT/lines.txt" 2>&1
    echo "rc=$?" | tee -a "$OUT/lines.txt"
    tail -n 40 "$OUT/lines.txt" | grep -E "^batch|spec K|plan|error|Error" | tail -12
  done < "$LINES"
  echo "== the runs so far as a table (tools/gpu/lines_table.py)"
  python3 "$(dirname "$0")/lines_table.py" "$OUT/lines.txt" | tee "$OUT/lines_table.md"
fi
if has images; then
  echo "== serve_images.sh on cpu and cuda"
  KILN_TEST_DEVICES="cpu cuda" timeout 300 bash tests/integration/serve_images.sh "$K" . 2>&1 | tail -12
fi
if has prefill; then
  IFS='|' read -ra VARIANTS <<< "${PREFILL_VARIANTS:---moe-runner-backend kiln-mma|--moe-runner-backend kiln-blas}"
  for shape in ${PREFILL_SHAPES:-4096:1 8192:1 512:16}; do
    len=${shape%%:*}; b=${shape##*:}
    for v in "${VARIANTS[@]}"; do
      echo "== prefill 35B-A3B dummy, $b x $len tokens, $v"
      timeout 300 "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch $b --input-len $len \
        --output-len 4 --max-pass-tokens $((len * b > 8192 ? 8192 : len * b)) --skip-self-check --profile $v \
        > "$OUT/prefill_${len}x${b}_$(echo $v | tr -c 'a-z0-9' _).txt" 2>&1
      grep -E "^batch" "$OUT/prefill_${len}x${b}_$(echo $v | tr -c 'a-z0-9' _).txt"
    done
  done
fi
if [ -n "${TRAIN_PID:-}" ]; then
  echo "== waiting for train_mtp.py"; wait $TRAIN_PID
  grep -E "steps|acceptance|loss|wrote|Error|error" "$OUT/train_mtp.log" | tail -8; ls -l "$OUT/mtp_head.safetensors"
fi
