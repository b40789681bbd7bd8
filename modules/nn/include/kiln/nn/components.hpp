#pragma once
// Components the model attaches to its entities. Other modules add their own components to the same
// entities (FP8 meta on Linear entities, shard specs on parameters, recompute policies on layers)
// without the model knowing them.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <boost/describe/enum.hpp>

#include "kiln/engine/world.hpp"
#include "kiln/tensor/shard.hpp"
#include "kiln/tensor/tensor.hpp"

namespace kiln::nn {

// A parameter: where it lives in the flat buffers and how it is initialised.
struct Param {
  std::string name;          // e.g. "blocks.3.mlp.fc.weight"
  Shape shape;               // what this rank holds
  Shape global_shape;        // the logical tensor (equal to shape unless sharded)
  TensorShard shard;
  std::int64_t offset = 0;   // element offset in ParamStore's flat buffers (aligned)
  std::int64_t numel = 0;
  bool weight_decay = false;  // matrices decay; biases, norms and position embeddings do not
  float init_std = 0;         // > 0: normal(0, init_std); else the constant init_value
  float init_value = 0;
  int unit = 0;               // the layer (FSDP unit) owning it: 0 embeddings, 1..L blocks, L+1 final norm
  // Replicated over the TP group but computed from this rank's rows only (sequence parallelism):
  // each rank's gradient is a partial sum, to be summed over the TP group once per step.
  bool tp_partial_grad = false;
  // Split over the expert-parallel group (a mixture of experts' weights under parallel.ep > 1): the
  // ranks holding the same part are the expert-data-parallel group, which sums its gradient (the
  // other data-parallel ranks hold other experts).
  bool expert_parallel = false;
};

// On a Param: another module applies the optimizer's update to this parameter, fused with its own
// pass over it (the fp8 module writes a weight's FP8 copies while updating it). The optimizer leaves
// the parameter alone and publishes AdamWStep (events.hpp) with everything the update needs.
struct UpdatedBy {
  std::string module;
};

// On a Param: its compute copy is one byte per element (an FP8 weight's codes; the module that
// attaches it writes this rank's bytes and reads the gathered ones). A sharded store lays such
// parameters out apart in each unit and gathers their compute copy as bytes (half of bf16's);
// unsharded stores ignore it unless told to keep the codes apart (ParamStore::keep_codes_apart).
struct ByteCompute {};

// On a Param: its gradient has one producer, a linear layer's weight gradient, which writes it on a
// step's first micro-batch (LinearBackward::dweight_overwrite) and adds to it on the others; the
// step's gradient zeroing leaves it out.
struct GradWrittenFirst {};

// On a Param held by two pipeline stages (the token embedding of the first, which the last stage's
// tied LM head multiplies by, as Megatron-LM keeps it): `peer` is the other stage's pipeline rank.
// Both copies start from the same draws and have their gradients summed each step (the parallel
// module), so they take the same updates. On the last stage's copy `copy` is set: sums over all
// parameters (the gradient's norm), parameter counts and checkpoints count the first stage's only.
struct TiedAcrossStages {
  int peer = 0;
  bool copy = false;
};

enum class LayerKind { embedding, block, final_norm };

// A layer: a unit of forward/backward and of parameter sharding.
struct Layer {
  int unit = 0;       // 0 .. L+1
  int block = -1;     // block index for LayerKind::block
  LayerKind kind = LayerKind::block;
  std::vector<Entity> params;
};

// What a linear layer does in the network, so modules pick layers by type (the fp8 module runs the
// block linears in FP8, and the LM head only when asked). The names read the same for every
// architecture: a GPT-2 MLP's FC1 and a SwiGLU's fused gate/up projection are both mlp_in.
enum class LinearRole {
  qkv,       // attention: the fused query/key/value projection (column-parallel)
  attn_out,  // attention: the output projection (row-parallel)
  mlp_in,    // MLP: the up projection(s) (column-parallel)
  mlp_out,   // MLP: the down projection (row-parallel)
  lm_head,   // the output layer giving the logits
  router,    // a mixture of experts' router (the experts' scores; whole on every rank)
};
BOOST_DESCRIBE_ENUM(LinearRole, qkv, attn_out, mlp_in, mlp_out, lm_head, router)
// Whether the layer is one of a transformer block's projections (the router is not: modules that
// transform the projections, such as FP8, leave the routing decision alone).
inline bool in_block(LinearRole r) { return r != LinearRole::lm_head && r != LinearRole::router; }

// A linear layer (a GEMM): weight [out, in] and optional bias.
struct Linear {
  LinearRole role = LinearRole::qkv;
  int unit = 0;
  Entity weight{};
  std::optional<Entity> bias;
  int in = 0, out = 0;  // this rank's part (tensor parallelism splits one of them)
  // The model stores this layer's input for the backward pass for this layer alone (no recompute,
  // no other reader): an implementation that keeps its own copy of the input instead
  // (ops::LinearImpl::keeps_input) then saves the model that memory.
  bool input_stored_for_backward = false;
};

// A grouped linear layer: one linear per expert of a mixture of experts (grouped GEMMs), its weight
// the experts' stacked [experts x out, in] (an FC1's) or, with weight_in_out, [experts x in, out] (an
// FC2's stored input-major). Counts are this rank's: its experts and its part of each one's features.
struct GroupedLinear {
  LinearRole role = LinearRole::mlp_in;
  int unit = 0;
  Entity weight{};
  int experts = 0, in = 0, out = 0;
  bool weight_in_out = false;
  bool input_stored_for_backward = false;  // as Linear's (ops::GroupedLinearImpl::keeps_input)
};

// World resource the model provides once it has allocated its activations (Phase::setup): memory
// it does not use while the transformer blocks run, forward, backward or recomputed. (GptModel lends
// its logits buffer, which lives only from the LM head's forward to the LM head's backward.) Work
// inside a block may use it as scratch.
struct BlockScratch {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// Activation recompute of one layer (attached to its Layer entity by the activation_checkpoint
// module, before the model allocates activation memory in Phase::setup). The model keeps the
// layer's input and what `scope` leaves out, and in the backward pass recomputes the rest between
// LayerRecomputeBegin and LayerRecomputeEnd, drawing its random numbers again from the RNG tracker
// (whoever attaches this component restores the tracker's states around the recompute).
enum class RecomputeScope {
  none,
  attention,  // LayerNorm 1, the QKV GEMM and the attention core (qkv, attention output, lse)
  mlp,        // LayerNorm 2 and FC1 with its GELU (the MLP's 4C-wide activations)
  full,       // everything but the layer's input
};
struct ActivationRecompute {
  RecomputeScope scope = RecomputeScope::full;
  bool distribute_input = false;  // keep this TP rank's 1/tp of the input rows; all-gather before recomputing
};

// Activation offload of one layer (attached to its Layer entity by the activation_offload module, before
// the model allocates activation memory in Phase::setup; never together with ActivationRecompute). The
// layer's saved activations live in device copy `slot` of the few that the offloaded layers take in
// turn; the model fills `region` with that copy's memory (one contiguous tensor) once it has allocated
// it, and the module moves the region to host memory after the layer's forward pass and back before
// its backward pass.
struct ActivationOffload {
  int slot = 0;
  TensorView region;
};

}  // namespace kiln::nn
