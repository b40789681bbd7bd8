#pragma once
// Token shards on disk.
//  - llm.c format: a header of 256 int32 (magic, version, token count), then the tokens: uint16 for
//    magic 20240520 version 1 (llm.c's GPT-2 shards), uint32 for magic 20240801 version 7 (its
//    Llama 3 shards, dev/data/data_common.py), for vocabularies beyond 65536.
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

inline constexpr std::int32_t kLlmcMagic = 20240520;     // version 1, uint16 tokens
inline constexpr std::int32_t kLlmcMagicU32 = 20240801;  // version 7, uint32 tokens
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
  int token_bytes() const { return token_bytes_; }  // 2, or 4 for llm.c's uint32 shards
  // Tokens [first, first + n) into `out`; a FileError naming the file if it no longer holds them.
  // The uint16 form reads only 2-byte shards; the uint32 form reads either.
  void read(std::size_t first, std::size_t n, std::uint16_t* out) const;
  void read(std::size_t first, std::size_t n, std::uint32_t* out) const;
  // Every token, read now (tests, small shards): of a 2-byte shard, and of either.
  std::vector<std::uint16_t> tokens() const;
  std::vector<std::uint32_t> tokens32() const;

 private:
  std::string path_;
  ShardFormat format_;
  int fd_ = -1;
  std::size_t first_byte_ = 0;  // where the tokens begin (after the llm.c header)
  std::size_t count_ = 0;
  int token_bytes_ = 2;
  void read_bytes(std::size_t first, std::size_t n, void* out) const;
};

// A shard's loss mask, in a file beside it: DIR/train_000000.mask for DIR/train_000000.bin (the
// name with ".bin" replaced, else ".mask" appended; a glob of *.bin does not take it for a shard).
// A header of 256 int32 (kMaskMagic, version 1, the shard's token count), then one byte per token:
// bit 0 (kTrained) set when the token is a target the loss is taken on (supervised fine-tuning
// trains on the assistant's tokens only), bit 1 (kDocumentStart) when it starts a document.
inline constexpr std::int32_t kMaskMagic = 20251126;
inline constexpr std::uint8_t kTrained = 1, kDocumentStart = 2;
std::string mask_path_of(const std::string& shard_path);

class TokenMask {
 public:
  // FileErrors name the file: missing, truncated, another magic or version, or a count other than
  // `tokens` (the shard's).
  TokenMask(const std::string& path, std::size_t tokens);
  TokenMask(TokenMask&&) noexcept;
  TokenMask& operator=(TokenMask&&) = delete;
  ~TokenMask();
  const std::string& path() const { return path_; }
  std::size_t size() const { return count_; }
  void read(std::size_t first, std::size_t n, std::uint8_t* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::size_t count_ = 0;
};

// Writes a mask file atomically (as write_llmc_shard).
void write_token_mask(const std::string& path, std::span<const std::uint8_t> flags);

// One split of a token stream as llm.c shards DIR/SPLIT_000000.bin, ... of at most `shard_tokens`
// tokens each (uint32 when `wide`, else uint16), and, when `flags` is not empty (one per token),
// each shard's loss mask beside it. Returns the files written, each shard followed by its mask.
std::vector<std::string> write_split_shards(const std::string& dir, const std::string& split,
                                            std::span<const std::uint32_t> tokens, std::span<const std::uint8_t> flags,
                                            std::int64_t shard_tokens, bool wide);

// Files matching a glob pattern (wildcards in the file name and directories), sorted; an error
// naming the pattern if nothing matches.
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what);

// Writes tokens as an llm.c shard, atomically (temp file + fsync + rename): uint16 tokens with
// llm.c's GPT-2 header, uint32 tokens with its Llama 3 header.
void write_llmc_shard(const std::string& path, std::span<const std::uint16_t> tokens);
void write_llmc_shard(const std::string& path, std::span<const std::uint32_t> tokens);

}  // namespace kiln::data
