#!/usr/bin/env bash
# Long contexts, KV paging, preemption and the prefix cache through `kiln serve` (kiln-tiny on the CPU):
#  - 16k- and 32k-token prompts are accepted and answered by a server whose model config allows them: a copy of
#    kiln-tiny's folder with max_position_embeddings raised to 40960 (its own is 4096), served by the hash dummy
#    runner (the engine, scheduler and paged KV bookkeeping are the real ones; a 32k-token prefill of the real
#    model takes over 10 minutes on a 2-core CPU, so that one is a GPU run: docs/perf/prefix-cache.md);
#  - with --max-total-tokens 2048 a request without max_tokens is served (the context is capped to the pool);
#  - usage.prompt_tokens_details.cached_tokens reports prefix-cache hits, streamed and not; --disable-radix-cache
#    reports 0;
#  - 32 concurrent greedy requests in a 256-token KV pool are preempted and recomputed and give the outputs they
#    give alone; /metrics is back to 0 pages and slots in use.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
# serve_init's work dir and cleanup, without its node checks (this test's client is python3).
KILN=$1
SERVE_WORK=$(mktemp -d)
trap serve_cleanup EXIT
if [ ! -f "$ROOT/models/kiln-tiny/model.safetensors" ]; then
  echo "SKIP: models/kiln-tiny is missing"
  exit 0
fi

LONG="$SERVE_WORK/kiln-tiny-40k"
cp -r "$ROOT/models/kiln-tiny" "$LONG"
python3 - "$LONG/config.json" <<'EOF'
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["max_position_embeddings"] = 40960
json.dump(c, open(p, "w"), indent=2)
EOF

CLIENT="$SERVE_WORK/client.py"
cat > "$CLIENT" <<'EOF'
import json, sys, threading, urllib.request, urllib.error

def post(url, body, stream=False):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            data = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    if not stream:
        return status, json.loads(data)
    usage, text = None, ""
    for line in data.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                text += ch.get("text") or ""
    return status, {"usage": usage, "text": text}

def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"FAIL: metric {name} missing")

fails = 0
def check(ok, what):
    global fails
    print(("ok: " if ok else "FAIL: ") + what)
    if not ok:
        fails += 1

mode, base = sys.argv[1], sys.argv[2]
comp = base + "/v1/completions"
if mode == "long":
    for n in (16000, 32000):
        ids = [300 + (i * 7919) % 1500 for i in range(n)]
        st, r = post(comp, {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        check(st == 200 and r["usage"]["prompt_tokens"] == n and r["usage"]["completion_tokens"] == 4,
              f"{n}-token prompt answered (status {st}: {str(r)[:200]})")
elif mode == "default-max-tokens":
    st, r = post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    check(st == 200, f"no max_tokens with --max-total-tokens 2048: status {st} {str(r)[:300]}")
    with urllib.request.urlopen(base + "/v1/models", timeout=30) as m:
        mm = json.loads(m.read().decode())
    check(mm["data"][0].get("max_model_len") == 2048, f"context capped to the pool: {mm['data'][0]}")
elif mode in ("cached", "uncached"):
    stem = [300 + (i * 31) % 1500 for i in range(200)]
    out = []
    for k, stream in enumerate((False, True, False, True)):
        body = {"prompt": stem + [1000 + k] * 5, "max_tokens": 3, "temperature": 0}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        st, r = post(comp, body, stream)
        check(st == 200 and r["usage"] is not None, f"request {k} (stream {stream}) status {st}")
        out.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    if mode == "cached":
        check(out[0] == 0 and all(c >= 192 for c in out[1:]), f"cached_tokens {out} (192+ of the shared 200)")
        check(metric(base, "kiln:prefix_cache_hit_tokens_total") >= 3 * 192, "hit tokens counted in /metrics")
    else:
        check(out == [0, 0, 0, 0], f"cached_tokens with --disable-radix-cache: {out}")
elif mode in ("alone", "together"):
    prompts = [[300 + (i * 97 + j * 13) % 1500 for j in range(10 + i % 15)] for i in range(32)]
    def run(p):
        st, r = post(comp, {"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
        return r["choices"][0]["text"] if st == 200 else f"status {st}: {r}"
    if mode == "alone":
        ref = [run(p) for p in prompts]
        check(all(not t.startswith("status ") for t in ref), "32 requests answered one at a time")
        json.dump(ref, open(sys.argv[3], "w"))
    else:
        ref = json.load(open(sys.argv[3]))
        got = [None] * len(prompts)
        def worker(i):
            got[i] = run(prompts[i])
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in ts: t.start()
        for t in ts: t.join()
        same = sum(1 for a, b in zip(got, ref) if a == b)
        check(same == len(prompts), f"{same} of {len(prompts)} concurrent outputs equal their runs alone")
        check(metric(base, "kiln:preemptions_total") > 0, "requests were preempted")
        check(metric(base, "kiln:kv_pages_used") == 0, "no KV page in use after")
        check(metric(base, "kiln:state_slots_used") == 0, "no state slot in use after")
sys.exit(1 if fails else 0)
EOF

failures=0
run_client() { python3 "$CLIENT" "$@" || failures=$((failures + 1)); }

start_server long --model-path "$LONG" --dummy-runner hash --max-running-requests 2 --chunked-prefill-size 2048
run_client long "$URL_long"
stop_server long

start_server small --device cpu --max-total-tokens 2048
run_client default-max-tokens "$URL_small"
run_client cached "$URL_small"
stop_server small

start_server nocache --device cpu --disable-radix-cache
run_client uncached "$URL_nocache"
run_client alone "$URL_nocache" "$SERVE_WORK/alone.json"
stop_server nocache

start_server tinypool --device cpu --max-total-tokens 256 --max-running-requests 32 --chunked-prefill-size 64
run_client together "$URL_tinypool" "$SERVE_WORK/alone.json"
stop_server tinypool

if [ "$failures" != 0 ]; then
  for l in "$SERVE_WORK"/*.log; do echo "== $l"; tail -15 "$l"; done
  echo "FAIL: serve_kv_cache ($failures)"
  exit 1
fi
echo "PASS: serve_kv_cache"
