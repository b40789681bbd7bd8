#pragma once
// Picking the next token from a row of logits, on the host: greedy, or a draw from the softmax at a
// temperature over the top-k tokens. Draws come from kiln's Philox, so a seed reproduces a run.
#include <cstdint>
#include <span>
#include <vector>

namespace kiln::model {

struct SamplingOptions {
  float temperature = 1.0f;  // 0: greedy (the most likely token, the lowest id on ties)
  int top_k = 0;             // draw among the k most likely tokens only; 0: all
  std::uint64_t seed = 0;    // Philox key of the draws
  std::vector<int> stop;     // generation ends after drawing one of these (a chat template's end of turn)
};

// The token drawn from `logits` (one per real vocabulary entry). Draw `draw` reads Philox words
// 2 draw and 2 draw + 1 of stream (seed, offset 0) as one 53-bit uniform; greedy draws nothing.
int sample_token(std::span<const float> logits, const SamplingOptions& options, std::uint64_t draw);

}  // namespace kiln::model
