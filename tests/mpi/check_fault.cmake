# Runs one fault scenario under mpirun and asserts: the job fails (non-zero
# exit), its output matches EXPECT (the message naming the rank) and, when
# given, EXPECT_ALSO (another rank's), it ended within MAX_SECONDS, and the
# file NO_OUTPUT, when given, was not written. Inputs: MPIEXEC NP FLAGS DRIVER
# ARGS EXPECT [EXPECT_ALSO] MAX_SECONDS [NO_OUTPUT].
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
if(NO_OUTPUT)
  file(REMOVE "${NO_OUTPUT}")
endif()
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} -np ${NP} ${flags} ${DRIVER} ${ARGS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 100)
string(TIMESTAMP t1 "%s")
math(EXPR elapsed "${t1} - ${t0}")
message(STATUS "exit: ${rc}, ${elapsed} s\n--- stdout\n${out}\n--- stderr\n${err}")
if(rc STREQUAL "0")
  message(FATAL_ERROR "the job exited 0, expected a failure")
endif()
foreach(pattern IN ITEMS "${EXPECT}" "${EXPECT_ALSO}")
  if(pattern AND NOT "${out}${err}" MATCHES "${pattern}")
    message(FATAL_ERROR "the output does not match '${pattern}'")
  endif()
endforeach()
if(NO_OUTPUT AND EXISTS "${NO_OUTPUT}")
  message(FATAL_ERROR "the failed job wrote ${NO_OUTPUT}")
endif()
if(elapsed GREATER ${MAX_SECONDS})
  message(FATAL_ERROR "the job took ${elapsed} s, expected at most ${MAX_SECONDS} s")
endif()
