# run(COMMAND...): for the ctest scripts (consumer_test.cmake,
# subdir_test.cmake); fails the test on the first step that fails.
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "step failed (${rc}): ${ARGV}")
  endif()
endfunction()
