# Runs by ctest: install the build, configure + build tests/consumer against
# the installed package, run it. Fails on the first step that fails.
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
file(REMOVE_RECURSE ${PREFIX} ${BUILD_DIR}/consumer-build)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
# Relocatable: the exported targets name imported targets (LibTorch's, the
# codecs', remat::glpk), never this machine's library paths: the consumer's
# find_package(remat) finds each again on its machine (rematConfig.cmake).
file(GLOB _exports ${PREFIX}/lib/cmake/remat/rematTargets*.cmake)
if(NOT _exports)
  message(FATAL_ERROR "consumer test: no rematTargets*.cmake under ${PREFIX}/lib/cmake/remat")
endif()
foreach(_f ${_exports})
  file(READ ${_f} _text)
  if(_text MATCHES "libc10|libtorch|site-packages")
    message(FATAL_ERROR "consumer test: ${_f} hard-codes a LibTorch path; export only the torch target")
  endif()
  # An absolute path to a library (e.g. /usr/lib/x86_64-linux-gnu/libglpk.so),
  # where only ${_IMPORT_PREFIX}/... (the package's own files) may stand.
  if(_text MATCHES "[\";(:]/[^\";)>]*lib[^/\";)>]+\\.(so|a)[\";)>.]")
    message(FATAL_ERROR "consumer test: ${_f} hard-codes a library path (${CMAKE_MATCH_0}); link an imported target "
                        "that rematConfig.cmake finds again")
  endif()
  if(_text MATCHES "\\$<LINK_ONLY:>")
    message(FATAL_ERROR "consumer test: ${_f} has an empty $<LINK_ONLY:> (a BUILD_INTERFACE-only link dependency)")
  endif()
endforeach()
# Every library target the docs name is exported (docs/getting-started.md).
file(READ ${PREFIX}/lib/cmake/remat/rematTargets.cmake _targets)
foreach(_t remat::remat remat::plan remat::models remat::parallel)
  if(NOT _targets MATCHES "add_library\\(${_t} ")
    message(FATAL_ERROR "consumer test: the package does not export ${_t}")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE} -B ${BUILD_DIR}/consumer-build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -Dremat_DIR=${PREFIX}/lib/cmake/remat -DTorch_DIR=${TORCH_DIR})
run(${CMAKE_COMMAND} --build ${BUILD_DIR}/consumer-build)
run(${BUILD_DIR}/consumer-build/consumer)
# The installed tools start (they must find LibTorch through their RPATH)
# and do real work.
run(${PREFIX}/bin/remat-plan --help)
# --version: remat's version (the project's, -DVERSION) and LibTorch's.
foreach(_tool remat-plan remat-train)
  execute_process(COMMAND ${PREFIX}/bin/${_tool} --version RESULT_VARIABLE rc OUTPUT_VARIABLE out)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "remat ${VERSION}\n" OR NOT out MATCHES "LibTorch ${TORCH_VERSION}")
    message(FATAL_ERROR "consumer test: ${_tool} --version exited ${rc} and printed '${out}'; expected "
                        "'remat ${VERSION}' and 'LibTorch ${TORCH_VERSION}'")
  endif()
endforeach()
run(${PREFIX}/bin/remat-train --model resnet --layers 10 --d-model 4 --image-size 16 --batch 2 --steps 1
    --threads 1 --checkpoint block)
