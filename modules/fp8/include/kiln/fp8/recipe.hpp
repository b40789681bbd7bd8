#pragma once
// Scaling recipes: how the scale of each FP8 tensor is chosen.
//  - delayed: each tensor keeps a history of its amax over the last `history_len` steps; it is
//    quantised with a scale computed from that history (fp8_max / amax / 2^margin), and its amax
//    of this step is recorded for the next update, which runs once per step.
//  - current: the amax of the tensor is computed when it is quantised and used at once.
//  - block: a scale per 1x128 block of activations and gradients and per 128x128 block of weights,
//    from each block's own amax (block.hpp, Fp8BlockLinear): no history, no per-tensor state.
// Which format each tensor gets: "hybrid" uses E4M3 for activations and weights (forward) and
// E5M2 for gradients (backward); "e4m3" uses E4M3 everywhere.
#include <boost/describe/enum.hpp>
#include <cstdint>

#include "kiln/fp8/format.hpp"

namespace kiln::fp8 {

enum class RecipeKind { delayed, current, block };
BOOST_DESCRIBE_ENUM(RecipeKind, delayed, current, block)

enum class AmaxAlgo { max, most_recent };
BOOST_DESCRIBE_ENUM(AmaxAlgo, max, most_recent)

enum class FormatPolicy { hybrid, e4m3 };
BOOST_DESCRIBE_ENUM(FormatPolicy, hybrid, e4m3)

// The three FP8 tensors of a linear layer, in the order of its meta slots.
enum class TensorRole : std::uint8_t { input = 0, weight = 1, grad_output = 2 };
inline constexpr int kRolesPerLinear = 3;

constexpr Format format_for(FormatPolicy p, TensorRole r) {
  return p == FormatPolicy::hybrid && r == TensorRole::grad_output ? Format::e5m2 : Format::e4m3;
}

struct Fp8Recipe {
  RecipeKind kind = RecipeKind::delayed;
  int history_len = 1024;
  AmaxAlgo algo = AmaxAlgo::max;
  int margin = 0;
  FormatPolicy format = FormatPolicy::hybrid;
  bool fast_accum_forward = true;  // backward GEMMs always accumulate with periodic f32 promotion
};

}  // namespace kiln::fp8
