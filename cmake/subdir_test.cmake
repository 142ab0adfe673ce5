# Runs by ctest: configure tests/consumer_subdir (remat via add_subdirectory)
# with no build type, build it, run it. Fails on the first step that fails.
include(${CMAKE_CURRENT_LIST_DIR}/run_step.cmake)
file(REMOVE_RECURSE ${BUILD_DIR}/subdir-consumer-build)
# Unity batches of 8 sources: LibTorch's headers parsed once per batch, not
# per source (this build alone: 161 s and 319 CPU s -> 50 s and 96 CPU s;
# the longest test of `make test`). Without the PCH, a source that forgets an include still
# fails here unless a source before it in its batch includes the header;
# each public header is also compiled on its own (remat_header_check). It
# also keeps the sources unity-safe (no two alike names in anonymous
# namespaces) for users who build that way.
run(${CMAKE_COMMAND} -S ${SOURCE}/tests/consumer_subdir -B ${BUILD_DIR}/subdir-consumer-build -G ${GENERATOR}
    -DREMAT_SOURCE=${SOURCE} -DEXPECTED_BUILD_TYPE= -DTorch_DIR=${TORCH_DIR} -DCMAKE_UNITY_BUILD=ON
    -DCMAKE_UNITY_BUILD_BATCH_SIZE=8)
run(${CMAKE_COMMAND} --build ${BUILD_DIR}/subdir-consumer-build -j 2 --target consumer)
run(${BUILD_DIR}/subdir-consumer-build/consumer)
