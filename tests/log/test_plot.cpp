// Reading metrics files back and drawing them: errors naming file:line, round ticks, the SVG's
// curves, legend and escaping.
#include <doctest/doctest.h>

#include <string>

#include "kiln/core/error.hpp"
#include "kiln/log/metrics.hpp"
#include "kiln/log/plot.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {
std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}
}  // namespace

TEST_CASE("metrics files read back, bad lines are errors naming file:line") {
  test::TempDir dir("log-metrics");
  const auto good = dir.file("m.jsonl",
                             "{\"step\":1,\"loss\":5.5,\"lr\":0.001}\n\n{\"step\":2,\"loss\":null,\"val_loss\":4.25}\n"
                             "{\"step\":3,\"loss\":4.5,\"note\":\"text\"}\n");
  const auto rows = log::read_metrics(good);
  REQUIRE(rows.size() == 3);
  CHECK(rows[0].at("loss") == 5.5);
  CHECK(rows[1].count("loss") == 0);  // null: left out
  CHECK(rows[2].count("note") == 0);  // not a number
  const auto p = log::column(rows, "step", "loss");
  CHECK(p.x == std::vector<double>{1, 3});
  CHECK(p.y == std::vector<double>{5.5, 4.5});
  CHECK(log::column(rows, "step", "val_loss").y == std::vector<double>{4.25});
  const auto bad = dir.file("bad.jsonl", "{\"step\":1}\n{\"step\":2,\n");
  CHECK_THROWS_WITH_AS(log::read_metrics(bad), doctest::Contains("bad.jsonl:2: not a JSON object"), Error);
  CHECK_THROWS_WITH_AS(log::read_metrics(dir.path().string() + "/missing.jsonl"),
                       doctest::Contains("missing.jsonl: cannot open"), Error);
}

TEST_CASE("ticks are round numbers covering the range, smoothing is a centred moving average") {
  CHECK(log::nice_ticks(0, 2000) == std::vector<double>{0, 500, 1000, 1500, 2000});
  CHECK(log::nice_ticks(2.71, 5.52) == std::vector<double>{3.0, 3.5, 4.0, 4.5, 5.0, 5.5});
  CHECK(log::nice_ticks(3, 3).size() >= 2);
  CHECK(log::smooth({1, 2, 3, 4, 5}, 3) == std::vector<double>{1.5, 2, 3, 4, 4.5});
  CHECK(log::smooth({1, 2}, 1) == std::vector<double>{1, 2});
}

TEST_CASE("the SVG has one polyline per series, every point, and an escaped legend") {
  std::vector<log::Series> s = {{"bf16", {1, 2, 3, 4}, {5, 4, 3.5, 3.2}}, {"fp8 <delayed> & co", {1, 2, 3}, {5, 4.1, 3.6}}};
  log::PlotOptions o;
  o.title = "loss";
  const std::string svg = log::line_plot_svg(s, o);
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  CHECK(count(svg, "<polyline") == 2);
  CHECK(svg.find("fp8 &lt;delayed&gt; &amp; co") != std::string::npos);
  const auto first = svg.find("points=\"");
  const auto end = svg.find('"', first + 8);
  CHECK(count(svg.substr(first, end - first), ",") == 4);  // four x,y pairs
  CHECK_THROWS_AS(log::line_plot_svg({}, o), Error);
  CHECK_THROWS_AS(log::line_plot_svg({{"x", {1, 2}, {1}}}, o), Error);
}
