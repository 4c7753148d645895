#!/usr/bin/env bash
# Tensor parallelism over several machines, the machines played by processes on localhost (CPU backend; the ranks
# of different nodes meet over TCP, backend/comm_net.h): node 1 runs `kiln serve --node-rank 1` (no HTTP), node 0
# serves. Checks: the greedy text of `kiln generate` on node 0 equals TP 1's; `kiln smoke` and `kiln bench` pass
# against node 0 of tp 2 over 2 nodes (smoke_kiln.sh); a follower stops cleanly (exit 0) when node 0 exits; a
# follower that is killed makes node 0's requests fail with an error that says so (no hang) and /health 503; a node
# launched with other flags is refused with both sides named.
# Usage: serve_nodes.sh KILN_BINARY [REPO_ROOT]
set -euo pipefail
KILN=${1:?usage: serve_nodes.sh KILN_BINARY [REPO_ROOT]}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_exit() {  # pid seconds -> the exit status, or 124 when still running
  local pid=$1 s=$2
  for _ in $(seq $((s * 10))); do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null && return 0 || return $?
    fi
    sleep 0.1
  done
  return 124
}

# 1. generate on node 0 (tp 4, ep 2, 2 nodes) gives TP 1's text; the follower exits 0 when node 0 is done.
DIST=127.0.0.1:$(free_port)
"$KILN" serve --device cpu --tp 4 --ep 2 --nnodes 2 --node-rank 1 --dist-init-addr "$DIST" > "$WORK/f1.log" 2>&1 &
F=$!; PIDS+=("$F")
one=$("$KILN" generate --device cpu --prompt "What is 2 + 3?" --chat --no-think --max-tokens 24 2>/dev/null)
two=$("$KILN" generate --device cpu --tp 4 --ep 2 --nnodes 2 --node-rank 0 --dist-init-addr "$DIST" \
        --prompt "What is 2 + 3?" --chat --no-think --max-tokens 24 2>"$WORK/g0.log") ||
  { echo "FAIL: generate on node 0:"; cat "$WORK/g0.log"; tail -20 "$WORK/f1.log"; exit 1; }
[ "$one" = "$two" ] || { echo "FAIL: 2-node text differs: '$two' vs '$one'"; exit 1; }
rc=0; wait_exit "$F" 20 || rc=$?
[ "$rc" = 0 ] || { echo "FAIL: the follower exited with $rc after node 0 finished:"; cat "$WORK/f1.log"; exit 1; }
grep -q "node 0 stopped the group" "$WORK/f1.log" || { echo "FAIL: follower log:"; cat "$WORK/f1.log"; exit 1; }
echo "ok: tp 4 ep 2 over 2 nodes generates TP 1's text: $two; the follower stopped with node 0"

# 2. A node launched with another --ep-size is refused at the rendezvous, naming both.
DIST=127.0.0.1:$(free_port)
"$KILN" serve --device cpu --tp 2 --ep 2 --nnodes 2 --node-rank 1 --dist-init-addr "$DIST" --dist-timeout 20 \
  > "$WORK/f2.log" 2>&1 &
F=$!; PIDS+=("$F")
if "$KILN" generate --device cpu --tp 2 --nnodes 2 --node-rank 0 --dist-init-addr "$DIST" --dist-timeout 20 \
     --prompt "Hi" --max-tokens 2 > /dev/null 2>"$WORK/g2.log"; then
  echo "FAIL: mismatched nodes joined"; exit 1
fi
grep -q "the nodes disagree" "$WORK/g2.log" || { echo "FAIL: node 0's error:"; cat "$WORK/g2.log"; exit 1; }
rc=0; wait_exit "$F" 20 || rc=$?
[ "$rc" != 0 ] && [ "$rc" != 124 ] || { echo "FAIL: the refused follower: status $rc"; cat "$WORK/f2.log"; exit 1; }
grep -q "refused node 1" "$WORK/f2.log" || { echo "FAIL: follower's error:"; cat "$WORK/f2.log"; exit 1; }
echo "ok: a node with another --ep-size is refused on both sides"

# 3. kill -9 of the follower while node 0 serves: the next request fails with a clear error, no hang.
DIST=127.0.0.1:$(free_port)
PORT=$(free_port)
"$KILN" serve --device cpu --tp 2 --nnodes 2 --node-rank 1 --dist-init-addr "$DIST" > "$WORK/f3.log" 2>&1 &
F=$!; PIDS+=("$F")
"$KILN" serve --device cpu --tp 2 --nnodes 2 --node-rank 0 --dist-init-addr "$DIST" --port "$PORT" \
  > "$WORK/s3.log" 2>&1 &
S=$!; PIDS+=("$S")
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
  kill -0 "$S" 2>/dev/null || { echo "FAIL: node 0 exited:"; cat "$WORK/s3.log"; exit 1; }
  sleep 0.2
done
body='{"prompt":"Once","max_tokens":4,"temperature":0}'
curl -sf -m 60 "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -d "$body" > /dev/null ||
  { echo "FAIL: a request before the kill"; cat "$WORK/s3.log"; exit 1; }
kill -9 "$F"
out=$(curl -s -m 30 "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -d "$body") ||
  { echo "FAIL: the request after the kill hung or the server died: $out"; tail -20 "$WORK/s3.log"; exit 1; }
echo "$out" | grep -q "restart every node" || { echo "FAIL: no clear error after the kill: $out"; tail -20 "$WORK/s3.log"; exit 1; }
code=$(curl -s -o "$WORK/health.txt" -w '%{http_code}' -m 10 "http://127.0.0.1:$PORT/health")
[ "$code" = 503 ] && grep -q "restart every node" "$WORK/health.txt" ||
  { echo "FAIL: /health after the group broke: $code $(cat "$WORK/health.txt")"; exit 1; }
kill "$S"; wait_exit "$S" 20 || true
echo "ok: a killed follower fails node 0's requests with: $(echo "$out" | head -c 200)"

# 4. kiln smoke and kiln bench against node 0 of tp 2 over 2 nodes.
DIST=127.0.0.1:$(free_port)
"$KILN" serve --device cpu --tp 2 --nnodes 2 --node-rank 1 --dist-init-addr "$DIST" > "$WORK/f4.log" 2>&1 &
F=$!; PIDS+=("$F")
KILN_SERVE_ARGS="--device cpu --tp 2 --nnodes 2 --node-rank 0 --dist-init-addr $DIST ${KILN_SERVE_ARGS:-}" \
  bash "$HERE/smoke_kiln.sh" "$KILN"
rc=0; wait_exit "$F" 20 || rc=$?
[ "$rc" = 0 ] || { echo "FAIL: the follower exited with $rc after node 0 stopped:"; tail -20 "$WORK/f4.log"; exit 1; }
echo "PASS: serve_nodes"
