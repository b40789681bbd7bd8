#pragma once
// A linear layer whose three GEMMs run in FP8, with the contract of ops::LinearForward /
// LinearBackward (bias; GELU epilogue writing pre_gelu; dx with dgelu; dweight, dbias accumulated in
// f32). Device-agnostic: it only calls Fp8Ops.
//
//   forward  out[N, OC]  = x[N, IC] @ W[OC, IC]^T        X = x rowwise,   Y = W rowwise   (E4M3 x E4M3)
//   dgrad    dx[N, IC]   = dout[N, OC] @ W[OC, IC]        X = dout rowwise, Y = W colwise (E5M2 x E4M3 hybrid)
//   wgrad    dW[OC, IC] += dout^T[OC, N] @ x[N, IC]       X = dout colwise, Y = x colwise (E5M2 x E4M3 hybrid)
//
// Scales (per tensor, slots of an Fp8MetaStore): the weight's FP8 copies (rowwise and colwise) are
// made once per weight version and reused by every micro-batch and by the backward pass. The input
// is quantised in the forward pass (rowwise) and again, with the same scale, in the backward pass
// (colwise only), so no FP8 activation is kept between the passes, unless keep_input is set: then
// the forward writes both copies and keeps the colwise one for the backward, which never reads the
// high-precision input (ops::LinearImpl::keeps_input; worth it where the model would otherwise keep
// that input in bf16 only for this layer). The grad_output is quantised once in the backward pass
// into both copies, with its amax and the bias gradient in the same pass, and with the dGELU too
// when the caller hands in the output gradient as ops::DgeluOnLoad, or the SwiGLU's backward with
// ops::DswigluOnLoad (a layer without bias: Fp8Ops::quantize_grouped over one group of rows), or,
// for an LM head, the cross-entropy's gradient made from the logits with ops::XentOnLoad (written
// over the logits first where the scale needs the gradient's amax: current scaling, delayed
// scaling's first step).
// It takes every prologue of ops/prologue.hpp: the input as GeluOnLoad (the input is gelu of the
// pre-activation), SwigluOnLoad (the SwiGLU of FC1's [gate | up] output) or LayerNormOnLoad (a
// LayerNorm output: the forward computes its statistics, then its values while quantising; the
// backward recomputes the values from those statistics while quantising the colwise copy).
//
// Replays: a forward run again on the same input (activation recompute) is called with
// `replay = true`: it quantises with the scale the original forward used (kept in the meta slot:
// no other forward touches this layer's slot in between) and records no amax, so neither current
// nor delayed scaling sees the tensor twice. Nothing here rolls or updates the amax history
// (Fp8MetaStore::update does, once per step), so a recompute can never advance it.
#include <array>
#include <functional>
#include <cstdint>
#include <span>
#include <string>

#include "kiln/fp8/meta.hpp"
#include "kiln/fp8/ops.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/ops/linear_impl.hpp"

namespace kiln::fp8 {

// Scratch memory for the quantised activations and gradients of the linear layers that share one
// Fp8Ops: one buffer, holding a forward's rowwise input, or a backward's two gradient copies and
// transposed input (the layers run one after another on the stream, so these never overlap in
// time). Grows on demand to the largest request.
class Fp8Workspace {
 public:
  explicit Fp8Workspace(Fp8Ops& ops) : ops_(ops) {}
  // At least `bytes`: the lent memory where it is large enough, else an own buffer (growing waits
  // for the work that may still read the old one).
  std::uint8_t* get(std::size_t bytes);
  // Memory that is free whenever these layers run (nn::BlockScratch), used before allocating.
  void lend(void* data, std::size_t bytes) {
    lent_ = static_cast<std::uint8_t*>(data);
    lent_bytes_ = data ? bytes : 0;
  }

 private:
  Fp8Ops& ops_;
  Buffer buf_;
  std::uint8_t* lent_ = nullptr;
  std::size_t lent_bytes_ = 0;
};

class Fp8Linear {
 public:
  // Uses slots first_slot + TensorRole of `meta`; their formats decide the FP8 types.
  Fp8Linear(Fp8Ops& ops, Fp8MetaStore& meta, int first_slot, Fp8Workspace& workspace, const Fp8Recipe& recipe,
            std::string name = "linear", bool keep_input = false);
  // What it takes through prologues (ops::LinearImpl::prologues).
  static constexpr ops::PrologueSet kPrologues = ops::PrologueSet::all();

