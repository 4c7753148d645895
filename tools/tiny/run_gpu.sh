#!/usr/bin/env bash
# The kiln-tiny GPU run: data, tokenizer, training, evaluation, calibration (tools/tiny/train.py), then
# everything it wrote is tarred into $OUT in <=15 MB parts (kt.tgz.part-*). Extra args go to train.py.
#   reassemble: cat kt.tgz.part-* | tar -xzf - -C DEST
set -uo pipefail
cd "$(dirname "$0")/../.."
WORK=/tmp/kiln_tiny
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
python3 tools/tiny/train.py --out "$WORK" "$@" 2>&1 | tee "$OUT/train_log.txt"
rc=${PIPESTATUS[0]}
if [ -d "$WORK" ] && [ -n "$(ls -A "$WORK")" ]; then
  rm -f "$OUT"/kt.tgz.part-*
  tar -C "$WORK" -czf - . | split -b 15000000 - "$OUT/kt.tgz.part-"
fi
ls -la "$OUT"
exit "$rc"
