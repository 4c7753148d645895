#!/usr/bin/env bash
# GPU machine: Nsight Compute on the decode-step kernels that set the batch-16 / batch-64 step (routed-expert
# tensor-core GEMMs, the recurrent delta rule), eager mode, 35B-A3B shape with dummy weights. Prints per kernel:
# duration, DRAM throughput, occupancy, registers, and the top warp stall reasons.
#   OUT=... bash tools/gpu/ncu_decode_kernels.sh CARRY [B_EXPERTS] [B_DELTA]
set -uo pipefail
CARRY=${1:-gpu-carry}
BE=${2:-16}
BD=${3:-64}
OUT=${OUT:-/tmp/kiln-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/*.xz; do [ -e "$f" ] && [ ! -x "${f%.xz}" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/kiln"
C35=configs/qwen3.5-35b-a3b-nvfp4
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || echo /usr/local/cuda/bin/ncu)
SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
STALLS=""
for s in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle lg_throttle not_selected selected \
         no_instruction dispatch_stall tex_throttle imc_miss drain membar branch_resolving sleeping; do
  STALLS="$STALLS${STALLS:+,}smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
SECTIONS="$SECTIONS --metrics $STALLS"
# 4-token prompts; a pass launches 80 expert kernels (gate/up + down per layer): skip the warm-up, prefill and first
# decode passes.
timeout 240 "$NCU" --clock-control none --launch-skip ${SKIP_E:-400} --launch-count 4 -k "regex:moe_mma_kernel" $SECTIONS \
  --csv --page details "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch $BE --input-len 4 \
  --output-len 8 --skip-self-check --disable-cuda-graph > "$OUT/ncu_experts.csv" 2> "$OUT/ncu.err"
echo "ncu experts rc=$?"; tail -2 "$OUT/ncu.err"
timeout 240 "$NCU" --clock-control none --launch-skip ${SKIP_D:-150} --launch-count 2 -k "regex:delta_rule_kernel" $SECTIONS \
  --csv --page details "$K" bench-engine --device cuda --model-path $C35 --load-format dummy --batch $BD --input-len 4 \
  --output-len 8 --skip-self-check --disable-cuda-graph > "$OUT/ncu_delta.csv" 2>> "$OUT/ncu.err"
echo "ncu delta rc=$?"; tail -2 "$OUT/ncu.err"
python3 - "$OUT/ncu_experts.csv" "$OUT/ncu_delta.csv" <<'PY'
import csv, sys, collections
for path in sys.argv[1:]:
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows: print(path, ": no ncu rows"); continue
    hdr = rows[0]; idx = {h: i for i, h in enumerate(hdr)}
    want = ["Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Achieved Occupancy",
            "Theoretical Occupancy", "Registers Per Thread", "Grid Size", "Block Size", "L1/TEX Hit Rate",
            "L2 Hit Rate", "Warp Cycles Per Issued Instruction", "Issued Warp Per Scheduler"]
    per = collections.OrderedDict()
    for r in rows[1:]:
        k = (r[idx["ID"]], r[idx["Kernel Name"]][:70])
        per.setdefault(k, {})[r[idx["Metric Name"]]] = r[idx["Metric Value"]] + " " + r[idx["Metric Unit"]]
    for (i, name), m in per.items():
        print(i, name)
        print("   ", " | ".join(f"{w}: {m.get(w, '-')}" for w in want))
        stalls = []
        for n, v in m.items():
            if "issue_stalled" in n:
                try: stalls.append((float(v.split()[0].replace(',', '')), n.split("issue_stalled_")[1].split("_per_")[0]))
                except ValueError: pass
        stalls.sort(reverse=True)
        if stalls: print("    stalls (warp cycles per issue):", ", ".join(f"{n} {v:.2f}" for v, n in stalls[:7]))
PY
