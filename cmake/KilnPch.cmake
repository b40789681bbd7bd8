# KILN_PCH: one precompiled header of the standard library and Boost's reflection headers, shared by
# every C++ target of the build tree (GCC and clang). Most of kiln's translation units spent 2-4 s
# parsing these before their own code (docs/RELIABILITY.md, "CI"); the header is compiled once per
# tree and reused. Only system headers go in, so a change to a kiln header rebuilds what includes
# it, as before, and nothing a translation unit sees depends on kiln's own macros.
#
# A precompiled header is used only with the flags it was made with, and GCC refuses it (silently,
# parsing the headers instead) when -fPIC and -fPIE differ: so every C++ file is compiled as
# position-independent code (-fPIC), executables included, where this is on. CUDA files are left
# alone (nvcc has no precompiled headers).
option(KILN_PCH "Precompile the standard library and Boost headers once per build tree" ON)

set(_kiln_pch_headers
  <algorithm> <any> <array> <atomic> <chrono> <cmath> <cstdint> <cstring> <filesystem> <functional>
  <iomanip> <iostream> <map> <memory> <mutex> <optional> <span> <sstream> <string> <string_view>
  <tuple> <typeindex> <unordered_map> <unordered_set> <variant> <vector>
  <boost/describe.hpp> <boost/pfr.hpp>)

if(KILN_PCH AND CMAKE_CXX_COMPILER_ID MATCHES "^(GNU|Clang)$")
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-fPIC>")
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    # GCC 12's false reports on inlined std::string code (bugs 105651, 107138), which it keeps quiet
    # about where the standard headers are parsed but not where they come from a precompiled header.
    add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-Wno-array-bounds;-Wno-stringop-overflow;-Wno-stringop-overread>")
  endif()
endif()

# Called once, after every target exists: the shared header, and every C++ target in the tree
# reusing it.
function(kiln_precompile_headers)
  if(NOT KILN_PCH OR NOT CMAKE_CXX_COMPILER_ID MATCHES "^(GNU|Clang)$")
    return()
  endif()
  add_library(kiln_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
  target_precompile_headers(kiln_pch PRIVATE ${_kiln_pch_headers})
  # OpenMP defines _OPENMP, which the standard headers test: its users (the CPU kernels) get a
  # header of their own. (The modules' find_package made a target only their folders see.)
  find_package(OpenMP QUIET)
  if(TARGET OpenMP::OpenMP_CXX)
    add_library(kiln_pch_openmp OBJECT ${PROJECT_SOURCE_DIR}/cmake/pch.cpp)
    target_precompile_headers(kiln_pch_openmp PRIVATE ${_kiln_pch_headers})
    target_link_libraries(kiln_pch_openmp PRIVATE OpenMP::OpenMP_CXX)
  endif()
  _kiln_reuse_pch(${PROJECT_SOURCE_DIR})
  message(STATUS "kiln: precompiled headers on")
endfunction()

function(_kiln_reuse_pch dir)
  get_property(targets DIRECTORY ${dir} PROPERTY BUILDSYSTEM_TARGETS)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    if(t MATCHES "^kiln_pch" OR NOT type MATCHES "^(STATIC_LIBRARY|SHARED_LIBRARY|MODULE_LIBRARY|OBJECT_LIBRARY|EXECUTABLE)$")
      continue()
    endif()
    get_target_property(sources ${t} SOURCES)
    if(NOT sources MATCHES "\\.cpp(;|$)")
      continue()
    endif()
    get_target_property(libs ${t} LINK_LIBRARIES)
    if(libs MATCHES "OpenMP::OpenMP_CXX" AND TARGET kiln_pch_openmp)
      target_precompile_headers(${t} REUSE_FROM kiln_pch_openmp)
    else()
      target_precompile_headers(${t} REUSE_FROM kiln_pch)
    endif()
  endforeach()
  get_property(subdirs DIRECTORY ${dir} PROPERTY SUBDIRECTORIES)
  foreach(sub IN LISTS subdirs)
    _kiln_reuse_pch(${sub})
  endforeach()
endfunction()
