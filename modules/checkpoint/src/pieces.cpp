#include "kiln/checkpoint/pieces.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"

namespace kiln::checkpoint {

std::vector<LocalPiece> pieces_of(const TensorShard& shard, const Shape& global, std::int64_t first,
                                  std::int64_t count) {
  KILN_CHECK(global.ndim == 1 || global.ndim == 2, "checkpoint pieces of ", global.ndim, "-D tensors (1-D or 2-D only)");
  const bool two_d = global.ndim == 2;
  const std::int64_t rows = global[0], cols = two_d ? global[1] : 1;
  struct Box {
    std::vector<std::int64_t> offsets, extents;
    std::int64_t local = 0;
  };
  std::vector<Box> boxes;
  auto box = [&](std::int64_t r0, std::int64_t nr, std::int64_t c0, std::int64_t nc, std::int64_t local) {
    if (two_d) boxes.push_back({{r0, c0}, {nr, nc}, local});
    else boxes.push_back({{r0}, {nr}, local});
  };
  if (!shard.sharded()) {
    box(0, rows, 0, cols, 0);
  } else if (shard.dim == 0) {
    std::int64_t at = 0;
    for (auto [b, e] : shard.ranges) {
      box(b, e - b, 0, cols, at);
      at += (e - b) * cols;
    }
  } else {
    KILN_CHECK(two_d && shard.dim == 1, "a shard along dimension ", shard.dim, " of a ", global.ndim, "-D tensor");
    if (shard.ranges.size() != 1)
      KILN_THROW("checkpoints cannot describe a column shard of ", shard.ranges.size(),
                 " ranges (its parts are not runs of the local tensor)");
    box(0, rows, shard.ranges[0].first, shard.ranges[0].second - shard.ranges[0].first, 0);
  }
  std::vector<LocalPiece> out;
  for (auto& b : boxes) {
    std::int64_t n = 1;
    for (auto e : b.extents) n *= e;
    const std::int64_t lo = std::max(b.local, first), hi = std::min(b.local + n, first + count);
    if (lo < hi) out.push_back({Piece{b.offsets, b.extents, lo - b.local, hi - b.local}, lo});
  }
  return out;
}

std::vector<Run> runs_of(const Piece& p, const std::vector<std::int64_t>& global) {
  KILN_CHECK(p.offsets.size() == global.size() && p.extents.size() == global.size(), "a piece of ",
             p.offsets.size(), " dimensions of a ", global.size(), "-D tensor");
  std::vector<Run> out;
  if (p.numel() <= 0) return out;
  const std::int64_t width = global.size() == 2 ? p.extents[1] : p.extents[0];
  const std::int64_t cols = global.size() == 2 ? global[1] : global[0];
  const std::int64_t c0 = global.size() == 2 ? p.offsets[1] : 0;
  const std::int64_t r0 = global.size() == 2 ? p.offsets[0] : 0;
  if (global.size() == 1 || width == cols) {  // whole rows: one run
    const std::int64_t start = global.size() == 1 ? p.offsets[0] : r0 * cols;
    out.push_back({start + p.flat_begin, 0, p.numel()});
    return out;
  }
  for (std::int64_t f = p.flat_begin; f < p.flat_end;) {
    const std::int64_t r = f / width, c = f % width;
    const std::int64_t n = std::min(width - c, p.flat_end - f);
    out.push_back({(r0 + r) * cols + c0 + c, f - p.flat_begin, n});
    f += n;
  }
  return out;
}

}  // namespace kiln::checkpoint
