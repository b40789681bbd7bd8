#pragma once
// log.sample_every: text generated from the training weights (rank 0, whole model).
#include <string>

#include "kiln/engine/world.hpp"
#include "kiln/model/config.hpp"
#include "kiln/train/train.hpp"

namespace kiln::model {

// On rank 0: `e.tokens` tokens after `e.prompt`, sampled (temperature 1, seeded by train.seed and the
// step) with a Generator on this rank's backend; "" on other ranks. Byte-level vocabularies
// (vocab_size <= 256) encode the prompt and decode the text (bytes that are not printable
// ASCII as '?'); others start from token 0 (GPT-2's
// <|endoftext|> where the vocabulary has it) and print token ids.
std::string sample_text(World& w, const ModelConfig& cfg, const train::SampleRequested& e);

}  // namespace kiln::model
