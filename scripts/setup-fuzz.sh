#!/usr/bin/env bash
# Installs what the fuzz and format checks need on Debian 12 (as root, or with
# sudo); idempotent and fast when present: clang with libFuzzer (the
# compiler-rt package of the same major version) and clang-format. Kept out of
# setup.sh: `make test` needs neither.
set -euo pipefail
CLANG_VERSION="${REMAT_CLANG_VERSION:-14}"   # Debian 12's default clang
pkgs=("clang-$CLANG_VERSION" "libclang-rt-$CLANG_VERSION-dev" "clang-format-$CLANG_VERSION")
. "$(dirname "$0")/apt-missing.sh"
apt_install_missing setup-fuzz "${pkgs[@]}"
