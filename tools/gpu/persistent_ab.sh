#!/usr/bin/env bash
# GPU machine, issue 27: the persistent decode kernels' tests, then the 35B-A3B decode step (graphs) at $BATCHES with
# each variant of $VARIANTS ("label|flags" entries separated by ';'), one binary, one call; two files in $OUT.
# Usage: OUT=... bash tools/gpu/persistent_ab.sh CARRY (CARRY/new: kiln and test_cuda, xz; CARRY/lib: tools/gpu/README.md)
set -uo pipefail
CARRY=${1:-gpu-carry}; WHAT=all; OUT=${OUT:-/tmp/kiln-gpu}
source tools/gpu/carry.sh
T=$CARRY/new/test_cuda; K=$CARRY/new/kiln; C35=configs/qwen3.5-35b-a3b-nvfp4
S0=$SECONDS
timeout ${TEST_TIMEOUT:-150} $T --gtest_filter="${TEST_FILTER:-*DeltaNetBlock*:CudaRunner.PersistentDeltaNet*:*MoeBlockDecode.*}" \
  > $OUT/tests.log 2>&1
echo "test_cuda rc=$? ($((SECONDS-S0)) s)"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|^\[       OK" $OUT/tests.log | head -24
grep -E "delta blk\]|persistent DeltaNet" $OUT/tests.log | sed -E 's/ \| state/\n    state/' | head -50
grep -B2 -A6 "Failure" $OUT/tests.log | head -40
V=${VARIANTS:-"off|;delta|--enable-persistent-deltanet;delta+pf|--enable-persistent-deltanet --enable-persistent-prefetch;moe+pf|--enable-persistent-moe --enable-persistent-prefetch;both+pf|--enable-persistent-moe --enable-persistent-deltanet --enable-persistent-prefetch"}
IFS=';' read -ra VS <<< "$V"
for v in "${VS[@]}"; do
  echo "== ${v%%|*} (${v#*|})" >> $OUT/bench.log
  timeout 60 $K bench-engine --device cuda --model-path $C35 --load-format dummy --skip-self-check --input-len 256 \
    --output-len 32 --batch ${BATCHES:-1,2,4} ${v#*|} 2>&1 | grep -E "^batch" | sed -E 's/prefill [^|]*\| //' | cut -c1-100 \
    >> $OUT/bench.log
  echo "-- ${v%%|*} ($((SECONDS-S0)) s)"
done
cat $OUT/bench.log
echo "total $((SECONDS-S0)) s"
