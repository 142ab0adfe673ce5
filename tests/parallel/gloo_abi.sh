#!/usr/bin/env bash
# NOTE [c10d from C++]: src/parallel/gloo.cpp is compiled against Debian's
# gloo headers, libtorch_cpu against the gloo of its own build. The objects
# gloo.cpp allocates must have the size libtorch_cpu gives them: read that
# size where libtorch_cpu itself allocates each one (operator new's argument,
# `mov $SIZE,%edi` just before `call _Znwm`) and compare with the probe's
# sizeof. Usage: gloo_abi.sh PROBE LIBTORCH_CPU
set -euo pipefail
probe="$1" lib="$2"
command -v objdump >/dev/null || { echo "gloo_abi: objdump (binutils) is missing: apt-get install binutils" >&2; exit 1; }
# size_allocated_by SYMBOL_REGEX: the first operator new size in that function.
size_allocated_by() {
  local sym
  sym=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -E "$1" | head -1)
  [ -n "$sym" ] || { echo "gloo_abi: no symbol matching $1 in $lib" >&2; exit 1; }
  # The last immediate moved into %edi before the first call of operator new.
  local hex
  hex=$(objdump -d --no-show-raw-insn "$lib" --disassemble="$sym" | awk '
    match($0, /mov +\$0x[0-9a-f]+,%edi/) { imm = substr($0, RSTART, RLENGTH); sub(/^mov +\$/, "", imm); sub(/,%edi$/, "", imm) }
    /call +[0-9a-f]+ <_Znwm(@plt)?>/ { if (imm != "") print imm; exit }')
  [ -n "$hex" ] && echo $((hex))
}
fail=0
check() {  # name, symbol regex (a libtorch_cpu function that allocates exactly that object first)
  local ours theirs
  ours=$("$probe" | awk -v n="$1" '$1 == n {print $2}')
  theirs=$(size_allocated_by "$2" || true)
  if [ -z "$theirs" ]; then
    echo "gloo_abi: could not read the size libtorch_cpu allocates for $1 (in $2)" >&2
    fail=1
  elif [ "$ours" != "$theirs" ]; then
    echo "gloo_abi: MISMATCH $1: $ours bytes with these gloo headers, $theirs in libtorch_cpu" >&2
    fail=1
  else
    echo "gloo_abi: $1 $ours bytes, as libtorch_cpu allocates it"
  fi
}
# split() makes a new ProcessGroupGloo; Options::create_default a new Options.
check ProcessGroupGloo '^_ZN4c10d16ProcessGroupGloo5split'
check ProcessGroupGloo::Options '^_ZN4c10d16ProcessGroupGloo7Options14create_default'
exit $fail