  // The weight's FP8 copies are remade when `weight_version` differs from the cached one (or the
  // weight is another tensor). Bump the version whenever the weight values change.
  void forward(const ops::LinearForward& a, std::int64_t weight_version, bool replay = false);
  // The same forward in pieces of rows (ops::LinearImpl::forward_pieces): the input quantised once,
  // as forward does, then one GEMM per piece into its `out`, queued(k) after each.
  void forward_pieces(const ops::LinearForward& a, std::int64_t weight_version, bool replay,
                      std::span<const ops::RowsOut> pieces, const ops::PieceQueued& queued);
  // The forward of a sequence-parallel layer (ops::LinearImpl::forward_gathered): this rank's rows
  // `local` quantised with the input scale (current scaling, or delayed scaling's first step: from
  // the amax over the group, g.max), the codes gathered (g.all_gather, one byte an element; or
  // g.gather_pieces, one GEMM a piece of rows as it arrives), the
  // kept colwise copy (keep_input) their transpose. The same codes, scale and product as forward on
  // the gathered input; under delayed scaling this rank's amax is recorded (the step's amax
  // reduction, whose group holds the TP group, makes it the whole input's). a.x is never written:
  // without keep_input the backward is handed the input gathered again.
  void forward_gathered(const ops::LinearForward& a, const TensorView& local, std::int64_t weight_version, bool replay,
                        const ops::RowGather& g);
  void backward(const ops::LinearBackward& a);

  // Makes the weight's FP8 copies from `master` (the weight's f32 master copy) and stores them in
  // the memory of `compute` (its act-precision compute copy: rowwise in the first OC x IC bytes,
  // colwise in the next), for forwards whose weight is that compute copy. The FP8 layer then
  // replaces the compute copy instead of adding to it, so nothing else may read it between the
  // first forward after a weight update and the next update (the optimizer rewrites it).
  void use_master_weight(const TensorView& master, const TensorView& compute);

  // The optimizer's step of the master weight (use_master_weight) and its FP8 copies in one pass
  // (Fp8Ops::adamw_quantize; `u` names the master's grad, m and v, and the hyperparameters; its
  // param and out are filled in here). Under delayed scaling with this weight's scale already
  // known, the copies are written with it and the new weight's amax recorded as the next step's,
  // exactly as the next forward would; they are then the copies of `version`, which that forward
  // reuses. Otherwise (current scaling, no scale yet) the update alone: the forward quantises.
  void update_weight(AdamWQuantizeArgs u, std::int64_t version);

  // ---- a weight made of parts (sharded masters) and gathered as FP8 codes, or held as its rowwise
  //      codes alone (fp8.keep_weight_transpose = false) ----
  // A forward or backward handed a u8 weight [OC, IC] reads it as the weight's rowwise codes, made
  // by quantize_weight_part on every rank with this layer's weight scale and gathered by whoever
  // shards the parameters; the backward transposes them into `scratch` for the data gradient.
  void use_transpose_scratch(Fp8Workspace& scratch) { transposed_ = &scratch; }
  // Whether the weight's scale comes from the weight's own amax now (current scaling, or delayed
  // scaling's first step). Then each part's amax goes into weight_amax() (zeroed here under current
  // scaling), the ranks agree on the largest (Fp8MetaStore::amaxes_now, or amaxes() under delayed
  // scaling), and weight_scale_from_amax() sets the scale, before any part is quantised.
  bool weight_scale_from_tensor() const;
  float* weight_amax();
  void weight_scale_from_amax();
  // A part of the weight (f32 master elements, flat) quantised into `codes` with the weight scale;
  // under delayed scaling with a scale from the history, its amax max-accumulated as this step's
  // (the amax reduction makes it the whole weight's).
  void quantize_weight_part(const TensorView& master_part, void* codes);
  // The optimizer's step of a part of the weight (`u`: the part's f32 master, grad, m and v, flat,
  // or the whole weight [OC, IC]; and the hyperparameters) and its codes in one pass (delayed
  // scaling, the scale known), as update_weight does for a whole weight without its colwise copy.
  void update_weight_part(AdamWQuantizeArgs u, void* codes);

