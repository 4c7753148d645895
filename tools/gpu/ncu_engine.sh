#!/usr/bin/env bash
# GPU machine: Nsight Compute on selected kernels of a 35B-A3B dummy decode (eager), plus SM clocks sampled during a
# graph-mode bench. Run from the repo root: OUT=... bash tools/gpu/ncu_engine.sh CARRY BATCH
set -uo pipefail
CARRY=${1:-gpu-carry}
B=${2:-64}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/kiln"
C35=configs/qwen3.5-35b-a3b-nvfp4
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || echo /usr/local/cuda/bin/ncu)
echo "ncu: $NCU"
nvidia-smi --query-gpu=clocks.sm,clocks.mem --format=csv,noheader -lms 200 > "$OUT/clocks.txt" 2>&1 &
SMI=$!
"$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch 1,$B --input-len 512 --output-len 64 \
  --skip-self-check 2>&1 | grep -E "^batch"
kill $SMI 2>/dev/null
echo "SM clock samples during the bench (MHz): $(cut -d' ' -f1 "$OUT/clocks.txt" | sort -n | uniq -c | sort -rn | head -5 | tr '\n' ' ')"
# A: attention of a decode step at context ~512 (skips the warm-up and prefill passes' 200 attention launches).
timeout 200 "$NCU" --clock-control none --launch-skip 200 --launch-count 2 -k "regex:attention_split|attention_merge" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --csv --page details \
  "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch $B --input-len 512 --output-len 2 \
  --skip-self-check --disable-cuda-graph > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu A rc=$?"; tail -2 "$OUT/ncu.err"
# B: the first ~2 layers of a decode step (4-token prompts: the warm-up prefill pass is skipped).
timeout 200 "$NCU" --clock-control none --launch-skip ${NCU_SKIP:-1370} --launch-count 40 \
  -k "regex:gemv_stream|moe_group|moe_combine|moe_route_warp|rms_norm_row|delta_rule|conv1d" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --csv --page details \
  "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch $B --input-len 4 --output-len 2 \
  --skip-self-check --disable-cuda-graph 2>> "$OUT/ncu.err" >> "$OUT/ncu.csv"
echo "ncu B rc=$?"; tail -2 "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: print("no ncu rows"); sys.exit()
hdr = rows[0]; idx = {h: i for i, h in enumerate(hdr)}
want = ["Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
        "Registers Per Thread", "Grid Size", "Block Size", "SM Frequency"]
per = collections.OrderedDict()
for r in rows[1:]:
    k = (r[idx["ID"]], r[idx["Kernel Name"]][:60])
    per.setdefault(k, {})[r[idx["Metric Name"]]] = r[idx["Metric Value"]] + " " + r[idx["Metric Unit"]]
for (i, name), m in per.items():
    print(i, name, " | ".join(f"{w}: {m.get(w, '-')}" for w in want))
PY
