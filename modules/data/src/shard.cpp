#include "kiln/data/shard.hpp"

#include <fcntl.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "kiln/core/error.hpp"

namespace kiln::data {

namespace {
// Reads up to `n` bytes at `offset`, retrying short reads; returns how many there were.
std::size_t pread_full(int fd, void* out, std::size_t n, std::size_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd, static_cast<char*>(out) + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      KILN_FILE_ERROR(path, ": cannot read token shard: ", std::strerror(errno));
    }
    if (r == 0) break;
    done += static_cast<std::size_t>(r);
  }
  return done;
}
}  // namespace

TokenShard::TokenShard(const std::string& path, ShardFormat format) : path_(path), format_(format) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) KILN_FILE_ERROR(path, ": cannot open token shard: ", std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) KILN_FILE_ERROR(path, ": cannot stat token shard: ", std::strerror(errno));
    if (!S_ISREG(st.st_mode)) KILN_FILE_ERROR(path, ": not a regular file");
    const auto file_bytes = static_cast<std::size_t>(st.st_size);
    if (file_bytes == 0) KILN_FILE_ERROR(path, ": token shard is empty");
    std::int32_t header[kLlmcHeaderInts] = {};
    const std::size_t header_bytes = sizeof header;
    const std::size_t got = pread_full(fd_, header, std::min(header_bytes, file_bytes), 0, path);
    const bool has_magic = got >= 4 && (header[0] == kLlmcMagic || header[0] == kLlmcMagicU32);
    if (format_ == ShardFormat::auto_) format_ = has_magic ? ShardFormat::llmc : ShardFormat::raw;
    if (format_ == ShardFormat::llmc) {
      if (got < header_bytes)
        KILN_FILE_ERROR(path, ": truncated llm.c shard: ", got, " bytes, shorter than the 1024-byte header");
      if (header[0] != kLlmcMagic && header[0] != kLlmcMagicU32)
        KILN_FILE_ERROR(path, ": not an llm.c shard: magic is ", header[0], ", expected ", kLlmcMagic, " or ",
                        kLlmcMagicU32);
      if (header[0] == kLlmcMagic && header[1] != 1)
        KILN_FILE_ERROR(path, ": llm.c shard version ", header[1], " is not supported (version 1: uint16 tokens)");
      if (header[0] == kLlmcMagicU32 && header[1] != 7)
        KILN_FILE_ERROR(path, ": llm.c shard version ", header[1], " with magic ", kLlmcMagicU32,
                        " is not supported (version 7: uint32 tokens)");
      token_bytes_ = header[0] == kLlmcMagic ? 2 : 4;
      if (header[2] < 0) KILN_FILE_ERROR(path, ": llm.c shard header has a negative token count ", header[2]);
      count_ = static_cast<std::size_t>(header[2]);
      const std::size_t expect = header_bytes + count_ * token_bytes_;
      if (file_bytes != expect)
        KILN_FILE_ERROR(path, ": llm.c shard header says ", count_, " tokens (", expect, " bytes) but the file has ",
                        file_bytes, " bytes", file_bytes < expect ? " (truncated?)" : "");
      first_byte_ = header_bytes;
    } else {
      if (file_bytes % 2 != 0)
        KILN_FILE_ERROR(path, ": raw uint16 token file has an odd size of ", file_bytes, " bytes (truncated?)");
      count_ = file_bytes / 2;
      first_byte_ = 0;
    }
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)),
      format_(o.format_),
      fd_(std::exchange(o.fd_, -1)),
      first_byte_(std::exchange(o.first_byte_, 0)),
      count_(std::exchange(o.count_, 0)),
      token_bytes_(o.token_bytes_) {}

TokenShard::~TokenShard() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenShard::read_bytes(std::size_t first, std::size_t n, void* out) const {
  if (first > count_ || n > count_ - first)
    KILN_THROW(path_, ": tokens [", first, ", ", first + n, ") asked of a shard of ", count_);
  const std::size_t width = static_cast<std::size_t>(token_bytes_);
  const std::size_t bytes = n * width;
  const std::size_t got = pread_full(fd_, out, bytes, first_byte_ + first * width, path_);
  if (got != bytes)
    KILN_FILE_ERROR(path_, ": token shard changed while in use: tokens [", first, ", ", first + n,
                    ") are gone (the file was ", first_byte_ + count_ * width,
                    " bytes when opened; truncated or rewritten since?)");
}

void TokenShard::read(std::size_t first, std::size_t n, std::uint16_t* out) const {
  if (token_bytes_ != 2) KILN_THROW(path_, ": holds uint32 tokens, read as uint16");
  read_bytes(first, n, out);
}

void TokenShard::read(std::size_t first, std::size_t n, std::uint32_t* out) const {
  if (token_bytes_ == 4) return read_bytes(first, n, out);
  std::vector<std::uint16_t> narrow(n);
  read_bytes(first, n, narrow.data());
  std::copy(narrow.begin(), narrow.end(), out);
}

std::vector<std::uint16_t> TokenShard::tokens() const {
  std::vector<std::uint16_t> out(count_);
  read(0, count_, out.data());
  return out;
}

std::vector<std::uint32_t> TokenShard::tokens32() const {
  std::vector<std::uint32_t> out(count_);
  read(0, count_, out.data());
  return out;
}

