# Runs one fault scenario under mpirun and asserts: the job fails (non-zero
# exit), its output matches EXPECT (the message naming the rank), and it ended
# within MAX_SECONDS. Inputs: MPIEXEC NP FLAGS DRIVER ARGS EXPECT MAX_SECONDS.
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} -np ${NP} ${flags} ${DRIVER} ${ARGS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 100)
string(TIMESTAMP t1 "%s")
math(EXPR elapsed "${t1} - ${t0}")
message(STATUS "exit: ${rc}, ${elapsed} s\n--- stdout\n${out}\n--- stderr\n${err}")
if(rc STREQUAL "0")
  message(FATAL_ERROR "the job exited 0, expected a failure")
endif()
if(NOT "${out}${err}" MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output does not match '${EXPECT}'")
endif()
if(elapsed GREATER ${MAX_SECONDS})
  message(FATAL_ERROR "the job took ${elapsed} s, expected at most ${MAX_SECONDS} s")
endif()
