#pragma once
// A mixture-of-experts MLP: an MLP type (a Mixer) the spec makes in the blocks [model.moe] names.
//
//   router       a linear C -> E, whole on every rank, scoring the experts (ops::moe_route: each
//                token's k best and their gates; the load-balancing loss and z-loss add their
//                gradients in its backward)
//   permute      the tokens' rows grouped by expert (ops::moe_permute), capacity drops per sequence
//   dispatch     the rows to the expert-parallel ranks holding their experts (parallel::ExpertParallel,
//                grouped send/recv; nothing moves on one rank)
//   experts      each an MLP of its own (GELU or SwiGLU as the dense MLP, no biases), all of a rank's
//                run at once as grouped linears over their rows (ops::grouped_linear_*), with expert
//                dropout on their hidden activations
//   combine      the rows back to their ranks, each token's output its experts' outputs weighted by
//                its gates (ops::moe_combine)
//   shared       optional shared experts: a dense MLP every token goes through, added
//
// Tensor parallelism splits each expert's hidden features over the TP group as the dense MLP's
// (expert tensor parallelism = tp): every TP rank routes all N tokens the same way, runs its part
// of every expert, and the combined outputs (partial sums) are summed over the group like a
// row-parallel output, so sequence parallelism works unchanged. Stage `in` is the router up to the
// experts' hidden activations; stage `out` FC2, the return and the combination.
//
// Parameters: `<block>.mlp.router.weight` [E, C], `mlp.experts.fc.weight` [E x fc rows, C] (each
// expert's FC1 [out, in], SwiGLU's gate rows then up rows), `mlp.experts.proj.weight` [E x hidden, C]
// (each expert's FC2 stored [in, out]); with shared experts `mlp.shared.fc/proj.*`. The experts' FC1
// and FC2 are nn::GroupedLinear entities (roles mlp_in and mlp_out): a module may attach its own
// ops::GroupedLinearImpl to them (FP8).
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kiln/model/parts/linear.hpp"
#include "kiln/model/parts/mixer.hpp"
#include "kiln/model/parts/mlp.hpp"
#include "kiln/ops/moe.hpp"
#include "kiln/parallel/expert_parallel.hpp"

namespace kiln::model {

// The experts' activation: GELU (GPT-2's MLP) or SwiGLU (Llama's: FC1 writes [gate | up]).
enum class ExpertActivation { gelu, swiglu };

struct MoeOptions {
  int n_experts = 8;
  int top_k = 2;
  int hidden = 0;  // each expert's hidden width (all TP ranks)
  ExpertActivation activation = ExpertActivation::gelu;
  ops::MoeScore score = ops::MoeScore::softmax;
  bool normalize_gates = true;
  float aux_loss_coeff = 0, z_loss_coeff = 0;
  float bias_update_rate = 0;  // sigmoid scoring: the balancing bias's step
  float capacity_factor = 0;   // 0: dropless
  float expert_dropout = 0;
  float init_std = 0.02f, proj_init_std = 0.02f;
};

class MoeMlp final : public Mixer {
 public:
  // `shared`: the shared experts (made first by the spec, from the same builder), or null.
  MoeMlp(LayerBuilder& b, const MoeOptions& o, std::unique_ptr<Mlp> shared);

