# The layers of Tessera as CMake targets, so the build says what docs/architecture.md says:
#   core <- kernels <- autograd <- {nn, optim};  core <- data;  {nn, optim, data} <- dist
#   <- train <- cli
# (data, the datasets and tokenizers, uses only core.) A layer's DEPENDS names the layers it
# includes; tests/layering checks that an upward include fails to compile.
# Each layer is an OBJECT library compiled against an include root of its own that holds
# only itself and the layers below it (symbolic links under ${TESSERA_LAYER_ROOTS}), so a
# layer that includes an upper layer's header fails to compile. The objects are combined
# into libtessera.so; with TESSERA_CHECK_LAYERS each layer's objects are also linked, with
# everything below and nothing above, into a throw-away shared library with
# --no-undefined, so a layer that calls (not only includes) an upper layer fails to link.
#
# A layer's `cuda/` and `mpi/` subfolders are backends: they go into libtessera_cuda.so and
# libtessera_mpi.so (see the top-level CMakeLists.txt), compiled against the same layer's
# include root.

set(TESSERA_LAYER_ROOTS ${PROJECT_BINARY_DIR}/include_roots)

# Headers are spelt `tessera/<layer>/...` everywhere. An include root maps that prefix onto
# the source folders with one link per layer. A root that is already right is left alone, so
# re-configuring never pulls headers away from a compiler that is running.
function(tessera_make_include_root root)
  set(wanted)
  foreach(layer IN LISTS ARGN)
    list(APPEND wanted "${layer}->${PROJECT_SOURCE_DIR}/${layer}")
  endforeach()
  set(present)
  file(GLOB entries LIST_DIRECTORIES true ${root}/tessera/*)
  foreach(entry IN LISTS entries)
    if(IS_SYMLINK ${entry} AND NOT entry MATCHES "\\.h$")
      file(READ_SYMLINK ${entry} target)
      get_filename_component(name ${entry} NAME)
      list(APPEND present "${name}->${target}")
    endif()
  endforeach()
  list(SORT wanted)
  list(SORT present)
  if(wanted STREQUAL present)
    return()
  endif()
  file(REMOVE_RECURSE ${root})
  file(MAKE_DIRECTORY ${root}/tessera)
  foreach(layer IN LISTS ARGN)
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${layer} ${root}/tessera/${layer} SYMBOLIC)
  endforeach()
endfunction()

# tessera_add_layer(<name> [PROGRAM] [DEPENDS <layers below it that it calls directly>...])
# A missing folder (a layer not written yet) gives an include root and no target. PROGRAM
# (cli): only the include root; its sources build a program, not part of the library.
function(tessera_add_layer layer)
  cmake_parse_arguments(ARG "PROGRAM" "" "DEPENDS" ${ARGN})
  set(closure ${layer})
  foreach(dep IN LISTS ARG_DEPENDS)
    get_property(dep_closure GLOBAL PROPERTY TESSERA_LAYER_CLOSURE_${dep})
    list(APPEND closure ${dep_closure})
  endforeach()
  list(REMOVE_DUPLICATES closure)
  set_property(GLOBAL PROPERTY TESSERA_LAYER_CLOSURE_${layer} ${closure})
  set(root ${TESSERA_LAYER_ROOTS}/${layer})
  tessera_make_include_root(${root} ${closure})
  set_property(GLOBAL PROPERTY TESSERA_LAYER_ROOT_${layer} ${root})
  if(ARG_PROGRAM)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY TESSERA_LAYERS ${layer})

  file(GLOB_RECURSE sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${layer}/*.cpp
       ${PROJECT_SOURCE_DIR}/${layer}/*.cu)
  set(backend_sources ${sources})
  list(FILTER sources EXCLUDE REGEX "/${layer}/(cuda|mpi)/|\\.cu$")
  if(sources)
    add_library(tessera_${layer} OBJECT ${sources})
    tessera_layer_settings(tessera_${layer} ${root})
    set_property(GLOBAL APPEND PROPERTY TESSERA_LAYER_TARGETS tessera_${layer})
  endif()
  # Backend parts of this layer: tessera_<layer>_cuda, tessera_<layer>_mpi.
  foreach(backend cuda mpi)
    set(part ${backend_sources})
    list(FILTER part INCLUDE REGEX "/${layer}/${backend}/")
    string(TOUPPER ${backend} upper)
    if(part AND TESSERA_HAS_${upper})
      add_library(tessera_${layer}_${backend} OBJECT ${part})
      tessera_layer_settings(tessera_${layer}_${backend} ${root})
      set_property(GLOBAL APPEND PROPERTY TESSERA_${upper}_TARGETS tessera_${layer}_${backend})
    endif()
  endforeach()
endfunction()

# Compile settings every layer object library shares.
function(tessera_layer_settings target root)
  target_include_directories(${target} PRIVATE ${root})
  target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX Eigen3::Eigen
                        nlohmann_json::nlohmann_json)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${TESSERA_NATIVE}>>:-march=native>)
endfunction()

# One link check per layer below the top: its objects and those of the layers below it,
# linked alone with --no-undefined. Not installed; built with the library (fast: no
# compiling, only linking objects that exist already).
function(tessera_add_layer_link_checks)
  get_property(layers GLOBAL PROPERTY TESSERA_LAYERS)
  list(POP_BACK layers)  # the top layer is linked by libtessera.so itself
  foreach(layer IN LISTS layers)
    get_property(closure GLOBAL PROPERTY TESSERA_LAYER_CLOSURE_${layer})
    set(objects)
    foreach(member IN LISTS closure)
      if(TARGET tessera_${member})
        list(APPEND objects $<TARGET_OBJECTS:tessera_${member}>)
      endif()
    endforeach()
    if(NOT objects)
      continue()
    endif()
    add_library(tessera_layer_check_${layer} SHARED ${objects})
    target_link_libraries(tessera_layer_check_${layer} PRIVATE OpenMP::OpenMP_CXX ZLIB::ZLIB
                          ${CMAKE_DL_LIBS})
    target_link_options(tessera_layer_check_${layer} PRIVATE LINKER:--no-undefined)
    set_target_properties(tessera_layer_check_${layer} PROPERTIES
      LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/layer_checks)
  endforeach()
endfunction()
