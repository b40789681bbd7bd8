#include <doctest/doctest.h>

#include <set>

#include "kiln/core/error.hpp"
#include "kiln/parallel/topology.hpp"

using kiln::parallel::Axis;
using kiln::parallel::Topology;

TEST_CASE("world 8 with tp 4 gives Megatron's groups") {
  Topology t(8, 4, 1, 1, 1, 0);
  CHECK(t.sizes().dp == 2);
  CHECK(t.tp_group(0) == std::vector<int>{0, 1, 2, 3});
  CHECK(t.tp_group(6) == std::vector<int>{4, 5, 6, 7});
  CHECK(t.dp_group(0) == std::vector<int>{0, 4});
  CHECK(t.dp_group(3) == std::vector<int>{3, 7});
  CHECK(t.all_groups({Axis::dp}) == std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
}

TEST_CASE("groups match a brute-force enumeration for many shapes") {
  int shapes = 0;
  for (int world = 1; world <= 48; ++world)
    for (int tp = 1; tp <= world; ++tp)
      for (int pp = 1; tp * pp <= world; ++pp)
        for (int cp = 1; tp * pp * cp <= world; cp *= 2)
          for (int ep = 1; tp * pp * cp * ep <= world; ep += 2) {
            if (world % (tp * pp * cp * ep)) continue;
            Topology t(world, tp, pp, cp, ep, 0);  // dp = world / (tp pp cp), of which ep form an EP group
            const int dp = world / (tp * pp * cp * ep);  // the dp axis: expert-data-parallel
            REQUIRE(t.data_parallel_size() == ep * dp);
            ++shapes;
            // Brute force: decode each rank with tp fastest, then cp, ep, dp, pp.
            for (int r = 0; r < world; ++r) {
              int x = r;
              int c_tp = x % tp; x /= tp;
              int c_cp = x % cp; x /= cp;
              int c_ep = x % ep; x /= ep;
              int c_dp = x % dp; x /= dp;
              int c_pp = x;
              auto c = t.coords(r);
              REQUIRE(c.tp == c_tp);
              REQUIRE(c.cp == c_cp);
              REQUIRE(c.ep == c_ep);
              REQUIRE(c.dp == c_dp);
              REQUIRE(c.pp == c_pp);
              REQUIRE(t.rank(c) == r);
              std::vector<int> tpg, dpg, epg, edpg;
              for (int q = 0; q < world; ++q) {
                auto o = t.coords(q);
                if (o.cp == c.cp && o.ep == c.ep && o.dp == c.dp && o.pp == c.pp) tpg.push_back(q);
                if (o.tp == c.tp && o.cp == c.cp && o.pp == c.pp) dpg.push_back(q);
                if (o.tp == c.tp && o.cp == c.cp && o.dp == c.dp && o.pp == c.pp) epg.push_back(q);
                if (o.tp == c.tp && o.cp == c.cp && o.ep == c.ep && o.pp == c.pp) edpg.push_back(q);
              }
              REQUIRE(t.tp_group(r) == tpg);
              REQUIRE(t.dp_group(r) == dpg);  // data parallelism spans the ep and dp axes
              REQUIRE(t.group(r, {Axis::ep}) == epg);
              REQUIRE(t.group(r, {Axis::dp}) == edpg);
              REQUIRE(t.data_parallel_rank(r) == c_ep + ep * c_dp);
              REQUIRE(dpg[static_cast<std::size_t>(t.data_parallel_rank(r))] == r);
            }
            // every rank in exactly one group of each kind
            for (Axis a : {Axis::tp, Axis::cp, Axis::ep, Axis::dp, Axis::pp}) {
              std::multiset<int> all;
              for (auto& g : t.all_groups({a})) all.insert(g.begin(), g.end());
              REQUIRE(all.size() == static_cast<std::size_t>(world));
              REQUIRE(std::set<int>(all.begin(), all.end()).size() == static_cast<std::size_t>(world));
            }
          }
  CHECK(shapes > 100);
}

TEST_CASE("expert parallelism is carved out of data parallelism (Megatron-Core's layout)") {
  // 8 ranks, tp 2: 4 data-parallel ranks, of which pairs form the expert-parallel groups.
  Topology t(8, 2, 1, 1, 2, 0);
  CHECK(t.data_parallel_size() == 4);
  CHECK(t.sizes().ep == 2);
  CHECK(t.sizes().dp == 2);
  CHECK(t.dp_group(0) == std::vector<int>{0, 2, 4, 6});
  CHECK(t.all_groups({Axis::ep}) == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(t.all_groups({Axis::dp}) == std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  const std::string d = t.describe();
  CHECK(d.find("dp 4 (ep 2 x expert-dp 2)") != std::string::npos);
  CHECK(d.find("expert-dp groups: [0,4] [1,5] [2,6] [3,7]") != std::string::npos);
  CHECK(d.find("ep groups: [0,2] [1,3] [4,6] [5,7]") != std::string::npos);
}

TEST_CASE("shapes that do not fit are errors naming the sizes") {
  CHECK_THROWS_WITH_AS(Topology(8, 3, 1, 1, 1, 0), doctest::Contains("world size 8 is not divisible by tp*pp*cp"),
                       kiln::Error);
  CHECK_THROWS_WITH_AS(Topology(4, 1, 1, 1, 3, 0), doctest::Contains("parallel.ep = 3 does not divide the 4 data-parallel"),
                       kiln::Error);
  CHECK_THROWS_WITH_AS(Topology(8, 2, 1, 1, 1, 3), doctest::Contains("does not match the world size 8"), kiln::Error);
  CHECK_THROWS_WITH_AS(Topology(8, 0, 1, 1, 1, 0), doctest::Contains("parallel.tp must be positive"), kiln::Error);
}
