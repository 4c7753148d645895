#!/usr/bin/env bash
# GPU machine, issue 30: Nsight Compute on the wgmma expert kernels (moe_prefill_wgmma.cu) of one prefill pass: the
# 35B-A3B at 8192 tokens and the 397B TP-8 rank at 4096, one gate/up and one down launch each (a middle layer).
# Usage: OUT=... bash tools/gpu/ncu_wgmma.sh CARRY (CARRY/new: kiln, xz-compressed; CARRY/lib: tools/gpu/README.md).
# $NCU_FLAGS: more bench-engine flags (e.g. --enable-wgmma-producer, --moe-wgmma-tile-rows 64).
# Writes ncu_35b.csv, ncu_397b.csv, ncu.err to $OUT and prints each launch's main metrics.
set -uo pipefail
CARRY=${1:-gpu-carry}; WHAT=ncu; OUT=${OUT:-/tmp/kiln-gpu}
source tools/gpu/carry.sh
K=$CARRY/new/kiln
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for shape in "35b|--model-path configs/qwen3.5-35b-a3b-nvfp4 --input-len 8192 --max-pass-tokens 8192" \
             "397b|--model-path configs/qwen3.5-397b-a17b-nvfp4 --tp 8 --single-rank 0 --input-len 4096 --max-pass-tokens 4096"; do
  label=${shape%%|*}
  timeout 240 "$NCU" --clock-control none -k "regex:moe_wgmma_kernel" --launch-skip ${NCU_SKIP:-10} --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats --csv --page details \
    "$K" bench-engine --device cuda --load-format dummy --skip-self-check --batch 1 --output-len 2 \
    --moe-runner-backend kiln-wgmma ${NCU_FLAGS:-} ${shape#*|} > "$OUT/ncu_$label.csv" 2>> "$OUT/ncu.err"
  echo "== ncu $label rc=$?"; tail -2 "$OUT/ncu.err"
  python3 - "$OUT/ncu_$label.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
start = [i for i, r in enumerate(rows) if r and r[0] == "ID"]
if not start: print("no ncu rows"); sys.exit()
rows = [r for r in rows[start[0]:] if len(r) > 15]
h = {n: i for i, n in enumerate(rows[0])}
skip = ("Stack Size", "Shared Memory Configuration Size", "Driver Shared Memory", "Function Cache", "Cluster")
for r in rows[1:]:
    name = r[h["Metric Name"]]
    if any(name.startswith(s) for s in skip): continue
    print(r[h["ID"]], r[h["Kernel Name"]][:34], "|", r[h["Section Name"]][:18], "|", name, "=", r[h["Metric Value"]], r[h["Metric Unit"]])
PY
done
