# Sourced by the GPU scripts after they set CARRY, WHAT and OUT: the output folder, the carried libraries on the
# library path, NVLink multicast off, the xz-compressed binaries unpacked (Python's lzma: the GPU image has no xz),
# has() for the WHAT list, and the GPU's name and clocks in $OUT/gpu.txt.
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
# Unpacked without the carried libraries on the path and renamed into place: a second run of this script would
# otherwise truncate the libz.so.1 that its own python3 has mapped ("file too short" for every later process).
for f in "$CARRY"/*/*.xz; do [ -e "$f" ] && env -u LD_LIBRARY_PATH python3 -c "
import lzma, os, sys; t = sys.argv[1][:-3]; open(t + '.tmp', 'wb').write(lzma.open(sys.argv[1]).read()); os.replace(t + '.tmp', t)" "$f" && chmod +x "${f%.xz}"; done
has() { [[ ",$WHAT," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
