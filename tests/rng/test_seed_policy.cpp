#include <doctest/doctest.h>

#include <map>
#include <unordered_map>

#include "kiln/core/error.hpp"
#include "kiln/rng/seed_policy.hpp"

using namespace kiln;
using kiln::rng::RankCoords;
using kiln::rng::SeedPolicy;
using kiln::rng::StreamKind;

namespace {
// Every rank's seed of every stream kind must agree exactly where the semantics say "equal" and
// differ everywhere else. Checked over every topology of a world size.
void check_world(SeedPolicy policy, int world, std::uint64_t master, int& topologies) {
  for (int tp = 1; tp <= world; ++tp)
    for (int pp = 1; tp * pp <= world; ++pp)
      for (int ep = 1; tp * pp * ep <= world; ++ep) {
        if (world % (tp * pp * ep)) continue;
        const int dp = world / (tp * pp * ep);
        ++topologies;
        // identity of a stream = what must be equal for two ranks to share it
        std::unordered_map<std::uint64_t, std::tuple<int, int, int, int>> owner;
        for (int r = 0; r < world; ++r) {
          // Megatron's rank order: tp fastest, then ep, dp and pp (cp = 1)
          const RankCoords c{.tp = r % tp, .ep = r / tp % ep, .pp = r / (tp * ep * dp)};
          std::tuple<int, int, int, int> ids[] = {{0, c.pp, 0, 0}, {1, c.pp, c.tp, 0}, {2, c.pp, 0, 0}, {3, c.pp, c.ep, c.tp}};
          StreamKind kinds[] = {StreamKind::default_, StreamKind::model_parallel, StreamKind::data_parallel,
                                StreamKind::expert_parallel};
          for (int k = 0; k < 4; ++k) {
            auto seed = rng::stream_seed(policy, master, kinds[k], c);
            auto [it, inserted] = owner.emplace(seed, ids[k]);
            if (!inserted && it->second != ids[k]) {
              // Two different streams share a seed: fail with the details.
              FAIL_CHECK("seed " << seed << " shared by different streams at world " << world << " tp " << tp
                                 << " pp " << pp << " ep " << ep);
              return;
            }
          }
        }
      }
}
}  // namespace

TEST_CASE("the collision-free seed policy never gives two streams one seed, for every topology up to 512 ranks") {
  int topologies = 0;
  for (int world = 1; world <= 512; ++world) check_world(SeedPolicy::collision_free, world, 1337, topologies);
  CHECK(topologies > 5000);
}

TEST_CASE("the collision-free policy separates coordinates up to 65535 on every axis") {
  std::unordered_map<std::uint64_t, int> seen;
  int n = 0;
  for (int v : {0, 1, 2, 255, 256, 4095, 65534, 65535})
    for (int w : {0, 1, 17, 65535}) {
      RankCoords a{.tp = v, .ep = w, .pp = 3};
      for (auto k : {StreamKind::model_parallel, StreamKind::expert_parallel}) {
        auto s = rng::stream_seed(SeedPolicy::collision_free, 42, k, a);
        auto [it, ins] = seen.emplace(s, n++);
        (void)it;
        if (k == StreamKind::expert_parallel || w == 0) CHECK(ins);
      }
    }
  CHECK_THROWS_AS(rng::stream_seed(SeedPolicy::collision_free, 1, StreamKind::model_parallel, RankCoords{.tp = 65536}),
                  kiln::Error);
}

TEST_CASE("the megatron policy reproduces Megatron's formula, collisions included") {
  RankCoords a{.tp = 6};
  RankCoords b{.ep = 17};
  auto mp = rng::stream_seed(SeedPolicy::megatron, 1234, StreamKind::model_parallel, a);
  auto ep = rng::stream_seed(SeedPolicy::megatron, 1234, StreamKind::expert_parallel, b);
  CHECK(mp == 1234 + 2718 + 6);
  CHECK(ep == 1234 + 1024 + 100 * 17);
  CHECK(mp == ep);  // the known collision
  CHECK(rng::stream_seed(SeedPolicy::megatron, 1234, StreamKind::default_, RankCoords{.pp = 2}) == 1434);
}
