# kdacp_bundle_runtime_dependencies(<target> DESTINATION <dir> [COMPONENT <component>])
#
# At install time, copies every shared library that the installed <target>
# loads, directly or through another, into <dir> beside it, except the C and
# C++ runtimes every Linux system has (libc, libm, libstdc++, libgcc_s,
# libpthread, libdl, librt, the loader), so that <dir> can move to a machine
# that lacks the others (a wheel). Each copy is the library's file itself (the
# end of its symlink chain) under the name the loader asks for (its soname, the
# NEEDED entry), and <target> must find it through an INSTALL_RPATH of
# "$ORIGIN". A dependency that cannot be resolved fails the install, naming it.
# Each bundled library is named in the install's output.
#
# Like auditwheel, but inside the build: no tool beyond CMake (3.21+:
# file(GET_RUNTIME_DEPENDENCIES) and file(COPY_FILE)).
set(KDACP_SYSTEM_LIBRARIES
    "^(ld-linux.*|linux-vdso|libc|libm|libmvec|libstdc[+][+]|libgcc_s|libpthread|libdl|librt|libutil)[.]so([.][0-9]+)*$"
    CACHE INTERNAL "Sonames kdacp_bundle_runtime_dependencies leaves to the system")

function(kdacp_bundle_runtime_dependencies target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "DESTINATION;COMPONENT" "")
  if(NOT arg_DESTINATION)
    message(FATAL_ERROR "kdacp_bundle_runtime_dependencies(${target}): DESTINATION is required")
  endif()
  set(component "")
  if(arg_COMPONENT)
    set(component COMPONENT ${arg_COMPONENT})
  endif()
  install(CODE "
    set(_dir \"\${CMAKE_INSTALL_PREFIX}/${arg_DESTINATION}\")
    set(_module \"\${_dir}/$<TARGET_FILE_NAME:${target}>\")
    file(GET_RUNTIME_DEPENDENCIES
      LIBRARIES \"\${_module}\"
      RESOLVED_DEPENDENCIES_VAR _resolved
      UNRESOLVED_DEPENDENCIES_VAR _unresolved
      PRE_EXCLUDE_REGEXES \"${KDACP_SYSTEM_LIBRARIES}\"
      POST_EXCLUDE_REGEXES \"^\${_dir}/\")
    if(_unresolved)
      message(FATAL_ERROR \"$<TARGET_FILE_NAME:${target}> needs \${_unresolved}, which the loader does not find: it cannot be bundled\")
    endif()
    foreach(_lib IN LISTS _resolved)
      get_filename_component(_name \"\${_lib}\" NAME)
      file(REAL_PATH \"\${_lib}\" _file)
      message(STATUS \"Bundling: \${_dir}/\${_name} (\${_file})\")
      file(COPY_FILE \"\${_file}\" \"\${_dir}/\${_name}\")
    endforeach()
  " ${component})
endfunction()
