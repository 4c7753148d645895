#!/usr/bin/env bash
# GPU machine: issue "A decode step without bubbles" and "Multi-token prediction" in one call. The same commands
# run on CARRY/base (the binaries before the change) and CARRY/new, interleaved, so every number has its baseline
# from the same machine.
#   OUT=... bash tools/gpu/decode_ab.sh CARRY [what: tests,smoke,decode35,rank397,layers397,spec]
# CARRY holds lib/, base/ and new/ (kiln, test_cuda; stripped, xz-compressed; see README.md).
# Variables: BATCHES (35B decode batches), RANK_TPS (TP sizes whose rank 0 is benched), NEW_FLAGS (flags given
# to the new binary only, e.g. to compare a kernel choice), BASE_FLAGS (the same for base: with base/ a copy of new/,
# a flag's A/B on one binary), BASE_DIR (the folder of CARRY that base runs, e.g. new: an A/B of flags on one
# binary), TEST_FILTER.
# The `gemv` step runs CARRY/new/bench_gemv (the bandwidth gemv per loads-in-flight setting).
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=${2:-tests,smoke,decode35,rank397,layers397}
OUT=${OUT:-/tmp/kiln-gpu}
source "$(dirname "$0")/carry.sh"
dir_of() { if [ "$1" = base ]; then echo "$CARRY/${BASE_DIR:-base}"; else echo "$CARRY/new"; fi; }
VARIANTS=()
for v in base new; do [ -x "$(dir_of $v)/kiln" ] && VARIANTS+=("$v"); done
for v in "${VARIANTS[@]}"; do "$(dir_of $v)/kiln" version || { ldd "$(dir_of $v)/kiln" | grep "not found"; exit 1; }; done
flags_of() { if [ "$1" = new ]; then echo "${NEW_FLAGS:-}"; else echo "${BASE_FLAGS:-}"; fi; }
C35=configs/qwen3.5-35b-a3b-nvfp4
C397=configs/qwen3.5-397b-a17b-nvfp4

if has gemv && [ -x "$CARRY/new/bench_gemv" ]; then
  echo "== bench_gemv"
  timeout 200 "$CARRY/new/bench_gemv" --rows ${GEMV_ROWS:-1,8} 2>&1 | tee "$OUT/bench_gemv.txt"
fi
if has tests && [ -x "$CARRY/new/test_cuda" ]; then
  echo "== test_cuda (new)"
  timeout ${TEST_TIMEOUT:-300} "$CARRY/new/test_cuda" ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} > "$OUT/test_cuda.log" 2>&1
  echo "test_cuda rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]" "$OUT/test_cuda.log" | head -40
fi
if has smoke; then
  K="$CARRY/new/kiln"
  for s in "" "--kv-cache-dtype fp8_e4m3" "--tp 2 --gpu-id-step 0" ${SMOKE_EXTRA:+"$SMOKE_EXTRA"}; do
    echo "== kiln serve --device cuda $s (kiln-tiny) + kiln smoke"
    "$K" serve --device cuda --model-path models/kiln-tiny $s --port 30000 > "$OUT/serve.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 240); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.5; done
    timeout 300 "$K" smoke --url http://127.0.0.1:30000 2>&1 | tail -4
    kill -TERM $SERVER; wait $SERVER; echo "serve exit status: $?"
  done
fi
if has decode35; then
  for v in "${VARIANTS[@]}"; do
    echo "== [$v] bench-engine 35B-A3B dummy, decode batches ${BATCHES:-1,16,64,128}"
    timeout 300 "$(dir_of $v)/kiln" bench-engine --device cuda --model-path $C35 --load-format dummy $(flags_of $v) \
      --batch ${BATCHES:-1,16,64,128} --input-len 512 --output-len 32 --skip-self-check --profile > "$OUT/decode35_$v.txt" 2>&1
    grep -E "^batch" "$OUT/decode35_$v.txt"
  done
fi
if has rank397; then
  for tp in ${RANK_TPS:-8}; do
    for v in "${VARIANTS[@]}"; do
      echo "== [$v] bench-engine 397B rank 0 of TP $tp, batch 1"
      timeout 400 "$(dir_of $v)/kiln" bench-engine --device cuda --model-path $C397 --load-format dummy $(flags_of $v) \
        --tp $tp --single-rank 0 --batch 1 --input-len 512 --output-len 32 --skip-self-check --profile \
        > "$OUT/rank397_tp${tp}_$v.txt" 2>&1
      grep -E "^batch|projected" "$OUT/rank397_tp${tp}_$v.txt"
    done
  done
fi
if has layers397; then
  # Per-layer fixed cost: 24-layer minus 12-layer truncations of the 397B (rank 0 of TP 8), divided by 12.
  for n in 12 24; do
    d=/tmp/c397_$n; mkdir -p $d; cp $C397/*.json $d/
    python3 - "$d/config.json" $n <<'PY'
import json, sys
p, n = sys.argv[1], int(sys.argv[2]); c = json.load(open(p)); t = c.get("text_config", c)
t["num_hidden_layers"] = n
if "layer_types" in t: t["layer_types"] = t["layer_types"][:n]
json.dump(c, open(p, "w"), indent=1)
PY
  done
  for v in "${VARIANTS[@]}"; do
    for n in 12 24; do
      echo "== [$v] 397B $n layers, rank 0 of TP 8, batch 1"
      timeout 200 "$(dir_of $v)/kiln" bench-engine --device cuda --model-path /tmp/c397_$n --load-format dummy $(flags_of $v) \
        --tp 8 --single-rank 0 --batch 1 --input-len 128 --output-len 32 --skip-self-check 2>&1 | grep -E "^batch"
    done
  done
fi
if has spec && [ -n "${SPEC_CMD:-}" ]; then
  echo "== speculative: $SPEC_CMD"
  bash -c "$SPEC_CMD" 2>&1 | tee "$OUT/spec.txt" | tail -40
fi
