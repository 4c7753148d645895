#!/usr/bin/env bash
# kiln quantize from the command line: a real run is covered by tests/unit/format/quantize_checkpoint_test.cpp
# and tests/unit/backend/calibration_test.cpp; here the CLI's
# wiring and its one-line errors (already-quantised input, unknown scheme, missing calibration file,
# calibration alternatives, bad calibration prompts).
# Args: $1 = kiln binary, $2 = repo root.
set -u
KILN="$1"
ROOT="$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0
expect_error() {  # expect_error NAME PATTERN ARGS...
  local name="$1" pattern="$2"
  shift 2
  local out rc
  out=$("$KILN" quantize "$@" 2>&1)
  rc=$?
  if [ "$rc" -eq 1 ] && printf '%s' "$out" | grep -q "$pattern" && [ "$(printf '%s\n' "$out" | grep -c '^error:')" -eq 1 ]; then
    pass=$((pass + 1))
  else
    echo "FAIL $name: exit $rc, output: $out"
    fail=$((fail + 1))
  fi
}
expect_error already_quantised "already quantised" --model-path "$ROOT/models/kiln-tiny" --output "$tmp/q"
expect_error bad_scheme "unknown --scheme 'int3'" --model-path "$ROOT/models/kiln-tiny" --output "$tmp/q" --scheme int3
expect_error missing_calibration "cannot read calibration file" --model-path "$ROOT/models/kiln-tiny" \
  --output "$tmp/q" --calibration "$tmp/none.json"
expect_error no_model "$tmp/absent" --model-path "$tmp/absent" --output "$tmp/q"
expect_error two_calibrations "alternatives" --model-path "$ROOT/models/kiln-tiny" --output "$tmp/q" \
  --calibration "$ROOT/tools/tiny/calib_amax.json" --no-calibration
# The engine calibration pass reads prompts before loading weights: a weightless copy of kiln-tiny's
# config, tokenizer and chat template is enough to check the prompt file's errors.
mkdir -p "$tmp/bf16"
for f in "$ROOT"/models/kiln-tiny/*; do
  case "$(basename "$f")" in *.safetensors|hf_quant_config.json) ;; *) cp "$f" "$tmp/bf16/" ;; esac
done
expect_error missing_prompts "cannot read calibration prompts file" --model-path "$tmp/bf16" --output "$tmp/q" \
  --calibration-prompts "$tmp/none.jsonl"
# The built-in prompts render with the chat template and tokenize; loading the (absent) weights then fails.
expect_error builtin_prompts "16 prompts from the built-in set" --model-path "$tmp/bf16" --output "$tmp/q"
printf '{"text": "hello"}\n{"messages": 3}\n' > "$tmp/bad.jsonl"
expect_error bad_prompt_line "bad.jsonl:2: expected" --model-path "$tmp/bf16" --output "$tmp/q" \
  --calibration-prompts "$tmp/bad.jsonl"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
