#pragma once
// The token embedding (split by vocabulary rows over the TP group under vocabulary parallelism),
// with a learned position table where the spec has one (GPT-2; rotary positions live in attention).
#include <cstdint>
#include <optional>

#include "kiln/model/parts/layer_builder.hpp"
#include "kiln/parallel/vocab_parallel.hpp"

namespace kiln::model {

class Embedding {
 public:
  // wte [padded vocabulary, C] and, with learned positions, wpe [max_seq_len, C].
  Embedding(LayerBuilder b, bool learned_positions);

  Entity token_table() const { return wte_; }  // the tied LM head's weight
  // The token table as a parameter of another stage's unit (pipeline parallelism: the last stage's
  // tied LM head), named, shaped, split and drawn as the embedding's own.
  static Entity table_copy(LayerBuilder& b);
  // out_local [Nl, C] = the tokens' rows (+ positions).
  void forward(const TensorView& tokens, const TensorView& out_local) const;
  // The tables' gradients from this rank's rows of the output's gradient.
  void backward(const TensorView& tokens, const std::int32_t* tokens_host, const TensorView& dout_local) const;

 private:
  TensorView tensor(Entity e, bool grad) const;

  ModelContext& ctx_;
  parallel::VocabParallelEmbedding layer_;
  Entity wte_{};
  std::optional<Entity> wpe_;
};

}  // namespace kiln::model
