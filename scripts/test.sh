#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds and runs kiln's whole test suite (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)"
# The template oracle tests run `python3` with jinja2. setup.sh installs Debian's python3-jinja2; if the
# python3 first on PATH (e.g. a pyenv one) lacks jinja2, put Debian's python3 first for the tests.
if ! python3 -c 'import jinja2' 2>/dev/null && /usr/bin/python3 -c 'import jinja2' 2>/dev/null; then
  mkdir -p "$BUILD/python-shim"
  ln -sf /usr/bin/python3 "$BUILD/python-shim/python3"
  export PATH="$(cd "$BUILD/python-shim" && pwd):$PATH"
  echo "[test] using /usr/bin/python3 (has jinja2) for the tests"
fi
cd "$BUILD"
ctest --output-on-failure -j "$(nproc)" --timeout 900
