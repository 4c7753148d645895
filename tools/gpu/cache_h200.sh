#!/usr/bin/env bash
# GPU machine: kiln smoke on kiln-tiny (CUDA), test_cuda, then a full-size random checkpoint (kiln
# dummy-checkpoint) served with the prefix cache on and off: kiln bench 512/128 at concurrency 64 and
# `kiln bench --multi-turn 5` (8k-token conversations by turn 5). CARRY/new holds kiln and test_cuda.
#   OUT=... bash tools/gpu/cache_h200.sh CARRY [CONFIG_DIR]
set -uo pipefail
CARRY=${1:-gpu-carry}
CFG=${2:-configs/qwen3.5-35b-a3b-nvfp4}
OUT=${OUT:-/tmp/kiln-gpu}
CK=${CK:-/tmp/kiln-ck}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/new/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/new/kiln"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }
URL=http://127.0.0.1:30000
start() {  # start LOG ARGS...: serve, wait until ready, print the seconds
  local log=$1; shift
  local t0=$(date +%s.%N)
  "$K" serve --device cuda --port 30000 "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1200); do curl -sf $URL/health > /dev/null && break; kill -0 $SERVER 2>/dev/null || break; sleep 0.25; done
  echo "ready after $(python3 -c "import time; print(f'{time.time()-$t0:.1f}')") s"
  grep -E "KV cache|context|state slots|max_total|batching" "$log" | head -6
}
stop() { kill -TERM $SERVER 2>/dev/null; wait $SERVER; echo "serve exit status: $?"; }

echo "== kiln smoke on kiln-tiny (cuda)"
start "$OUT/serve_tiny.log" --model-path models/kiln-tiny
"$K" smoke --url $URL 2>&1 | tail -10
stop
if [ -x "$CARRY/new/test_cuda" ]; then
  echo "== test_cuda"
  timeout 240 "$CARRY/new/test_cuda" > "$OUT/test_cuda.log" 2>&1; echo "test_cuda rc=$?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/test_cuda.log" | head -20
fi
echo "== dummy-checkpoint $CFG"
[ -f "$CK/model.safetensors.index.json" ] || "$K" dummy-checkpoint --model-path "$CFG" --output "$CK" --tokenizer-from models/kiln-tiny 2>&1 | tail -3
for mode in on off; do
  flags=""; [ $mode = off ] && flags="--disable-radix-cache"
  echo "== prefix cache $mode"
  start "$OUT/serve_ck_$mode.log" --model-path "$CK" $flags
  timeout 200 "$K" bench --url $URL --multi-turn 5 --conversations 8 --input-len 1600 --output-len 128 \
    --tokenizer "$CK" --no-progress --json "$OUT/multiturn_$mode.json" 2>&1 | tail -14
  if [ $mode = on ]; then
    timeout 200 "$K" bench --url $URL --input-len 512 --output-len 128 --max-concurrency 64 --tokenizer "$CK" \
      --no-progress --json "$OUT/bench64.json" 2>&1 | tail -4
    curl -s $URL/metrics | grep -E "prefix_cache|preempt" | head -12
  fi
  stop
done