  // Forward on an input its producer already quantised (e.g. a LayerNorm writing FP8): `x.rowwise`
  // [N, IC] in input_slot().format, quantised with *input_slot().scale; under delayed scaling the
  // producer also max-accumulates max|x| into *input_slot().amax. `a.x` still names the
  // high-precision input, which the backward pass reads.
  void forward_quantized(const Fp8TensorView& x, const ops::LinearForward& a, std::int64_t weight_version);

  ScalingSlot slot(TensorRole r) const { return meta_.slot(first_slot_ + static_cast<int>(r)); }
  void invalidate_weight() { cache_.valid = false; }
  bool keeps_input() const { return keep_input_; }
  std::size_t kept_bytes() const { return kept_.bytes(); }  // the kept input copy's memory
  const std::string& name() const { return name_; }

 private:
  // The tensor a forward's or backward's input is given as (the input itself, or what a prologue
  // computes it from: the pre-activation, FC1's output, the LayerNorm's input) and the layer's
  // input shape [N, IC].
  struct Input {
    TensorView x;
    ops::Prologue prologue = ops::Prologue::plain;
    const ops::LayerNormOnLoad* layernorm = nullptr;  // the prologue's statistics and parameters
    std::int64_t N = 0, IC = 0;
    std::string what;  // for errors
  };
  Input input_of(const ops::LinearInput& x, const char* pass) const;
  // quantize(), quantize_gelu() or quantize_swiglu() of a given input (not a LayerNorm's).
  void quantize_input(const Input& in, const Fp8TensorView& out, float* amax);
  // Makes slot s's scale valid for quantising t (or act(gelu(t)), act(swiglu(t))); returns where the
  // quantisation records its amax (nullptr when the amax is already recorded or not wanted).
  float* prepare_scale(const ScalingSlot& s, const TensorView& t, ops::Prologue f = ops::Prologue::plain);
  // The same with the tensor's amax measured by `amax` (max-accumulated into its argument), called
  // only where the scale needs it now.
  float* prepare_scale(const ScalingSlot& s, const std::function<void(float*)>& amax);
  // A forward's weight copies and quantised input (the workspace's rowwise [N, IC] codes).
  TensorView quantize_forward(const ops::LinearForward& a, std::int64_t weight_version, bool replay);
  void prepare_forward_weight(const TensorView& w, std::int64_t weight_version, bool replay);
  void ensure_weight(const TensorView& w, std::int64_t version);
  void* kept_input(std::int64_t rows, std::int64_t cols);  // the keep_input buffer, sized for [rows, cols]
  bool weight_cached(const TensorView& w) const;
  void gemm_forward(const TensorView& xq, const ops::LinearForward& a);
  Fp8TensorView view(const ScalingSlot& s, void* rowwise, void* colwise, std::int64_t rows, std::int64_t cols) const;

  Fp8Ops& ops_;
  Fp8MetaStore& meta_;
  int first_slot_;
  Fp8Workspace& ws_;
  Fp8Recipe recipe_;
  std::string name_;
  bool keep_input_ = false;
  Buffer kept_;               // keep_input: the colwise input copy [IC, N] of the last forward
  std::int64_t kept_rows_ = 0, kept_cols_ = 0;
  TensorView master_, compute_;  // use_master_weight
  Fp8Workspace* transposed_ = nullptr;  // use_transpose_scratch
  struct WeightCache {
    void* rowwise = nullptr;  // [OC, IC]
    void* colwise = nullptr;  // [IC, OC]
    Buffer own_rowwise, own_colwise;  // where they live unless in the compute copy
    bool valid = false;
    std::int64_t version = 0;
    const void* source = nullptr;
    std::int64_t rows = 0, cols = 0;
  } cache_;
};

}  // namespace kiln::fp8
