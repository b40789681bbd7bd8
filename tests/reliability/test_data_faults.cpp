// Token shards that change under a running job: truncated, deleted, replaced.
#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/data/loader.hpp"
#include "kiln/data/shard.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::data;

namespace {
std::vector<std::uint16_t> tokens_from(std::uint16_t first, std::size_t n) {
  std::vector<std::uint16_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<std::uint16_t>(first + i);
  return t;
}
WindowIndex index_of(const std::string& path, int T) {
  std::vector<TokenShard> shards;
  shards.emplace_back(path, ShardFormat::auto_);
  return WindowIndex(std::move(shards), T);
}
}  // namespace

TEST_CASE("a shard truncated while it is read is a file error naming it, never a crash") {
  test::TempDir dir("shrink");
  const auto path = (dir.path() / "train_000000.bin").string();
  write_llmc_shard(path, tokens_from(0, 4096));
  auto index = index_of(path, 16);
  std::vector<std::int32_t> in(16), out(16);
  index.read(200, in.data(), out.data());
  CHECK(in[0] == 200 * 16);
  // Cut the file (a mapping would now raise SIGBUS on these pages).
  REQUIRE(::truncate(path.c_str(), 1024 + 2 * 100) == 0);
  index.read(0, in.data(), out.data());  // what is still there reads as before
  CHECK(in[5] == 5);
  CHECK_THROWS_WITH_AS(index.read(200, in.data(), out.data()),
                       doctest::Contains("train_000000.bin: token shard changed while in use"), FileError);
  REQUIRE(::truncate(path.c_str(), 0) == 0);
  CHECK_THROWS_AS(index.read(0, in.data(), out.data()), FileError);
}

TEST_CASE("a shard deleted while it is read keeps its tokens: the open file still holds them") {
  test::TempDir dir("vanish");
  const auto path = (dir.path() / "train_000000.bin").string();
  write_llmc_shard(path, tokens_from(7, 1000));
  auto index = index_of(path, 10);
  std::filesystem::remove(path);
  std::vector<std::int32_t> in(10), out(10);
  index.read(index.windows() - 1, in.data(), out.data());
  CHECK(in[0] == 7 + static_cast<int>(index.windows() - 1) * 10);
  CHECK(out[9] == in[9] + 1);
}

TEST_CASE("a shard replaced by another file (rename) is read as it was when opened") {
  test::TempDir dir("replace");
  const auto path = (dir.path() / "train_000000.bin").string();
  write_llmc_shard(path, tokens_from(1, 500));
  auto index = index_of(path, 10);
  write_llmc_shard(path, tokens_from(30000, 20));  // written to path.tmp, renamed over it
  std::vector<std::int32_t> in(10), out(10);
  index.read(3, in.data(), out.data());
  CHECK(in[0] == 31);
}

TEST_CASE("a token outside the model's vocabulary is a file error naming the shard and position") {
  test::TempDir dir("vocab");
  const auto path = (dir.path() / "v.bin").string();
  auto tokens = tokens_from(0, 100);
  tokens[25] = 300;
  write_llmc_shard(path, tokens);
  auto index = index_of(path, 10);
  std::vector<std::int32_t> in(10), out(10);
  index.read(1, in.data(), out.data(), 300);
  CHECK_THROWS_WITH_AS(index.read(2, in.data(), out.data(), 300),
                       doctest::Contains("v.bin: token 300 at position 25 is outside the model's vocabulary of 300"),
                       FileError);
}
