#!/usr/bin/env bash
# The kiln-tiny continued-training GPU run (tools/tiny/continue_train.py): warm start from models/kiln-tiny,
# train by wall clock, save BF16, evaluate, calibrate. The script tars what it wrote into $OUT in <=15 MB
# parts (kt.tar.part-*: first the model, then the model + eval + calibration); the log goes to
# $OUT/train_log.txt. Extra args go to continue_train.py.
#   reassemble: cat kt.tar.part-* | tar -xf - -C DEST
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers, tokenizers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)"
python3 tools/tiny/continue_train.py --init-from models/kiln-tiny --out /tmp/kiln_tiny_continue "$@" 2>&1 \
  | tee "$OUT/train_log.txt"
rc=${PIPESTATUS[0]}
ls -la "$OUT"
exit "$rc"
