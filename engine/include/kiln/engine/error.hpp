#pragma once
// One error type family for all of kiln. Library code throws; only `main` turns errors into exit
// codes. Every error carries the C++ file:line that raised it.
#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace kiln {

// Concatenates anything streamable into one string (g++ 12 has no <format>).
template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, std::source_location where = std::source_location::current())
      : std::runtime_error(what), where_(where) {}
  // "file.cpp:123", the C++ place that raised the error (not a user's config position).
  std::string where() const { return cat(where_.file_name(), ":", where_.line()); }

 private:
  std::source_location where_;
};

// A configuration error: bad TOML, unknown key, wrong type, failed validation, bad --set.
// The message already names the config file:line:column; the runner exits with code 2.
class ConfigError : public Error {
 public:
  using Error::Error;
};

}  // namespace kiln

#define KILN_THROW(...) throw ::kiln::Error(::kiln::cat(__VA_ARGS__))
#define KILN_CHECK(cond, ...)                                                   \
  do {                                                                          \
    if (!(cond)) throw ::kiln::Error(::kiln::cat("check failed: " #cond ": ", __VA_ARGS__)); \
  } while (0)