std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (out.empty())
    KILN_FILE_ERROR(what, " = \"", pattern, "\": no file matches (working directory ",
                    std::filesystem::current_path().string(), ")");
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

void write_shard(const std::string& path, std::int32_t magic, std::int32_t version, std::span<const std::byte> tokens,
                 std::size_t count) {
  if (count > 0x7fffffffu) KILN_THROW(path, ": too many tokens for one llm.c shard");
  std::int32_t header[kLlmcHeaderInts] = {};
  header[0] = magic;
  header[1] = version;
  header[2] = static_cast<std::int32_t>(count);
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) KILN_THROW(tmp, ": cannot create: ", std::strerror(errno));
  auto write_all = [&](const void* p, std::size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd, c, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        int e = errno;
        ::close(fd);
        KILN_THROW(tmp, ": write failed: ", std::strerror(e));
      }
      c += w;
      n -= static_cast<std::size_t>(w);
    }
  };
  write_all(header, sizeof header);
  write_all(tokens.data(), tokens.size_bytes());
  if (::fsync(fd) != 0 || ::close(fd) != 0) KILN_THROW(tmp, ": fsync/close failed: ", std::strerror(errno));
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) KILN_THROW(path, ": cannot rename the finished shard into place: ", ec.message());
}

}  // namespace

std::string mask_path_of(const std::string& shard_path) {
  const std::string_view bin = ".bin";
  if (shard_path.ends_with(bin)) return shard_path.substr(0, shard_path.size() - bin.size()) + ".mask";
  return shard_path + ".mask";
}

TokenMask::TokenMask(const std::string& path, std::size_t tokens) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) KILN_FILE_ERROR(path, ": cannot open loss mask: ", std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) KILN_FILE_ERROR(path, ": cannot stat loss mask: ", std::strerror(errno));
    std::int32_t header[kLlmcHeaderInts] = {};
    const std::size_t got = pread_full(fd_, header, sizeof header, 0, path);
    if (got < sizeof header) KILN_FILE_ERROR(path, ": truncated loss mask: shorter than its 1024-byte header");
    if (header[0] != kMaskMagic || header[1] != 1)
      KILN_FILE_ERROR(path, ": not a kiln loss mask (magic ", header[0], " version ", header[1], ", expected ",
                      kMaskMagic, " version 1)");
    if (header[2] < 0 || static_cast<std::size_t>(header[2]) != tokens)
      KILN_FILE_ERROR(path, ": holds ", header[2], " flags but its shard has ", tokens, " tokens");
    count_ = tokens;
    if (static_cast<std::size_t>(st.st_size) != sizeof header + count_)
      KILN_FILE_ERROR(path, ": header says ", count_, " flags (", sizeof header + count_, " bytes) but the file has ",
                      st.st_size, " bytes");
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

TokenMask::TokenMask(TokenMask&& o) noexcept
    : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), count_(std::exchange(o.count_, 0)) {}

TokenMask::~TokenMask() {
  if (fd_ >= 0) ::close(fd_);
}

void TokenMask::read(std::size_t first, std::size_t n, std::uint8_t* out) const {
  if (first > count_ || n > count_ - first)
    KILN_THROW(path_, ": flags [", first, ", ", first + n, ") asked of a mask of ", count_);
  if (pread_full(fd_, out, n, kLlmcHeaderInts * 4 + first, path_) != n)
    KILN_FILE_ERROR(path_, ": loss mask changed while in use (truncated or rewritten since it was opened?)");
}

void write_token_mask(const std::string& path, std::span<const std::uint8_t> flags) {
  write_shard(path, kMaskMagic, 1, std::as_bytes(flags), flags.size());
}

std::vector<std::string> write_split_shards(const std::string& dir, const std::string& split,
                                            std::span<const std::uint32_t> tokens, std::span<const std::uint8_t> flags,
                                            std::int64_t shard_tokens, bool wide) {
  KILN_CHECK(shard_tokens > 0, "tokenize: shard size must be positive");
  KILN_CHECK(flags.empty() || flags.size() == tokens.size(), "tokenize: ", flags.size(), " flags for ", tokens.size(),
             " tokens");
  std::vector<std::string> files;
  std::vector<std::uint16_t> narrow;
  int index = 0;
  for (std::size_t s = 0; s < tokens.size();) {
    const std::size_t e = std::min(tokens.size(), s + static_cast<std::size_t>(shard_tokens));
    char name[64];
    std::snprintf(name, sizeof name, "%s_%06d.bin", split.c_str(), index++);
    const auto path = (std::filesystem::path(dir) / name).string();
    const auto part = tokens.subspan(s, e - s);
    if (wide) {
      write_llmc_shard(path, part);
    } else {
      narrow.assign(part.begin(), part.end());
      write_llmc_shard(path, std::span<const std::uint16_t>(narrow));
    }
    files.push_back(path);
    if (!flags.empty()) {
      write_token_mask(mask_path_of(path), flags.subspan(s, e - s));
      files.push_back(mask_path_of(path));
    }
    s = e;
  }
  return files;
}

void write_llmc_shard(const std::string& path, std::span<const std::uint16_t> tokens) {
  write_shard(path, kLlmcMagic, 1, std::as_bytes(tokens), tokens.size());
}

void write_llmc_shard(const std::string& path, std::span<const std::uint32_t> tokens) {
  write_shard(path, kLlmcMagicU32, 7, std::as_bytes(tokens), tokens.size());
}

}  // namespace kiln::data
