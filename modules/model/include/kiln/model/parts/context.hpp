#pragma once
// What every part of a model shares (one per model): the World, the configuration, the backend, the
// tensor-parallel group, the micro-batch's shapes, the step's place in the global batch, and the
// working tensors of the residual stream that every block uses in turn.
#include <cstdint>

#include "kiln/engine/world.hpp"
#include "kiln/model/config.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/grouped_linear_impl.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/tensor_parallel.hpp"
#include "kiln/rng/philox.hpp"

namespace kiln::model {

// The residual stream's working tensors, one of each per model (in its activation table). Outside
// the tensor-parallel regions a rank holds Nl token rows (N / tp under sequence parallelism, else N).
struct StreamTensors {
  TensorView row_out;  // [N, C]: a row-parallel linear's output before its sum over the TP group
  TensorView local;    // [Nl, C]: a norm's rows before they are gathered, a row-parallel sum's rows
  TensorView full;     // [N, C]: gathered rows (the embedding's lookup, a row-parallel output gradient)
  TensorView col_dx;   // [N, C]: a column-parallel linear's input gradient before its sum over TP
  // The gradient a mixer is given is, under sequence parallelism, this rank's rows of `full` (its
  // row-parallel backward gathers the others' there): dres without dropout, ddrop with it.
  TensorView dres;   // [Nl, C]: the residual stream's gradient
  TensorView ddrop;  // [Nl, C]: the gradient through dropout (only with model.dropout > 0)
  // The rows a column-parallel linear's input gradient is summed into: `local` under sequence
  // parallelism, else col_dx itself.
  TensorView col_dx_local(bool sequence_parallel) const { return sequence_parallel ? local : col_dx; }
};

struct ModelContext {
  ModelContext(World& world, const ModelConfig& cfg, ops::Backend& be, parallel::TensorParallel tp, int B, int T,
               std::int64_t batch_sequences);

  World& world;
  ModelConfig cfg;
  ops::Backend& be;
  parallel::TensorParallel tp;
  int B, T;
  std::int64_t N;                // tokens of a micro-batch, B T
  std::int64_t Nl;               // this rank's token rows outside the TP regions
  std::int64_t batch_sequences;  // sequences of the step's global batch (all ranks and micro-batches)
  std::int64_t seq_offset = 0;   // the global index of the current micro-batch's first sequence
  TensorView doc_start;          // [B, T] i32 of the current micro-batch (packed documents), or empty
  bool training = false;         // the current forward is a training one (not an evaluation)
  int copy = 0;                  // the activation copy of the current micro-batch (ActivationTable::select_copy)
  ops::LinearImpl backend_linear;  // the backend's linear ops, for linears no module replaced
  ops::GroupedLinearImpl backend_grouped_linear;  // and its grouped ones
  StreamTensors stream;

  // Dropout with probability p on this rank's rows of the step's [batch tokens, C] hidden states.
  ops::DropoutArgs hidden_dropout(float p, const rng::PhiloxArgs& r) const;
  // A parameter's compute weights (or its gradient accumulation), wherever they are now (nn::ParamStore).
  TensorView param(Entity e, bool grad) const;
  DType act() const { return be.act_dtype(); }
};

}  // namespace kiln::model
