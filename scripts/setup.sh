#!/usr/bin/env bash
# Installs every dependency kiln needs on a fresh Debian bookworm machine.
# Single source of dependencies: the build, the tests and CI all rely on this script.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libfmt-dev
  libpcre2-dev libxxhash-dev
  libpng-dev libjpeg62-turbo-dev libwebp-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang libclang-rt-14-dev
  python3 python3-jinja2
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "[setup] Debian packages: all present"
fi

# Node.js + npm: machines of this kind ship them; install Debian's only where none is present.
if ! command -v npm >/dev/null 2>&1; then
  $SUDO apt-get install -y -q nodejs npm
fi

# Test-only npm packages (oracles: HF tokenizers in JS, @huggingface/jinja, the openai SDK).
if [ -f tests/js/package.json ]; then
  echo "[setup] installing npm test packages (tests/js)"
  (cd tests/js && npm install --no-audit --no-fund --loglevel=error)
fi
echo "[setup] done"
