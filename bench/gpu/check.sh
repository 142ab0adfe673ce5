#!/usr/bin/env bash
# bench/gpu/check.sh: the GPU check (build, test_cuda, the reference GPU
# workload against PyTorch), one run within 8 minutes on
# the lent GPU machine (one H200, Python PyTorch with CUDA, no registry):
#   0. preflight: Python torch (and its LibTorch, torch.utils.cmake_prefix_path),
#      cmake, ninja, a C++ compiler, nvcc, GoogleTest, nlohmann-json, CLI11,
#      zstd/lz4, gloo's headers; says what is missing and what is skipped;
#   1. configure and build remat against that LibTorch with -DREMAT_CUDA=ON,
#      only the targets needed (remat, remat_models, remat_gpu_bench, and
#      test_cuda when tests/test_cuda.cpp and GoogleTest are there);
#   2. run test_engine_order and test_cuda, then the CUDA cases of the other
#      suites: test_memory_source (the caching allocator's trace replayed
#      against its statistics on the device) and test_auto's Cuda* tests
#      (the whole-step planner on the device);
#   3. the GPT benchmark at the reference GPU size (bf16 autocast,
#      explicit and SDPA attention): C++ remat (bench/gpu/remat_gpu_bench.cpp:
#      plain, per-block checkpoint, selective save_matmuls, Megatron policy,
#      per-block with inputs offloaded to pinned host memory,
#      CheckpointedSequential auto, the whole-step planner at 0.5 and at its
#      leanest plan) and Python PyTorch (bench/gpu/gpu_bench.py: plain, per-block
#      torch.utils.checkpoint, SAC, then torch.compile with
#      activation_memory_budget under what time is left): peak CUDA memory,
#      step time, tokens/s, largest batch within --budget-gib (default 40);
#   4. long context (bench/gpu/remat_longctx_gpu.cpp): remat's whole GPT
#      step with a 32k vocabulary, plain and per-block against the chunked
#      head + loss and MLP: peaks, step times, longest sequence under a cap.
# Every phase has a timeout cut to what is left of the deadline (470 s).
# Writes check.log, build.log, tests.log, tests-source.log, tests-auto.log, bench.log, longctx.log,
# longctx.json, results.json and
# summary.md to $OUT if set, else bench/gpu/out.
#
# Usage: bench/gpu/check.sh [--quick] [--build-only] [--skip-build]
#                           [--no-compile] [--jobs N]
#   --quick       CPU smoke run at a toy size (no GPU needed; REMAT_CUDA=AUTO):
#                 the CUDA test cases skip, the benchmarks run on the CPU
#   --build-only  phases 0-1 only (a compile check against a CUDA LibTorch)
#   --skip-build  use the binaries already in the build folder
# Environment: PYTHON (python3), BUILD_DIR (bench/gpu/build), DEPS_DIR
# (bench/gpu/deps, from pack-deps.sh: used only for what the machine lacks;
# CHECK_FORCE_DEPS=1 uses it for everything it holds), REMAT_CUDA (ON),
# CHECK_DEADLINE_S (470), BUILD_TIMEOUT_S (300), BUDGET_GIB (40), CPP_ARGS / PY_ARGS (extra bench
# arguments), LONGCTX_ARGS (extra remat_longctx_gpu arguments), LONGCTX_S (its seconds, 130),
# COMPILE_BUDGET (0.5).
# On the device tool: bash bench/gpu/pack-deps.sh here, then
#   run(command="bash bench/gpu/check.sh", carry=["bench/gpu/deps"], timeout_s=540)
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
t0=$SECONDS
deadline=${CHECK_DEADLINE_S:-470}
quick=0 build_only=0 skip_build=0 compile=1 jobs=16
while (($#)); do
  case $1 in
    --quick) quick=1 ;;
    --build-only) build_only=1 ;;
    --skip-build) skip_build=1 ;;
    --no-compile) compile=0 ;;
    --jobs) jobs=$2; shift ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

