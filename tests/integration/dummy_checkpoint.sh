#!/usr/bin/env bash
# `kiln dummy-checkpoint`: a random-weight checkpoint in the real layout from a config.json. kiln-tiny's
# config with an image_token_id (the added tokens must land where it says) is written, loaded by
# `kiln generate`, and its covering tokenizer checked against HF tokenizers JS (every id decodes, kiln's
# encodings of the tokenizer corpus equal the oracle's). Bad input: an existing checkpoint folder is refused.
# Args: $1 = kiln binary, $2 = repo root.
set -euo pipefail
KILN=$(realpath "$1")
ROOT=$(realpath "$2")
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ ! -d "$ROOT/tests/js/node_modules/@huggingface/tokenizers" ]; then
  echo "SKIP: @huggingface/tokenizers not installed (run scripts/setup.sh)"; exit 0
fi
mkdir -p "$TMP/cfg"
cp "$ROOT/models/kiln-tiny/config.json" "$ROOT/models/kiln-tiny/hf_quant_config.json" "$TMP/cfg/"
# <|image_pad|> is kiln-tiny's 13th added token: put the added tokens at 2000 (fill tokens follow them).
node -e 'const fs=require("fs");const p=process.argv[1];const c=JSON.parse(fs.readFileSync(p));c.image_token_id=2012;fs.writeFileSync(p,JSON.stringify(c,null,2));' "$TMP/cfg/config.json"

"$KILN" dummy-checkpoint --model-path "$TMP/cfg" --output "$TMP/ck" --shard-gib 0.005 > "$TMP/out.txt" 2> "$TMP/err.txt"
cat "$TMP/out.txt"
grep -q "added tokens from id 2000" "$TMP/out.txt" || { echo "FAIL: added tokens not at image_token_id - 12"; exit 1; }
ls "$TMP/ck"/model-0000*-of-*.safetensors > /dev/null || { echo "FAIL: no shards"; exit 1; }
[ -f "$TMP/ck/model.safetensors.index.json" ] || { echo "FAIL: no shard index"; exit 1; }
grep -q "written" "$TMP/err.txt" || { echo "FAIL: no progress line"; exit 1; }
id=$(printf '<|image_pad|>' | "$KILN" tokenize --model-path "$TMP/ck")
[ "$id" = "[2012]" ] || { echo "FAIL: <|image_pad|> is $id, not [2012]"; exit 1; }

# The checkpoint loads and generates.
"$KILN" generate --model-path "$TMP/ck" --prompt "Hello" --max-tokens 8 > "$TMP/gen.txt" 2>&1 || { cat "$TMP/gen.txt"; echo "FAIL: generate"; exit 1; }

# A folder that already holds weights is refused with a message saying so.
if "$KILN" dummy-checkpoint --model-path "$TMP/cfg" --output "$TMP/ck" 2> "$TMP/err2.txt"; then
  echo "FAIL: wrote over an existing checkpoint"; exit 1
fi
grep -q "already holds safetensors" "$TMP/err2.txt" || { echo "FAIL: unclear error: $(cat "$TMP/err2.txt")"; exit 1; }

# HF tokenizers JS against kiln on the tokenizer corpus.
cd "$ROOT/tests/js"
node -e '
  const fs = require("fs"), path = require("path");
  const dir = process.argv[1]; const out = [];
  for (const f of fs.readdirSync(dir).filter((f) => f.endsWith(".txt")).sort())
    for (const part of fs.readFileSync(path.join(dir, f), "utf8").split("---8<---")) if (part.trim()) out.push(JSON.stringify(part));
  fs.writeFileSync(process.argv[2], out.join("\n") + "\n");
' "$ROOT/tests/fixtures/tokenizer/corpus" "$TMP/texts.jsonl"
"$KILN" tokenize --model-path "$TMP/ck" --jsonl < "$TMP/texts.jsonl" > "$TMP/kiln.jsonl"
node covering_tokenizer_check.mjs "$TMP/ck" 2112 "$TMP/texts.jsonl" "$TMP/kiln.jsonl"
