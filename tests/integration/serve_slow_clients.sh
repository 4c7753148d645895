#!/usr/bin/env bash
# The HTTP front under slow and idle clients (tests/integration/lib/slow_clients.py), loopback only: 1,000
# connections that send their headers then one body byte a second, 1,000 that send one header byte a second and
# 1,000 idle keep-alive ones, each reopened when the server closes it, while 64 streamed chat completions finish
# and /health is asked every 100 ms. Passes when every stream finishes, every /health answers in < 100 ms (one
# slower answer in a hundred is tolerated for a loaded CI machine, none over 1 s), and the slow clients were
# answered 408. Runs `kiln serve --dummy-runner echo` (no weights: the engine, tokenizer and HTTP paths are real).
# $1 = kiln binary, $2 = repo root.
set -euo pipefail
ROOT=${2:-$(cd "$(dirname "$0")/../.." && pwd)}
source "$ROOT/tests/integration/lib/serve_lib.sh"
KILN=$1
SERVE_WORK=$(mktemp -d)
trap serve_cleanup EXIT
command -v python3 > /dev/null || { echo "SKIP: python3 is not installed"; exit 0; }

# 3,000 client sockets here, as many in the server (which raises its own soft limit to the hard one).
ulimit -n 8192 2> /dev/null || ulimit -n "$(ulimit -Hn)"
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt 4096 ]; then
  echo "SKIP: the open-file limit ($(ulimit -n), hard $(ulimit -Hn)) is below the 4096 this battery needs"
  exit 0
fi

make_model_dir "$SERVE_WORK/echo" echo
start_server front --model-path "$SERVE_WORK/echo" --dummy-runner echo --served-model-name battery --max-running-requests 64
port=${URL_front##*:}
out="$SERVE_WORK/battery.txt"
timeout 120 python3 "$ROOT/tests/integration/lib/slow_clients.py" --port "$port" --seconds 12 | tee "$out"
kill -0 "$PID_front" || { echo "FAIL: kiln serve died"; tail -20 "$LOG_front"; exit 1; }
stop_server front TERM

python3 - "$out" << 'EOF'
import json, sys
s = json.loads(open(sys.argv[1]).read().split("summary: ")[-1])
problems = []
if s["streams_ok"] != s["streams"]:
    problems.append("%d of %d streams finished" % (s["streams_ok"], s["streams"]))
if s["health_failed"]:
    problems.append("%d /health probes failed or timed out" % s["health_failed"])
if s["health_over_100ms"] > s["health_probes"] // 100:
    problems.append("%d of %d /health answers took 100 ms or more" % (s["health_over_100ms"], s["health_probes"]))
if s["health_ms_max"] is None or s["health_ms_max"] >= 1000:
    problems.append("slowest /health: %s ms" % s["health_ms_max"])
if s["metrics_ms_max"] is None or s["metrics_ms_max"] >= 1000:
    problems.append("slowest /metrics: %s ms" % s["metrics_ms_max"])
if not any(k.startswith("HTTP/1.1 408") for k in s["server_answers"]):
    problems.append("no slow client was answered 408: %s" % s["server_answers"])
if problems:
    print("FAIL: serve_slow_clients: " + "; ".join(problems))
    sys.exit(1)
print("PASS: serve_slow_clients (/health p50 %s ms, p99 %s ms, max %s ms over %d probes; %d streams)"
      % (s["health_ms_p50"], s["health_ms_p99"], s["health_ms_max"], s["health_probes"], s["streams"]))
EOF