out=${OUT:-$here/out}
build=${BUILD_DIR:-$here/build}
deps=${DEPS_DIR:-$here/deps}
mkdir -p "$out" "$build"
out=$(cd "$out" && pwd)
build=$(cd "$build" && pwd)
work=$build/_check  # per-phase JSON, merged into $out/results.json
rm -rf "$work"
mkdir -p "$work"
: >"$out/check.log"
exec > >(tee -a "$out/check.log") 2>&1
tee_pid=$!

elapsed() { echo $((SECONDS - t0)); }
left() { echo $((deadline - (SECONDS - t0))); }
say() { printf '[check %3ss] %s\n' "$(elapsed)" "$*"; }
# budget CAP RESERVE: seconds for a phase: at most CAP, leaving RESERVE for later ones.
budget() {
  local b=$(($(left) - $2))
  ((b > $1)) && b=$1
  ((b < 0)) && b=0
  echo "$b"
}
phases=()   # "name|status|seconds|detail"
missing=()  # what the machine lacks, with what it costs
record() { phases+=("$1|$2|$3|$4"); say "phase $1: $2 ($3 s) $4"; }
# run_phase NAME TIMEOUT LOG CMD...: runs CMD under timeout, output to LOG and the console.
run_phase() {
  local name=$1 limit=$2 logf=$3 s=$SECONDS rc
  shift 3
  if ((limit < 5)); then
    record "$name" skipped 0 "no time left"
    return 99
  fi
  say "phase $name (timeout ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" >>"$logf" 2>&1
  rc=$?
  local d=$((SECONDS - s))
  if ((rc == 124 || rc == 137)); then
    record "$name" timeout "$d" "after ${limit} s (log: $(basename "$logf"))"
  elif ((rc != 0)); then
    record "$name" "failed" "$d" "exit $rc (log: $(basename "$logf")): $(grep -m1 -iE 'error|fatal|what\(\)' "$logf" | cut -c1-200)"
  else
    record "$name" ok "$d" ""
  fi
  return $rc
}

# --- 0. preflight ---------------------------------------------------------------
say "repo $repo, results in $out, build in $build"
py=${PYTHON:-}
if [[ -z $py ]]; then
  for c in python3 python; do command -v "$c" >/dev/null && py=$c && break; done
fi
torch_prefix="" have_cuda=0
if [[ -n $py ]] && "$py" - >"$work/torch.txt" 2>&1 <<'EOF'
import torch, torch.utils
print("version", torch.__version__)
print("cuda", torch.version.cuda)
print("available", int(torch.cuda.is_available()))
print("gpu", torch.cuda.get_device_name(0).replace(" ", "_") if torch.cuda.is_available() else "-")
print("prefix", torch.utils.cmake_prefix_path)
print("abi", int(torch._C._GLIBCXX_USE_CXX11_ABI))
EOF
then
  torch_prefix=$(awk '$1 == "prefix" {print $2}' "$work/torch.txt")
  have_cuda=$(awk '$1 == "available" {print $2}' "$work/torch.txt")
  say "python $py: torch $(awk '$1=="version"{print $2}' "$work/torch.txt"), CUDA $(awk '$1=="cuda"{print $2}' "$work/torch.txt"), GPU $(awk '$1=="gpu"{print $2}' "$work/torch.txt"), LibTorch $torch_prefix"
else
  missing+=("python with torch (${py:-none found}): $(tail -1 "$work/torch.txt" 2>/dev/null); nothing runs")
  py=""
fi
device=cuda
if ((quick)); then
  device=cpu
elif [[ $have_cuda != 1 ]]; then
  missing+=("a CUDA device visible to torch: the tests and benchmarks are skipped")
fi

