#!/usr/bin/env bash
# GPU machine, issue 27: the persistent decode kernels (the MoE block, moe_block_decode.cu; the DeltaNet mixer,
# deltanet_block_decode.cu). Their tests, the 35B-A3B decode step with each on and off and with the L2 prefetch (one
# binary, one call), the eager per-op profile with both on and both off, and Nsight Compute on a few launches of each.
# Usage: OUT=... bash tools/gpu/persistent_decode.sh CARRY [tests,bench,profile,ncu] (CARRY/new: kiln and test_cuda,
# xz-compressed; CARRY/lib: tools/gpu/README.md). $TEST_FILTER; $VARIANTS ("label|flags" entries separated by ';'; default
# off, each kernel, both, and with the L2 prefetch); $BATCHES (default 1,2,4); $NCU_BATCHES (default 1 4). Writes at most
# 7 files to $OUT (the device tool returns 8): gpu.txt, tests.log, bench.log, profile.log, ncu.err, ncu1.csv, ncu4.csv.
# $TEST_TIMEOUT (default 240 s) bounds the tests.
set -uo pipefail
CARRY=${1:-gpu-carry}; WHAT=${2:-tests,bench,profile,ncu}; OUT=${OUT:-/tmp/kiln-gpu}
source tools/gpu/carry.sh
T=$CARRY/new/test_cuda; K=$CARRY/new/kiln; C35=configs/qwen3.5-35b-a3b-nvfp4
S0=$SECONDS
MOE=--enable-persistent-moe; DELTA=--enable-persistent-deltanet
if has tests; then
  timeout ${TEST_TIMEOUT:-240} $T --gtest_filter="${TEST_FILTER:-*MoeBlock*:*DeltaNetBlock*:CudaRunner.Persistent*:CudaOps.SelfCheckPasses*}" \
    > $OUT/tests.log 2>&1
  echo "test_cuda rc=$? ($((SECONDS-S0)) s)"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|tests ran" $OUT/tests.log | head -20
  grep -E "delta blk\]|persistent DeltaNet|persistent MoE" $OUT/tests.log | head -40
  grep -B2 -A8 "Failure" $OUT/tests.log | head -60
fi
be() { local log=$1 label=$2; shift 2; echo "== $label: $*" >> $OUT/$log; timeout 60 $K bench-engine --device cuda \
  --model-path $C35 --load-format dummy --skip-self-check --input-len 256 "$@" > $OUT/last.txt 2>&1
  echo "-- $label rc=$? ($((SECONDS-S0)) s): $*"; }
if has bench; then
  PF=--enable-persistent-prefetch
  IFS=';' read -ra VS <<< "${VARIANTS:-off|;moe|$MOE;delta|$DELTA;both|$MOE $DELTA;delta+pf|$DELTA $PF;both+pf|$MOE $DELTA $PF}"
  for v in "${VS[@]}"; do
    be bench.log "${v%%|*}" --batch ${BATCHES:-1,2,4} --output-len 32 ${v#*|}
    grep -E "^batch" $OUT/last.txt | sed -E 's/prefill [^|]*\| //' | cut -c1-120 | tee -a $OUT/bench.log
  done
fi
if has profile; then
  for b in 1 4; do for v in "off|" "both|$MOE $DELTA"; do
    be profile.log "batch $b ${v%%|*}" --batch $b --output-len 8 --profile ${v#*|}
    grep -A24 "per-op time of one decode" $OUT/last.txt | tee -a $OUT/profile.log | head -16 | cut -c1-100
  done; done
fi
if has ncu; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for b in ${NCU_BATCHES:-1 4}; do
    timeout 150 "$NCU" --clock-control none -k "regex:moe_block_decode|deltanet_block_decode" --launch-skip 80 \
      --launch-count 2 --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
      --section SchedulerStats --csv --page details $K bench-engine --device cuda --model-path $C35 \
      --load-format dummy --skip-self-check --batch $b --input-len 4 --output-len 4 --disable-cuda-graph $MOE $DELTA \
      > $OUT/ncu$b.csv 2>> $OUT/ncu.err
    echo "ncu batch $b rc=$? ($((SECONDS-S0)) s)"; tail -2 $OUT/ncu.err
    python3 - $OUT/ncu$b.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
start = [i for i, r in enumerate(rows) if r and r[0] == "ID"]  # the program's own output comes first
if not start: print("no ncu rows"); sys.exit()
rows = [r for r in rows[start[0]:] if len(r) > 15]
h = {n: i for i, n in enumerate(rows[0])}
keep = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler", "No Eligible",
        "Dynamic Shared Memory Per Block", "Grid Size", "SM Frequency", "DRAM Frequency")
for r in rows[1:]:
    if r[h["Metric Name"]] in keep:
        print(r[h["ID"]], r[h["Kernel Name"]][:40], "|", r[h["Metric Name"]], "=", r[h["Metric Value"]], r[h["Metric Unit"]])
PY
  done
fi
rm -f $OUT/last.txt
echo "total $((SECONDS-S0)) s"
