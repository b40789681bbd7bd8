# kiln_add_library(<name> [NO_HEADERS] SOURCES ... [CUDA_SOURCES ...] [DEPS ...] [PRIVATE_DEPS ...])
# Defines the library target kiln_<name>, its alias kiln::<name>, and installs it with its
# public headers (the folder's include/). CUDA_SOURCES are compiled only when the CUDA backend is on.
# NO_HEADERS: the folder's headers belong to another of its targets, which must be among DEPS (a
# module's engine glue, kiln::<module>_module, beside the module's plain library).
function(kiln_add_library name)
  cmake_parse_arguments(M "NO_HEADERS" "" "SOURCES;CUDA_SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  set(target kiln_${name})
  if(NOT M_SOURCES)
    # Header-only module.
    add_library(${target} INTERFACE)
    add_library(kiln::${name} ALIAS ${target})
    set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
    target_include_directories(${target} INTERFACE
      $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${target} INTERFACE ${M_DEPS})
    install(TARGETS ${target} EXPORT kilnTargets)
    install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
    return()
  endif()
  add_library(${target} ${M_SOURCES})
  if(KILN_WITH_CUDA AND M_CUDA_SOURCES)
    target_sources(${target} PRIVATE ${M_CUDA_SOURCES})
  endif()
  add_library(kiln::${name} ALIAS ${target})
  set_target_properties(${target} PROPERTIES EXPORT_NAME ${name} OUTPUT_NAME kiln_${name})
  if(NOT M_NO_HEADERS)
    target_include_directories(${target} PUBLIC
      $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
      $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  endif()
  target_link_libraries(${target} PUBLIC ${M_DEPS} PRIVATE ${M_PRIVATE_DEPS})
  if(KILN_WITH_CUDA)
    target_compile_definitions(${target} PUBLIC KILN_WITH_CUDA=1)
  endif()
  install(TARGETS ${target} EXPORT kilnTargets
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  if(NOT M_NO_HEADERS AND EXISTS ${CMAKE_CURRENT_SOURCE_DIR}/include)
    install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  endif()
endfunction()
