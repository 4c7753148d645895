# Shared by the scripts that drive the fake OpenAI server (tests/fake_server). Source after setting
# KILN (the kiln binary; the fake server is built next to it). Provides WORK (a temp dir removed at
# exit), start_fake FLAGS... (sets PORT and FAKE_PID) and stop_fake.
FAKE="$(dirname "$KILN")/kiln-fake-openai-server"
[ -x "$FAKE" ] || { echo "FAIL: $FAKE is not built (target kiln-fake-openai-server)"; exit 1; }
WORK=$(mktemp -d)
FAKE_PID=""
cleanup() {
  if [ -n "$FAKE_PID" ]; then kill "$FAKE_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

start_fake() {  # start_fake FLAGS...: sets PORT and FAKE_PID
  : > "$WORK/fake.out"
  "$FAKE" "$@" > "$WORK/fake.out" 2> "$WORK/fake.err" &
  FAKE_PID=$!
  for _ in $(seq 200); do
    PORT=$(awk '/^PORT /{print $2}' "$WORK/fake.out")
    if [ -n "$PORT" ]; then return 0; fi
    sleep 0.05
  done
  echo "FAIL: the fake server did not start: $(cat "$WORK/fake.err")"
  exit 1
}
stop_fake() {
  kill "$FAKE_PID" 2>/dev/null || true
  wait "$FAKE_PID" 2>/dev/null || true
  FAKE_PID=""
}
