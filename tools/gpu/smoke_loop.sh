#!/usr/bin/env bash
# GPU machine, repo root: start kiln serve (kiln-tiny) fresh $RUNS times per flag set in $VARIANTS ('|'-separated,
# default: the default flags only) and run kiln smoke against each; count the failing runs. Carry gpu-carry
# (kiln.xz, lib/) as for run_engine_h200.sh.
export LD_LIBRARY_PATH="$PWD/gpu-carry/lib:/usr/local/cuda/lib64"
for f in gpu-carry/*.xz; do [ -e "$f" ] && env -u LD_LIBRARY_PATH python3 -c "
import lzma, os, sys; t = sys.argv[1][:-3]; open(t + '.tmp', 'wb').write(lzma.open(sys.argv[1]).read()); os.replace(t + '.tmp', t)" "$f" && chmod +x "${f%.xz}"; done
K=${KILN_BIN:-gpu-carry/kiln}
if [ -n "${VARIANTS:-}" ]; then IFS='|' read -ra VLIST <<< "$VARIANTS"; else VLIST=(""); fi
for v in "${VLIST[@]}"; do
  fails=0
  for i in $(seq ${RUNS:-6}); do
    "$K" serve $v --device cuda --model-path models/kiln-tiny --port 30000 --skip-self-check > /tmp/serve.log 2>&1 &
    S=$!
    for _ in $(seq 100); do curl -sf http://127.0.0.1:30000/health > /dev/null && break; sleep 0.2; done
    out=$("$K" smoke --url http://127.0.0.1:30000 2>&1)
    # A run passes only with smoke's own all-passed line (a server that never came up counts as a failure).
    echo "$out" | grep -q "^result: all .* checks passed" || { fails=$((fails+1)); echo "$out" | grep -E "FAIL|rror" | head -3 | cut -c1-200; }
    kill -TERM $S; wait $S
  done
  echo "flags '${v}': $fails of ${RUNS:-6} smoke runs failed"
done
