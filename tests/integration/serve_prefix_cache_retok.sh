#!/usr/bin/env bash
# The prefix cache with a random-weight checkpoint and a covering tokenizer (`kiln dummy-checkpoint`, the setup of
# the H200 run that got 0 hits): multi-turn conversations whose next turn re-sends the history as text, over
# /v1/completions (history text + answer text + new message, re-tokenized by the server) and over
# /v1/chat/completions (the messages, rendered by the chat template). The random model's answers are byte soup that
# re-tokenizes into other ids, and the previous prompt's last word can merge with them: each turn from the second
# on must still reuse the previous turn's prompt up to its second-to-last page boundary
# (usage.prompt_tokens_details.cached_tokens), and greedy answers equal those with --disable-radix-cache.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
KILN=$1
SERVE_WORK=$(mktemp -d)
trap serve_cleanup EXIT
if [ ! -f "$ROOT/models/kiln-tiny/config.json" ]; then
  echo "SKIP: models/kiln-tiny is missing"
  exit 0
fi

# kiln-tiny's config (qwen3_5_moe, 8 layers, 6 of them Gated DeltaNet) with random weights and a covering tokenizer.
mkdir -p "$SERVE_WORK/cfg"
cp "$ROOT/models/kiln-tiny/config.json" "$ROOT/models/kiln-tiny/hf_quant_config.json" "$SERVE_WORK/cfg/"
"$KILN" dummy-checkpoint --model-path "$SERVE_WORK/cfg" --output "$SERVE_WORK/random" \
  --tokenizer-from "$ROOT/models/kiln-tiny" > "$SERVE_WORK/dummy.log" 2>&1 || { cat "$SERVE_WORK/dummy.log"; exit 1; }

CLIENT="$SERVE_WORK/client.py"
cat > "$CLIENT" <<'EOF'
import json, sys, random, urllib.request

def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read().decode())

WORDS = "time year people way day man thing woman life child world school state family student group".split()
mode, base, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
rng = random.Random(7)
convs, turns = 2, 4
page = json.load(urllib.request.urlopen(base + "/server_info", timeout=30)).get("page_size", 16)
result = {"answers": [], "cached": [], "need": []}
for c in range(convs):
    prompt, messages, prev_tokens = "", [], 0
    for t in range(turns):
        msg = " ".join(rng.choice(WORDS) for _ in range(40 + 7 * c))
        if mode == "text":
            prompt += (" " if prompt else "") + msg
            r = post(base + "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                "ignore_eos": True})
            answer = r["choices"][0]["text"]
            prompt += answer
        else:
            messages.append({"role": "user", "content": msg})
            r = post(base + "/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0,
                                                     "ignore_eos": True})
            answer = r["choices"][0]["message"].get("content") or ""
            messages.append({"role": "assistant", "content": answer})
        u = r["usage"]
        result["answers"].append(answer)
        result["cached"].append((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        # What must be reused: the previous prompt up to its second-to-last page boundary.
        result["need"].append(max(0, prev_tokens // page * page - page) if t > 0 else 0)
        prev_tokens = u["prompt_tokens"]
json.dump(result, open(out_path, "w"))
print(mode, "cached_tokens", result["cached"], "at least", result["need"])
EOF

CHECK="$SERVE_WORK/check.py"
cat > "$CHECK" <<'EOF'
import json, sys
on, off = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
fails = 0
hits = [c >= n for c, n, first in zip(on["cached"], on["need"], [i % 4 == 0 for i in range(len(on["need"]))]) if not first]
if not all(hits) or sum(on["cached"]) == 0:
    print(f"FAIL: {sys.argv[3]}: cached_tokens {on['cached']}, needed at least {on['need']}"); fails += 1
if on["answers"] != off["answers"]:
    print(f"FAIL: {sys.argv[3]}: greedy answers differ with the cache on and off"); fails += 1
if any(off["cached"]):
    print(f"FAIL: {sys.argv[3]}: cached_tokens {off['cached']} with --disable-radix-cache"); fails += 1
sys.exit(1 if fails else 0)
EOF

failures=0
start_server on --model-path "$SERVE_WORK/random" --device cpu --max-running-requests 4
for mode in text chat; do python3 "$CLIENT" $mode "$URL_on" "$SERVE_WORK/on_$mode.json" || failures=$((failures + 1)); done
stop_server on
start_server off --model-path "$SERVE_WORK/random" --device cpu --max-running-requests 4 --disable-radix-cache
for mode in text chat; do python3 "$CLIENT" $mode "$URL_off" "$SERVE_WORK/off_$mode.json" || failures=$((failures + 1)); done
stop_server off
for mode in text chat; do
  python3 "$CHECK" "$SERVE_WORK/on_$mode.json" "$SERVE_WORK/off_$mode.json" "$mode" || failures=$((failures + 1))
done

if [ "$failures" != 0 ]; then
  for l in "$SERVE_WORK"/*.log; do echo "== $l"; tail -15 "$l"; done
  echo "FAIL: serve_prefix_cache_retok ($failures)"
  exit 1
fi
echo "PASS: serve_prefix_cache_retok"
