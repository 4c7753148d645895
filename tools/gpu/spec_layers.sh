#!/usr/bin/env bash
# A single rank of a model too large for the card, measured at two layer truncations and extrapolated to its full
# depth: the plain decode step, the MTP draft chain and the verify pass (`kiln bench-engine --spec-sweep`), so the
# speculative projection of, e.g., the 397B's TP-2 rank (~112 GB of weights) can be made on an 80 GB card.
#   OUT=... bash tools/gpu/spec_layers.sh CARRY
# CARRY holds lib/ and new/kiln (stripped, xz-compressed; see README.md). Variables: CONFIG (default the 397B),
# LAYERS (two or more depths, multiples of the full-attention interval; default "16 32"), TP (default 2), BATCHES
# (default 1), SWEEP (default 1,2,3,4), INPUT_LEN (default 512), EXTRA (more bench-engine flags).
# Then tools/gpu/extrapolate_layers.py fits each cost as a + b * layers and prints the full-depth PROJECTION.
set -uo pipefail
CARRY=${1:-gpu-carry}
WHAT=all
OUT=${OUT:-/tmp/kiln-gpu}
source "$(dirname "$0")/carry.sh"
K="$CARRY/new/kiln"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }
CONFIG=${CONFIG:-configs/qwen3.5-397b-a17b-nvfp4}
TP=${TP:-2}
for n in ${LAYERS:-16 32}; do
  d=/tmp/kiln_layers_$n
  rm -rf "$d" && mkdir -p "$d" && cp "$CONFIG"/*.json "$d"/
  python3 "$(dirname "$0")/extrapolate_layers.py" --truncate "$d/config.json" "$n" || exit 1
  echo "== $n layers, no MTP head: kiln bench-engine --model-path $CONFIG (truncated) --tp $TP --single-rank 0"
  timeout 300 "$K" bench-engine --device cuda --skip-self-check --model-path "$d" --load-format dummy --tp "$TP" \
    --single-rank 0 --batch "${BATCHES:-1}" --input-len "${INPUT_LEN:-512}" --output-len 32 ${EXTRA:-} \
    > "$OUT/layers_${n}_plain.txt" 2>&1
  echo "rc=$?"
  grep -E "^batch|error|Error" "$OUT/layers_${n}_plain.txt" | head -5
  log="$OUT/layers_$n.txt"
  echo "== $n layers: kiln bench-engine --model-path $CONFIG (truncated) --tp $TP --single-rank 0 --batch ${BATCHES:-1}" \
       "--spec-sweep ${SWEEP:-1,2,3,4} ${EXTRA:-}"
  timeout 400 "$K" bench-engine --device cuda --skip-self-check --model-path "$d" --load-format dummy --tp "$TP" \
    --single-rank 0 --batch "${BATCHES:-1}" --input-len "${INPUT_LEN:-512}" --output-len 32 \
    --spec-sweep "${SWEEP:-1,2,3,4}" ${EXTRA:-} > "$log" 2>&1
  echo "rc=$?"
  grep -E "^batch|spec K|error|Error|plan" "$log" | head -30
done
python3 "$(dirname "$0")/extrapolate_layers.py" --config "$CONFIG" "$OUT"/layers_*.txt | tee "$OUT/projection.txt"
