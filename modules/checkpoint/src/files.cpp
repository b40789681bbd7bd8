#include "kiln/checkpoint/files.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "kiln/core/error.hpp"

namespace kiln::checkpoint {

namespace {
std::string why() { return std::strerror(errno); }
std::string parent_of(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? "." : p.string();
}
}  // namespace

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) KILN_FILE_ERROR("cannot create ", path_, ": ", why());
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write(const void* data, std::size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const std::size_t chunk = bytes < (std::size_t{1} << 30) ? bytes : (std::size_t{1} << 30);
    const ssize_t n = ::write(fd_, p, chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const bool full = n < 0 && (errno == ENOSPC || errno == EDQUOT || errno == EFBIG);
      KILN_FILE_ERROR(full ? "no space left writing " : "cannot write ", path_, " (", written_, " bytes written): ",
                      n < 0 ? why() : std::string("nothing written"));
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
    written_ += static_cast<std::uint64_t>(n);
  }
}

void OutputFile::write_zeros(std::size_t bytes) {
  static constexpr char zeros[4096] = {};
  while (bytes > 0) {
    const std::size_t n = bytes < sizeof zeros ? bytes : sizeof zeros;
    write(zeros, n);
    bytes -= n;
  }
}

void OutputFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const std::string e = why();
    ::close(fd);
    KILN_FILE_ERROR("cannot sync ", path_, " to disk: ", e);
  }
  if (::close(fd) != 0) KILN_FILE_ERROR("cannot close ", path_, ": ", why());
}

void sync_directory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) KILN_FILE_ERROR("cannot open directory ", path, ": ", why());
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  // Some file systems cannot sync a directory (EINVAL); their renames are as durable as they get.
  if (rc != 0 && err != EINVAL) KILN_FILE_ERROR("cannot sync directory ", path, ": ", std::strerror(err));
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) KILN_FILE_ERROR("cannot rename ", from, " to ", to, ": ", why());
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  OutputFile f(tmp);
  f.write(text.data(), text.size());
  f.close();
  rename_path(tmp, path);
  sync_directory(parent_of(path));
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) KILN_FILE_ERROR("cannot open ", path, std::filesystem::exists(path) ? ": not readable" : ": no such file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) KILN_FILE_ERROR("cannot read ", path);
  return ss.str();
}

MappedFile::MappedFile(std::string path) : path_(std::move(path)) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) KILN_FILE_ERROR("cannot open ", path_, ": ", why());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string e = why();
    ::close(fd);
    KILN_FILE_ERROR("cannot stat ", path_, ": ", e);
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const std::string e = why();
      ::close(fd);
      KILN_FILE_ERROR("cannot map ", path_, ": ", e);
    }
    data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace kiln::checkpoint
