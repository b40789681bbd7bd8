// The learning-rate schedule: linear warm-up, then cosine decay to lr * min_lr_ratio at the last
// step, or a constant rate.
#include <doctest/doctest.h>

#include <cmath>
#include <numbers>

#include "kiln/optim/optim.hpp"

using namespace kiln;
using optim::learning_rate;

namespace {
// The schedule computes in double from float settings (lr * min_lr_ratio is a float product): the
// rates agree with the formulas to float precision.
constexpr double kTol = 1e-7;

optim::OptimConfig cosine(float lr, std::int64_t warmup, float min_ratio) {
  optim::OptimConfig c;
  c.lr = lr;
  c.warmup_steps = warmup;
  c.min_lr_ratio = min_ratio;
  return c;
}
}  // namespace

TEST_CASE("the learning rate rises linearly from lr / warmup_steps to lr during warm-up") {
  const auto c = cosine(3e-3f, 10, 0.1f);
  for (std::int64_t s = 1; s <= 10; ++s) {
    CAPTURE(s);
    CHECK(learning_rate(c, s, 100) == doctest::Approx(double(c.lr) * s / 10).epsilon(kTol));
  }
  CHECK(learning_rate(c, 10, 100) == doctest::Approx(c.lr).epsilon(kTol));
}

TEST_CASE("the cosine schedule decays from lr after warm-up to lr * min_lr_ratio at the last step") {
  const auto c = cosine(2e-3f, 20, 0.1f);
  const double lr = c.lr, min_lr = lr * double(c.min_lr_ratio);
  CHECK(learning_rate(c, 20, 220) == doctest::Approx(lr).epsilon(kTol));
  CHECK(learning_rate(c, 220, 220) == doctest::Approx(min_lr).epsilon(kTol));
  CHECK(learning_rate(c, 120, 220) == doctest::Approx((lr + min_lr) / 2).epsilon(kTol));  // halfway
  // In between, the cosine of the fraction of the decay done.
  for (std::int64_t s : {21, 57, 150, 219}) {
    CAPTURE(s);
    const double ratio = double(s - 20) / 200;
    CHECK(learning_rate(c, s, 220) ==
          doctest::Approx(min_lr + 0.5 * (1 + std::cos(std::numbers::pi * ratio)) * (lr - min_lr)).epsilon(kTol));
  }
}

TEST_CASE("the cosine schedule never rises after warm-up") {
  const auto c = cosine(1e-3f, 5, 0.0f);
  double prev = learning_rate(c, 5, 60);
  for (std::int64_t s = 6; s <= 60; ++s) {
    const double now = learning_rate(c, s, 60);
    CHECK(now <= prev);
    prev = now;
  }
  CHECK(prev == 0.0);
}

TEST_CASE("without warm-up the cosine decay starts at the first step") {
  const auto c = cosine(1e-3f, 0, 0.5f);
  const double lr = c.lr;
  CHECK(learning_rate(c, 1, 4) == doctest::Approx(0.5 * lr + 0.25 * lr * (1 + std::cos(std::numbers::pi / 4))).epsilon(kTol));
  CHECK(learning_rate(c, 4, 4) == doctest::Approx(0.5 * lr).epsilon(kTol));
}

TEST_CASE("the constant schedule keeps lr after warm-up") {
  auto c = cosine(6e-4f, 3, 0.1f);
  c.schedule = optim::Schedule::constant;
  CHECK(learning_rate(c, 1, 50) == doctest::Approx(double(c.lr) / 3).epsilon(kTol));
  for (std::int64_t s : {3, 4, 25, 50, 51, 1000}) CHECK(learning_rate(c, s, 50) == double(c.lr));
}

TEST_CASE("steps past the end keep the final learning rate") {
  const auto c = cosine(1e-3f, 10, 0.2f);
  const double last = learning_rate(c, 100, 100);
  CHECK(last == doctest::Approx(double(c.lr) * double(c.min_lr_ratio)).epsilon(kTol));
  for (std::int64_t s : {101, 150, 100000}) CHECK(learning_rate(c, s, 100) == doctest::Approx(last).epsilon(kTol));
}

TEST_CASE("a run no longer than its warm-up stays in warm-up") {
  const auto c = cosine(1e-3f, 10, 0.1f);
  CHECK(learning_rate(c, 4, 8) == doctest::Approx(double(c.lr) * 0.4).epsilon(kTol));
  CHECK(learning_rate(c, 8, 8) == doctest::Approx(double(c.lr) * 0.8).epsilon(kTol));
}
