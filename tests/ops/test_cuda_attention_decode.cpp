// CUDA attention_decode (split over the cached positions, then combined) against the CPU reference,
// at awkward shapes: lengths of 1, below and across the split size, non-multiples of 32 and 64, and
// head dims that fill no warp evenly. bf16 output by relative L2 error, as attention_forward's.
#include <cmath>
#include <vector>

#include "op_harness.hpp"

namespace {

using namespace kiln;
using namespace kiln::test;

constexpr double kDecodeTol = 1e-2;

struct Decode {
  BackendPair& p;
  int B, Tmax, H, D;
  Dual qkv, out;
  Decode(BackendPair& pair, int b, int tmax, int h, int d, std::uint64_t seed)
      : p(pair), B(b), Tmax(tmax), H(h), D(d), qkv(pair, Kind::act, {b, tmax, 3, h, d}), out(pair, Kind::act, {b, h, d}) {
    // std 1.5 for q and k: the scaled scores have std ~2, softmax rows neither flat nor one-hot.
    qkv.set(random_values(static_cast<std::size_t>(qkv.numel()), seed, 1.5f));
  }
  ops::AttentionDecode args(bool gpu, int length) const {
    return {gpu ? out.gpu() : out.cpu(), gpu ? qkv.gpu() : qkv.cpu(), length, 1.0f / std::sqrt(static_cast<float>(D))};
  }
  void run(int length) {
    out.poison();
    p.cpu->attention_decode(args(false, length));
    p.gpu->attention_decode(args(true, length));
    p.gpu->synchronize();
  }
};

}  // namespace

TEST_CASE("cuda attention_decode matches the CPU reference at awkward shapes and lengths") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  struct Shape4 {
    int B, Tmax, H, D;
  };
  const Shape4 shapes[] = {{1, 300, 12, 64}, {3, 97, 5, 16}, {2, 1100, 2, 128}, {1, 70, 3, 40},
                           {2, 65, 4, 256}, {1, 33, 7, 100}, {4, 130, 1, 32}, {1, 5, 2, 3}};
  std::uint64_t seed = 1;
  for (const auto& s : shapes) {
    Decode d(p, s.B, s.Tmax, s.H, s.D, seed++);
    for (int length : {1, 2, 31, 33, 63, 64, 65, 100, 257, 1000, s.Tmax}) {
      if (length > s.Tmax) continue;
      INFO("B=" << s.B << " Tmax=" << s.Tmax << " H=" << s.H << " D=" << s.D << " length=" << length);
      d.run(length);
      KILN_CHECK_CLOSE(d.out, kDecodeTol);
    }
  }
}

TEST_CASE("cuda attention_decode is deterministic (same bits run after run)") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  Decode d(p, 1, 1024, 12, 64, 77);
  d.run(1000);
  const auto first = d.out.gpu_values();
  d.out.poison();
  p.gpu->attention_decode(d.args(true, 1000));
  p.gpu->synchronize();
  CHECK(d.out.gpu_values() == first);
}

TEST_CASE("cuda attention_decode rejects a head dim above 256") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  Decode d(p, 1, 4, 1, 264, 3);
  CHECK_THROWS_WITH_AS(p.gpu->attention_decode(d.args(true, 2)), doctest::Contains("D = 264 is not supported"),
                       kiln::Error);
}
