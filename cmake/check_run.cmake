# Runs by ctest: one command, its exit status and output checked (the smoke
# tests of remat_demo and the tools' --version).
#   -DCMD=<program;args...>  -DEXPECT_RC=<exit status, default 0>
#   -DEXPECT=<regexes (;-separated), each must match stdout + stderr>
#   -DREJECT=<regexes that must not match>  -DENV=<VAR=value;...>
#   -DCLEAN=<folder removed first>  -DFILES=<files that must exist after>
if(CLEAN)
  file(REMOVE_RECURSE ${CLEAN})
endif()
if(NOT DEFINED EXPECT_RC)
  set(EXPECT_RC 0)
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env ${ENV} ${CMD} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT "${rc}" STREQUAL "${EXPECT_RC}")
  message(FATAL_ERROR "check_run: '${CMD}' exited with ${rc}, expected ${EXPECT_RC}")
endif()
foreach(_re IN LISTS EXPECT)
  if(NOT "${out}${err}" MATCHES "${_re}")
    message(FATAL_ERROR "check_run: the output has no match for '${_re}'")
  endif()
endforeach()
foreach(_re IN LISTS REJECT)
  if("${out}${err}" MATCHES "${_re}")
    message(FATAL_ERROR "check_run: the output matches '${_re}', which it must not")
  endif()
endforeach()
foreach(_f IN LISTS FILES)
  if(NOT EXISTS ${_f})
    message(FATAL_ERROR "check_run: no ${_f}")
  endif()
endforeach()
