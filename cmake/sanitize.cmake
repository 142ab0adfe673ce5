# Sanitizer and fuzzer instrumentation of remat's own targets (remat_plan,
# remat, remat::models, the tests, tools, examples and benchmarks): every
# target defined after this file is included. Imported targets (LibTorch,
# GoogleTest, Google Benchmark) are prebuilt and stay uninstrumented; see
# docs/RELIABILITY.md for what that means and the run-time options it needs.
#
#   REMAT_SANITIZE  ""                  (default) nothing
#                   "address,undefined" ASan + UBSan (make test-asan)
#                   "thread"            TSan (make test-tsan)
#                   (any list -fsanitize= accepts; address and thread exclude each other)
#   REMAT_FUZZ      ON: libFuzzer targets in fuzz/ (clang only); the library
#                   gets coverage instrumentation (-fsanitize=fuzzer-no-link).
set(REMAT_SANITIZE "" CACHE STRING "Sanitizers for remat's own targets: empty, address,undefined or thread")
set_property(CACHE REMAT_SANITIZE PROPERTY STRINGS "" "address,undefined" "address" "undefined" "thread")
option(REMAT_FUZZ "Build the libFuzzer targets in fuzz/ (needs clang)" OFF)

if(REMAT_SANITIZE OR REMAT_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "REMAT_SANITIZE / REMAT_FUZZ need GCC or Clang, not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  if(REMAT_SANITIZE MATCHES "address" AND REMAT_SANITIZE MATCHES "thread")
    message(FATAL_ERROR "REMAT_SANITIZE=${REMAT_SANITIZE}: address and thread cannot be combined")
  endif()
  # Readable stacks: frame pointers for the sanitizers' fast unwinder, line
  # tables (-g1 is cheap next to full -g with LibTorch's headers).
  set(_remat_san_flags -fno-omit-frame-pointer -g1)
  if(REMAT_SANITIZE)
    list(APPEND _remat_san_flags -fsanitize=${REMAT_SANITIZE})
    if(REMAT_SANITIZE MATCHES "undefined")
      # A UBSan finding aborts the process, so the test that hit it fails
      # (by default UBSan prints and carries on, and the test passes).
      list(APPEND _remat_san_flags -fno-sanitize-recover=all)
    endif()
  endif()
  add_compile_options(${_remat_san_flags})
  if(REMAT_SANITIZE)
    add_link_options(-fsanitize=${REMAT_SANITIZE})
  endif()
  if(REMAT_FUZZ)
    if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
      message(FATAL_ERROR "REMAT_FUZZ needs clang (libFuzzer), not ${CMAKE_CXX_COMPILER_ID}: "
                          "configure with -DCMAKE_CXX_COMPILER=clang++ (scripts/fuzz.sh does)")
    endif()
    # Coverage feedback from the library too, not only from the harnesses;
    # the harnesses link the libFuzzer driver (fuzz/CMakeLists.txt).
    add_compile_options(-fsanitize=fuzzer-no-link)
  endif()
  if(REMAT_INSTALL)
    # An instrumented static libremat needs the sanitizer runtime in whatever
    # links it: no install rules, hence no consumer test, in these builds.
    message(STATUS "remat: REMAT_SANITIZE/REMAT_FUZZ set; install rules and the consumer test are off")
    set(REMAT_INSTALL OFF)
  endif()
  message(STATUS "remat: instrumenting remat's targets with ${_remat_san_flags}")
endif()