gen="" cxx="" nvcc=""
if ! command -v cmake >/dev/null; then missing+=("cmake: the C++ build is skipped"); fi
if command -v ninja >/dev/null; then gen=Ninja
elif command -v make >/dev/null; then gen="Unix Makefiles"; missing+=("ninja (building with make)")
else missing+=("ninja and make: the C++ build is skipped"); fi
for c in "${CXX:-}" g++ c++ clang++; do
  [[ -n $c ]] && command -v "$c" >/dev/null && cxx=$(command -v "$c") && break
done
[[ -z $cxx ]] && missing+=("a C++ compiler (g++): the C++ build is skipped")
for c in "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc; do
  [[ -n $c && -x $c ]] && nvcc=$c && break
done
if [[ -z $nvcc && $quick == 0 ]]; then
  missing+=("nvcc (the CUDA toolkit that LibTorch's CMake config looks for): configure may fail")
fi
say "tools: cmake $(cmake --version 2>/dev/null | head -1 | awk '{print $3}'), generator ${gen:-none}, c++ ${cxx:-none}$([[ -n $cxx ]] && "$cxx" -dumpversion 2>/dev/null | sed 's/^/ /'), nvcc ${nvcc:-none}"

# Dependencies: the machine's own, else the carried ones (pack-deps.sh).
force=${CHECK_FORCE_DEPS:-0}
prefixes=()
dep_dirs=/usr:/usr/local:/opt
pkg_dirs=()  # -D<Name>_DIR=... for the packages found below (CMake may not search there itself)
has_cmake_pkg() {  # has_cmake_pkg NAME: a NAMEConfig.cmake under a system prefix
  local d f
  IFS=: read -ra ds <<<"$dep_dirs"
  for d in "${ds[@]}"; do
    f=$(find "$d" -maxdepth 6 \( -name "$1Config.cmake" -o -name "$1-config.cmake" \) -print -quit 2>/dev/null)
    if [[ -n $f ]]; then
      pkg_dirs+=("-D$1_DIR=$(dirname "$f")")
      return 0
    fi
  done
  return 1
}
carried_deps=()
for pkg in nlohmann_json CLI11; do
  if ((force == 0)) && has_cmake_pkg "$pkg"; then continue; fi
  if [[ -d $deps/share/cmake/$pkg ]]; then
    carried_deps+=("$pkg")
  else
    missing+=("$pkg (Debian: $([[ $pkg == CLI11 ]] && echo libcli11-dev || echo nlohmann-json3-dev)); carry it with pack-deps.sh: configure fails")
  fi
