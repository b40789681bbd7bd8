#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "kiln/core/error.hpp"
#include "kiln/log/timeline.hpp"

using namespace kiln::log;

TEST_CASE("a timeline's bubble: the idle share of the ranks' time between the first start and the last end") {
  // Two ranks, one micro-batch each way: rank 0 busy 0-1 and 3-5, rank 1 busy 1-3 (F and B of its
  // stage): makespan 5, busy 5 of 10.
  const std::vector<TimedPass> passes = {{0, 0, true, 0, 0, 0.0, 1.0}, {1, 1, true, 0, 0, 1.0, 2.0},
                                         {1, 1, false, 0, 0, 2.0, 3.0}, {0, 0, false, 0, 0, 3.0, 5.0}};
  const auto s = summarize_timeline(passes);
  CHECK(s.ranks == 2);
  CHECK(s.pp == 2);
  CHECK(s.vpp == 1);
  CHECK(s.micro_batches == 1);
  CHECK(s.makespan_s == doctest::Approx(5.0));
  CHECK(s.bubble == doctest::Approx(0.5));
  CHECK(s.formula == doctest::Approx(0.5));
  const std::string svg = timeline_svg(passes, "test");
  CHECK(svg.find("<svg") == 0);
  CHECK(svg.find("bubble 50.0%, formula 50.0%") != std::string::npos);
}

TEST_CASE("timeline files are read back, and a bad line names its file and line") {
  const std::string path = "/tmp/kiln_timeline_test.rank0";
  std::ofstream(path) << R"({"rank":0,"pp_rank":0,"step":3,"pass":"B","micro_batch":2,"chunk":1,"start_s":1.5,"end_s":2.0})"
                      << "\n";
  const auto passes = read_timeline({path});
  REQUIRE(passes.size() == 1);
  CHECK_FALSE(passes[0].forward);
  CHECK(passes[0].micro_batch == 2);
  CHECK(passes[0].chunk == 1);
  std::ofstream(path) << "{\"rank\":0}\n";
  try {
    read_timeline({path});
    FAIL("no error");
  } catch (const kiln::Error& e) {
    CHECK(std::string(e.what()).find(path + ":1: not a timeline line") != std::string::npos);
  }
  std::remove(path.c_str());
  CHECK_THROWS_AS(read_timeline({path}), kiln::Error);
}
