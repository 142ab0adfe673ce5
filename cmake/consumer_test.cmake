# Runs by ctest: install the build, configure + build tests/consumer against
# the installed package, run it. Fails on the first step that fails.
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
file(REMOVE_RECURSE ${PREFIX} ${BUILD_DIR}/consumer-build)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
# Relocatable: the exported targets name LibTorch's imported targets, never
# this machine's library paths (a consumer's find_package(Torch) resolves them).
file(GLOB _exports ${PREFIX}/lib/cmake/remat/rematTargets*.cmake)
foreach(_f ${_exports})
  file(READ ${_f} _text)
  if(_text MATCHES "libc10|libtorch|site-packages")
    message(FATAL_ERROR "consumer test: ${_f} hard-codes a LibTorch path; export only the torch target")
  endif()
endforeach()
run(${CMAKE_COMMAND} -S ${SOURCE} -B ${BUILD_DIR}/consumer-build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -Dremat_DIR=${PREFIX}/lib/cmake/remat -DTorch_DIR=${TORCH_DIR})
run(${CMAKE_COMMAND} --build ${BUILD_DIR}/consumer-build)
run(${BUILD_DIR}/consumer-build/consumer)
# The installed tools start (they must find LibTorch through their RPATH)
# and do real work.
run(${PREFIX}/bin/remat-plan --help)
run(${PREFIX}/bin/remat-train --model resnet --layers 10 --d-model 4 --image-size 16 --batch 2 --steps 1
    --threads 1 --checkpoint block)
