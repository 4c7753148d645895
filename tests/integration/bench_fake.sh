#!/usr/bin/env bash
# kiln bench against the fake server (tests/fake_server) in `good` mode with known delays: 40 ms to
# the first token, 5 ms between tokens. The measured numbers must agree with those delays, prompts
# must be exactly --input-len tokens, and server errors must fail the run loudly.
# Usage: bench_fake.sh KILN_BINARY [REPO_ROOT]
set -euo pipefail
KILN=${1:?usage: bench_fake.sh KILN_BINARY [REPO_ROOT]}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fake_lib.sh"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

FIRST_MS=40
TOKEN_MS=5
INPUT=32
OUTPUT=16
N=8
DELAYS=(--first-token-delay-ms $FIRST_MS --token-delay-ms $TOKEN_MS)
BENCH=(--input-len $INPUT --output-len $OUTPUT --num-prompts $N --no-progress)

# check_numbers JSON LEVELS_CSV TOKEN_SOURCE: sanity of every level given the fake server's delays.
check_numbers() {
  python3 - "$@" "$FIRST_MS" "$TOKEN_MS" "$INPUT" "$OUTPUT" "$N" <<'PY'
import json, sys
path, levels_csv, source = sys.argv[1], sys.argv[2], sys.argv[3]
first_ms, token_ms, input_len, output_len, n = map(float, sys.argv[4:9])
r = json.load(open(path))
errors = []
def need(cond, what):
    if not cond: errors.append(what)
need(r["passed"] is True, f"passed={r['passed']} failure={r['failure']}")
levels = [l["max_concurrency"] for l in r["levels"]]
need(levels == [int(c) for c in levels_csv.split(",")], f"levels {levels}")
# Fastest possible request: first token after first_ms, then (output-1) gaps of token_ms.
min_e2e_ms = first_ms + (output_len - 1) * token_ms
prev_tput = None
for l in r["levels"]:
    c = l["max_concurrency"]
    tag = f"c={c}:"
    need(l["completed"] == n and l["failed"] == 0, f"{tag} completed {l['completed']} failed {l['failed']}")
    need(l["total_input_tokens"] == n * input_len, f"{tag} input tokens {l['total_input_tokens']} (prompts not exact?)")
    need(l["total_output_tokens"] == n * output_len, f"{tag} output tokens {l['total_output_tokens']}")
    need(l["output_tokens_counted_from"] == source, f"{tag} counted from {l['output_tokens_counted_from']}")
    ttft, tpot, itl, e2e = l["ttft_ms"], l["tpot_ms"], l["itl_ms"], l["e2e_ms"]
    need(first_ms <= ttft["median"] < first_ms + 400, f"{tag} TTFT median {ttft['median']}")
    need(ttft["min"] >= first_ms, f"{tag} TTFT min {ttft['min']} below the fake delay")
    need(token_ms <= tpot["median"] < token_ms * 10, f"{tag} TPOT median {tpot['median']}")
    need(itl["count"] == n * (output_len - 1), f"{tag} ITL count {itl['count']}")
    need(itl["mean"] <= tpot["mean"] + 1e-6, f"{tag} ITL mean {itl['mean']} > TPOT mean {tpot['mean']}")
    need(e2e["min"] >= min_e2e_ms, f"{tag} E2E min {e2e['min']} < {min_e2e_ms}")
    for p in ("median", "p90", "p99"):
        need(ttft[p] <= ttft["max"] and tpot[p] <= tpot["max"], f"{tag} percentile {p} above max")
    user = l["per_user_tok_s"]["from_median_tpot"]
    need(1000 / (token_ms * 10) < user <= 1000 / token_ms, f"{tag} per-user tok/s {user}")
    # Output tok/s can never beat c requests each taking min_e2e_ms.
    cap = min(c, n) * output_len / (min_e2e_ms / 1000)
    need(0.1 * cap / min(c, n) < l["output_throughput"] <= cap, f"{tag} output tok/s {l['output_throughput']} (cap {cap:.1f})")
    need(abs(l["output_throughput"] * l["duration_s"] - n * output_len) < 1e-6 * n * output_len + 1e-6, f"{tag} tok/s x duration")
    need(abs(l["total_throughput"] * l["duration_s"] - n * (input_len + output_len)) < 1e-3, f"{tag} total tok/s")
    need(abs(l["request_throughput"] * l["duration_s"] - n) < 1e-6, f"{tag} req/s")
    if prev_tput is not None:
        need(l["output_throughput"] > 1.5 * prev_tput, f"{tag} more concurrency did not raise tok/s ({prev_tput} -> {l['output_throughput']})")
    prev_tput = l["output_throughput"]
if errors:
    print("\n".join("  " + e for e in errors))
    sys.exit(1)
PY
}

