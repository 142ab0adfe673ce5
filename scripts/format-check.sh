#!/usr/bin/env bash
# Checks the C++ sources against .clang-format (clang-format from Debian 12,
# version 14: other versions format some constructs differently).
#
#   scripts/format-check.sh [--fix|--advisory] [PATH...]
#     (no flag)   list the files clang-format would change; exit 1 if any
#     --fix       rewrite them in place
#     --advisory  list them, print the count, exit 0 (CI until the tree is formatted)
#     PATH...     only these files or folders (default: every tracked or new,
#                 not ignored *.cpp / *.h / *.hpp / *.cc in the repository)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=check
paths=()
for a in "$@"; do
  case "$a" in
    --fix) mode=fix ;;
    --advisory) mode=advisory ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) echo "format-check: unknown flag $a" >&2; exit 2 ;;
    *) paths+=("$a") ;;
  esac
done
CLANG_VERSION="${REMAT_CLANG_VERSION:-14}"
CF="$(command -v "clang-format-$CLANG_VERSION" || true)"
if [ -z "$CF" ]; then
  bash scripts/setup-fuzz.sh >&2
  CF="$(command -v "clang-format-$CLANG_VERSION" || command -v clang-format || true)"
fi
[ -n "$CF" ] || { echo "format-check: clang-format not found (scripts/setup-fuzz.sh installs it)" >&2; exit 2; }

mapfile -t files < <(git ls-files --cached --others --exclude-standard -- "${paths[@]}" |
  grep -E '\.(cpp|h|hpp|cc)$' | while read -r f; do [ -f "$f" ] && echo "$f"; done)
if [ "$mode" = fix ]; then
  printf '%s\0' "${files[@]}" | xargs -0 -r "$CF" -i --style=file
  echo "format-check: formatted ${#files[@]} files with $("$CF" --version | head -1)"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$CF" --style=file --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -eq 0 ]; then
  echo "format-check: ${#files[@]} files match .clang-format"
  exit 0
fi
printf 'format-check: needs formatting: %s\n' "${bad[@]}"
echo "format-check: ${#bad[@]} of ${#files[@]} files differ from .clang-format; run scripts/format-check.sh --fix"
[ "$mode" = advisory ] && exit 0
exit 1
