#!/usr/bin/env bash
# Installs what the fuzz and format checks need on Debian 12 (as root, or with
# sudo); idempotent and fast when present: clang with libFuzzer (the
# compiler-rt package of the same major version) and clang-format. Kept out of
# setup.sh: `make test` needs neither.
set -euo pipefail
CLANG_VERSION="${REMAT_CLANG_VERSION:-14}"   # Debian 12's default clang
pkgs=("clang-$CLANG_VERSION" "libclang-rt-$CLANG_VERSION-dev" "clang-format-$CLANG_VERSION")
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup-fuzz] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
