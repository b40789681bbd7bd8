#pragma once
// Which part of a logical 2-D (or 1-D) tensor a rank holds: along `dim` (0 rows, 1 columns; -1 the
// whole tensor), the concatenation of `ranges` ([begin, end) in the logical tensor), in order. A
// rank's share of a fused QKV weight under tensor parallelism is three row ranges, one per q, k, v;
// a row-parallel weight's is one column range. Initialisation, gradient checks and checkpoints walk
// a shard's contiguous blocks to map local elements to global ones.
#include <cstdint>
#include <utility>
#include <vector>

#include "kiln/tensor/tensor.hpp"

namespace kiln {

struct TensorShard {
  int dim = -1;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;

  bool sharded() const { return dim >= 0; }
  std::int64_t extent() const {
    std::int64_t n = 0;
    for (auto& [b, e] : ranges) n += e - b;
    return n;
  }
  // The shape this rank holds of a logical tensor of `global` shape.
  Shape local_shape(const Shape& global) const {
    Shape s = global;
    if (sharded()) s.dims[dim] = extent();
    return s;
  }
  bool operator==(const TensorShard&) const = default;

  // A run of elements contiguous in both the local and the logical tensor (row-major).
  struct Block {
    std::int64_t local = 0, global = 0, count = 0;
  };
  // Calls f(Block) for every contiguous block of the shard of a logical tensor of shape `global`,
  // in local order; together they cover the local tensor once.
  template <class F>
  void for_each_block(const Shape& global, F&& f) const {
    const std::int64_t cols = global.ndim > 1 ? global[1] : 1;
    if (!sharded()) {
      f(Block{0, 0, global.numel()});
      return;
    }
    if (dim == 0) {  // whole rows: one block per range
      std::int64_t at = 0;
      for (auto [b, e] : ranges) {
        f(Block{at, b * cols, (e - b) * cols});
        at += (e - b) * cols;
      }
      return;
    }
    const std::int64_t local_cols = extent();  // column ranges: one block per row and range
    for (std::int64_t row = 0; row < global[0]; ++row) {
      std::int64_t c0 = 0;
      for (auto [b, e] : ranges) {
        f(Block{row * local_cols + c0, row * cols + b, e - b});
        c0 += e - b;
      }
    }
  }
  // The same for the local elements [begin, end) only: the blocks clipped to them.
  template <class F>
  void for_each_block(const Shape& global, std::int64_t begin, std::int64_t end, F&& f) const {
    for_each_block(global, [&](const Block& b) {
      const std::int64_t lo = b.local > begin ? b.local : begin;
      const std::int64_t hi = b.local + b.count < end ? b.local + b.count : end;
      if (lo < hi) f(Block{lo, b.global + (lo - b.local), hi - lo});
    });
  }
};

}  // namespace kiln
