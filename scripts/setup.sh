#!/usr/bin/env bash
# Installs what remat needs on a fresh Debian 12 machine; idempotent and fast
# when everything is present. Debian packages via apt-get (as root), LibTorch
# via pip (torch==2.13.0, CPU wheel) into a venv outside the repository.
# `setup.sh --docs` installs only what make docs needs (doxygen).
set -euo pipefail
VENV="${REMAT_VENV:-$HOME/.cache/remat/venv}"
TORCH_VERSION="${REMAT_TORCH_VERSION:-2.13.0}"

pkgs=(cmake ninja-build g++ make python3-venv libgtest-dev libgmock-dev libgloo-dev
      libbenchmark-dev nlohmann-json3-dev libcli11-dev pkg-config libzstd-dev liblz4-dev libsentencepiece-dev libglpk-dev)
# The API reference (make docs, scripts/api-docs.sh): `setup.sh --docs`
# installs only these, so that make test does not fetch doxygen and the LLVM
# libraries it links (about 45 MB).
docs_pkgs=(doxygen)
. "$(dirname "$0")/apt-missing.sh"
if [ "${1:-}" = --docs ]; then
  apt_install_missing setup "${docs_pkgs[@]}"
  exit 0
fi
apt_install_missing setup "${pkgs[@]}"

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  echo "[setup] creating $VENV with torch==$TORCH_VERSION"
  mkdir -p "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # --no-compile: Python compiles the modules it imports when it imports them
  # (byte-compiling all of torch takes about 8 s of a fresh setup).
  "$VENV/bin/pip" install -q --no-compile --disable-pip-version-check "torch==$TORCH_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import torch" || { echo "[setup] torch install failed" >&2; exit 1; }
fi
# matplotlib draws the demo's chart; optional: the demo skips the chart without it.
"$VENV/bin/python" -c "import matplotlib" 2>/dev/null || \
  "$VENV/bin/pip" install -q --disable-pip-version-check matplotlib 2>&1 | grep -v "^WARNING: Location" || true
