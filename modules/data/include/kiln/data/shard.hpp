#pragma once
// Token shards on disk, memory-mapped read-only.
//  - llm.c format: a header of 256 int32 (magic 20240520, version 1, token count), then uint16 tokens.
//  - raw: uint16 tokens and nothing else, as nanoGPT's prepare scripts write them.
// Missing, truncated or mis-formatted files are errors naming the file.
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
  std::span<const std::uint16_t> tokens() const { return {tokens_, count_}; }
  std::size_t size() const { return count_; }

 private:
  std::string path_;
  ShardFormat format_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const std::uint16_t* tokens_ = nullptr;
  std::size_t count_ = 0;
};

// Files matching a glob pattern (wildcards in the file name and directories), sorted; an error
// naming the pattern if nothing matches.
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what);

// Writes tokens as an llm.c shard, atomically (temp file + fsync + rename).
void write_llmc_shard(const std::string& path, std::span<const std::uint16_t> tokens);

}  // namespace kiln::data
