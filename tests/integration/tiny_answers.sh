#!/usr/bin/env bash
# The embedded kiln-tiny model answers arithmetic correctly through `kiln generate --chat` (no --model-path),
# in thinking mode (reasoning, </think>, answer) and in direct mode (--no-think). The expected results are
# computed here with shell arithmetic; the answer's last integer must equal them.
# $1 = kiln binary ($2 = repo root, unused).
set -uo pipefail
KILN=${1:?usage: tiny_answers.sh KILN_BINARY [REPO_ROOT]}
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

# prompt | expected value
CASES=(
  "What is 17*19?|$((17 * 19))"
  "Compute 64 times 29|$((64 * 29))"
  "What is 9*8?|$((9 * 8))"
  "What's 45 + 38?|$((45 + 38))"
  "Subtract 38 from 45.|$((45 - 38))"
  "What is 23 - 91?|$((23 - 91))"
)

passed=0
failed=0
for mode in think no-think; do
  flags=(--chat --max-tokens 400 --threads 2)
  [ "$mode" = no-think ] && flags+=(--no-think)
  for case in "${CASES[@]}"; do
    prompt=${case%|*}
    want=${case##*|}
    if ! "$KILN" generate "${flags[@]}" --prompt "$prompt" >"$DIR/out.txt" 2>"$DIR/err.txt"; then
      echo "FAIL [$mode] '$prompt': kiln generate failed:"
      cat "$DIR/err.txt"
      failed=$((failed + 1))
      continue
    fi
    if [ "$mode" = think ]; then
      # The reasoning must be closed; the answer is what follows the last </think>.
      if ! grep -q '</think>' "$DIR/out.txt"; then
        echo "FAIL [$mode] '$prompt': no </think> in: $(tail -c 300 "$DIR/out.txt")"
        failed=$((failed + 1))
        continue
      fi
      answer=$(awk '/<\/think>/ { buf = ""; sub(/.*<\/think>/, ""); } { buf = buf $0 "\n" } END { printf "%s", buf }' \
        "$DIR/out.txt")
    else
      answer=$(cat "$DIR/out.txt")
    fi
    got=$(printf '%s' "$answer" | grep -oE -- '-?[0-9]+' | tail -n 1)
    if [ "$got" = "$want" ]; then
      echo "ok   [$mode] '$prompt' -> $(printf '%s' "$answer" | tr '\n' ' ' | sed 's/^ *//')"
      passed=$((passed + 1))
    else
      echo "FAIL [$mode] '$prompt': want $want, got '${got}' in: $(printf '%s' "$answer" | tr '\n' ' ')"
      failed=$((failed + 1))
    fi
  done
done
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
