// TensorShard: which part of a logical tensor a rank holds, and its contiguous blocks mapping local
// elements to global ones.
#include <doctest/doctest.h>

#include <cstdint>
#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "kiln/tensor/shard.hpp"

using namespace kiln;

namespace {

using Ranges = std::vector<std::pair<std::int64_t, std::int64_t>>;

// The global (row-major) index of local element `i`, from the definition: the local tensor is the
// concatenation of the ranges along `dim`.
std::int64_t global_index_of(const TensorShard& s, const Shape& global, std::int64_t i) {
  const std::int64_t cols = global.ndim > 1 ? global[1] : 1;
  if (!s.sharded()) return i;
  std::vector<std::int64_t> picked;  // global rows (dim 0) or columns (dim 1), in local order
  for (auto [b, e] : s.ranges)
    for (std::int64_t k = b; k < e; ++k) picked.push_back(k);
  if (s.dim == 0) return picked[static_cast<std::size_t>(i / cols)] * cols + i % cols;
  const auto local_cols = static_cast<std::int64_t>(picked.size());
  return (i / local_cols) * cols + picked[static_cast<std::size_t>(i % local_cols)];
}

// Walks the blocks: they come in local order, touch every local element exactly once, and map
// each to its global index. Returns the number of blocks.
int check_blocks(const TensorShard& s, const Shape& global) {
  const std::int64_t local_numel = s.local_shape(global).numel();
  std::vector<int> seen(static_cast<std::size_t>(local_numel), 0);
  std::int64_t next_local = 0;
  int blocks = 0, wrong = 0;
  s.for_each_block(global, [&](const TensorShard::Block& b) {
    ++blocks;
    CHECK(b.local == next_local);
    CHECK(b.count > 0);
    next_local = b.local + b.count;
    for (std::int64_t k = 0; k < b.count; ++k) {
      REQUIRE(b.local + k < local_numel);
      ++seen[static_cast<std::size_t>(b.local + k)];
      wrong += b.global + k != global_index_of(s, global, b.local + k);
    }
  });
  CHECK(wrong == 0);
  for (int n : seen) REQUIRE(n == 1);
  return blocks;
}

// Rank r's share of a fused [3 C, C] QKV weight over tp ranks: its rows of q, of k and of v.
TensorShard qkv_rows(std::int64_t C, int tp, int r) {
  TensorShard s{0, {}};
  for (int part = 0; part < 3; ++part) s.ranges.push_back({part * C + r * C / tp, part * C + (r + 1) * C / tp});
  return s;
}

}  // namespace

TEST_CASE("an unsharded tensor is one block covering every element") {
  TensorShard s;
  CHECK_FALSE(s.sharded());
  CHECK(s.extent() == 0);
  CHECK(s.local_shape({4, 6}) == Shape{4, 6});
  std::vector<TensorShard::Block> blocks;
  s.for_each_block({4, 6}, [&](const TensorShard::Block& b) { blocks.push_back(b); });
  REQUIRE(blocks.size() == 1);
  CHECK(blocks[0].local == 0);
  CHECK(blocks[0].global == 0);
  CHECK(blocks[0].count == 24);
  CHECK(check_blocks(s, {7}) == 1);
}

TEST_CASE("a row shard with several ranges, like a fused QKV split, maps each local row to its global row") {
  const TensorShard s = qkv_rows(8, 4, 1);  // rows [2,4), [10,12), [18,20) of [24, 8]
  CHECK(s.sharded());
  CHECK(s.extent() == 6);
  CHECK(s.local_shape({24, 8}) == Shape{6, 8});
  std::vector<TensorShard::Block> blocks;
  s.for_each_block({24, 8}, [&](const TensorShard::Block& b) { blocks.push_back(b); });
  REQUIRE(blocks.size() == 3);  // one per range: whole rows are contiguous in both tensors
  CHECK(blocks[1].local == 16);
  CHECK(blocks[1].global == 80);
  CHECK(blocks[1].count == 16);
  CHECK(check_blocks(s, {24, 8}) == 3);
}

TEST_CASE("a row shard of a 1-D tensor, like a QKV bias, maps elements one to one") {
  const TensorShard s = qkv_rows(6, 2, 1);
  CHECK(s.local_shape({18}) == Shape{9});
  CHECK(check_blocks(s, {18}) == 3);
}

TEST_CASE("a column shard maps each row's columns to the global columns") {
  TensorShard s{1, {{2, 5}, {7, 9}}};
  CHECK(s.extent() == 5);
  CHECK(s.local_shape({4, 10}) == Shape{4, 5});
  std::vector<TensorShard::Block> blocks;
  s.for_each_block({4, 10}, [&](const TensorShard::Block& b) { blocks.push_back(b); });
  REQUIRE(blocks.size() == 8);  // one per row and range
  CHECK(blocks[3].local == 8);
  CHECK(blocks[3].global == 17);
  CHECK(blocks[3].count == 2);
  CHECK(check_blocks(s, {4, 10}) == 8);
}

TEST_CASE("the shards of every tensor-parallel rank together cover the logical tensor once") {
  const Shape qkv{3 * 12, 5}, proj{12, 12};
  for (int tp : {1, 2, 3, 4}) {
    CAPTURE(tp);
    std::vector<int> rows_seen(static_cast<std::size_t>(qkv.numel()), 0);
    std::vector<int> cols_seen(static_cast<std::size_t>(proj.numel()), 0);
    for (int r = 0; r < tp; ++r) {
      qkv_rows(12, tp, r).for_each_block(qkv, [&](const TensorShard::Block& b) {
        for (std::int64_t k = 0; k < b.count; ++k) ++rows_seen[static_cast<std::size_t>(b.global + k)];
      });
      TensorShard col{1, {{r * 12 / tp, (r + 1) * 12 / tp}}};
      col.for_each_block(proj, [&](const TensorShard::Block& b) {
        for (std::int64_t k = 0; k < b.count; ++k) ++cols_seen[static_cast<std::size_t>(b.global + k)];
      });
    }
    for (int n : rows_seen) REQUIRE(n == 1);
    for (int n : cols_seen) REQUIRE(n == 1);
  }
}

TEST_CASE("random row and column shards cover their local elements once at the right global indices") {
  std::mt19937 gen(4242);
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen); };
  for (int trial = 0; trial < 200; ++trial) {
    const Shape global = trial % 5 == 0 ? Shape{pick(1, 40)} : Shape{pick(1, 12), pick(1, 12)};
    TensorShard s{global.ndim == 1 ? 0 : static_cast<int>(pick(0, 1)), {}};
    // Disjoint increasing ranges, some of them possibly adjacent.
    for (std::int64_t at = pick(0, 2); at < global[s.dim];) {
      const std::int64_t end = std::min(global[s.dim], at + pick(1, 4));
      s.ranges.push_back({at, end});
      at = end + pick(0, 3);
    }
    if (s.ranges.empty()) continue;
    CAPTURE(trial);
    CAPTURE(global.str());
    CHECK(s.local_shape(global)[s.dim] == s.extent());
    check_blocks(s, global);
  }
}

TEST_CASE("shards compare equal by dimension and ranges") {
  CHECK(TensorShard{0, {{0, 2}}} == TensorShard{0, {{0, 2}}});
  CHECK_FALSE(TensorShard{0, {{0, 2}}} == TensorShard{1, {{0, 2}}});
  CHECK_FALSE(TensorShard{0, {{0, 2}}} == TensorShard{0, {{0, 2}, {4, 6}}});
  CHECK(TensorShard{} == TensorShard{});
}
