#!/usr/bin/env bash
# GPU machine: the per-step token budget (--chunked-prefill-size) on a full-size random checkpoint of a config
# (kiln dummy-checkpoint). For each budget in $BUDGETS (default "auto 512": auto is 8192 on an H200) kiln serve is
# started fresh and measured with kiln bench: 512 in / 128 out at concurrency 64 (throughput), at concurrency 16
# (ITL p50 / p99), and at concurrency 16 with every $LONG_EVERY-th request an $LONG_LEN-token prompt (ITL of the
# short requests while long prompts prefill). A table of the numbers ends the run. CARRY/new holds kiln.
#   OUT=... [BUDGETS="auto 512 2048"] [PASSES="auto 512"] [TTFT_LEN=32000] bash tools/gpu/prefill_budget_h200.sh CARRY [CONFIG_DIR]
# PASSES: the --max-pass-tokens values tried with each budget (default: $PASS, default auto); TTFT_LEN: also the time
# to first token of one prompt of that many tokens (concurrency 1, 3 requests) per setting (0: skipped).
set -uo pipefail
CARRY=${1:-gpu-carry}
CFG=${2:-configs/qwen3.5-35b-a3b-nvfp4}
OUT=${OUT:-/tmp/kiln-gpu}
CK=${CK:-/tmp/kiln-ck}
BUDGETS=${BUDGETS:-auto 512}
PASS=${PASS:-auto}
PASSES=${PASSES:-$PASS}
TTFT_LEN=${TTFT_LEN:-0}
LONG_LEN=${LONG_LEN:-8192}
LONG_EVERY=${LONG_EVERY:-8}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
for f in "$CARRY"/new/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
K="$CARRY/new/kiln"
"$K" version || { ldd "$K" | grep "not found"; exit 1; }
URL=http://127.0.0.1:30000
start() {  # start LOG ARGS...: serve, wait until ready, print the seconds and the plan / prefill lines
  local log=$1; shift
  local t0=$(date +%s.%N)
  "$K" serve --device cuda --port 30000 "$@" > "$log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1200); do curl -sf $URL/health > /dev/null && break; kill -0 $SERVER 2>/dev/null || break; sleep 0.25; done
  echo "ready after $(python3 -c "import time; print(f'{time.time()-$t0:.1f}')") s"
  grep -E "memory plan:|prefill:|batching" "$log" | grep -v "runner:" | head -4
}
stop() { kill -TERM $SERVER 2>/dev/null; wait $SERVER; echo "serve exit status: $?"; }
bench() {  # bench NAME ARGS...
  local name=$1; shift
  timeout 280 "$K" bench --url $URL --output-len 128 --tokenizer "$CK" --no-progress --json "$OUT/$name.json" "$@" \
    2>&1 | grep -E "^(Output token|TTFT|ITL|TPOT)" | sed "s/^/  [$name] /"
}

echo "== dummy-checkpoint $CFG"
[ -f "$CK/model.safetensors.index.json" ] || "$K" dummy-checkpoint --model-path "$CFG" --output "$CK" --tokenizer-from models/kiln-tiny 2>&1 | tail -3
SETTINGS=""
for b in $BUDGETS; do
  for p in $PASSES; do
    n="${b}_p${p}"
    SETTINGS="$SETTINGS $n"
    echo "== --chunked-prefill-size $b --max-pass-tokens $p"
    start "$OUT/serve_budget_$n.log" --model-path "$CK" --chunked-prefill-size "$b" --max-pass-tokens "$p"
    bench "c64_$n" --input-len 512 --max-concurrency 64
    bench "c16_$n" --input-len 512 --max-concurrency 16
    bench "c16mixed_$n" --input-len 512 --max-concurrency 16 --num-prompts 128 --long-input-len "$LONG_LEN" \
      --long-every "$LONG_EVERY"
    if [ "$TTFT_LEN" -gt 0 ]; then
      timeout 280 "$K" bench --url $URL --output-len 4 --tokenizer "$CK" --no-progress --json "$OUT/ttft_$n.json" \
        --input-len "$TTFT_LEN" --max-concurrency 1 --num-prompts 3 2>&1 | grep -E "^TTFT" | sed "s/^/  [ttft_$n] /"
    fi
    stop
  done
done
python3 - "$OUT" $SETTINGS <<'EOF'
import json, sys, os
out, budgets = sys.argv[1], sys.argv[2:]
def level(name):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p): return None
    j = json.load(open(p))
    return j["levels"][0] if j.get("levels") else None
print(f"{'budget_pass':>12} {'c64 out tok/s':>14} {'c16 out tok/s':>14} {'c16 ITL p50':>12} {'c16 ITL p99':>12} {'p99/p50':>8} "
      f"{'mixed ITL p50':>14} {'mixed ITL p99':>14} {'p99/p50':>8} {'long TTFT p50':>14} {'TTFT_LEN TTFT':>14}")
for b in budgets:
    c64, c16, mx = level(f"c64_{b}"), level(f"c16_{b}"), level(f"c16mixed_{b}")
    f = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else "-"
    s = (mx or {}).get("short_prompts", {}).get("itl_ms", {})
    lt = (mx or {}).get("long_prompts", {}).get("ttft_ms", {})
    i16 = (c16 or {}).get("itl_ms", {})
    ratio = lambda d: f"{d['p99'] / d['median']:.2f}" if d and d.get("median") else "-"
    tt = (level(f"ttft_{b}") or {}).get("ttft_ms", {})
    print(f"{b:>12} {f((c64 or {}).get('output_throughput')):>14} {f((c16 or {}).get('output_throughput')):>14} "
          f"{f(i16.get('median')):>12} {f(i16.get('p99')):>12} {ratio(i16):>8} {f(s.get('median')):>14} "
          f"{f(s.get('p99')):>14} {ratio(s):>8} {f(lt.get('median')):>14} {f(tt.get('median')):>14}")
EOF
