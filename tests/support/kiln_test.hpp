#pragma once
// Helpers shared by kiln's test suites.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include <unistd.h>

namespace kiln::test {

// Marks the running test as skipped (CTest matches KILN_SKIP) and returns from it.
#define KILN_SKIP_TEST(reason)                       \
  do {                                               \
    std::cout << "KILN_SKIP: " << (reason) << "\n"; \
    return;                                          \
  } while (0)

// A run's settings joined by spaces, for a test's messages; `empty` where there are none.
inline std::string joined(const std::vector<std::string>& sets, const char* empty = "") {
  std::string out;
  for (const auto& x : sets) out += (out.empty() ? "" : " ") + x;
  return out.empty() ? empty : out;
}

// Whether two float vectors hold the same bits (NaNs and signed zeros included).
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  // (Empty vectors may hold no storage: memcmp is not given their null pointers.)
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Whether the tests are built for the sanitizers (scripts/sanitize.sh defines KILN_TEST_SANITIZED):
// a step there costs ~3x, and a case that measures time scales its waits to keep compute small beside them.
#ifdef KILN_TEST_SANITIZED
inline constexpr bool sanitized = true;
#else
inline constexpr bool sanitized = false;
#endif

// A training-equivalence test's steps (two layouts or recipes compared step by step, nothing held to
// a step's number: no resume at step k, no convergence over n steps): `steps` in the plain builds,
// at most 5 under the sanitizers (scripts/sanitize.sh builds the tests with KILN_TEST_SANITIZED),
// where a step costs ~3x and a memory error shows in the first steps.
inline int equivalence_step_count(int steps) {
#ifdef KILN_TEST_SANITIZED
  steps = std::min(steps, 5);
#endif
  return steps;
}
// The same as a `--set`. Put it first: a test's own train.steps then wins.
inline std::string equivalence_steps(int steps) {
  return "train.steps=" + std::to_string(equivalence_step_count(steps));
}

// What a linear backward's dgrad_queued (ops::LinearBackward) saw: dx and dweight (host vectors the
// backward writes) copied when it was called. Called once, dx was then written and the weight
// gradient not yet touched (checked against its value before the call; the bias gradient may come
// before or after: an FP8 layer sums it while quantising the output gradient).
struct DgradProbe {
  const std::vector<float>& dx;
  const std::vector<float>& dw;
  int calls = 0;
  std::vector<float> dx_then, dw_then;
  std::function<void()> hook() {
    return [this] {
      ++calls;
      dx_then = dx;
      dw_then = dw;
    };
  }
  // After the backward: dx then was the final dx, dweight was still dw0 (and is not now).
  void check(const std::vector<float>& dw0) const {
    CHECK(calls == 1);
    CHECK(same_bits(dx_then, dx));
    CHECK(same_bits(dw_then, dw0));
    CHECK_FALSE(same_bits(dw, dw0));
  }
};

// The mean of the last n values (a loss curve's end).
inline double tail_mean(const std::vector<double>& v, std::size_t n) {
  return std::accumulate(v.end() - static_cast<std::ptrdiff_t>(n), v.end(), 0.0) / static_cast<double>(n);
}

// ||a - b|| / ||b|| (b the reference); anything not finite gives infinity.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// A fresh directory under the build tree, removed on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    path_ = std::filesystem::temp_directory_path() / ("kiln-test-" + name + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name, const std::string& content) const {
    auto p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << content;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

}  // namespace kiln::test
