#!/usr/bin/env bash
# kiln generate end to end on a tiny reference model (tests/fixtures/reference) with the byte-level test
# tokenizer: streams text, stops at max tokens or eos, prints speeds; --chat renders the chat template.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
KILN=$1
ROOT=$2
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT
for m in qwen3_5_moe_nvfp4 qwen3_next_bf16 qwen3_bf16; do
  mkdir -p "$DIR/$m"
  cp "$ROOT/tests/fixtures/reference/$m/model/"* "$DIR/$m/"
  cp "$ROOT/tests/fixtures/reference/byte_tokenizer/"tokenizer*.json "$DIR/$m/"
  "$KILN" generate --model-path "$DIR/$m" --prompt "Hello kiln" --max-tokens 16 --threads 2 \
    >"$DIR/out.txt" 2>"$DIR/err.txt"
  grep -q "prompt: 10 tokens" "$DIR/err.txt" || { cat "$DIR/err.txt"; echo "FAIL: $m: no speed line"; exit 1; }
  # Greedy is deterministic: the same command gives the same bytes.
  "$KILN" generate --model-path "$DIR/$m" --prompt "Hello kiln" --max-tokens 16 --threads 2 >"$DIR/out2.txt" 2>/dev/null
  cmp -s "$DIR/out.txt" "$DIR/out2.txt" || { echo "FAIL: $m: greedy output differs between runs"; exit 1; }
  "$KILN" generate --model-path "$DIR/$m" --prompt "Hi" --chat --no-think --max-tokens 4 --temperature 0.7 --seed 1 \
    >/dev/null 2>"$DIR/err.txt"
  # "<|im_start|>" "user" "\n" "Hi" "<|im_end|>" "\n" "<|im_start|>" "assistant" "\n" "<think>" "\n\n" "</think>" "\n\n"
  # in byte tokens: 1+4+1+2+1+1+1+9+1+7+2+8+2 = 40
  grep -q "prompt: 40 tokens" "$DIR/err.txt" || { cat "$DIR/err.txt"; echo "FAIL: $m: chat prompt length"; exit 1; }
  echo "ok: $m"
done
if "$KILN" generate --model-path "$DIR/nope" --prompt x 2>"$DIR/err.txt"; then echo "FAIL: missing model accepted"; exit 1; fi
grep -q "error" "$DIR/err.txt" || { echo "FAIL: no error line"; exit 1; }
echo "1 passed, 0 failed"
