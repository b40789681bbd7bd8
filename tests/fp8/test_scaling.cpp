// Delayed scaling: the update of every slot (amax from the history, new scale, history roll) on the
// CPU emulation against a direct computation, and the meta store's layout.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <vector>

#include "fp8_test_util.hpp"
#include "kiln/fp8/meta.hpp"

using namespace kiln;
using namespace kiln::fp8;

TEST_CASE("the delayed scaling update matches a direct computation for random histories") {
  auto ops = make_cpu_ops({.threads = 2});
  std::mt19937_64 gen(99);
  for (int trial = 0; trial < 40; ++trial) {
    const int len = 1 + static_cast<int>(gen() % 40);
    const int n = 1 + static_cast<int>(gen() % 30);
    const int margin = static_cast<int>(gen() % 4);
    const AmaxAlgo algo = trial % 2 ? AmaxAlgo::max : AmaxAlgo::most_recent;
    auto hist = test::random_amaxes(static_cast<std::size_t>(len * n), gen());
    std::vector<float> scale(static_cast<std::size_t>(n)), fmax(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      scale[i] = std::ldexp(1.0f, static_cast<int>(gen() % 20) - 10);
      fmax[i] = i % 3 == 2 ? 57344.0f : 448.0f;
    }
    // Direct computation, written out independently of the library's loop.
    std::vector<float> want_scale = scale, want_inv(static_cast<std::size_t>(n)), want_hist(hist.size());
    for (int i = 0; i < n; ++i) {
      float amax = hist[i];
      bool nan = std::isnan(amax);
      if (algo == AmaxAlgo::max)
        for (int h = 0; h < len; ++h) {
          const float v = hist[static_cast<std::size_t>(h * n + i)];
          nan |= std::isnan(v);
          if (v > amax) amax = v;
        }
      if (nan) amax = NAN;
      if (std::isfinite(amax) && amax > 0) {
        const float s = (fmax[i] / amax) / std::pow(2.0f, static_cast<float>(margin));
        if (std::isfinite(s) && s > 0) want_scale[i] = s;
      }
      want_inv[i] = 1.0f / want_scale[i];
      want_hist[i] = 0;
      for (int h = 1; h < len; ++h) want_hist[static_cast<std::size_t>(h * n + i)] = hist[static_cast<std::size_t>((h - 1) * n + i)];
    }
    std::vector<float> inv(static_cast<std::size_t>(n), 0.0f);
    DelayedUpdateArgs a;
    a.history = hist.data();
    a.scale = scale.data();
    a.scale_inv = inv.data();
    a.fp8_max = fmax.data();
    a.len = len;
    a.n = n;
    a.algo = algo;
    a.margin = margin;
    ops->update_delayed(a);
    INFO("trial " << trial << " len " << len << " n " << n << " margin " << margin);
    CHECK(test::same_bits(scale, want_scale));
    CHECK(test::same_bits(inv, want_inv));
    CHECK(test::same_bits(hist, want_hist));
  }
}

TEST_CASE("the meta store: layout, initial values, and an update that rolls the history once") {
  auto ops = make_cpu_ops();
  Fp8MetaStore meta(*ops, {Format::e4m3, Format::e4m3, Format::e5m2}, 4);
  CHECK(meta.size() == 3);
  CHECK(meta.history().shape == Shape({4, 3}));
  CHECK(meta.amaxes().data == meta.history().data);  // row 0 is the all-reduce buffer
  // history, scale, fp8_max and amax_now (4 + 3 rows of 3), padded to 16 bytes, then scale_inv 16 bytes apart
  CHECK(meta.state().numel() == 24 + 4 * 3);
  for (int i = 0; i < 3; ++i) CHECK(reinterpret_cast<std::uintptr_t>(meta.slot(i).scale_inv) % 16 == 0);
  const ScalingSlot s2 = meta.slot(2);
  CHECK(s2.format == Format::e5m2);
  CHECK(s2.fp8_max == 57344.0f);
  CHECK(*s2.scale == 1.0f);
  CHECK(*s2.scale_inv == 1.0f);
  CHECK(meta.fp8_maxes().as<float>()[0] == 448.0f);
  CHECK(meta.fp8_maxes().as<float>()[2] == 57344.0f);
  CHECK(!meta.ready(0));

  *meta.slot(0).amax = 2.0f;  // slot 1 records nothing: its scale stays
  *meta.slot(2).amax = 0.5f;
  meta.update(*ops, AmaxAlgo::max, 0);
  CHECK(meta.ready(1));
  CHECK(*meta.slot(0).scale == 224.0f);
  CHECK(*meta.slot(0).scale_inv == 1.0f / 224.0f);
  CHECK(*meta.slot(1).scale == 1.0f);
  CHECK(*meta.slot(2).scale == 57344.0f * 2);
  CHECK(*meta.slot(0).amax == 0.0f);                     // row 0 is fresh
  CHECK(meta.history().as<float>()[1 * 3 + 0] == 2.0f);  // last step moved to row 1
  // A smaller amax this step: the history's max still holds the larger one.
  *meta.slot(0).amax = 1.0f;
  meta.update(*ops, AmaxAlgo::max, 0);
  CHECK(*meta.slot(0).scale == 224.0f);
  *meta.slot(0).amax = 1.0f;
  meta.update(*ops, AmaxAlgo::most_recent, 0);
  CHECK(*meta.slot(0).scale == 448.0f);
  // After 4 more steps with nothing recorded, the 2.0 has left the 4-step window.
  for (int i = 0; i < 2; ++i) meta.update(*ops, AmaxAlgo::max, 0);
  *meta.slot(0).amax = 0.25f;
  meta.update(*ops, AmaxAlgo::max, 0);
  CHECK(*meta.slot(0).scale == 448.0f);  // window: 0.25, 0, 0, 1.0
}
