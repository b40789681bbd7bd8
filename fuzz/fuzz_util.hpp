#pragma once
// Helpers shared by kiln's libFuzzer targets.
//
// Harness rule: a reader may reject any input by throwing (kiln's errors are std::exceptions, and
// the harness catches them); what counts as a finding is a crash, a sanitizer report, a leak, a
// timeout, or a broken promise that the harness checks itself (a round trip that does not hold),
// which it reports with fuzz_fail (abort, so libFuzzer saves the input).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace kiln::fuzz {

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

[[noreturn]] inline void fuzz_fail(const std::string& what) {
  std::fprintf(stderr, "kiln fuzz: broken promise: %s\n", what.c_str());
  std::abort();
}

// An in-memory file (memfd) holding some bytes, opened by path as kiln's readers do
// ("/proc/self/fd/N"): no disk traffic, nothing left behind. Rewritten for every input.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) std::abort();
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& set(std::string_view bytes) {
    if (::ftruncate(fd_, 0) != 0) std::abort();
    std::size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t w = ::pwrite(fd_, bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
      if (w <= 0) std::abort();
      done += static_cast<std::size_t>(w);
    }
    return path_;
  }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

}  // namespace kiln::fuzz
