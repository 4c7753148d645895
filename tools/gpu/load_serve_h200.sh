#!/usr/bin/env bash
# GPU machine: a full-size random checkpoint of a config (kiln dummy-checkpoint, real on-disk layout) written
# to local disk, `kiln serve` on it timed from start to ready (the load rate), then `kiln bench` through the
# server. CARRY as in compare_h200.sh (new/kiln is used).
#   OUT=... bash tools/gpu/load_serve_h200.sh CARRY [CONFIG_DIR] [extra serve flags...]
# Variables: CK (the checkpoint folder; reused when there), CONC (bench concurrencies, default 1,16,64; none: skip),
# NPROMPTS, LONG_TTFT (also time one prompt of this many tokens, alone), MIXED (also run concurrency 16 with every 8th
# prompt this long: the short streams' ITL), TAG (suffix of the output files, for a second run in the same call).
set -uo pipefail
CARRY=${1:-gpu-carry}
CFG=${2:-configs/qwen3.5-35b-a3b-nvfp4}
shift 2 2>/dev/null || shift $#
OUT=${OUT:-/tmp/kiln-gpu}
CK=${CK:-/tmp/kiln-ck}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/*/*.xz; do [ -e "$f" ] && [ ! -x "${f%.xz}" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/new/kiln"
df -h /tmp | tail -1
if [ ! -f "$CK/model.safetensors.index.json" ]; then
  echo "== dummy-checkpoint $CFG -> $CK"
  /usr/bin/time -v "$K" dummy-checkpoint --model-path "$CFG" --output "$CK" 2>&1 | grep -vE "^\s+(Page|Swaps|File|Socket|Signals|Voluntary|Involuntary|Average|Minor|Major|Exit|Percent|System|User)" | tail -8
fi
sync; du -sh "$CK"
echo "== kiln serve --model-path (checkpoint) --device cuda: start to ready"
T0=$(date +%s.%N)
"$K" serve --device cuda --model-path "$CK" --port 30000 "$@" > "$OUT/serve_ck.log" 2>&1 &
SERVER=$!
ready=0
for _ in $(seq 1200); do
  curl -sf http://127.0.0.1:30000/health > /dev/null && { ready=1; break; }
  kill -0 $SERVER 2>/dev/null || break
  sleep 0.25
done
T1=$(date +%s.%N)
echo "ready=$ready after $(python3 -c "print(f'{$T1-$T0:.1f}')") s" | tee "$OUT/load_time.txt"
grep -vE "^\s*$" "$OUT/serve_ck.log" | head -30
TAG=${TAG:-}
if [ $ready = 1 ] && [ -n "${LONG_TTFT:-}" ]; then
  # One long prompt at a time (nothing else running): its time to the first token.
  echo "== kiln bench $LONG_TTFT in / 1 out, concurrency 1 (TTFT of a long prompt)"
  "$K" bench --url http://127.0.0.1:30000 --input-len "$LONG_TTFT" --output-len 1 --max-concurrency 1 --num-prompts 3 \
    --tokenizer "$CK" --no-progress 2>&1 | grep -E "TTFT|E2E|Total input" | tee "$OUT/bench_ttft$TAG.txt"
fi
if [ $ready = 1 ] && [ -n "${MIXED:-}" ]; then
  # Short streams with every 8th request a long prompt: ITL of the short ones (--chunked-prefill-size-while-decoding).
  echo "== kiln bench 512 / 128 at concurrency 16, every 8th prompt $MIXED tokens"
  "$K" bench --url http://127.0.0.1:30000 --input-len 512 --output-len 128 --max-concurrency 16 --num-prompts 64 \
    --long-input-len "$MIXED" --long-every 8 --tokenizer "$CK" --no-progress 2>&1 | grep -E "TTFT|ITL|Output token" \
    | tee "$OUT/bench_mixed$TAG.txt"
fi
if [ $ready = 1 ] && [ "${CONC:-1,16,64}" != none ]; then
  echo "== kiln bench 512 in / 128 out"
  "$K" bench --url http://127.0.0.1:30000 --input-len 512 --output-len 128 --max-concurrency ${CONC:-1,16,64} \
    ${NPROMPTS:+--num-prompts $NPROMPTS} --tokenizer "$CK" --no-progress --json "$OUT/bench_serve$TAG.json" 2>&1 | tail -30 | tee "$OUT/bench_serve$TAG.txt"
fi
kill -TERM $SERVER 2>/dev/null; wait $SERVER; echo "serve exit status: $?"
