#!/usr/bin/env bash
# Builds the libFuzzer harnesses of fuzz/ (clang, ASan + UBSan, planner only)
# into build-fuzz/ and runs each for a bounded time. Exits non-zero if any
# harness crashed, broke an invariant, leaked, hit a sanitizer or timed out;
# the input that did it is left in build-fuzz/artifacts/<target>/.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]   SECONDS per target (default 60)
#   reproduce:  build-fuzz/fuzz/<target> build-fuzz/artifacts/<target>/crash-...
#
# Seeds come from fuzz/corpus/<target>/ (committed, read only); what a run adds
# goes to build-fuzz/corpus/<target>/ and is kept between runs.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-60}"
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(chain_json_fuzz solve_fuzz parse_fuzz step_fuzz)
BUILD="${REMAT_FUZZ_BUILD:-build-fuzz}"
JOBS="${JOBS:-2}"
CLANG_VERSION="${REMAT_CLANG_VERSION:-14}"

bash scripts/setup-fuzz.sh
CXX_BIN="$(command -v "clang++-$CLANG_VERSION" || command -v clang++ || true)"
[ -n "$CXX_BIN" ] || { echo "[fuzz] clang++ not found (scripts/setup-fuzz.sh)" >&2; exit 1; }

# -O1 -g1 (from cmake/sanitize.cmake): the usual libFuzzer + ASan setting; asserts on.
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CXX_COMPILER="$CXX_BIN" -DREMAT_PLAN_ONLY=ON -DREMAT_FUZZ=ON \
  -DREMAT_SANITIZE=address,undefined -DREMAT_BUILD_TESTS=OFF -DREMAT_BUILD_BENCH=OFF -DREMAT_BUILD_EXAMPLES=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 >/dev/null
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"

# Leaks are findings (the planner owns all its memory); the first finding ends the run.
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=()
summary="$BUILD/fuzz-summary.txt"
: > "$summary"
# The targets run side by side (JOBS at a time): each is single-threaded, and
# in sequence they were most of CI's fuzz step on 2 cores.
run_one() {
  local t="$1"
  # -timeout: one input running 10 s is a hang; -rss_limit_mb: 2 GiB is a blow-up;
  # -max_len: JSON chains need more than the default (taken from the seeds).
  "$BUILD/fuzz/$t" "$BUILD/corpus/$t" "fuzz/corpus/$t" -max_total_time="$SECONDS_EACH" -timeout=10 \
    -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 -artifact_prefix="$BUILD/artifacts/$t/" \
    >"$BUILD/$t.log" 2>&1
}
declare -A pid_of rc_of
for t in "${TARGETS[@]}"; do
  mkdir -p "$BUILD/corpus/$t" "$BUILD/artifacts/$t"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  echo "[fuzz] $t for ${SECONDS_EACH}s (log: $BUILD/$t.log)"
  run_one "$t" &
  pid_of[$t]=$!
done
for t in "${TARGETS[@]}"; do
  rc=0
  wait "${pid_of[$t]}" || rc=$?
  rc_of[$t]=$rc
done
for t in "${TARGETS[@]}"; do
  log="$BUILD/$t.log"
  rc="${rc_of[$t]}"
  done_line="$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)"
  execs="$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}' || true)"
  cov="$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' "$log" | tail -1)"
  ft="$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' "$log" | tail -1)"
  corp="$(sed -nE 's/.* corp: ([0-9]+\/[0-9]+[a-zA-Z]*).*/\1/p' "$log" | tail -1)"
  line="$t: rc=$rc execs=${execs:-?} cov=${cov:-?} ft=${ft:-?} corpus=${corp:-?} time=${SECONDS_EACH}s"
  echo "[fuzz] $line" | tee -a "$summary"
  if [ "$rc" -ne 0 ] || [ -z "$done_line" ]; then
    failed+=("$t")
    echo "[fuzz] $t FAILED; last lines of $log:" >&2
    tail -40 "$log" >&2
    ls "$BUILD/artifacts/$t/" >&2 || true
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "[fuzz] failed: ${failed[*]} (reproduce: $BUILD/fuzz/<target> <artifact>)" >&2
  exit 1
fi
echo "[fuzz] all ${#TARGETS[@]} targets clean"
