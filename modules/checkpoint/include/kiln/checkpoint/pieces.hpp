#pragma once
// Where a part of a global tensor lies, independent of any layout: the resharding arithmetic of
// training-state checkpoints.
//
// A piece is a box of the global tensor (offsets and extents per dimension) and the run
// [flat_begin, flat_end) of the box's elements in row-major order. A rank's tensor-parallel slice
// is one box per range of its shard (a fused QKV slice is three), and an FSDP part is a flat run of
// the rank's local tensor, which cuts each box to a run of its elements. Saving records every piece
// with its place in a file; loading intersects the pieces a rank now needs with those saved, so any
// layout loads any other.
#include <cstdint>
#include <vector>

#include "kiln/tensor/shard.hpp"

namespace kiln::checkpoint {

struct Piece {
  std::vector<std::int64_t> offsets, extents;  // the box, one entry per dimension of the global tensor
  std::int64_t flat_begin = 0, flat_end = 0;    // the run of the box's elements (row-major) the piece holds
  std::int64_t numel() const { return flat_end - flat_begin; }
  bool operator==(const Piece&) const = default;
};

// A piece of a rank's local tensor: its first element is local element `local` (row-major), and
// its elements follow each other in the local tensor.
struct LocalPiece {
  Piece piece;
  std::int64_t local = 0;
};

// The pieces covering local elements [first, first + count) of a rank's shard `shard` of a tensor
// of shape `global` (1-D or 2-D), in local order. Throws for a column shard of several ranges (its
// boxes are not runs of the local tensor; no kiln layer makes one).
std::vector<LocalPiece> pieces_of(const TensorShard& shard, const Shape& global, std::int64_t first,
                                  std::int64_t count);

// A run of a piece contiguous in the global tensor: `count` elements from global flat element
// `global`, which are elements [pos, pos + count) of the piece.
struct Run {
  std::int64_t global = 0, pos = 0, count = 0;
};
// The piece's runs in ascending global order (one per box row it crosses, adjacent rows merged).
std::vector<Run> runs_of(const Piece& p, const std::vector<std::int64_t>& global);

// Calls f(dst_pos, src_pos, count) for every stretch of elements both run lists cover.
template <class F>
void for_each_overlap(const std::vector<Run>& dst, const std::vector<Run>& src, F&& f) {
  std::size_t i = 0, j = 0;
  while (i < dst.size() && j < src.size()) {
    const Run& a = dst[i];
    const Run& b = src[j];
    const std::int64_t lo = a.global > b.global ? a.global : b.global;
    const std::int64_t ae = a.global + a.count, be = b.global + b.count;
    const std::int64_t hi = ae < be ? ae : be;
    if (lo < hi) f(a.pos + (lo - a.global), b.pos + (lo - b.global), hi - lo);
    if (ae <= be) ++i;
    else ++j;
  }
}

}  // namespace kiln::checkpoint
