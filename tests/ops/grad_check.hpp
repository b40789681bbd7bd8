#pragma once
// Backward ops against central finite differences of their forward on the CPU reference backend: the
// loss is L = sum(out * w) with fixed random weights w (dot), summed in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "host_view.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::test {

inline double dot(const std::vector<float>& a, const std::vector<float>& w) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += double(a[i]) * w[i];
  return s;
}

// How a gradient is checked: `samples` elements spread over x (0: every element), the step h, and
// the tolerance relative to the largest |gradient| (so tiny entries do not fail).
struct Diff {
  int samples = 40;
  float h = 1e-2f;
  double tol = 2e-3;
};

// analytic[i] against the central difference of loss() in x[i].
inline void check_gradient(const char* what, std::vector<float>& x, const std::vector<float>& analytic,
                           const std::function<double()>& loss, Diff d = {}) {
  REQUIRE(x.size() == analytic.size());
  double scale = 1e-6;
  for (float g : analytic) scale = std::max(scale, double(std::fabs(g)));
  const std::size_t step = d.samples > 0 ? std::max<std::size_t>(1, x.size() / d.samples) : 1;
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); i += step) {
    const float saved = x[i];
    x[i] = saved + d.h;
    const double lp = loss();
    x[i] = saved - d.h;
    const double lm = loss();
    x[i] = saved;
    worst = std::max(worst, std::fabs((lp - lm) / (2.0 * d.h) - analytic[i]) / scale);
  }
  INFO(what << ": worst error relative to max |grad| = " << worst);
  CHECK(worst < d.tol);
}

// The CPU reference backend in fp32 (no bf16 rounding), two threads.
inline std::unique_ptr<ops::Backend> cpu() { return ops::make_cpu_backend({.round_bf16 = false, .threads = 2}); }

}  // namespace kiln::test