done
((${#carried_deps[@]})) && prefixes+=("$deps")
pkgconf_env=() pkgconf_arg=()
need_pc=0
if ((force)) || ! command -v pkg-config >/dev/null || ! pkg-config --exists libzstd liblz4 sentencepiece 2>/dev/null; then
  need_pc=1
fi
if ((need_pc)); then
  first_file() { local f; for f in "$@"; do [[ -f $f ]] && echo "$f" && return; done; }
  if [[ -n $(first_file "$deps"/lib/libzstd.so.*) && -n $(first_file "$deps"/lib/liblz4.so.*) ]]; then
    d=$build/_deps
    mkdir -p "$d/lib/pkgconfig" "$d/bin"
    ln -sfn "$deps/include" "$d/include"
    for lib in libzstd liblz4 libsentencepiece libsentencepiece_train; do
      real=$(first_file "$deps"/lib/$lib.so.*)
      [[ -n $real ]] || continue
      ln -sfn "$real" "$d/lib/$lib.so"
      ln -sfn "$real" "$d/lib/$(basename "$real" | sed -E 's/(\.so\.[0-9]+).*/\1/')"
    done
    # One .pc per pkg-config module: (module, its libraries).
    for mod in "libzstd zstd" "liblz4 lz4" "sentencepiece sentencepiece sentencepiece_train"; do
      read -r name libs <<<"$mod"
      first=${libs%% *}
      [[ -e $d/lib/lib$first.so ]] || continue
      ver=$(cat "$deps/lib/lib$first.version" 2>/dev/null || basename "$(readlink "$d/lib/lib$first.so")" | sed "s/^lib$first\.so\.//")
      flags=$(for l in $libs; do printf -- ' -l%s' "$l"; done)
      # shellcheck disable=SC2016  # ${prefix} and ${libdir} are pkg-config's
      printf 'prefix=%s\nlibdir=${prefix}/lib\nincludedir=${prefix}/include\nName: %s\nDescription: carried by bench/gpu/pack-deps.sh\nVersion: %s\nLibs: -L${libdir}%s\nCflags: -I${includedir}\n' \
        "$d" "$name" "$ver" "$flags" >"$d/lib/pkgconfig/$name.pc"
    done
    carried_deps+=(zstd lz4 sentencepiece)
    pkgconf_env=(env "PKG_CONFIG_PATH=$d/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}")
    if ((force)) || ! command -v pkg-config >/dev/null; then
      # A stand-in that answers CMake's FindPkgConfig from the .pc files above.
      cat >"$d/bin/pkg-config" <<EOF
#!/usr/bin/env bash
# pkg-config stand-in written by bench/gpu/check.sh (the machine has none).
pc=$d/lib/pkgconfig
mode=exists mods=()
for a in "\$@"; do
  case \$a in
    --version) echo 0.29.2; exit 0 ;;
    --modversion) mode=version ;;
    --cflags | --cflags-only-I) mode=I ;;
    --libs) mode=libs ;;
    --libs-only-L) mode=L ;;
    --libs-only-l) mode=l ;;
    --variable=*) mode=var:\${a#--variable=} ;;
    -*) ;;
    *) mods+=("\${a%%[<>=]*}") ;;
  esac
done
for m in "\${mods[@]}"; do [[ -f \$pc/\$m.pc ]] || { echo "Package \$m was not found" >&2; exit 1; }; done
for m in "\${mods[@]}"; do
  f=\$pc/\$m.pc
  case \$mode in
    version) sed -n 's/^Version: //p' "\$f" ;;
    I) echo "-I$d/include" ;;
    L) echo "-L$d/lib" ;;
    l) sed -n 's/^Libs: -L[^ ]* //p' "\$f" ;;
    libs) sed -n 's/^Libs: -L[^ ]* //p' "\$f" | sed "s|^|-L$d/lib |" ;;
    var:prefix) echo "$d" ;;
    var:libdir) echo "$d/lib" ;;
    var:includedir) echo "$d/include" ;;
    var:*) echo ;;
  esac
done
exit 0
EOF
      chmod +x "$d/bin/pkg-config"
      pkgconf_arg=("-DPKG_CONFIG_EXECUTABLE=$d/bin/pkg-config")
    fi
  else
    missing+=("zstd/lz4/SentencePiece development files and pkg-config (Debian: libzstd-dev liblz4-dev libsentencepiece-dev pkgconf); carry them with pack-deps.sh: configure fails")
  fi
