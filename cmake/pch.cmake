# REMAT_PCH: LibTorch's <torch/torch.h> precompiled once and reused by
# remat's own torch targets. Parsing it is about 16 s of every translation
# unit (a test file takes 45-65 s at -O3 on the 2-core CI machine), and the
# build is most of CI's time. Include(d) after find_package(Torch).
#
# Two headers, because GCC rejects a PCH built with other code-generation
# flags: one for libraries (-fPIC), one for executables (-fPIE). A TU whose
# flags still differ falls back to the text header (correct, only slower):
# -Winvalid-pch says so in the build log.
#
# Top-level builds only: as a subproject (tests' consumer_add_subdirectory)
# nothing is force-included, so that build still catches a source that
# forgets an include. remat_header_check (each public header on its own)
# never uses the PCH. Off for the libFuzzer build (planner only, no torch).
option(REMAT_PCH "Precompile LibTorch's headers for remat's own targets" ${REMAT_TOP_LEVEL})
if(REMAT_FUZZ OR CMAKE_VERSION VERSION_LESS 3.16 OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(REMAT_PCH OFF)
endif()

if(REMAT_PCH)
  set(_remat_pch_src ${CMAKE_CURRENT_BINARY_DIR}/remat_pch.cpp)
  file(CONFIGURE OUTPUT ${_remat_pch_src} CONTENT "// the PCH's own translation unit (cmake/pch.cmake)\n")
  foreach(_kind lib exe)
    add_library(remat_pch_${_kind} OBJECT ${_remat_pch_src})
    target_link_libraries(remat_pch_${_kind} PRIVATE torch)
    target_compile_features(remat_pch_${_kind} PRIVATE cxx_std_20)
    target_precompile_headers(remat_pch_${_kind} PRIVATE <torch/torch.h>)
    target_compile_options(remat_pch_${_kind} PRIVATE -Winvalid-pch)
  endforeach()
  # Executables compile with -fPIE (CMAKE_POSITION_INDEPENDENT_CODE), an
  # object library would get -fPIC: give the executables' PCH their flag.
  set_target_properties(remat_pch_lib PROPERTIES POSITION_INDEPENDENT_CODE ON)
  set_target_properties(remat_pch_exe PROPERTIES POSITION_INDEPENDENT_CODE OFF)
  target_compile_options(remat_pch_exe PRIVATE -fPIE)
endif()

# remat_use_pch(target...): the target's sources get the PCH (no-op when off).
function(remat_use_pch)
  if(NOT REMAT_PCH)
    return()
  endif()
  foreach(_t IN LISTS ARGN)
    get_target_property(_type ${_t} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      target_precompile_headers(${_t} REUSE_FROM remat_pch_exe)
    else()
      target_precompile_headers(${_t} REUSE_FROM remat_pch_lib)
    endif()
    target_compile_options(${_t} PRIVATE -Winvalid-pch)
  endforeach()
endfunction()
