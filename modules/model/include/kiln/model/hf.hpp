#pragma once
// The model's configuration as kiln::interop's Hugging Face layouts take it (interop knows no model).
#include "kiln/interop/hf_gpt2.hpp"
#include "kiln/model/config.hpp"

namespace kiln::model {

// A GPT-2 model's shape (model.arch = gpt2; another architecture is an error naming it).
interop::Gpt2Shape gpt2_shape(const ModelConfig& cfg);
// `base` with the shape's n_layer, n_head, n_embd, vocab_size, max_seq_len and norm_eps (a GPT-2).
ModelConfig with_gpt2_shape(ModelConfig base, const interop::Gpt2Shape& shape);

}  // namespace kiln::model
