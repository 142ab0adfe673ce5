# Runs by ctest: install the build, configure + build tests/consumer against
# the installed package, run it. Fails on the first step that fails.
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test step failed (${rc}): ${ARGV}")
  endif()
endfunction()
file(REMOVE_RECURSE ${PREFIX} ${BUILD_DIR}/consumer-build)
run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})
run(${CMAKE_COMMAND} -S ${SOURCE} -B ${BUILD_DIR}/consumer-build -G ${GENERATOR}
    -DCMAKE_BUILD_TYPE=Release -Dremat_DIR=${PREFIX}/lib/cmake/remat -DTorch_DIR=${TORCH_DIR})
run(${CMAKE_COMMAND} --build ${BUILD_DIR}/consumer-build)
run(${BUILD_DIR}/consumer-build/consumer)
