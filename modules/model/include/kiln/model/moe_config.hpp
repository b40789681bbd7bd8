#pragma once
// [model.moe]: mixture-of-experts MLPs (n_experts > 0) in every `every`-th block, dense MLPs
// elsewhere. The experts' activation is the architecture's (GELU for gpt2, SwiGLU for llama); each
// expert is that MLP without biases, of width `hidden`.
#include <boost/describe/enum.hpp>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"

namespace kiln::model {

// How the router scores the experts (ops::MoeScore): softmax over them (Mixtral, Qwen-MoE), or a
// sigmoid per expert with a balancing bias that steers the choice (DeepSeek-V3).
enum class MoeRouter { softmax, sigmoid };
BOOST_DESCRIBE_ENUM(MoeRouter, softmax, sigmoid)

struct MoeConfig {
  int n_experts = 0;
  int top_k = 2;
  int every = 1;
  int hidden = 0;
  int shared_experts = 0;
  MoeRouter router = MoeRouter::softmax;
  bool normalize_gates = true;
  float aux_loss_coeff = 0.01f;
  float z_loss_coeff = 0.001f;
  float bias_update_rate = 0.001f;
  float capacity_factor = 0.0f;
  float expert_dropout = 0.0f;
  bool enabled() const { return n_experts > 0; }
  // Whether block `block` (0-based) has a mixture of experts.
  bool in_block(int block) const { return enabled() && block % every == 0; }
  void validate(config::Checks& c) const {
    c.expect(n_experts >= 0, "n_experts", "must be 0 (dense MLPs) or a number of experts");
    c.expect(n_experts == 0 || (top_k >= 1 && top_k <= n_experts), "top_k", "must be in [1, n_experts]");
    c.expect(every >= 1, "every", "must be at least 1");
    c.expect(hidden >= 0, "hidden", "must be 0 (the dense MLP's width) or positive");
    c.expect(shared_experts >= 0, "shared_experts", "must not be negative");
    c.expect(aux_loss_coeff >= 0, "aux_loss_coeff", "must not be negative");
    c.expect(z_loss_coeff >= 0, "z_loss_coeff", "must not be negative");
    c.expect(bias_update_rate >= 0, "bias_update_rate", "must not be negative");
    c.expect(capacity_factor == 0 || capacity_factor > 0, "capacity_factor", "must be 0 (dropless) or positive");
    c.expect(expert_dropout >= 0 && expert_dropout < 1, "expert_dropout", "must be in [0, 1)");
  }
};
KILN_CONFIG(MoeConfig,
            (n_experts, "routed experts per mixture-of-experts MLP (0: every MLP dense)"),
            (top_k, "experts each token is routed to"),
            (every, "a mixture of experts in blocks 0, every, 2 every, ... (dense MLPs in the others)"),
            (hidden, "each expert's hidden width (0: the dense MLP's, model.ffn_hidden or its default)"),
            (shared_experts,
             "experts every token goes through besides its routed ones (DeepSeek, Qwen2-MoE): one dense MLP of "
             "shared_experts x hidden, split over TP like the dense MLP"),
            (router,
             "softmax: the k best of the softmax over the experts (Mixtral, Qwen-MoE); sigmoid: the k best of "
             "per-expert sigmoid scores plus a balancing bias that only steers the choice (DeepSeek-V3's "
             "aux-loss-free balancing)"),
            (normalize_gates,
             "divide each token's gates by their sum (Mixtral, DeepSeek-V3); false: the raw scores (Qwen1.5-MoE)"),
            (aux_loss_coeff,
             "the load-balancing loss's weight: Switch Transformer's E sum_e f_e P_e taken per sequence and "
             "averaged over the batch's sequences (Megatron-Core's seq_aux_loss); 0: none"),
            (z_loss_coeff, "the router z-loss's weight (ST-MoE: the mean over tokens of the squared log-sum-exp of the "
                           "router's logits); 0: none"),
            (bias_update_rate,
             "sigmoid router: after each step every expert's bias moves by this much towards balance (up if the "
             "expert took fewer than the mean of the global batch's choices, down if more; DeepSeek-V3's gamma)"),
            (capacity_factor,
             "0: dropless; else each expert takes at most ceil(capacity_factor x seq_len x top_k / n_experts) of "
             "each sequence's choices, the earliest first (the rest are dropped and counted; capacity per sequence "
             "keeps the drops the same on any split of the batch over ranks)"),
            (expert_dropout,
             "dropout on the experts' hidden activations (Switch Transformer's expert dropout), drawn from the "
             "expert-parallel RNG state"))

}  // namespace kiln::model