fi
((${#carried_deps[@]})) && say "using carried dependencies ($deps): ${carried_deps[*]}"

gloo_arg=()  # remat::parallel's configure needs gloo's headers (Debian: libgloo-dev)
if ((force)) || [[ ! -f /usr/include/gloo/config.h && ! -f /usr/local/include/gloo/config.h ]]; then
  if [[ -f $deps/gloo/include/gloo/config.h ]]; then
    gloo_arg=("-DREMAT_GLOO_INCLUDE_DIR=$deps/gloo/include")
    say "using carried gloo headers ($deps/gloo/include)"
  else
    missing+=("gloo's headers (Debian: libgloo-dev; carry them with pack-deps.sh): configure fails (src/parallel)")
  fi
fi
has_gtest_files() {  # headers and a library where FindGTest looks
  [[ -f /usr/include/gtest/gtest.h || -f /usr/local/include/gtest/gtest.h ]] || return 1
  compgen -G "/usr/lib/*/libgtest.*" >/dev/null || compgen -G "/usr/lib*/libgtest.*" >/dev/null ||
    compgen -G "/usr/local/lib*/libgtest.*" >/dev/null
}
tests=OFF gtest_dir=""
if [[ ! -f $repo/tests/test_cuda.cpp ]]; then
  missing+=("tests/test_cuda.cpp (not in this tree): no CUDA tests to run")
elif ((force == 0)) && { has_cmake_pkg GTest || has_gtest_files; }; then
  tests=ON  # GTestConfig, or FindGTest on the headers and libraries
elif [[ -f $deps/googletest/CMakeLists.txt && -n $gen && -n $cxx ]]; then
  tests=build  # from the carried sources, below
else
  missing+=("GoogleTest (Debian: libgtest-dev; or carry /usr/src/googletest with pack-deps.sh): the CUDA tests are skipped")
fi
for m in "${missing[@]}"; do say "MISSING: $m"; done

# --- 1. configure and build --------------------------------------------------------
cuda_opt=${REMAT_CUDA:-ON}
((quick)) && cuda_opt=${REMAT_CUDA:-AUTO}
built=0
targets=(remat remat_models remat_gpu_bench remat_longctx_gpu)
if ((skip_build)); then
  [[ -x $build/bench/gpu/remat_gpu_bench ]] && built=1
  record build skipped 0 "--skip-build ($([[ $built == 1 ]] && echo "binaries found" || echo "no binaries in $build"))"
elif [[ -z $torch_prefix || -z $gen || -z $cxx ]] || ! command -v cmake >/dev/null; then
  record build skipped 0 "missing: torch, cmake, a generator or a compiler"
else
  : >"$out/build.log"
  if [[ $tests == build ]]; then
    gb=$build/_gtest
    if run_phase gtest "$(budget 120 300)" "$out/build.log" bash -c \
      "cmake -S '$deps/googletest' -B '$gb' -G '$gen' -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
         -DCMAKE_CXX_COMPILER='$cxx' -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DCMAKE_INSTALL_PREFIX='$gb/install' \
       && cmake --build '$gb' -j$jobs && cmake --install '$gb'"; then
      tests=ON
      gtest_dir=$(dirname "$(find "$gb/install" -name GTestConfig.cmake | head -1)")
    else
      tests=OFF
      missing+=("GoogleTest: building the carried sources failed (build.log): the CUDA tests are skipped")
    fi
  fi
  prefix_path=$torch_prefix
  for p in "${prefixes[@]}"; do prefix_path+=";$p"; done
  cfg=(cmake -S "$repo" -B "$build" -G "$gen" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_COMPILER=$cxx"
    "-DCMAKE_PREFIX_PATH=$prefix_path" "-DREMAT_CUDA=$cuda_opt" -DREMAT_BUILD_EXAMPLES=OFF
    -DREMAT_BUILD_BENCH=ON -DREMAT_INSTALL=OFF -DTORCH_CUDA_ARCH_LIST=9.0
    "${pkgconf_arg[@]}")
  if [[ -n $nvcc ]]; then
    # The toolkit's root: where its headers are (nvcc may be a wrapper script elsewhere).
    for r in "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" "${CUDA_HOME:-/nonexistent}" /usr/local/cuda; do
      if [[ -x $r/bin/nvcc && ( -f $r/include/cuda_runtime.h || -f $r/targets/x86_64-linux/include/cuda_runtime.h ) ]]; then
        cfg+=("-DCMAKE_CUDA_COMPILER=$r/bin/nvcc" "-DCUDAToolkit_ROOT=$r" "-DCUDA_TOOLKIT_ROOT_DIR=$r")
        break
      fi
    done
  fi
  [[ -n $gtest_dir ]] && cfg+=("-DGTest_DIR=$gtest_dir")
  cfg+=("${pkg_dirs[@]}" "${gloo_arg[@]}")
  if ! run_phase configure "$(budget 90 240)" "$out/build.log" "${pkgconf_env[@]}" "${cfg[@]}" -DREMAT_BUILD_TESTS=$tests; then
    if [[ $tests == ON ]]; then
      say "configure with tests failed; again without them"
      tests=OFF
      missing+=("a configure with tests (see build.log): the CUDA tests are skipped")
      run_phase configure-notests "$(budget 60 220)" "$out/build.log" "${pkgconf_env[@]}" "${cfg[@]}" -DREMAT_BUILD_TESTS=OFF
    fi
  fi
  if [[ ${phases[-1]} == configure*"|ok|"* ]]; then
    [[ $tests == ON ]] && targets+=(test_cuda test_engine_order test_memory_source test_auto)
    keep_going=()  # a test that does not compile must not cost the benchmark its binary
    [[ $gen == Ninja ]] && keep_going=(-- -k 0)
    [[ $gen != Ninja ]] && keep_going=(-- -k)
    rm -f "$build/bench/gpu/remat_gpu_bench" "$build/bench/gpu/remat_longctx_gpu" "$build/tests/test_cuda" \
      "$build/tests/test_engine_order" "$build/tests/test_memory_source" "$build/tests/auto/test_auto"
    run_phase build "$(budget "${BUILD_TIMEOUT_S:-300}" 150)" "$out/build.log" \
      cmake --build "$build" -j"$jobs" --target "${targets[@]}" "${keep_going[@]}"
    [[ -x $build/bench/gpu/remat_gpu_bench ]] && built=1
    grep -m1 "remat: CUDA paths" "$out/build.log" | sed 's/^-- /[check] /'
  fi
fi
if ((build_only)); then
  record bench skipped 0 "--build-only"
fi

# --- 2. CUDA tests --------------------------------------------------------------------
: >"$out/tests.log"
test_bin=$(find "$build/tests" -maxdepth 2 -name test_cuda -type f -perm -u+x 2>/dev/null | head -1)
if ((build_only)); then
  :
elif [[ -z $test_bin ]]; then
  record tests skipped 0 "no test_cuda binary$([[ $tests == OFF ]] && echo " (tests not configured)")"
else
  # test_engine_order first, in a process of its own (a plain backward before the first checkpoint).
  order_bin=$(dirname "$test_bin")/test_engine_order
  [[ -x $order_bin ]] && test_bin_cmd=(bash -c "'$order_bin' --gtest_color=no; r=\$?; '$test_bin' --gtest_color=no && exit \$r") ||
    test_bin_cmd=("$test_bin" --gtest_color=no)
  ((quick)) && say "quick: a CPU run; the CUDA test cases skip (no device), their CPU cases run"
  run_phase tests "$(budget 60 200)" "$out/tests.log" "${test_bin_cmd[@]}"
  say "tests: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \] [0-9]' "$out/tests.log" | tr '\n' ' ')"
  # The CUDA cases of the other suites (each binary's CPU cases run in CI).
  src_bin=$(dirname "$test_bin")/test_memory_source
  auto_bin=$(dirname "$test_bin")/auto/test_auto
  if [[ -x $src_bin ]]; then
    : >"$out/tests-source.log"
    run_phase tests-source "$(budget 30 180)" "$out/tests-source.log" "$src_bin" --gtest_color=no
    say "test_memory_source: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \] [0-9]' "$out/tests-source.log" | tr '\n' ' ')"
  else
    record tests-source skipped 0 "no test_memory_source binary"
  fi
  if [[ -x $auto_bin ]]; then
    : >"$out/tests-auto.log"
    run_phase tests-auto "$(budget 60 170)" "$out/tests-auto.log" "$auto_bin" --gtest_color=no '--gtest_filter=Cuda*'
    say "test_auto Cuda*: $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \] [0-9]' "$out/tests-auto.log" | tr '\n' ' ')"
  else
    record tests-auto skipped 0 "no test_auto binary"
  fi
fi

# --- 3. benchmarks ------------------------------------------------------------------
: >"$out/bench.log"
budget_gib=${BUDGET_GIB:-40}
common=(--device "$device")
((quick)) && common+=(--quick)
[[ -n ${BUDGET_GIB:-} ]] && common+=(--budget-gib "$budget_gib")
if ((build_only)); then
  :
elif [[ $device == cuda && $have_cuda != 1 ]]; then
  record bench skipped 0 "no CUDA device"
else
  if ((built)); then
    t=$(budget 120 $((compile ? 160 : 100)))
    # shellcheck disable=SC2086
    run_phase bench-cpp "$t" "$out/bench.log" "$build/bench/gpu/remat_gpu_bench" "${common[@]}" \
      --json "$work/cpp.json" --time-limit-s $((t > 40 ? t - 30 : t / 2)) ${CPP_ARGS:-}
  else
    record bench-cpp skipped 0 "not built"
  fi
  # Long context: the whole GPT step with a 32k vocabulary, chunked head +
  # loss and MLP against plain and per-block (bench/gpu/remat_longctx_gpu.cpp).
  if [[ -x $build/bench/gpu/remat_longctx_gpu ]]; then
    t=$(budget "${LONGCTX_S:-130}" $((compile ? 180 : 100)))
    # shellcheck disable=SC2086
    run_phase longctx "$t" "$out/longctx.log" "$build/bench/gpu/remat_longctx_gpu" --device "$device" \
      $( ((quick)) && echo --quick) --json "$out/longctx.json" --time-limit-s $((t > 40 ? t - 30 : t / 2)) \
      ${LONGCTX_ARGS:-}
  else
    record longctx skipped 0 "not built"
  fi
  if [[ -n $py ]]; then
    t=$(budget 120 $((compile ? 60 : 0)))
    # shellcheck disable=SC2086
    run_phase bench-py "$t" "$out/bench.log" "$py" "$here/gpu_bench.py" "${common[@]}" \
      --json "$work/py.json" --time-limit-s $((t > 40 ? t - 30 : t / 2)) ${PY_ARGS:-}
    if ((compile)); then
      t=$(budget 200 5)
      if ((t < 60)); then
        record bench-compile skipped 0 "${t} s left (< 60 s)"
      else
        run_phase bench-compile "$t" "$out/bench.log" "$py" "$here/gpu_bench.py" "${common[@]}" \
          --strategies "compile:${COMPILE_BUDGET:-0.5}" --attention sdpa --search none --warmup 2 --steps 3 \
          --json "$work/py_compile.json" --time-limit-s "$t"
      fi
    fi
  else
    record bench-py skipped 0 "no python with torch"
  fi
fi

# --- summary ----------------------------------------------------------------------------
printf '%s\n' "${phases[@]}" >"$work/phases.txt"
printf '%s\n' "${missing[@]}" >"$work/missing.txt"
cp "$work/torch.txt" "$work/torch_info.txt" 2>/dev/null
summary_py=${py:-python3}
if command -v "$summary_py" >/dev/null; then
  "$summary_py" "$here/summarize.py" "$work" "$out" "$(elapsed)" || say "summarize.py failed"
  cat "$out/summary.md" 2>/dev/null
else
  say "no python for the summary; phases:"
  printf '  %s\n' "${phases[@]}"
fi
say "done in $(elapsed) s; results in $out"
# torch.compile running out of its time is a skip, not a failure.
fails=$(printf '%s\n' "${phases[@]}" | awk -F'|' '($2 == "failed" || $2 == "timeout") && !($1 == "bench-compile" && $2 == "timeout")' | wc -l)
exec 1>&- 2>&-  # let tee write the last lines before the script ends
wait "$tee_pid" 2>/dev/null
exit $((fails > 0 ? 1 : 0))
