# Sourced by the GPU scripts after they set CARRY, WHAT and OUT: the output folder, the carried libraries on the
# library path, NVLink multicast off, the xz-compressed binaries unpacked (Python's lzma: the GPU image has no xz),
# has() for the WHAT list, and the GPU's name and clocks in $OUT/gpu.txt.
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$CARRY/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export NCCL_NVLS_ENABLE=0
for f in "$CARRY"/*/*.xz; do [ -e "$f" ] && python3 -c "
import lzma, sys; open(sys.argv[1][:-3], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" && chmod +x "${f%.xz}"; done
has() { [[ ",$WHAT," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
