#!/usr/bin/env bash
# Tensor parallelism on the CPU: `kiln serve --device cpu --tp 4` (kiln-tiny as 4 ranks in one process: KV heads and
# linear-attention key heads replicated, the rest split) passes every `kiln smoke` check and the bench numbers
# (smoke_kiln.sh); the startup summary shows the per-rank figures; bad sizes fail before any weight loads.
# Usage: serve_tp.sh KILN_BINARY [REPO_ROOT]
set -euo pipefail
KILN=${1:?usage: serve_tp.sh KILN_BINARY [REPO_ROOT]}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ERR=$(mktemp)
trap 'rm -f "$ERR"' EXIT

# The per-rank summary (kiln-tiny: 4 q / 2 KV heads, 2 key / 4 value heads, experts of 128, vocab 2112).
KILN_LOG=info "$KILN" generate --device cpu --tp 4 --prompt "Hello" --max-tokens 4 >/dev/null 2>"$ERR"
grep -q "tensor parallel 4 x cpu (ep 1; 4 ranks as threads of this process) | per rank: 1 q / 1 KV heads, 1 key / 1 value heads, experts 16 of 16 (intermediate 32), vocab 528" "$ERR" ||
  { echo "FAIL: no per-rank summary:"; cat "$ERR"; exit 1; }
grep -q "KV heads: 2 KV heads < tp 4" "$ERR" || { echo "FAIL: no KV replication note"; cat "$ERR"; exit 1; }
# Greedy text equals TP 1's.
one=$("$KILN" generate --device cpu --prompt "What is 2 + 3?" --chat --no-think --max-tokens 24 2>/dev/null)
four=$("$KILN" generate --device cpu --tp 4 --ep 2 --prompt "What is 2 + 3?" --chat --no-think --max-tokens 24 2>/dev/null)
[ "$one" = "$four" ] || { echo "FAIL: tp 4 ep 2 text differs: '$four' vs '$one'"; exit 1; }
echo "ok: tp 4 ep 2 generates TP 1's text: $one"

# Sizes kiln-tiny cannot take: the numbers in the error, before the port opens or anything loads.
if "$KILN" serve --device cpu --tp 3 --port 0 2>"$ERR"; then echo "FAIL: --tp 3 accepted"; exit 1; fi
grep -q "4 query heads do not split over 3 ranks" "$ERR" || { echo "FAIL: --tp 3 error:"; cat "$ERR"; exit 1; }
if "$KILN" serve --device cpu --tp 4 --ep 3 --port 0 2>"$ERR"; then echo "FAIL: --ep 3 accepted"; exit 1; fi
grep -q "ep-size 3 must divide --tp-size 4" "$ERR" || { echo "FAIL: --ep 3 error:"; cat "$ERR"; exit 1; }
echo "ok: bad sizes rejected"

KILN_SERVE_ARGS="--device cpu --tp 4 ${KILN_SERVE_ARGS:-}" bash "$HERE/smoke_kiln.sh" "$KILN"
echo "PASS: serve_tp"
