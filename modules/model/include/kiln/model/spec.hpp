#pragma once
// What a model is made of, chosen once from the configuration (as Megatron-Core builds a
// TransformerLayer from a layer spec): every block's norm, attention and MLP type with their
// options, and the embedding's positions. This is where the model's code reads model.arch (beside
// the config's defaults and the Hugging Face GPT-2 conversion); the parts and the model never ask
// which architecture they are in. A new architecture is a new spec here, a new
// norm or MLP a new part type (docs/ARCHITECTURE.md: "Adding an architecture").
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kiln/model/config.hpp"
#include "kiln/model/parts/attention.hpp"
#include "kiln/model/parts/mlp.hpp"
#include "kiln/model/parts/moe.hpp"
#include "kiln/model/parts/norm.hpp"
#include "kiln/model/parts/output_head.hpp"
#include "kiln/parallel/tensor_parallel.hpp"

namespace kiln::model {

enum class NormKind { layernorm, rmsnorm };
enum class MlpKind { gelu, swiglu };
enum class Positions { learned, rotary };

struct ModelSpec {
  NormKind norm = NormKind::layernorm;
  Positions positions = Positions::learned;
  AttentionOptions attention;  // rotary embeddings there with Positions::rotary
  MlpKind mlp = MlpKind::gelu;
  MlpOptions mlp_options;
  // Mixture-of-experts MLPs in blocks 0, moe_every, 2 moe_every, ... (none: every MLP dense); the
  // experts' activation follows `mlp`, and with shared_experts > 0 a dense MLP of shared_experts x
  // the experts' width (no biases) goes beside them.
  std::optional<MoeOptions> moe;
  int moe_every = 1;
  int shared_experts = 0;
  bool tie_embeddings = true;
  // The LM head's rows a chunk (ChunkedLossHead), or 0: the whole micro-batch (LogitsHead).
  std::int64_t head_chunk_rows = 0;

  // The parts, registering their parameters through `b` (in the order they are made).
  std::unique_ptr<Norm> make_norm(LayerBuilder& b, const std::string& name, Norm::Output output) const;
  std::unique_ptr<Mixer> make_attention(LayerBuilder& b) const;
  // Block `block`'s MLP: a mixture of experts where the spec has one for that block, else dense.
  std::unique_ptr<Mixer> make_mlp(LayerBuilder& b, int block) const;
  // The final norm, LM head and loss (`tied`: the token embedding's table, the head's weight).
  std::unique_ptr<OutputHead> make_head(LayerBuilder& b, std::optional<Entity> tied) const;
  // The dense MLP of this spec's kind with options `o`.
  std::unique_ptr<Mlp> make_dense_mlp(LayerBuilder& b, const MlpOptions& o) const;
  // The norms' parameter names: "<stem><name>.weight" ("ln_1.weight", "norm_f.weight", ...).
  const char* norm_stem() const;
  // FC1's output rows per hidden feature: 1 (GELU), 2 (SwiGLU's gate and up).
  int mlp_in_parts() const { return mlp == MlpKind::swiglu ? 2 : 1; }
};

// The spec of model.arch: gpt2 (LayerNorm, learned positions, multi-head attention, GELU MLP,
// biases) or llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases).
ModelSpec model_spec(const ModelConfig& cfg);

// Model FLOPs per token of block `block` and of the head (as the parts count them: 6 per weight
// element, 12 T C for a block's attention scores), from the configuration alone: what a pipeline's
// balanced split weighs (parallel::balanced_split).
double block_flops_estimate(const ModelConfig& cfg, int T, int block);
double head_flops_estimate(const ModelConfig& cfg);

// What the model splits over the tensor-parallel group, each dimension with the key that sets it:
// the heads, the key/value heads, the MLP's hidden width, and (flags as parallel::ParallelState
// resolves them) the tokens of a micro-batch under sequence parallelism and the padded vocabulary
// under vocabulary parallelism. The model module checks them as config errors at install; the
// model requires them again.
std::vector<parallel::SplitDim> tensor_parallel_splits(const ModelConfig& cfg, std::int64_t tokens,
                                                       bool sequence_parallel, bool vocab_parallel);

}  // namespace kiln::model
