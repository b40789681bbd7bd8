# Refuses a test source whose TEST_CASE name holds ';': doctest_discover_tests splits a test's name
# at ';' (CMake's list separator), and each part then matches no test case and passes having run
# nothing. Run by tests/CMakeLists.txt at configure time (include, SOURCE set) and at build time for
# every suite source that changed (cmake -DSOURCE=... -DSTAMP=... -P), so an edit is caught by the
# next build, not only by a fresh configure.
file(STRINGS "${SOURCE}" bad REGEX "TEST_CASE\\(\"[^\"]*;")
if(bad)
  message(FATAL_ERROR "${SOURCE}: a TEST_CASE name holds ';', which CTest would split (it would then run "
                      "nothing): ${bad}")
endif()
if(DEFINED STAMP)
  file(TOUCH "${STAMP}")
endif()
