#pragma once
// Small helpers the Hugging Face layouts share (interop's own, not part of its interface).
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace kiln::interop::detail {

inline std::int64_t numel(const std::vector<std::int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>());
}

// "[3, 4]", for messages.
inline std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A float as the shortest decimal that reads back to it, so config.json shows 1e-05, not 9.99999974e-06.
inline double short_double(float f) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, f);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

}  // namespace kiln::interop::detail
