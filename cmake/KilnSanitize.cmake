# KILN_SANITIZE: AddressSanitizer + UndefinedBehaviorSanitizer (float-cast-overflow included, which
# GCC's -fsanitize=undefined leaves out) on all host C++ code; any undefined behaviour aborts (no
# recovery); libstdc++'s bounds assertions are on. CUDA sources are left alone: build such a tree
# with -DKILN_ENABLE_CUDA=OFF (ASan and the CUDA runtime only coexist with
# ASAN_OPTIONS=protect_shadow_gap=0). scripts/sanitize.sh builds one with GCC and runs the tests.
# KILN_FUZZ: also instruments everything for libFuzzer's coverage and builds the targets in fuzz/
# (clang only; implies KILN_SANITIZE). scripts/fuzz.sh builds one with clang, without the tests
# (clang 14 lacks two C++20 features the tests use: parenthesised aggregate initialisation and
# lambdas capturing structured bindings).
option(KILN_SANITIZE "Build with AddressSanitizer and UndefinedBehaviorSanitizer (undefined behaviour aborts)" OFF)
option(KILN_FUZZ "Build the libFuzzer targets in fuzz/ (clang only; implies KILN_SANITIZE)" OFF)

if(KILN_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KILN_FUZZ needs clang (libFuzzer): configure with -DCMAKE_CXX_COMPILER=clang++")
  endif()
  set(KILN_SANITIZE ON CACHE BOOL "" FORCE)
endif()

if(KILN_SANITIZE)
  # clang's -fsanitize=undefined has float-cast-overflow already; GCC's needs it named.
  set(_kiln_ubsan undefined)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    set(_kiln_ubsan undefined,float-cast-overflow)
  endif()
  set(_kiln_san -fsanitize=address,${_kiln_ubsan} -fno-sanitize-recover=undefined -fno-omit-frame-pointer)
  if(KILN_FUZZ)
    list(APPEND _kiln_san -fsanitize=fuzzer-no-link)
  endif()
  # Line tables only: file:line in every report without the cost of full debug info.
  if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    list(APPEND _kiln_san -gline-tables-only)
  else()
    list(APPEND _kiln_san -g1)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_kiln_san}>")
  add_compile_definitions("$<$<COMPILE_LANGUAGE:CXX>:_GLIBCXX_ASSERTIONS>")
  add_link_options(-fsanitize=address,${_kiln_ubsan})
  message(STATUS "kiln: sanitizers on (${_kiln_san})")
endif()
