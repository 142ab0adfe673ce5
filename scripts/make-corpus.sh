#!/usr/bin/env bash
# make-corpus.sh OUT: writes a ~11 MB text corpus for training subword
# tokenizers (remat-train --vocab-size N --data OUT) from text every Debian 12
# machine with python3 has, no download: the Python standard library's .py
# files (packages libpython3.X-minimal and libpython3.X-stdlib), Perl's core
# modules (perl-base, Essential) and /usr/share/common-licenses (base-files).
# Deterministic: the files of each package in byte order (LC_ALL=C sort), each
# followed by a newline; the same packages give the same bytes. Leaves out
# site-packages and dist-packages (what pip or apt added on this machine).
# Written to OUT.tmp.PID, then renamed over OUT.
set -euo pipefail
if [ $# -ne 1 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
  echo "usage: $0 OUT   (writes the corpus to the file OUT)" >&2
  exit 2
fi
out="$1"
export LC_ALL=C
pkgs=$(dpkg-query -W -f='${db:Status-Status} ${Package}\n' 'libpython3.*-minimal' 'libpython3.*-stdlib' 2>/dev/null |
  awk '$1 == "installed" { print $2 }' | sort || true)
if [ -z "$pkgs" ]; then
  echo "[make-corpus] no libpython3.X-stdlib installed; apt-get install python3" >&2
  exit 1
fi
files() {
  local p
  for p in $pkgs; do
    dpkg -L "$p" | grep '\.py$' | grep -v -e '/site-packages/' -e '/dist-packages/' | sort
  done
  dpkg -L perl-base 2>/dev/null | grep '\.pm$' | sort || true
  find /usr/share/common-licenses -maxdepth 1 -type f | sort
}
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
n=0
: >"$tmp"
while IFS= read -r f; do
  [ -f "$f" ] || continue
  cat "$f" >>"$tmp"
  printf '\n' >>"$tmp"
  n=$((n + 1))
done < <(files)
mv "$tmp" "$out"
trap - EXIT
echo "[make-corpus] $out: $n files, $(wc -c <"$out") bytes (packages: $(echo $pkgs) perl-base base-files)"
