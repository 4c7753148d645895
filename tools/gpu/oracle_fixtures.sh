#!/usr/bin/env bash
# GPU machine (it has torch, transformers, safetensors, Pillow, numpy; the scripts run on its CPU): the transformers
# oracles of the image work, written under $OUT so that they come back, from the repository root:
#   OUT=... bash tools/gpu/oracle_fixtures.sh [vision,media]
# then copy $OUT/fixtures/reference/* to tests/fixtures/reference/ and $OUT/fixtures/media to tests/fixtures/media.
set -uo pipefail
WHAT=${1:-vision,media}
OUT=${OUT:-/tmp/kiln-oracles}
mkdir -p "$OUT/fixtures/reference" "$OUT/fixtures/media"
has() { [[ ",$WHAT," == *",$1,"* ]]; }
python3 -c "import torch, transformers, safetensors; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if has vision; then
  echo "== tools/reference/make_vision_fixtures.py"
  PYTHONUNBUFFERED=1 timeout 400 python3 tools/reference/make_vision_fixtures.py --out "$OUT/fixtures/reference" \
    > "$OUT/vision_fixtures.log" 2>&1
  echo "rc=$?"; tail -40 "$OUT/vision_fixtures.log"
fi
if has media && [ -f tools/reference/make_image_fixtures.py ]; then
  echo "== tools/reference/make_image_fixtures.py"
  PYTHONUNBUFFERED=1 timeout 300 python3 tools/reference/make_image_fixtures.py --out "$OUT/fixtures/media" \
    > "$OUT/media_fixtures.log" 2>&1
  echo "rc=$?"; tail -40 "$OUT/media_fixtures.log"
fi
du -sh "$OUT/fixtures"/* 2>/dev/null
