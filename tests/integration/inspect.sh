#!/usr/bin/env bash
# kiln inspect on the bundled Qwen3.5-397B-A17B NVFP4 config: JSON keys and values against hand
# arithmetic (see tests/unit/format/capacity_test.cpp for the derivations).
# Args: $1 = kiln binary, $2 = repo root.
set -euo pipefail
KILN=$1
ROOT=$2
CFG="$ROOT/configs/qwen3.5-397b-a17b-nvfp4"

out=$("$KILN" inspect --model-path "$CFG" --tp 8 --gpu-mem-gib 96 --json)
python3 - "$out" <<'PY'
import json, math, sys
j = json.loads(sys.argv[1])
def check(cond, what):
    if not cond:
        print("FAIL:", what, file=sys.stderr)
        sys.exit(1)
for key in ["params_total", "params_active", "weight_bytes", "decode_bytes_per_token", "kv_bytes_per_token",
            "state_bytes_per_sequence", "max_kv_tokens", "weight_bytes_per_gpu", "kv_bytes_per_token_per_gpu"]:
    check(key in j, "missing key " + key)
check(j["model_type"] == "qwen3_5_moe", "model_type")
check(j["layer_pattern"] == "15 x [linear, linear, linear, full]", "layer pattern " + j["layer_pattern"])
check(abs(j["params_total"] / 1e9 - 397) < 1.0, "params_total %d" % j["params_total"])
check(abs(j["params_active"] / 1e9 - 17) < 0.5, "params_active %d" % j["params_active"])
check(abs(j["decode_bytes_per_token"] / 1e9 - 22) < 0.5, "decode bytes %d" % j["decode_bytes_per_token"])
# 15 full layers x 2 KV heads x 256 dims x (K, V) x 2 bytes.
check(j["kv_bytes_per_token"] == 15 * 2 * 256 * 2 * 2 == 30720, "kv bytes %d" % j["kv_bytes_per_token"])
# 45 linear layers x (64 x 128 x 128 fp32 state (--mamba-ssm-dtype auto = float32) + 12288 conv channels x 3 taps x
# 4 bytes (fp32)).
check(j["recurrent_state_dtype"] == "float32", "recurrent state dtype " + j["recurrent_state_dtype"])
check(j["state_bytes_per_sequence"] == 45 * (64 * 128 * 128 * 4 + 12288 * 3 * 4), "state bytes")
check(j["kv_bytes_per_token_per_gpu"] == 15360, "kv per gpu (one KV head per GPU at tp 8)")
gib = 1024 ** 3
budget = 96 * gib * 0.90 - j["weight_bytes_per_gpu"] - 2 * gib
check(abs(j["max_kv_tokens"] - math.floor(budget / 15360)) <= 1, "max_kv_tokens %d" % j["max_kv_tokens"])
check(j["weight_bytes_by_dtype"]["U8"] == 60 * 512 * 3 * 1024 * 4096 // 2, "FP4 expert bytes")
# kiln serve's plan of each GPU: the same per-GPU weights and KV bytes per token, every part inside the budget.
sp = j["serve_plan_per_gpu"]
check(sp["weight_bytes"] == j["weight_bytes_per_gpu"], "serve plan weights = the rank's weights")
check(sp["kv_bytes"] == sp["kv_tokens"] * 15360, "serve plan KV = tokens x one KV head's bytes")
check(sp["weight_bytes"] + sp["kv_bytes"] + sp["state_bytes"] + sp["activation_bytes"] <= 96 * 2**30 * 0.9 + 1, "within budget")
print("inspect 397B tp8/96GiB: ok, max_kv_tokens", j["max_kv_tokens"])
PY

# Text output and the errors users will hit.
err=$(mktemp)
trap 'rm -f "$err"' EXIT
"$KILN" inspect --model-path "$CFG" --tp 2 --gpu-mem-gib 141 | grep -q "15 x \[linear, linear, linear, full\]"
if "$KILN" inspect --model-path "$ROOT/does-not-exist" 2>"$err"; then echo "FAIL: missing dir accepted"; exit 1; fi
grep -q "does not exist" "$err"
if "$KILN" inspect --model-path "$CFG" --kv-cache-dtype int4 2>"$err"; then echo "FAIL: bad kv dtype accepted"; exit 1; fi
grep -q "kv-cache-dtype 'int4' is not supported" "$err"
# kiln serve's own plan on one GPU: the 35B-A3B shape with 64 requests: everything the budget (141 GiB x 0.9)
# leaves after weights, state slots and activations is KV cache (pages of 16 tokens x 20,480 bytes); the 397B
# does not fit one 141 GiB GPU.
out35=$("$KILN" inspect --model-path "$ROOT/configs/qwen3.5-35b-a3b-nvfp4" --gpu-mem-gib 141 --max-running-requests 64 \
  --context-length 8192 --disable-radix-cache)
echo "$out35" | grep -q "kiln serve on one 141 GiB GPU (--max-running-requests 64, prefix cache off" ||
  { echo "FAIL: no serve plan"; exit 1; }
# With the prefix cache (serve's default) each running request takes 3 state slots: its own and two snapshots
# (engine/scheduler.h, the rule kiln serve sizes its slots by).
"$KILN" inspect --model-path "$ROOT/configs/qwen3.5-35b-a3b-nvfp4" --gpu-mem-gib 141 --max-running-requests 64 \
  --context-length 8192 | grep -q "(192 slots, 64 running requests)" || { echo "FAIL: cache-on slots"; exit 1; }
echo "$out35" | python3 -c '
import re, sys
t = sys.stdin.read()
m = re.search(r"weights ([0-9.]+) GiB, KV cache ([0-9.]+) GiB \(([0-9]+) pages = ([0-9]+) tokens.*state slots ([0-9.]+) GiB \(64 slots.*activations ([0-9.]+) GiB", t)
if not m: sys.exit("FAIL: serve plan: " + t)
w, kv, pages, tokens, st, act = float(m[1]), float(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6])
budget = 141 * 0.9
left = budget - w - st - act
assert tokens == pages * 16, t
assert abs(pages * 16 * 20480 / 2**30 - kv) < 0.01, t
assert kv <= left + 0.01 and kv > left - 0.02, (kv, left, t)
print("inspect serve plan: ok, KV", kv, "GiB of", round(left, 2), "left")
' || exit 1
"$KILN" inspect --model-path "$CFG" --gpu-mem-gib 141 | grep -q "does not fit: out of GPU memory" ||
  { echo "FAIL: the 397B on one GPU should not fit"; exit 1; }
echo "inspect: all checks passed"
