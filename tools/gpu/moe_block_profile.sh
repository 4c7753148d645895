#!/usr/bin/env bash
# GPU machine, issue 27: where the persistent MoE block's time goes. The eager per-op profile (bench-engine --profile)
# of the 35B-A3B decode step at batch 1 and 4 with the kernel on and off, then Nsight Compute on a few of its launches.
# Usage: OUT=... bash tools/gpu/moe_block_profile.sh CARRY (CARRY/new: kiln, xz-compressed; CARRY/lib: tools/gpu/README.md)
set -uo pipefail
CARRY=${1:-gpu-carry}; WHAT=all; OUT=${OUT:-/tmp/kiln-gpu}
source tools/gpu/carry.sh
K=$CARRY/new/kiln; C35=configs/qwen3.5-35b-a3b-nvfp4
S0=$SECONDS
for b in 1 4; do for flag in --enable-persistent-moe --disable-persistent-moe; do
  l=p${b}${flag:2:3}
  timeout 60 $K bench-engine --device cuda --model-path $C35 --load-format dummy --skip-self-check --batch $b \
    --input-len 256 --output-len 16 --profile $flag ${EXTRA_FLAGS:-} > $OUT/$l.txt 2>&1
  echo "== $l rc=$? ($((SECONDS-S0)) s) batch $b $flag"
  grep -E "^batch" $OUT/$l.txt | cut -c1-200
  grep -iE "moe|add_rms|total|deltanet|linear" $OUT/$l.txt | grep -v INFO | head -14
done; done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for b in 1 4; do
  timeout 120 "$NCU" --clock-control none -k regex:moe_block_decode --launch-skip 50 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --csv --page details $K bench-engine --device cuda --model-path $C35 --load-format dummy --skip-self-check \
    --batch $b --input-len 4 --output-len 4 --disable-cuda-graph --enable-persistent-moe > $OUT/ncu$b.csv 2> $OUT/ncu$b.err
  echo "ncu batch $b rc=$? ($((SECONDS-S0)) s)"; tail -2 $OUT/ncu$b.err
  python3 - $OUT/ncu$b.csv <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no ncu rows"); sys.exit()
h = {n: i for i, n in enumerate(rows[0])}
first = rows[1][h["ID"]]
for r in rows[1:]:
    if r[h["ID"]] != first: continue
    print(r[h["ID"]], r[h["Section Name"]][:22], "|", r[h["Metric Name"]][:50], "=", r[h["Metric Value"]], r[h["Metric Unit"]])
PY
done
echo "total $((SECONDS-S0)) s"