  Entity input_linear() const override { return router_.entity(); }
  void declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) override;
  void draw(rng::RngStatesTracker* tracker, float p) override;
  void forward_in(const NormOutput& x, float p) override;
  void forward_out(const TensorView& out_local) override;
  TensorView backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                      float p) override;
  std::size_t scratch_bytes() const override;
  // The active FLOPs: the router, k experts per token and the shared experts.
  double flops_per_token() const override;
  // The experts a token does not meet: (E - k) experts' weights.
  std::int64_t inactive_parameters() const override;
  std::int64_t device_stats() const override { return 2; }
  void bind_device_stats(const TensorView& slot) override { terms_sum_ = slot; }
  void collect_stats(std::span<const float> device, std::vector<float>& sums) override;
  std::size_t end_step(std::span<const float> sums, std::size_t at, const std::string& name,
                       std::vector<std::pair<std::string, double>>& out) override;
  std::vector<float> state() const override { return bias_; }
  void set_state(std::span<const float> values) override;

 private:
  std::int64_t rows() const { return ctx_.N * o_.top_k; }  // R: this rank's choices, in grouped order
  std::int64_t expert_rows() const;                        // the most rows this rank's experts may receive
  std::int64_t fc_local() const;   // FC1's local output width: hidden / tp (x2 for SwiGLU)
  // The experts' row groups and their experts under expert parallelism (ExpertParallel::Plan), else
  // one group per expert (0, null).
  int row_groups() const;
  const std::int32_t* expert_of() const;
  std::int64_t hidden_local() const { return o_.hidden / ctx_.tp.size(); }
  bool gelu() const { return o_.activation == ExpertActivation::gelu; }
  bool dropout_on() const { return o_.expert_dropout > 0 && ctx_.training; }
  bool first_micro_batch() const;
  // The activation of FC1's output, then expert dropout (a forward, or a refill for the backward).
  void activate();
  ops::LinearInput fc2_input() const;  // FC2's input: the activation's output, or its prologue
  ops::MoeDropout dropout_args(const TensorView& t) const;
  // The router losses' coefficients as the kernels take them (per sequence and per token).
  struct LossCoeffs {
    float aux, z;
  };
  LossCoeffs loss_coeffs() const;
  ops::MoeRoute route_args();
  TensorView weight(Entity e, bool grad) const;  // an experts' weight as [local experts, rows, cols]
  // The implementation running a grouped linear: the one a module attached, else the backend's.
  const ops::GroupedLinearImpl& impl(Entity linear) const;

  ModelContext& ctx_;
  MoeOptions o_;
  parallel::ExpertParallel ep_;
  std::unique_ptr<Mlp> shared_;
  ColumnLinear router_;
  Entity fc_{}, proj_{};          // the experts' weights
  Entity fc_linear_{}, proj_linear_{};  // their grouped linears (nn::GroupedLinear)
  std::int64_t capacity_ = 0;  // per sequence and expert; 0: dropless
  // Where the activation's output lives (FC2's implementation may compute it on load: never with
  // expert dropout, which sits between the two), and whether FC1's computes the activation's backward
  // as it loads its output gradient (then dpre_ is not needed).
  ActOutput act_output_ = ActOutput::saved;
  bool dact_on_load_ = false;
  // Saved: the router's logits, scores and lse; each token's experts and gates; the grouping; the
  // experts' input rows and choice ids, FC1's output, the activation's output; the experts' outputs
  // back in grouped order.
  TensorView logits_, scores_, lse_, experts_, gates_, offsets_, row_of_, source_;
  TensorView x_in_, ids_in_, pre_, act_, y_;
  TensorView x_perm_, y_out_;  // with expert parallelism: the rows before dispatch, the outputs before return
  TensorView loss_terms_;      // [2] f32: this forward's load-balancing loss and z-loss
  TensorView terms_sum_;       // [2] f32: their sums over the step's training forwards (the model's)
  TensorView bias_dev_;        // [E] f32: the sigmoid router's balancing bias
  TensorView shared_out_;      // [Nl, C]: the shared experts' output (and input gradient)
  // Backward scratch.
  TensorView dlogits_, dgates_, dy_, dact_, dpre_, dx_in_, drouter_;
  TensorView dy_out_;          // with expert parallelism: the output gradient rows before dispatch
  // A forward's grouping on the host, by global expert, and where its rows went (expert
  // parallelism): read again by its backward, so kept per activation copy (ModelContext::copy: a
  // pipeline schedule runs other micro-batches' forwards in between).
  struct Routing {
    std::vector<std::int32_t> offsets_host;
    parallel::ExpertParallel::Plan plan;
  };
  mutable std::vector<Routing> routing_;
  Routing& routing() const {
    const auto c = static_cast<std::size_t>(ctx_.copy);
    if (routing_.size() <= c) routing_.resize(c + 1);
    return routing_[c];
  }
  rng::PhiloxArgs dropout_rng_;
  std::vector<float> bias_;                 // the balancing bias on the host (the same on every rank)
  bool bias_dirty_ = true;                  // changed since it was copied to the device
  // What the step's training forwards saw: how many (their loss terms are summed in terms_sum_ and
  // read once, by collect_stats: no synchronisation per forward), choices per expert, dropped choices.
  int forwards_ = 0;
  double dropped_ = 0;
  std::vector<double> tokens_;
};

}  // namespace kiln::model
