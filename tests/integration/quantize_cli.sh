#!/usr/bin/env bash
# kiln quantize from the command line: a real run is covered by tests/unit/quantize; here the CLI's
# wiring and its one-line errors (already-quantised input, unknown scheme, missing calibration file).
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
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
