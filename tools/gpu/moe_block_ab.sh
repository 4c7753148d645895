#!/usr/bin/env bash
# GPU machine, issue 27: the persistent MoE block's tests, then one-binary flag A/B (35B batch 1/2/4, spec K=3 verify).
# Usage: OUT=... bash tools/gpu/moe_block_ab.sh CARRY (CARRY/new holds kiln and test_cuda, stripped and xz-compressed;
# CARRY/lib the shared libraries the GPU image lacks: tools/gpu/README.md).
set -uo pipefail
CARRY=${1:-gpu-carry}; WHAT=all; OUT=${OUT:-/tmp/kiln-gpu}
source tools/gpu/carry.sh
T=$CARRY/new/test_cuda; K=$CARRY/new/kiln
S0=$SECONDS; left() { [ $((SECONDS - S0)) -lt $1 ]; }
timeout 150 $T --gtest_filter='*MoeBlock*:CudaRunner.PersistentMoeBlock*:CudaRunner.SnapshotsInsideAChunk*:CudaOps.SelfCheckPasses*' > $OUT/t1.log 2>&1; echo "test_cuda rc=$? ($((SECONDS-S0)) s)"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|moe block\]|persistent MoE|tests ran" $OUT/t1.log | head -60
grep -B3 -A14 "Failure" $OUT/t1.log | head -40
C35=configs/qwen3.5-35b-a3b-nvfp4
be() { local label=$1 to=$2; shift 2; timeout $to $K bench-engine --device cuda --load-format dummy --skip-self-check --output-len 32 "$@" > $OUT/$label.txt 2>&1; echo "-- $label rc=$? ($((SECONDS-S0)) s): $*"; grep -E "^batch|spec K|kernels:" $OUT/$label.txt | cut -c1-300 | head -12; }
left 150 && be b35_on 45 --model-path $C35 --batch 1,2,4 --input-len 256 --enable-persistent-moe
left 180 && be b35_off 45 --model-path $C35 --batch 1,2,4 --input-len 256 --disable-persistent-moe
left 210 && be s35_on 50 --model-path $C35 --batch 1 --input-len 256 --spec-sweep 3 --enable-persistent-moe
left 240 && be s35_off 50 --model-path $C35 --batch 1 --input-len 256 --spec-sweep 3 --disable-persistent-moe
echo "total $((SECONDS-S0)) s"
