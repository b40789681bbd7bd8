// The token-shard reader: an llm.c shard (1024-byte header: magic, version, token count; then
// uint16 tokens, or uint32 ones under llm.c's second magic) or a raw uint16 file, indexed into
// training windows and read back.
//
// Input: byte 0 picks the format (auto, llmc, raw) and the vocabulary limit, byte 1 the sequence
// length T (1..64); the rest is the file.
#include <algorithm>
#include <vector>

#include "fuzz_util.hpp"
#include "kiln/core/error.hpp"
#include "kiln/data/loader.hpp"
#include "kiln/data/shard.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace kiln::data;
  if (size < 2) return 0;
  static kiln::fuzz::MemFile file("fuzz-shard.bin");
  const ShardFormat format = static_cast<ShardFormat>(data[0] % 3);
  const int vocab_limit = (data[0] / 3) % 2 ? 50257 : 0;  // 0: no limit
  const int T = data[1] % 64 + 1;
  const std::string& path = file.set(kiln::fuzz::as_text(data + 2, size - 2));
  try {
    std::vector<TokenShard> shards;
    shards.emplace_back(path, format);
    const std::size_t n = shards.back().size();
    if (shards.back().tokens32().size() != n) kiln::fuzz::fuzz_fail("tokens32() and size() disagree");
    if (shards.back().token_bytes() == 2 && shards.back().tokens().size() != n)
      kiln::fuzz::fuzz_fail("tokens() and size() disagree");
    WindowIndex index(std::move(shards), T);
    if (index.windows() != (n - 1) / static_cast<std::size_t>(T)) kiln::fuzz::fuzz_fail("window count");
    std::vector<std::int32_t> inputs(T), targets(T);
    const std::uint64_t w = index.windows();
    for (std::uint64_t i : {std::uint64_t{0}, w / 2, w - 1}) index.read(i, inputs.data(), targets.data(), vocab_limit);
    // Reading past the last window is an error, never a read outside the file.
    try {
      index.read(w, inputs.data(), targets.data(), vocab_limit);
      kiln::fuzz::fuzz_fail("a window past the end was read");
    } catch (const kiln::Error&) {
    }
  } catch (const std::exception&) {
  }
  return 0;
}
