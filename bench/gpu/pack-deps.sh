#!/usr/bin/env bash
# pack-deps.sh: gathers, on a development machine (Debian), what building
# remat needs and a bare GPU machine may lack, into bench/gpu/deps (ignored
# by git; carry it with the run: carry=["bench/gpu/deps"]). bench/gpu/check.sh
# uses each piece only where the machine has none of its own:
#   include/ + share/cmake/   nlohmann-json and CLI11 (header-only, with their
#                             CMake package files)
#   include/ + lib/           zstd, lz4 and SentencePiece headers and shared
#                             libraries
#                             (check.sh writes their .pc files, and a
#                             pkg-config stand-in if the machine has none)
#   googletest/               Debian's GoogleTest sources (check.sh builds
#                             them when no GTest package is found)
#   gloo/include/gloo         Debian's libgloo-dev headers (remat::parallel
#                             needs them to configure; kept apart so that
#                             only its gloo.cpp sees them)
# About 7 MiB. Leaves out: LibTorch, CUDA and the compilers (the GPU machine
# has them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dst=${1:-$here/deps}
arch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/$arch
rm -rf "$dst"
mkdir -p "$dst/include" "$dst/lib" "$dst/share/cmake"
missing=()
copy() {  # copy SRC... DEST, noting what is absent
  local dest=${!#} n=$(($# - 1)) i
  for ((i = 1; i <= n; i++)); do
    if [[ -e ${!i} ]]; then cp -a "${!i}" "$dest"/; else missing+=("${!i}"); fi
  done
}
copy /usr/include/nlohmann /usr/include/CLI "$dst/include"
copy /usr/include/zstd.h /usr/include/zdict.h /usr/include/zstd_errors.h "$dst/include"
copy /usr/include/lz4.h /usr/include/lz4hc.h /usr/include/lz4frame.h /usr/include/lz4frame_static.h "$dst/include"
copy /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$dst/share/cmake"
copy /usr/include/sentencepiece_processor.h /usr/include/sentencepiece_trainer.h "$dst/include"
# The shared libraries under their real names; check.sh makes the links.
for lib in libzstd liblz4 libsentencepiece libsentencepiece_train; do
  real=$(readlink -f "$libdir/$lib.so" 2>/dev/null || true)
  if [[ -f $real ]]; then
    cp "$real" "$dst/lib/"
    pkg-config --modversion "${lib/#libsentencepiece*/sentencepiece}" >"$dst/lib/$lib.version" 2>/dev/null || true
  else
    missing+=("$libdir/$lib.so")
  fi
done
copy /usr/src/googletest "$dst"
mkdir -p "$dst/gloo/include"
copy /usr/include/gloo "$dst/gloo/include"
echo "pack-deps.sh: $(du -sh "$dst" | cut -f1) in $dst"
if ((${#missing[@]})); then
  echo "pack-deps.sh: not found here (install them, or the GPU machine must have them): ${missing[*]}" >&2
  exit 1
fi
