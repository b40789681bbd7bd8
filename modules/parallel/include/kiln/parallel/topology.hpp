#pragma once
// Rank layout of a job. Ranks are enumerated as Megatron does, tensor-parallel fastest, then
// context, expert, data and pipeline parallel:
//   rank = tp + TP * (cp + CP * (ep + EP * (dp + DP * pp)))
// With world 8 and tp 4 the TP groups are [0..3], [4..7] and the DP groups [0,4], [1,5], [2,6], [3,7].
//
// Expert parallelism is carved out of data parallelism, as in Megatron-Core: the data-parallel ranks
// (those differing only along the ep and dp axes: data_parallel_size() = EP x DP of them) each see
// their own slice of the batch and hold the same dense parameters; the ep axis splits the experts
// (the expert-parallel groups), and the dp axis is the expert-data-parallel coordinate (the ranks
// holding the same experts). Without expert parallelism (EP = 1) the dp axis is data parallelism.
#include <array>
#include <string>
#include <vector>

namespace kiln::parallel {

enum class Axis { tp = 0, cp = 1, ep = 2, dp = 3, pp = 4 };
inline constexpr int kAxes = 5;
const char* axis_name(Axis a);

struct Coords {
  int tp = 0, cp = 0, ep = 0, dp = 0, pp = 0;
  int operator[](Axis a) const;
  int& operator[](Axis a);
  bool operator==(const Coords&) const = default;
};

struct Sizes {
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;
  int operator[](Axis a) const;
  int world() const { return tp * cp * ep * dp * pp; }
  bool operator==(const Sizes&) const = default;
};

class Topology {
 public:
  // `dp` is the data-parallel size (ep of its ranks form each expert-parallel group; the dp axis is
  // dp / ep); dp <= 0 derives it from the world size. Throws kiln::Error naming the sizes when they do
  // not fit.
  Topology(int world_size, int tp, int pp, int cp, int ep, int dp);
  Topology() : Topology(1, 1, 1, 1, 1, 1) {}

  const Sizes& sizes() const { return sizes_; }
  int world() const { return sizes_.world(); }
  Coords coords(int rank) const;
  int rank(const Coords& c) const;

  // The ranks that differ from `rank` only along `axes` (each rank is in exactly one such group),
  // in increasing order; the rank's index in it is its position.
  std::vector<int> group(int rank, std::initializer_list<Axis> axes) const;
  // Which group of that kind `rank` belongs to: 0 .. number of groups - 1.
  int group_index(int rank, std::initializer_list<Axis> axes) const;
  std::vector<int> tp_group(int rank) const { return group(rank, {Axis::tp}); }
  // The data-parallel group (the ep and dp axes), in data-parallel rank order (ep fastest).
  std::vector<int> dp_group(int rank) const { return group(rank, {Axis::ep, Axis::dp}); }
  int data_parallel_size() const { return sizes_.ep * sizes_.dp; }
  // The rank's index in its data-parallel group: ep + EP dp.
  int data_parallel_rank(int rank) const;
  // Every group of that kind, ordered by group index.
  std::vector<std::vector<int>> all_groups(std::initializer_list<Axis> axes) const;

  // Human-readable listing of the TP, DP, PP, CP and EP groups (with EP > 1 also the
  // expert-data-parallel groups).
  std::string describe() const;

 private:
  Sizes sizes_;
};

}  // namespace kiln::parallel
