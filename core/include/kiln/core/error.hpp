#pragma once
// One error type family for all of kiln. Library code throws; only `main` turns errors into exit
// codes. Every error carries the C++ file:line that raised it.
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

// (std::source_location would be neater, but nvcc's front end cannot compile it as a default
// argument, and these headers are included from .cu files.)
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, const char* file = nullptr, int line = 0)
      : std::runtime_error(what), file_(file), line_(line) {}
  // "file.cpp:123", the C++ place that raised the error (not a user's config position); "" if unknown.
  std::string where() const { return file_ ? cat(file_, ":", line_) : std::string(); }

 private:
  const char* file_;
  int line_;
};

// A configuration error: bad TOML, unknown key, wrong type, failed validation, bad --set.
// The message already names the config file:line:column; the runner exits with code 2.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A file kiln reads or writes is bad or cannot be written: a corrupt or incomplete checkpoint, a
// safetensors file whose header does not hold, a disk that is full. The message names the file
// (and the tensor and rank where there is one); the runner exits with code 2, as for config errors.
class FileError : public Error {
 public:
  using Error::Error;
};

}  // namespace kiln

#define KILN_FILE_ERROR(...) throw ::kiln::FileError(::kiln::cat(__VA_ARGS__), __FILE__, __LINE__)
#define KILN_THROW(...) throw ::kiln::Error(::kiln::cat(__VA_ARGS__), __FILE__, __LINE__)
#define KILN_CHECK(cond, ...)                                                                          \
  do {                                                                                                 \
    if (!(cond)) throw ::kiln::Error(::kiln::cat("check failed: " #cond ": ", __VA_ARGS__), __FILE__, __LINE__); \
  } while (0)
