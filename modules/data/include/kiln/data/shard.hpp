#pragma once
// Token shards on disk.
//  - llm.c format: a header of 256 int32 (magic 20240520, version 1, token count), then uint16 tokens.
//  - raw: uint16 tokens and nothing else, as nanoGPT's prepare scripts write them.
// Missing, truncated or mis-formatted files are FileErrors naming the file. Tokens are read with
// pread from a descriptor kept open, not through a mapping: a shard truncated while a run reads it
// is then a FileError naming it (a mapping would kill the process with SIGBUS), and a shard
// deleted or replaced by rename keeps being read as it was when opened.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <boost/describe/enum.hpp>

namespace kiln::data {

enum class ShardFormat { auto_, llmc, raw };
BOOST_DESCRIBE_ENUM(ShardFormat, auto_, llmc, raw)

inline constexpr std::int32_t kLlmcMagic = 20240520;
inline constexpr int kLlmcHeaderInts = 256;

class TokenShard {
 public:
  TokenShard(const std::string& path, ShardFormat format);
  TokenShard(TokenShard&& o) noexcept;
  TokenShard& operator=(TokenShard&&) = delete;
  TokenShard(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  ShardFormat format() const { return format_; }
  std::size_t size() const { return count_; }
  // Tokens [first, first + n) into `out`; a FileError naming the file if it no longer holds them.
  void read(std::size_t first, std::size_t n, std::uint16_t* out) const;
  // Every token, read now (tests, small shards).
  std::vector<std::uint16_t> tokens() const;

 private:
  std::string path_;
  ShardFormat format_;
  int fd_ = -1;
  std::size_t first_byte_ = 0;  // where the tokens begin (after the llm.c header)
  std::size_t count_ = 0;
};

// Files matching a glob pattern (wildcards in the file name and directories), sorted; an error
// naming the pattern if nothing matches.
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what);

// Writes tokens as an llm.c shard, atomically (temp file + fsync + rename).
void write_llmc_shard(const std::string& path, std::span<const std::uint16_t> tokens);

}  // namespace kiln::data
