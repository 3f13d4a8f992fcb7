# The protocol tables of README.md and docs/protocols.md are the registry's:
# each must hold, between its protocols-table markers, exactly what
# `kdacp protocols --markdown` prints.
#   cmake -DKDACP=<kdacp binary> -DSOURCE_DIR=<repo> -P docs_table.cmake
execute_process(COMMAND ${KDACP} protocols --markdown
                OUTPUT_VARIABLE want RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR want STREQUAL "")
  message(FATAL_ERROR "kdacp protocols --markdown failed (${rc})")
endif()
foreach(doc README.md docs/protocols.md)
  file(READ ${SOURCE_DIR}/${doc} text)
  string(FIND "${text}" "<!-- protocols-table:begin -->\n" begin)
  string(FIND "${text}" "<!-- protocols-table:end -->" end)
  if(begin EQUAL -1 OR end EQUAL -1)
    message(FATAL_ERROR "${doc}: protocols-table markers missing")
  endif()
  math(EXPR first "${begin} + 31")
  math(EXPR len "${end} - ${first}")
  string(SUBSTRING "${text}" ${first} ${len} have)
  if(NOT have STREQUAL want)
    message(FATAL_ERROR "${doc}: the protocol table differs from `kdacp protocols --markdown`; "
                        "paste its output between the markers:\n${want}")
  endif()
endforeach()
message(STATUS "protocol tables match the registry")
