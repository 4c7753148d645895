#!/usr/bin/env bash
# What a new user meets first on the command line (issue 20): tokenize / template default to the embedded model;
# tokenize --decode ends its text with a newline and refuses out-of-range ids; generate's default length lets
# kiln-tiny finish its thinking and its text ends its line; --log-level also after the subcommand; serve --help
# names every open endpoint; inspect prints the router note once and no KV-token count the serve plan does not
# use; bench-engine on the CPU does not claim CUDA graphs or device sampling; serve logs why it chose its device.
# $1 = kiln binary, $2 = repo root.
set -uo pipefail
KILN=${1:?usage: cli_defaults.sh KILN_BINARY REPO_ROOT}
ROOT=${2:?usage: cli_defaults.sh KILN_BINARY REPO_ROOT}
DIR=$(mktemp -d)
SERVE_PID=""
trap '[ -n "$SERVE_PID" ] && kill "$SERVE_PID" 2>/dev/null; rm -rf "$DIR"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
TINY="$ROOT/models/kiln-tiny"
if ! "$KILN" inspect > /dev/null 2>&1; then
  echo "SKIP: this kiln binary has no embedded model"
  exit 0
fi

# tokenize and template without --model-path: the embedded model, the same as kiln-tiny's folder.
printf 'Hello kiln, 17*19?' | "$KILN" tokenize > "$DIR/tok_default" 2>"$DIR/err" || fail "tokenize without --model-path: $(cat "$DIR/err")"
printf 'Hello kiln, 17*19?' | "$KILN" tokenize --model-path "$TINY" > "$DIR/tok_dir" || fail "tokenize --model-path"
cmp -s "$DIR/tok_default" "$DIR/tok_dir" || fail "tokenize: embedded $(cat "$DIR/tok_default") vs folder $(cat "$DIR/tok_dir")"
req='{"messages":[{"role":"user","content":"Hi"}]}'
echo "$req" | "$KILN" template > "$DIR/tmpl_default" 2>"$DIR/err" || fail "template without --model-path: $(cat "$DIR/err")"
echo "$req" | "$KILN" template --model-path "$TINY" > "$DIR/tmpl_dir" || fail "template --model-path"
cmp -s "$DIR/tmpl_default" "$DIR/tmpl_dir" || fail "template: the embedded model's prompt differs from the folder's"
grep -q "<|im_start|>user" "$DIR/tmpl_default" || fail "template: no user turn in $(cat "$DIR/tmpl_default")"

# tokenize --decode: the text and a newline; an id outside the vocabulary is an error.
cat "$DIR/tok_default" | "$KILN" tokenize --decode > "$DIR/decoded" || fail "tokenize --decode"
[ "$(cat "$DIR/decoded")" = "Hello kiln, 17*19?" ] || fail "decode round trip: '$(cat "$DIR/decoded")'"
[ "$(tail -c 1 "$DIR/decoded" | od -An -c | tr -d ' ')" = '\n' ] || fail "decode: no trailing newline"
if echo "[1, 99999999]" | "$KILN" tokenize --decode > /dev/null 2>"$DIR/err"; then
  fail "tokenize --decode accepted an out-of-range id"
else
  grep -q "outside this tokenizer's ids" "$DIR/err" || fail "decode out of range: $(cat "$DIR/err")"
fi

# generate with the default --max-tokens: kiln-tiny finishes thinking and answers; the text ends its line.
"$KILN" generate --chat --threads 2 --prompt "What is 17*19?" > "$DIR/gen" 2>"$DIR/gen_err" || fail "generate: $(cat "$DIR/gen_err")"
grep -q "</think>" "$DIR/gen" || fail "generate: the default length stopped inside the thinking: $(tail -c 200 "$DIR/gen")"
grep -q "$((17 * 19))" "$DIR/gen" || fail "generate: no answer $((17 * 19)) in: $(tail -c 200 "$DIR/gen")"
[ "$(tail -c 1 "$DIR/gen" | od -An -c | tr -d ' ')" = '\n' ] || fail "generate: the text does not end with a newline"
grep -q "(eos)" "$DIR/gen_err" || fail "generate: did not end at eos: $(cat "$DIR/gen_err")"
"$KILN" generate --threads 2 --prompt "Once" --max-tokens 3 > /dev/null 2>"$DIR/gen_err"
grep -q "stopped at --max-tokens" "$DIR/gen_err" || fail "generate: no note that --max-tokens stopped it: $(cat "$DIR/gen_err")"

# --log-level after the subcommand, and a wrong one.
"$KILN" inspect --log-level debug > /dev/null 2>"$DIR/err" || fail "inspect --log-level debug refused: $(cat "$DIR/err")"
if "$KILN" inspect --log-level loud > /dev/null 2>"$DIR/err"; then fail "--log-level loud accepted"; fi
grep -q "unknown --log-level 'loud'" "$DIR/err" || fail "--log-level loud: $(cat "$DIR/err")"

# serve --help names the endpoints an API key leaves open.
"$KILN" serve --help > "$DIR/help" 2>&1
grep -q "/health, /health_generate, /metrics stay open" "$DIR/help" || fail "serve --help: $(grep -- --api-key "$DIR/help")"

# inspect: the router note once, no unused KV-token count beside serve's plan (on one GPU and per GPU at --tp 2).
CFG="$ROOT/configs/qwen3.5-35b-a3b-nvfp4"
"$KILN" inspect --model-path "$CFG" --gpu-mem-gib 141 > "$DIR/insp" 2>&1 || fail "inspect 35B"
[ "$(grep -c "would quantise" "$DIR/insp")" = 1 ] || fail "inspect: the router note $(grep -c "would quantise" "$DIR/insp") times: $(grep "would quantise" "$DIR/insp")"
grep -q "max KV tokens" "$DIR/insp" && fail "inspect: a max KV tokens line beside the serve plan"
"$KILN" inspect --model-path "$CFG" --tp 2 --gpu-mem-gib 141 > "$DIR/insp2" 2>&1 || fail "inspect 35B --tp 2"
grep -q "max KV tokens" "$DIR/insp2" && fail "inspect --tp 2: a max KV tokens line beside the serve plan"
grep -q "memory plan per GPU of tp 2" "$DIR/insp2" || fail "inspect --tp 2: no per-GPU serve plan: $(cat "$DIR/insp2")"

# bench-engine on the CPU says what it does there.
"$KILN" bench-engine --device cpu --threads 2 --batch 1 --input-len 4 --output-len 2 > "$DIR/bench" 2>&1 || fail "bench-engine: $(cat "$DIR/bench")"
grep -q "cuda graphs n/a (cpu), sampling argmax in the CPU backend" "$DIR/bench" || fail "bench-engine cpu line: $(grep 'cuda graphs' "$DIR/bench")"

# serve without --device: the device line gives the reason auto chose, not "--device cpu".
"$KILN" --log-level info serve --port 0 --threads 2 > "$DIR/serve.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 300); do grep -q "device: " "$DIR/serve.log" && break; sleep 0.1; done
kill "$SERVE_PID" 2>/dev/null; wait "$SERVE_PID" 2>/dev/null; SERVE_PID=""
grep "device: " "$DIR/serve.log" | grep -q -- "--device cpu" && fail "serve: $(grep 'device: ' "$DIR/serve.log")"
grep -q "device: " "$DIR/serve.log" || fail "serve: no device line: $(tail -5 "$DIR/serve.log")"

[ "$fails" = 0 ] && echo "cli_defaults: all passed" || { echo "cli_defaults: $fails failed"; exit 1; }
