# Runs by ctest: configure tests/consumer_subdir (remat via add_subdirectory)
# with no build type, build it, run it. Fails on the first step that fails.
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
file(REMOVE_RECURSE ${BUILD_DIR}/subdir-consumer-build)
run(${CMAKE_COMMAND} -S ${SOURCE}/tests/consumer_subdir -B ${BUILD_DIR}/subdir-consumer-build -G ${GENERATOR}
    -DREMAT_SOURCE=${SOURCE} -DEXPECTED_BUILD_TYPE= -DTorch_DIR=${TORCH_DIR})
run(${CMAKE_COMMAND} --build ${BUILD_DIR}/subdir-consumer-build -j 2 --target consumer)
run(${BUILD_DIR}/subdir-consumer-build/consumer)
