// The resharding arithmetic: pieces of a global tensor from shards and flat parts, their runs, and
// the overlaps that copy one layout's pieces into another's; the manifest's round trip and checks.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kiln/checkpoint/manifest.hpp"
#include "kiln/checkpoint/pieces.hpp"
#include "kiln/core/error.hpp"

using namespace kiln;
using namespace kiln::checkpoint;

namespace {

// The global elements a piece holds, in its order, from its runs.
std::vector<std::int64_t> elements(const Piece& p, const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(p.numel()), -1);
  for (auto& r : runs_of(p, shape))
    for (std::int64_t i = 0; i < r.count; ++i) out[static_cast<std::size_t>(r.pos + i)] = r.global + i;
  return out;
}

// The shards of a [rows, cols] tensor over n ranks: whole, by row ranges (three per rank, as a
// fused QKV weight), or by one column range.
std::vector<TensorShard> shards(int kind, int n, std::int64_t rows, std::int64_t cols) {
  std::vector<TensorShard> out(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (kind == 1) {
      out[r].dim = 0;
      const std::int64_t third = rows / 3, part = third / n;
      for (int q = 0; q < 3; ++q) out[r].ranges.push_back({q * third + r * part, q * third + (r + 1) * part});
    } else if (kind == 2) {
      out[r].dim = 1;
      out[r].ranges.push_back({cols / n * r, cols / n * (r + 1)});
    }
  }
  return out;
}

}  // namespace

TEST_CASE("the pieces of every layout tile the global tensor, and any layout's pieces fill any other's") {
  const std::int64_t rows = 24, cols = 10;
  const Shape global{rows, cols};
  const std::vector<std::int64_t> shape = {rows, cols};
  std::mt19937 gen(7);
  // Every layout: a shard kind, TP ranks, and FSDP-like flat parts of each local tensor.
  struct Layout {
    std::vector<LocalPiece> pieces;
  };
  auto make = [&](int kind, int tp, int parts) {
    Layout l;
    for (auto& s : shards(kind, tp, rows, cols)) {
      const std::int64_t local = s.local_shape(global).numel();
      std::vector<std::int64_t> cuts = {0, local};
      for (int i = 1; i < parts; ++i) cuts.push_back(std::uniform_int_distribution<std::int64_t>(0, local)(gen));
      std::sort(cuts.begin(), cuts.end());
      for (std::size_t i = 0; i + 1 < cuts.size(); ++i)
        for (auto& p : pieces_of(s, global, cuts[i], cuts[i + 1] - cuts[i])) l.pieces.push_back(p);
    }
    return l;
  };
  std::vector<Layout> layouts;
  for (int kind : {0, 1, 2})
    for (int tp : {1, 2})
      for (int parts : {1, 3})
        if (kind != 0 || tp == 1) layouts.push_back(make(kind, tp, parts));  // (whole tensors are not split over TP)

  std::vector<float> truth(static_cast<std::size_t>(rows * cols));
  std::iota(truth.begin(), truth.end(), 1.0f);
  for (auto& l : layouts) {
    std::vector<int> seen(truth.size(), 0);
    for (auto& p : l.pieces)
      for (auto g : elements(p.piece, shape)) ++seen[static_cast<std::size_t>(g)];
    for (int c : seen) REQUIRE(c == 1);  // a layout of whole copies covers each element once
  }
  // Saved under one layout, read under another through the overlaps.
  for (auto& from : layouts)
    for (auto& to : layouts)
      for (auto& dst : to.pieces) {
        std::vector<float> got(static_cast<std::size_t>(dst.piece.numel()), -1.0f);
        for (auto& src : from.pieces) {
          const auto src_elements = elements(src.piece, shape);
          for_each_overlap(runs_of(dst.piece, shape), runs_of(src.piece, shape),
                           [&](std::int64_t d, std::int64_t s, std::int64_t n) {
                             for (std::int64_t i = 0; i < n; ++i)
                               got[static_cast<std::size_t>(d + i)] =
                                   truth[static_cast<std::size_t>(src_elements[static_cast<std::size_t>(s + i)])];
                           });
        }
        const auto want = elements(dst.piece, shape);
        for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(got[i] == truth[static_cast<std::size_t>(want[i])]);
      }
}

TEST_CASE("a local piece starts at the local element its box run begins at") {
  TensorShard qkv{0, {{0, 2}, {6, 8}, {12, 14}}};  // rows of q, k, v
  const auto pieces = pieces_of(qkv, Shape{18, 4}, 5, 12);  // local elements [5, 17)
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[0].local == 5);
  CHECK(pieces[0].piece == Piece{{0, 0}, {2, 4}, 5, 8});
  CHECK(pieces[1].local == 8);
  CHECK(pieces[1].piece == Piece{{6, 0}, {2, 4}, 0, 8});
  CHECK(pieces[2].local == 16);
  CHECK(pieces[2].piece == Piece{{12, 0}, {2, 4}, 0, 1});
  CHECK_THROWS_WITH_AS(pieces_of(TensorShard{1, {{0, 1}, {2, 3}}}, Shape{4, 4}, 0, 8),
                       doctest::Contains("column shard of 2 ranges"), Error);
}

TEST_CASE("a manifest round-trips through JSON, and its parser names the key that is wrong") {
  Manifest m;
  m.step = 42;
  m.kiln_version = "0.1.0";
  m.topology = {{"tp", 2}, {"world", 2}};
  m.counters = {{"data.position", 640}};
  m.config = "[train]\nsteps = 100\n";
  m.files = {{"rank_00000.bin", 0, 4096, 0x0123456789abcdefull}};
  m.tensors = {{"model/wte", "f32", {8, 4}, {{Piece{{0, 0}, {8, 4}, 0, 32}, 0, 0, 7}}}};
  m.ranks = {{0, {{"tp", 0}}, {{"rng", 0, 128, 10, 9}}}};
  const Manifest back = Manifest::parse(m.to_json(), "m.json");
  CHECK(back.to_json() == m.to_json());
  CHECK(back.tensors[0].pieces[0].xxh3 == 7);
  CHECK(back.ranks[0].blob("rng")->offset == 128);

  auto broken = [&](const std::string& from, const std::string& to) {
    std::string text = m.to_json();
    const auto at = text.find(from);
    REQUIRE(at != std::string::npos);
    return text.replace(at, from.size(), to);
  };
  CHECK_THROWS_WITH_AS(Manifest::parse(broken("\"step\": 42", "\"step\": \"42\""), "m.json"),
                       "m.json: step: must be an integer", FileError);
  CHECK_THROWS_WITH_AS(Manifest::parse(broken("\"version\": 1", "\"version\": 9"), "m.json"),
                       doctest::Contains("written by a newer kiln"), FileError);
  CHECK_THROWS_WITH_AS(Manifest::parse(broken("\"bytes\": 4096", "\"bytes\": 64"), "m.json"),
                       doctest::Contains("lie outside rank_00000.bin (64 bytes)"), FileError);
  CHECK_THROWS_WITH_AS(Manifest::parse(broken("rank_00000.bin", "../x.bin"), "m.json"),
                       doctest::Contains("is not a file name inside the checkpoint directory"), FileError);
  CHECK_THROWS_WITH_AS(Manifest::parse(broken("\"flat\": [\n      0,\n      32", "\"flat\": [\n      0,\n      33"), "m.json"),
                       doctest::Contains("tensor 'model/wte'.pieces[0].flat"), FileError);
}
