# REMAT_PCH: LibTorch's <torch/torch.h> precompiled once and reused by
# remat's own torch targets. Parsing it is about 16 s of a translation unit
# that includes it (a test file takes 35-65 s at -O3 on the 2-core CI
# machine), and the build is most of CI's time: CI's `make test` step on a
# fresh clone took 1058-1122 s with it, 1336 s without (docs/RELIABILITY.md).
# Included after find_package(Torch).
#
# One PCH for libraries and executables: GCC refuses a PCH built with other
# code-generation flags, so executables compile with -fPIC as the libraries
# do (given after CMake's -fPIE, it wins; PIC code in a PIE executable costs
# nothing measurable here, the hot paths are in LibTorch). A TU whose flags
# still differ falls back to the text header (correct, only slower), and
# -Winvalid-pch (which CMake passes with the PCH) says so in the build log.
#
# Default on for GCC top-level builds only. As a subproject (tests'
# consumer_add_subdirectory) nothing is force-included, so that build still
# catches a source that forgets an include (in unity batches of 8: unless a
# source before it in its batch includes it); remat_header_check (every
# public header, each on its own) never uses it. Off for the libFuzzer build (planner
# only, no torch). Clang refuses, not falls back from, a mismatched PCH:
# opt in there with -DREMAT_PCH=ON.
set(_remat_pch_default OFF)
if(REMAT_TOP_LEVEL AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  set(_remat_pch_default ON)
endif()
option(REMAT_PCH "Precompile LibTorch's headers for remat's own targets" ${_remat_pch_default})
if(REMAT_FUZZ OR CMAKE_VERSION VERSION_LESS 3.16 OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(REMAT_PCH OFF)
endif()

if(REMAT_PCH)
  set(_remat_pch_src ${CMAKE_CURRENT_BINARY_DIR}/remat_pch.cpp)
  file(CONFIGURE OUTPUT ${_remat_pch_src} CONTENT "// the PCH's own translation unit (cmake/pch.cmake)\n")
  add_library(remat_pch OBJECT ${_remat_pch_src})
  target_link_libraries(remat_pch PRIVATE torch)
  target_compile_features(remat_pch PRIVATE cxx_std_20)
  set_target_properties(remat_pch PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_precompile_headers(remat_pch PRIVATE <torch/torch.h>)
endif()

# remat_use_pch(target...): the target's sources get the PCH (no-op when off).
function(remat_use_pch)
  if(NOT REMAT_PCH)
    return()
  endif()
  foreach(_t IN LISTS ARGN)
    target_precompile_headers(${_t} REUSE_FROM remat_pch)
    get_target_property(_type ${_t} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      target_compile_options(${_t} PRIVATE -fPIC)
    endif()
  endforeach()
endfunction()

# remat_skip_pch(source...): sources that include only light headers (c10,
# ATen/core/Tensor.h): loading the 0.7 GB PCH costs them more than it saves
# (error.cpp 0.3 -> 8.2 s, memory.cpp 3.4 -> 10.9 s, measured).
function(remat_skip_pch)
  if(REMAT_PCH)
    set_source_files_properties(${ARGN} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
  endif()
endfunction()
