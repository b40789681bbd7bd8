#pragma once
// Which parts of which global tensors this rank holds in its held buffers (nn::ParamStore's layout:
// the master weights and every buffer laid out like them), and which of those it writes: every
// part is written by exactly one rank of those holding an identical copy.
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/checkpoint/pieces.hpp"
#include "kiln/engine/world.hpp"
#include "kiln/ops/backend.hpp"

namespace kiln::checkpoint {

struct HeldTensor {
  std::string name;                 // "<family>/<parameter>"
  std::vector<std::int64_t> shape;  // global
  int family = 0;                   // index into the families held_tensors was given
  std::int64_t held = 0;            // the held element of the parameter's local element `first`
  std::int64_t first = 0;
  std::vector<LocalPiece> pieces;   // the parameter's held part, as pieces of the global tensor
  bool writes = false;              // this rank writes it
  // The held element of a piece's first element.
  std::int64_t held_at(const LocalPiece& p) const { return held + (p.local - first); }
};

// The held parts of every parameter in each family (families[i] names family i), in family then
// parameter order. Writers: a part replicated over tensor-parallel ranks is written by TP rank 0;
// a part replicated over data-parallel replicas (plain DP, or hybrid FSDP's replica groups) by one
// replica, the parts spread over the replicas by size so each writes a similar share.
std::vector<HeldTensor> held_tensors(World& w, const std::vector<std::string>& families);

// A held buffer (f32, or bf16: optim.moments) into / from its f32 slot of host staging memory. A
// checkpoint holds f32 whatever the run holds: bf16 values widen exactly, and f32 values load into
// bf16 rounded to nearest even, as the optimizer would store them. The conversion runs in place in
// the slot (no second buffer the size of the state).
void held_to_host(ops::Backend& be, float* slot, const TensorView& held);
void held_from_host(ops::Backend& be, const TensorView& held, float* slot);

}  // namespace kiln::checkpoint
