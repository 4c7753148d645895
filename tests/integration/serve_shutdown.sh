#!/usr/bin/env bash
# Graceful shutdown of `kiln serve`: on SIGTERM /health turns 503 and new requests get 503 while an
# in-flight stream runs to its end; then the server exits 0. With a short --shutdown-timeout the
# stream is cut (it ends with an error event, code "shutting_down", and no [DONE]) and the exit is still 0.
# A port in use fails at startup.
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
serve_init "$1" "$ROOT"
pick_real_model
fail() { echo "FAIL: $*"; exit 1; }
BODY='{"messages": [{"role": "user", "content": "go"}], "max_tokens": 1000, "ignore_eos": true, "temperature": 0, "stream": true}'

# 1. Drain: the stream finishes.
start_server drain "${REAL_MODEL_ARGS[@]}"
curl -sN "$URL_drain/v1/chat/completions" -H 'Content-Type: application/json' -d "$BODY" > "$SERVE_WORK/stream1.txt" &
CURL=$!
for _ in $(seq 100); do [ -s "$SERVE_WORK/stream1.txt" ] && break; sleep 0.02; done
[ -s "$SERVE_WORK/stream1.txt" ] || fail "the stream did not start"
kill -TERM "$PID_drain"
sleep 0.1
code=$(curl -s -o /dev/null -w '%{http_code}' "$URL_drain/health" || true)
if kill -0 "$PID_drain" 2>/dev/null; then
  [ "$code" = 503 ] || fail "/health answered $code while draining (want 503)"
  code=$(curl -s -o "$SERVE_WORK/refused.json" -w '%{http_code}' "$URL_drain/v1/chat/completions" \
           -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "x"}]}' || true)
  if kill -0 "$PID_drain" 2>/dev/null; then
    [ "$code" = 503 ] || fail "a new request got $code while draining (want 503)"
  fi
else
  echo "note: the server finished draining before the checks (a fast machine)"
fi
wait "$CURL" || true
wait_server drain
[ "$RC_drain" = 0 ] || fail "exit status $RC_drain after SIGTERM (want 0)"
tail -c 200 "$SERVE_WORK/stream1.txt" | grep -q 'data: \[DONE\]' || fail "the in-flight stream did not end with [DONE]"
grep -q '"finish_reason":"length"' "$SERVE_WORK/stream1.txt" || fail "the in-flight stream did not run to max_tokens"
echo "ok: drain lets the in-flight stream finish, exit 0"

# 2. Timeout: the stream is aborted, exit still 0.
start_server cut "${REAL_MODEL_ARGS[@]}" --shutdown-timeout 0
BIG='{"messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "ignore_eos": true, "stream": true}'
curl -sN "$URL_cut/v1/chat/completions" -H 'Content-Type: application/json' -d "$BIG" > "$SERVE_WORK/stream2.txt" &
CURL=$!
for _ in $(seq 100); do [ -s "$SERVE_WORK/stream2.txt" ] && break; sleep 0.02; done
stop_server cut TERM
wait "$CURL" || true
[ "$RC_cut" = 0 ] || fail "exit status $RC_cut after SIGTERM with --shutdown-timeout 0"
if ! grep -q '"finish_reason":"length"' "$SERVE_WORK/stream2.txt"; then
  grep -q '"code":"shutting_down"' "$SERVE_WORK/stream2.txt" ||
    fail "the cut stream has no shutting_down error event: $(tail -c 300 "$SERVE_WORK/stream2.txt")"
  grep -q 'data: \[DONE\]' "$SERVE_WORK/stream2.txt" && fail "the cut stream ended with [DONE] after its error"
fi
echo "ok: shutdown timeout aborts the stream, exit 0"

# 2b. The same cut on the Anthropic Messages and Responses streams: an error event, never a normal end.
for route in messages responses; do
  start_server cut "${REAL_MODEL_ARGS[@]}" --shutdown-timeout 0
  M=$(curl -s "$URL_cut/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
  if [ $route = messages ]; then
    BODY='{"model": "'"$M"'", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000, "stream": true}'
  else
    BODY='{"model": "'"$M"'", "input": "go", "max_output_tokens": 4000, "stream": true}'
  fi
  curl -sN "$URL_cut/v1/$route" -H 'Content-Type: application/json' -d "$BODY" > "$SERVE_WORK/$route.txt" &
  CURL=$!
  for _ in $(seq 100); do [ -s "$SERVE_WORK/$route.txt" ] && break; sleep 0.02; done
  stop_server cut TERM
  wait "$CURL" || true
  [ "$RC_cut" = 0 ] || fail "exit status $RC_cut after SIGTERM with --shutdown-timeout 0 ($route)"
  if [ $route = messages ]; then
    ended='event: message_stop'; cut='"type":"overloaded_error"'
  else
    ended='event: response.completed'; cut='"code":"server_shutting_down"'
  fi
  if grep -q "$ended" "$SERVE_WORK/$route.txt"; then
    # The generation may have finished (eos) before the signal: then it must not have been cut.
    grep -q "$cut" "$SERVE_WORK/$route.txt" && fail "the $route stream both ended normally and was cut"
    echo "note: the $route stream finished before the signal (not cut)"
  else
    grep -q "$cut" "$SERVE_WORK/$route.txt" ||
      fail "the cut $route stream has no shutdown error: $(tail -c 300 "$SERVE_WORK/$route.txt")"
  fi
done
echo "ok: shutdown timeout ends Messages and Responses streams with an error"

# 3. A port that is taken fails at once with a clear error.
start_server first "${REAL_MODEL_ARGS[@]}"
port=${URL_first##*:}
if "$KILN" serve --port "$port" "${REAL_MODEL_ARGS[@]}" > "$SERVE_WORK/second.log" 2>&1; then
  fail "a second server on the same port started"
fi
grep -q "cannot listen on" "$SERVE_WORK/second.log" || fail "no clear error for a taken port: $(cat "$SERVE_WORK/second.log")"
echo "ok: a taken port is a one-line error"
echo "PASS: serve_shutdown"
