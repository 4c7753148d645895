#!/usr/bin/env bash
# kiln bench-engine on the CPU: a batch list prints one result line per batch with its numbers, the batch-1 line
# reports the bandwidth from `kiln inspect`'s bytes per token, --load-format dummy runs kiln-tiny's config with
# random weights, and bad flags are one clear error line with exit status 1 (nothing else printed to stdout), --dtype
# included (the CPU backend runs fp32 only).
# $1 = kiln binary, $2 = repo root.
set -uo pipefail
KILN=${1:?usage: bench_engine.sh KILN_BINARY REPO_ROOT}
ROOT=${2:?usage: bench_engine.sh KILN_BINARY REPO_ROOT}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

run() {  # name, args...
  local name=$1; shift
  "$KILN" bench-engine --device cpu --threads 2 "$@" >"$DIR/$name.out" 2>"$DIR/$name.err"
}

if run list --batch 1,3 --input-len 12 --output-len 4; then
  [ "$(grep -c '^batch ' "$DIR/list.out")" = 2 ] || fail "batch list: expected 2 result lines: $(cat "$DIR/list.out")"
  grep -Eq '^batch 3: prefill 36 tokens in [0-9.]+ ms: [0-9.]+ tok/s \| decode 4 steps' "$DIR/list.out" ||
    fail "batch 3 line: $(grep '^batch 3' "$DIR/list.out")"
  grep -Eq 'batch-1 bandwidth: [0-9.e+-]+ GB read per token \(kiln inspect\)' "$DIR/list.out" ||
    fail "no batch-1 bandwidth line"
else
  fail "bench-engine --batch 1,3 exited $?: $(cat "$DIR/list.err")"
fi

if run dummy --model-path "$ROOT/models/kiln-tiny" --load-format dummy --batch 2 --input-len 8 --output-len 3; then
  grep -q '^batch 2: ' "$DIR/dummy.out" || fail "dummy: no result line"
  grep -q 'random weights from config.json' "$DIR/dummy.err" || fail "dummy: no warning that the weights are random"
else
  fail "bench-engine --load-format dummy exited $?: $(cat "$DIR/dummy.err")"
fi

expect_error() {  # name, expected text, args...
  local name=$1 want=$2; shift 2
  if run "$name" "$@"; then fail "$name: exit 0, expected an error"; return; fi
  grep -q -- "$want" "$DIR/$name.err" || fail "$name: error does not say '$want': $(cat "$DIR/$name.err")"
  [ ! -s "$DIR/$name.out" ] || fail "$name: printed to stdout: $(cat "$DIR/$name.out")"
}
expect_error batch0 "not a batch size" --batch 0
expect_error batchx "not a batch size" --batch 1,x
expect_error format "unknown --load-format 'bogus'" --load-format bogus
expect_error kernel "--fp4-gemm-backend 'cutlass' is not available" --fp4-gemm-backend cutlass
expect_error dtype "the CPU backend always runs fp32" --dtype bfloat16
expect_error dtype_name "--dtype: fp16 not in" --dtype fp16
# --dtype float32 is the CPU's own precision: accepted.
run dtype_f32 --dtype float32 --batch 1 --input-len 4 --output-len 2 || fail "--dtype float32: $(cat "$DIR/dtype_f32.err")"
expect_error nomodel "no config.json" --model-path "$DIR"

[ $fails = 0 ] && echo "bench_engine: all checks passed"
exit $((fails > 0))
