#!/usr/bin/env bash
# Checks the layering of the library (docs/architecture.md): every file of a
# layer folder in src/, and every public header in include/remat/, includes
# headers of its own layer or of a lower one only. Each offending include is
# printed as file:line -> header (and the two layers); exit 1 if any.
#
#   scripts/check-layers.sh [--map FILE]
#     --map FILE  lines "path layer": the layer of files outside a layer
#                 folder (to check a planned move before making it)
#
# What counts as an include: `#include "..."`, resolved from the including
# file's folder (a header of src/<layer>/ belongs to <layer>), and
# `#include <remat/...>`, a public header, whose layer is in PUBLIC below.
# Other includes (the standard library, LibTorch) are not layered, except
# that plan/ is torch-free: it includes nothing of torch, ATen or c10.
set -euo pipefail
cd "$(dirname "$0")/.."

# The layer order, lowest first. Layers in one entry are peers: neither
# includes the other. Each layer may include any layer before it:
#   plan    torch-free planner; includes no other layer
#   core    mechanisms: hooks, op interception, memory, replay, write guard
#   offload stores for saved tensors (host, disk, codecs)
#   region  checkpoint, selective policies, module switch; may use offload
#   optim   the optimizer step in backward, its state in a store; a peer of
#           region (uses offload's stores)
#   chain   CheckpointedSequential and its profiler
#   auto    the whole-step planner (profiles a step, plans every unit)
#   models, parallel  reference models and trainer; c10d data parallel.
#           Both may use every layer above (a data-parallel model may be
#           checkpointed or a planned chain), never each other.
LAYERS=(plan core offload "region optim" chain auto "models parallel")

# Public headers of include/remat/ by layer (the folders plan/, models/ and
# parallel/ are their layers). remat.h, the umbrella, is above every layer:
# no source includes it.
PUBLIC=(error.h:core hooks.h:core memory.h:core
  offload.h:offload
  optim.h:optim
  policy.h:region checkpoint.h:region selective.h:region checkpointable.h:region chunked.h:region
  profile.h:chain sequential.h:chain
  auto.h:auto
  remat.h:umbrella)

declare -A RANK
r=0
for entry in "${LAYERS[@]}"; do
  for l in $entry; do RANK[$l]=$r; done
  r=$((r + 1))
done
RANK[umbrella]=$r

declare -A MAP
if [ "${1:-}" = "--map" ]; then
  [ -n "${2:-}" ] || { echo "check-layers: --map needs a file" >&2; exit 2; }
  while read -r path layer; do
    [ -n "$path" ] && MAP[$path]=$layer
  done < <(grep -v '^#' "$2")
elif [ -n "${1:-}" ]; then
  sed -n '2,15p' "$0"
  exit 2
fi

# layer_of PATH (relative to the repository root): its layer, or "".
layer_of() {
  local p="$1"
  if [ -n "${MAP[$p]:-}" ]; then echo "${MAP[$p]}"; return; fi
  case "$p" in
    src/*/*)
      local l="${p#src/}"
      echo "${l%%/*}"
      ;;
    include/remat/*/*)
      local l="${p#include/remat/}"
      echo "${l%%/*}"
      ;;
    include/remat/*)
      local h="${p#include/remat/}" e
      for e in "${PUBLIC[@]}"; do
        if [ "${e%%:*}" = "$h" ]; then echo "${e#*:}"; return; fi
      done
      echo "unknown"
      ;;
    *) echo "" ;;
  esac
}

bad=0
report() {  # file line header message (line 0: the file itself)
  if [ "$2" = 0 ]; then echo "$1: $4"; else echo "$1:$2 -> $3 ($4)"; fi
  bad=$((bad + 1))
}

files=$(find src include/remat -type f \( -name '*.cpp' -o -name '*.h' \) | sort)
for f in $files; do
  own=$(layer_of "$f")
  if [ -z "$own" ]; then
    report "$f" 0 "-" "not in a layer folder: move it into one, or --map it"
    continue
  fi
  if [ -z "${RANK[$own]:-}" ]; then
    report "$f" 0 "-" "unknown layer '$own': add it to LAYERS (or PUBLIC) in $0"
    continue
  fi
  while IFS=: read -r line text; do
    target=""
    if [[ "$text" =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\"([^\"]+)\" ]]; then
      inc="${BASH_REMATCH[1]}"
      resolved=$(realpath -m --relative-to=. "$(dirname "$f")/$inc")
      target=$(layer_of "$resolved")
      [ -n "$target" ] || continue  # outside the layers (generated, third party)
    elif [[ "$text" =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<(remat/[^\>]+)\> ]]; then
      inc="${BASH_REMATCH[1]}"
      target=$(layer_of "include/$inc")
    elif [[ "$own" = plan && "$text" =~ ^[[:space:]]*#[[:space:]]*include[[:space:]]*\<((torch|ATen|c10)/[^\>]+)\> ]]; then
      report "$f" "$line" "${BASH_REMATCH[1]}" "plan is torch-free"
      continue
    else
      continue
    fi
    [ "$target" = "$own" ] && continue
    if [ -z "${RANK[$target]:-}" ]; then
      report "$f" "$line" "$inc" "header of unknown layer '$target': add it to PUBLIC in $0"
    elif [ "$own" = umbrella ] || [ "${RANK[$target]}" -lt "${RANK[$own]}" ]; then
      continue
    else
      report "$f" "$line" "$inc" "$own includes $target"
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include' "$f" || true)
done

if [ "$bad" -gt 0 ]; then
  echo "check-layers: $bad finding(s) against the layer order (${LAYERS[*]}; docs/architecture.md)" >&2
  exit 1
fi
echo "check-layers: $(echo "$files" | wc -w) files, every include within its layer or below"