# 1. completions endpoint, usage counts, a concurrency sweep.
start_fake --mode good "${DELAYS[@]}"
if "$KILN" bench --url "http://127.0.0.1:$PORT" "${BENCH[@]}" --max-concurrency 1,4 --json "$WORK/sweep.json" \
     > "$WORK/sweep.txt" 2>&1 && check_numbers "$WORK/sweep.json" 1,4 usage &&
   grep -q "max concurrency 4: 8 requests" "$WORK/sweep.txt" && grep -q "Summary" "$WORK/sweep.txt" &&
   grep -q "counted from the server's usage" "$WORK/sweep.txt"; then
  echo "ok: completions sweep 1,4 (numbers agree with the fake delays)"
else
  fail "completions sweep"; cat "$WORK/sweep.txt"
fi

# 2. chat endpoint with Poisson arrivals.
if "$KILN" bench --url "http://127.0.0.1:$PORT" "${BENCH[@]}" --endpoint chat --max-concurrency 2 --request-rate 50 \
     --seed 7 --json "$WORK/chat.json" > "$WORK/chat.txt" 2>&1 && check_numbers "$WORK/chat.json" 2 usage; then
  echo "ok: chat endpoint, request rate 50"
else
  fail "chat endpoint"; cat "$WORK/chat.txt"
fi

# 2b. Multi-turn: 2 conversations x 3 turns; every turn answered, TTFT no less than the fake's first-token delay,
# the prompt (history + new message) longer every turn.
if "$KILN" bench --url "http://127.0.0.1:$PORT" --input-len $INPUT --output-len $OUTPUT --no-progress --multi-turn 3 \
     --conversations 2 --json "$WORK/multi.json" > "$WORK/multi.txt" 2>&1 &&
   python3 - "$WORK/multi.json" "$FIRST_MS" "$INPUT" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
first_ms, input_len = float(sys.argv[2]), float(sys.argv[3])
turns = r["per_turn"]
assert r["passed"] and len(turns) == 3, r
for t in turns:
    assert t["completed"] == 2 and t["failed"] == 0, t
    assert t["ttft_ms"]["min"] >= first_ms, t
prompts = [t["mean_prompt_tokens"] for t in turns]
assert prompts[0] >= input_len and prompts[0] < prompts[1] < prompts[2], prompts
PY
then
  echo "ok: multi-turn 2 conversations x 3 turns"
else
  fail "multi-turn"; cat "$WORK/multi.txt"
fi
stop_fake

# 3. A server that sends no usage: tokens are counted as streamed chunks, and the output says so.
start_fake --mode good "${DELAYS[@]}" --no-usage
if "$KILN" bench --url "http://127.0.0.1:$PORT" "${BENCH[@]}" --max-concurrency 2 --json "$WORK/chunks.json" \
     > "$WORK/chunks.txt" 2>&1 && grep -q "counted as streamed chunks" "$WORK/chunks.txt" &&
   python3 -c "import json,sys; l=json.load(open(sys.argv[1]))['levels'][0]; sys.exit(not (l['output_tokens_counted_from']=='chunks' and l['total_output_tokens']==$N*$OUTPUT))" "$WORK/chunks.json"; then
  echo "ok: no usage -> counted as chunks"
else
  fail "no-usage counting"; cat "$WORK/chunks.txt"
fi
stop_fake

# 4. Server errors fail the run loudly: every 3rd request answers HTTP 500.
start_fake --mode good --fail-every 3
set +e
"$KILN" bench --url "http://127.0.0.1:$PORT" "${BENCH[@]}" --max-concurrency 2 --json "$WORK/errors.json" \
  > "$WORK/errors.out" 2> "$WORK/errors.err"
rc=$?
set -e
if [ "$rc" = 1 ] && grep -q "benchmark failed: .*requests failed.*injected failure" "$WORK/errors.err" &&
   grep -q "x HTTP 500: fake server: injected failure" "$WORK/errors.out" &&
   python3 -c "import json,sys; r=json.load(open(sys.argv[1])); sys.exit(not (r['passed'] is False and r['levels'][0]['failed']>0))" "$WORK/errors.json"; then
  echo "ok: failing requests fail the run: $(cat "$WORK/errors.err")"
else
  fail "server errors did not fail the run (exit $rc)"; cat "$WORK/errors.out" "$WORK/errors.err"
fi
stop_fake

# 5. No /tokenize: a clear error that points to --tokenizer.
start_fake --mode good --no-tokenize
set +e
"$KILN" bench --url "http://127.0.0.1:$PORT" "${BENCH[@]}" > "$WORK/notok.out" 2> "$WORK/notok.err"
rc=$?
set -e
if [ "$rc" = 1 ] && grep -q "cannot tokenize.*--tokenizer DIR" "$WORK/notok.err"; then
  echo "ok: no /tokenize -> $(cat "$WORK/notok.err")"
else
  fail "no /tokenize (exit $rc)"; cat "$WORK/notok.out" "$WORK/notok.err"
fi
stop_fake

if [ "$failures" != 0 ]; then
  echo "FAIL: $failures bench_fake case(s) failed"
  exit 1
fi
echo "PASS: bench_fake"
