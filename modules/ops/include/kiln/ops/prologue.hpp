#pragma once
// How a linear layer's operands reach it: its input (and, in the backward pass, its output
// gradient) as the tensor itself, or as a tensor the layer computes the operand from while it loads
// it (a prologue), so that the model neither writes nor keeps the operand. The backends' linear ops
// take the tensors themselves; an ops::LinearImpl says which prologues it takes as one set
// (LinearImpl::prologues), and the model hands it no other.
#include <cstdint>
#include <initializer_list>
#include <variant>

#include "kiln/tensor/tensor.hpp"

namespace kiln::ops {

// input[r, c] = act(layernorm_apply(x[r, c], mean[r], rstd[r], weight[c], bias[c])) (formulas.hpp),
// the values layernorm_forward writes. A forward computes the statistics too and writes them to
// mean and rstd, as layernorm_forward would; a backward reads the forward's.
struct LayerNormOnLoad {
  TensorView x;       // [N, IC] act: the normalised rows
  TensorView weight;  // [IC] act
  TensorView bias;    // [IC] act
  TensorView mean;    // [N] f32
  TensorView rstd;    // [N] f32
  float eps = 1e-5f;
};
// input = gelu(pre), the values gelu_forward would store.
struct GeluOnLoad {
  TensorView pre;  // [N, IC] act
};
// input = swiglu(gate_up), the values swiglu_forward would store (gate columns, then up columns).
struct SwigluOnLoad {
  TensorView gate_up;  // [N, 2 IC] act
};
// A linear layer's input: the tensor [N, IC] act itself, or one of the prologues above.
using LinearInput = std::variant<TensorView, LayerNormOnLoad, GeluOnLoad, SwigluOnLoad>;

// The output gradient of a linear layer whose output is a GELU's pre-activation, given as the
// gradient with respect to the GELU's output: the layer multiplies it by gelu'(pre) as it loads it
// (and may overwrite `dgelu` with the product).
struct DgeluOnLoad {
  TensorView dgelu;  // [N, OC] act: d loss / d gelu(out)
  TensorView pre;    // [N, OC] act: the forward's output
};
// The output gradient of a linear layer whose output is a SwiGLU's input (gate columns, then up
// columns), given as the gradient with respect to the SwiGLU's output: the layer computes the
// gradient with respect to its output as it loads it, the values swiglu_backward would store.
struct DswigluOnLoad {
  TensorView dswiglu;  // [N, OC / 2] act: d loss / d swiglu(out)
  TensorView gate_up;  // [N, OC] act: the forward's output
};
// The output gradient of an LM head, whose logits feed the softmax cross-entropy, given as the logits
// and each row's logsumexp (CrossEntropyFinish with write_dlogits false): the layer computes
// dlogits = xent_grad(logit, lse, column is the target's, dloss) (formulas.hpp), rounded to act,
// 0 in the padded columns and in ignored rows (target -1), as it loads them (and may overwrite the
// logits with them): the values the loss would otherwise have written over the logits.
struct XentOnLoad {
  TensorView logits;   // [N, V] act: this rank's columns of the (padded) vocabulary
  TensorView lse;      // [N] f32
  TensorView targets;  // [N] i32 on the device
  std::int64_t vocab_begin = 0;  // the vocabulary index of the logits' first column
  int vocab_real = 0;            // real (unpadded) size of the whole vocabulary
  float dloss = 1;
};
// A backward's output gradient: the tensor [N, OC] act itself, DgeluOnLoad, DswigluOnLoad or XentOnLoad.
using OutputGrad = std::variant<TensorView, DgeluOnLoad, DswigluOnLoad, XentOnLoad>;

// The prologues by name, one per alternative above (plain: the tensor itself).
enum class Prologue : std::uint8_t { plain, layernorm, gelu, swiglu, dgelu, dswiglu, xent };
Prologue prologue_of(const LinearInput& x);
Prologue prologue_of(const OutputGrad& dout);
const char* name_of(Prologue p);  // "plain", "layernorm-on-load", ...

// A set of prologues: what an implementation takes, in its forward and backward passes alike.
class PrologueSet {
 public:
  constexpr PrologueSet(std::initializer_list<Prologue> ps) {
    for (Prologue p : ps) bits_ |= bit(p);
  }
  static constexpr PrologueSet all() {
    return {Prologue::plain, Prologue::layernorm, Prologue::gelu,
            Prologue::swiglu, Prologue::dgelu, Prologue::dswiglu, Prologue::xent};
  }
  constexpr bool has(Prologue p) const { return (bits_ & bit(p)) != 0; }

 private:
  static constexpr unsigned bit(Prologue p) { return 1u << static_cast<unsigned>(p); }
  unsigned bits_ = 0;
};

// The plain tensor of an operand, or an empty view where it comes through a prologue.
inline TensorView plain_tensor(const LinearInput& x) {
  const auto* t = std::get_if<TensorView>(&x);
  return t ? *t : TensorView{};
}
inline TensorView plain_tensor(const OutputGrad& g) {
  const auto* t = std::get_if<TensorView>(&g);
  return t ? *t : TensorView{};
}

}  // namespace kiln::ops
