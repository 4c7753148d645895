#!/usr/bin/env bash
# kiln smoke against a deliberately broken fake server (tests/fake_server): in every mode exactly the
# checks that the breakage should fail must fail, each with a reason that says why; `good` passes all.
# Usage: smoke_fake.sh KILN_BINARY [REPO_ROOT]  (the fake server is built next to kiln)
set -euo pipefail
KILN=${1:?usage: smoke_fake.sh KILN_BINARY [REPO_ROOT]}
source "$(dirname "${BASH_SOURCE[0]}")/lib/fake_lib.sh"

# check_report JSON EXPECTED_FAILED_CSV REASON_REGEX [CHECKS_CSV]
check_report() {
  python3 - "$@" <<'PY'
import json, re, sys
path, expected_csv, reason_re = sys.argv[1], sys.argv[2], sys.argv[3]
all_checks = ["model-info", "simple", "math-no-think", "math-think", "determinism", "throughput"]
selected = sys.argv[4].split(",") if len(sys.argv) > 4 else all_checks
expected = set(filter(None, expected_csv.split(",")))
report = json.load(open(path))
names = [c["name"] for c in report["checks"]]
errors = []
if names != selected:
    errors.append(f"checks run {names}, expected {selected}")
failed = {c["name"] for c in report["checks"] if not c["passed"]}
if failed != expected:
    errors.append(f"failed checks {sorted(failed)}, expected {sorted(expected)}")
for c in report["checks"]:
    for key in ("name", "passed", "seconds", "evidence", "reason"):
        if key not in c:
            errors.append(f"{c.get('name')}: no '{key}' in the report")
    if not c["evidence"]:
        errors.append(f"{c['name']}: no evidence")
    if c["passed"] and c["reason"]:
        errors.append(f"{c['name']}: passed but has a reason: {c['reason']}")
    if not c["passed"] and not re.search(reason_re, c["reason"]):
        errors.append(f"{c['name']}: reason does not match /{reason_re}/: {c['reason']}")
if report["passed"] != (not expected):
    errors.append(f"report passed={report['passed']}")
if errors:
    print("\n".join("  " + e for e in errors))
    sys.exit(1)
PY
}

failures=0
# mode | checks that must fail | what their reasons must mention
cases=(
  "good||"
  "garbage|simple,math-no-think,math-think,determinism,throughput|NUL|garbage"
  "leak|simple,math-think|think"
  "repeat|math-think,determinism,throughput|degenerate repetition"
  "no-reasoning|math-think|no reasoning"
  "wrong|math-no-think,math-think|323"
  "nondeterministic|math-think,determinism|differ"
)
for case in "${cases[@]}"; do
  mode=${case%%|*}
  rest=${case#*|}
  expected=${rest%%|*}
  reason=${rest#*|}
  start_fake --mode "$mode"
  set +e
  "$KILN" smoke --url "http://127.0.0.1:$PORT" --json "$WORK/$mode.json" > "$WORK/$mode.txt" 2>&1
  rc=$?
  set -e
  stop_fake
  want_rc=1
  [ -z "$expected" ] && want_rc=0
  if [ "$rc" != "$want_rc" ]; then
    echo "FAIL: mode $mode: exit status $rc, expected $want_rc"; cat "$WORK/$mode.txt"; failures=$((failures + 1)); continue
  fi
  if ! check_report "$WORK/$mode.json" "$expected" "$reason"; then
    echo "FAIL: mode $mode (report above)"; cat "$WORK/$mode.txt"; failures=$((failures + 1)); continue
  fi
  # The table on stdout shows each check with PASS/FAIL.
  if [ "$(grep -cE '^(model-info|simple|math-no-think|math-think|determinism|throughput) +(PASS|FAIL) ' "$WORK/$mode.txt")" != 6 ]; then
    echo "FAIL: mode $mode: the table does not list 6 checks"; cat "$WORK/$mode.txt"; failures=$((failures + 1)); continue
  fi
  echo "ok: mode $mode (failed: ${expected:-none})"
done

# A short context: requests with a large max_tokens get HTTP 400; smoke retries with less and says so.
start_fake --mode good --context-length 3000
set +e
"$KILN" smoke --url "http://127.0.0.1:$PORT" --json "$WORK/context.json" > "$WORK/context.txt" 2>&1
rc=$?
set -e
stop_fake
if [ "$rc" = 0 ] && check_report "$WORK/context.json" "" "" && grep -q "max_tokens lowered to 2048 (HTTP 400: This model's maximum context length is 3000" "$WORK/context.txt"; then
  echo "ok: short context -> max_tokens lowered"
else
  echo "FAIL: short context (exit $rc)"; cat "$WORK/context.txt"; failures=$((failures + 1))
fi

# --tests selects checks; --baseline prints a ratio.
start_fake --mode wrong
set +e
"$KILN" smoke --url "http://127.0.0.1:$PORT/v1" --tests simple,math-think,throughput --baseline 100 \
  --json "$WORK/select.json" > "$WORK/select.txt" 2>&1
rc=$?
set -e
if [ "$rc" = 1 ] && check_report "$WORK/select.json" "math-think" "323" "simple,math-think,throughput" &&
   grep -q "x the baseline of 100 tok/s" "$WORK/select.txt"; then
  echo "ok: --tests selection and --baseline"
else
  echo "FAIL: --tests selection (exit $rc)"; cat "$WORK/select.txt"; failures=$((failures + 1))
fi
set +e
"$KILN" smoke --url "http://127.0.0.1:$PORT" --tests simple,bogus > "$WORK/bogus.txt" 2>&1
rc=$?
set -e
if [ "$rc" = 1 ] && grep -q "unknown check 'bogus'" "$WORK/bogus.txt"; then
  echo "ok: unknown check name"
else
  echo "FAIL: unknown check name (exit $rc)"; cat "$WORK/bogus.txt"; failures=$((failures + 1))
fi
stop_fake

# Nobody listening: one clear line, exit 1. (The port the fake server just left.)
set +e
"$KILN" smoke --url "http://127.0.0.1:$PORT" > "$WORK/down.out" 2> "$WORK/down.err"
rc=$?
set -e
if [ "$rc" = 1 ] && [ "$(wc -l < "$WORK/down.err")" = 1 ] && grep -q "cannot reach the server at http://127.0.0.1:$PORT" "$WORK/down.err"; then
  echo "ok: unreachable server: $(cat "$WORK/down.err")"
else
  echo "FAIL: unreachable server (exit $rc)"; cat "$WORK/down.out" "$WORK/down.err"; failures=$((failures + 1))
fi

if [ "$failures" != 0 ]; then
  echo "FAIL: $failures smoke_fake case(s) failed"
  exit 1
fi
echo "PASS: smoke_fake"
