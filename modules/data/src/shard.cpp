#include "kiln/data/shard.hpp"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "kiln/core/error.hpp"

namespace kiln::data {

TokenShard::TokenShard(const std::string& path, ShardFormat format) : path_(path), format_(format) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) KILN_THROW(path, ": cannot open token shard: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    KILN_THROW(path, ": cannot stat token shard: ", std::strerror(errno));
  }
  map_bytes_ = static_cast<std::size_t>(st.st_size);
  if (map_bytes_ == 0) {
    ::close(fd);
    KILN_THROW(path, ": token shard is empty");
  }
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    KILN_THROW(path, ": cannot map token shard: ", std::strerror(errno));
  }
  const auto* header = static_cast<const std::int32_t*>(map_);
  const bool has_magic = map_bytes_ >= 4 && header[0] == kLlmcMagic;
  if (format_ == ShardFormat::auto_) format_ = has_magic ? ShardFormat::llmc : ShardFormat::raw;
  if (format_ == ShardFormat::llmc) {
    const std::size_t header_bytes = kLlmcHeaderInts * sizeof(std::int32_t);
    if (map_bytes_ < header_bytes)
      KILN_THROW(path, ": truncated llm.c shard: ", map_bytes_, " bytes, shorter than the 1024-byte header");
    if (header[0] != kLlmcMagic)
      KILN_THROW(path, ": not an llm.c shard: magic is ", header[0], ", expected ", kLlmcMagic);
    if (header[1] != 1)
      KILN_THROW(path, ": llm.c shard version ", header[1], " is not supported (version 1: uint16 tokens)");
    if (header[2] < 0) KILN_THROW(path, ": llm.c shard header has a negative token count ", header[2]);
    count_ = static_cast<std::size_t>(header[2]);
    const std::size_t expect = header_bytes + count_ * sizeof(std::uint16_t);
    if (map_bytes_ != expect)
      KILN_THROW(path, ": llm.c shard header says ", count_, " tokens (", expect, " bytes) but the file has ",
                 map_bytes_, " bytes", map_bytes_ < expect ? " (truncated?)" : "");
    tokens_ = reinterpret_cast<const std::uint16_t*>(static_cast<const char*>(map_) + header_bytes);
  } else {
    if (map_bytes_ % 2 != 0)
      KILN_THROW(path, ": raw uint16 token file has an odd size of ", map_bytes_, " bytes (truncated?)");
    count_ = map_bytes_ / 2;
    tokens_ = static_cast<const std::uint16_t*>(map_);
  }
}

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)),
      format_(o.format_),
      map_(std::exchange(o.map_, nullptr)),
      map_bytes_(std::exchange(o.map_bytes_, 0)),
      tokens_(std::exchange(o.tokens_, nullptr)),
      count_(std::exchange(o.count_, 0)) {}

TokenShard::~TokenShard() {
  if (map_) ::munmap(map_, map_bytes_);
}

std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what) {
  glob_t g{};
  int rc = ::glob(pattern.c_str(), GLOB_ERR, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  if (out.empty())
    KILN_THROW(what, " = \"", pattern, "\": no file matches (working directory ",
               std::filesystem::current_path().string(), ")");
  std::sort(out.begin(), out.end());
  return out;
}

void write_llmc_shard(const std::string& path, std::span<const std::uint16_t> tokens) {
  if (tokens.size() > 0x7fffffffu) KILN_THROW(path, ": too many tokens for one llm.c shard");
  std::int32_t header[kLlmcHeaderInts] = {};
  header[0] = kLlmcMagic;
  header[1] = 1;
  header[2] = static_cast<std::int32_t>(tokens.size());
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

}  // namespace kiln::data
