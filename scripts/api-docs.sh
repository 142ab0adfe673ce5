#!/usr/bin/env bash
# Renders the API reference (Doxyfile: the public headers include/remat/**.h
# and docs/api-mainpage.md) as HTML into OUT/html and counts Doxygen's
# warnings, nearly all of them undocumented public symbols. The count may not
# go above the baseline in docs/api-warnings.txt; when it goes below, the
# script says how to lower the baseline (it only ever goes down).
#
#   scripts/api-docs.sh [OUT]   OUT defaults to build/docs (make docs: $(BUILD)/docs)
#
# Installs doxygen when missing (scripts/setup.sh --docs). About 1 s.
set -euo pipefail
out="$(realpath -m "${1:-build/docs}")"
cd "$(dirname "$0")/.."
command -v doxygen >/dev/null || bash scripts/setup.sh --docs >&2
command -v doxygen >/dev/null || { echo "api-docs: doxygen not found (scripts/setup.sh --docs installs it)" >&2; exit 2; }

rm -rf "$out/html"
mkdir -p "$out"
log="$out/warnings.log"
rm -f "$log"
# The Doxyfile with the output folder and log moved to OUT (later lines win).
{
  cat Doxyfile
  echo "OUTPUT_DIRECTORY = \"$out\""
  echo "WARN_LOGFILE = \"$log\""
} | doxygen -
[ -f "$out/html/index.html" ] || { echo "api-docs: doxygen wrote no $out/html/index.html" >&2; exit 2; }

baseline_file=docs/api-warnings.txt
baseline="$(grep -E '^[0-9]+$' "$baseline_file" | head -1)"
count="$(grep -c 'warning:' "$log" || true)"
undocumented="$(grep -c 'is not documented' "$log" || true)"
echo "api-docs: $count Doxygen warnings ($undocumented undocumented public symbols), baseline $baseline; HTML in $out/html/index.html"
if [ "$count" -gt "$baseline" ]; then
  echo "api-docs: FAIL: $((count - baseline)) more warnings than the baseline ($baseline_file)." >&2
  echo "api-docs: document the new public declarations with a /** */ comment (units, defaults); the warnings:" >&2
  sed "s|^$PWD/||" "$log" >&2
  exit 1
fi
if [ "$count" -lt "$baseline" ]; then
  echo "api-docs: $((baseline - count)) fewer warnings than the baseline: lower it with"
  echo "  sed -i 's/^$baseline\$/$count/' $baseline_file"
fi
