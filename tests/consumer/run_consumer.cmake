# Run by tests/consumer/CMakeLists.txt (ctest -R consumer_project); see there for what it
# checks. Every step prints what it saw, so a CI log shows the evidence.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(libdir ${prefix}/lib)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}${err}" PARENT_SCOPE)
endfunction()

# A program run as a user would: no LD_LIBRARY_PATH pointing into the build.
set(clean_env ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH)
set(configure_args -G ${GENERATOR} -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
if(CXX_LAUNCHER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER})
endif()

run(${CMAKE_COMMAND} --install ${TESSERA_BUILD_DIR} --prefix ${prefix})
if(NOT EXISTS ${libdir}/libtessera.so)
  message(FATAL_ERROR "no ${libdir}/libtessera.so after install (CMAKE_INSTALL_LIBDIR not lib?)")
endif()

# 1. The installed program finds its library through RUNPATH $ORIGIN/../lib.
run(readelf -d ${prefix}/bin/tessera)
if(NOT last_output MATCHES "RUNPATH[^\n]*\\$ORIGIN/\\.\\./lib")
  message(FATAL_ERROR "bin/tessera has no RUNPATH $ORIGIN/../lib:\n${last_output}")
endif()
run(${clean_env} ${prefix}/bin/tessera --help)
message(STATUS "installed `tessera --help` runs:\n${last_output}")

# 2. The CPU library needs no CUDA, cuDNN, NVRTC, NCCL or MPI library.
set(backend_libraries "libcuda|libcudart|libcublas|libcudnn|libnvrtc|libnccl|libmpi|libopen-")
run(ldd ${libdir}/libtessera.so)
message(STATUS "ldd lib/libtessera.so (CUDA backend built: ${HAS_CUDA}, MPI: ${HAS_MPI}):\n${last_output}")
if(last_output MATCHES "(${backend_libraries})[^ ]*")
  message(FATAL_ERROR "libtessera.so links ${CMAKE_MATCH_0}: a CPU-only user would need it")
endif()
foreach(backend cuda mpi)
  string(TOUPPER ${backend} upper)
  if(HAS_${upper})
    if(NOT EXISTS ${libdir}/libtessera_${backend}.so.0)
      message(FATAL_ERROR "the ${backend} backend was built but lib/libtessera_${backend}.so.0 "
                          "was not installed")
    endif()
    run(ldd ${libdir}/libtessera_${backend}.so.0)
    string(REGEX MATCHALL "(${backend_libraries})[^ ]*" needs "${last_output}")
    list(REMOVE_DUPLICATES needs)
    message(STATUS "lib/libtessera_${backend}.so.0 carries: ${needs}")
  endif()
endforeach()

# 3. An outside project with a core/error.h of its own.
run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/consumer ${configure_args})
message(STATUS "${last_output}")
run(${CMAKE_COMMAND} --build ${WORK_DIR}/consumer)
run(${clean_env} ${WORK_DIR}/consumer/consumer)
if(NOT last_output MATCHES "consumer ok: sum=21")
  message(FATAL_ERROR "consumer printed unexpected output:\n${last_output}")
endif()
message(STATUS "${last_output}")
if(EXISTS ${WORK_DIR}/consumer/consumer_cuda)
  run(${clean_env} ${WORK_DIR}/consumer/consumer_cuda)
  message(STATUS "${last_output}")
endif()

# 4. examples/ out of tree, and one of them run.
run(${CMAKE_COMMAND} -S ${TESSERA_SOURCE_DIR}/examples -B ${WORK_DIR}/examples ${configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/examples -j 2)
run(${clean_env} ${WORK_DIR}/examples/example_two_stage ${WORK_DIR}/two_stage_state)
if(NOT last_output MATCHES "stage 2: resumed")
  message(FATAL_ERROR "example_two_stage printed unexpected output:\n${last_output}")
endif()
message(STATUS "examples built out of tree; example_two_stage:\n${last_output}")
