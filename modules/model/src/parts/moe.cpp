// MoeMlp: the router, the grouping, the dispatch to the experts' ranks, the grouped experts, the
// return and the combination (moe.hpp).
#include "kiln/model/parts/moe.hpp"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::model {

namespace {
parallel::ExpertParallel make_expert_parallel(ModelContext& ctx, int n_experts) {
  return parallel::expert_parallel(ctx.world, ctx.be, n_experts);
}
}  // namespace

MoeMlp::MoeMlp(LayerBuilder& b, const MoeOptions& o, std::unique_ptr<Mlp> shared)
    : ctx_(b.ctx()),
      o_(o),
      ep_(make_expert_parallel(ctx_, o.n_experts)),
      shared_(std::move(shared)),
      // The router: whole on every rank (the experts' scores are not split; its input is every row).
      router_(b, "mlp.router", nn::LinearRole::router,
              parallel::ColumnParallelLinear(ctx_.tp, ctx_.cfg.n_embd, o.n_experts, 1, /*split=*/false), false,
              o.init_std) {
  const std::int64_t E = o.n_experts, C = ctx_.cfg.n_embd, H = o.hidden;
  ctx_.tp.require({H, "model.moe.hidden", "expert hidden features (model.moe.hidden, or the dense MLP's width)"});
  // Each expert's FC1 rows: GELU's hidden, or SwiGLU's gate and up, each split over TP; FC2 stored
  // [hidden, C] per expert, its hidden rows split the same way.
  const std::vector<std::int64_t> fc_parts = gelu() ? std::vector<std::int64_t>{H} : std::vector<std::int64_t>{H, H};
  const std::int64_t fc_rows = gelu() ? H : 2 * H;
  auto expert_param = [&](const char* name, std::int64_t rows_per_expert, const std::vector<std::int64_t>& parts,
                          float std) {
    const Entity e = b.param(b.prefix() + name, {E * rows_per_expert, C}, parallel::expert_row_shard(ctx_.tp, ep_, parts),
                             ParamInit::normal(std), true);
    auto& p = ctx_.world.get<nn::Param>(e);
    p.expert_parallel = ep_.size() > 1;
    ctx_.world.emplace<nn::GradWrittenFirst>(e);  // the grouped linears write them on a step's first micro-batch
    return e;
  };
  fc_ = expert_param("mlp.experts.fc.weight", fc_rows, fc_parts, o.init_std);
  proj_ = expert_param("mlp.experts.proj.weight", H, {H}, o.proj_init_std);
  const int El = ep_.local_experts();
  fc_linear_ = b.grouped_linear(b.prefix() + "mlp.experts.fc",
                                {.role = nn::LinearRole::mlp_in, .weight = fc_, .experts = El,
                                 .in = static_cast<int>(C), .out = static_cast<int>(fc_local()),
                                 .input_stored_for_backward = true});  // the experts' input rows: for FC1 alone
  proj_linear_ = b.grouped_linear(b.prefix() + "mlp.experts.proj",
                                  {.role = nn::LinearRole::mlp_out, .weight = proj_, .experts = El,
                                   .in = static_cast<int>(hidden_local()), .out = static_cast<int>(C),
                                   .weight_in_out = true,
                                   // FC2's input (the activation's output) is stored for it alone
                                   .input_stored_for_backward = !ctx_.cfg.recompute_gelu});
  if (o.capacity_factor > 0)
    capacity_ = static_cast<std::int64_t>(
        std::ceil(static_cast<double>(o.capacity_factor) * ctx_.T * o.top_k / static_cast<double>(E)));
  if (o.score == ops::MoeScore::sigmoid) bias_.assign(static_cast<std::size_t>(E), 0.0f);
  tokens_.assign(static_cast<std::size_t>(E), 0.0);
}

int MoeMlp::row_groups() const { return ep_.size() > 1 ? routing().plan.groups() : 0; }

const std::int32_t* MoeMlp::expert_of() const {
  return ep_.size() > 1 ? routing().plan.expert_of.data() : nullptr;
}

std::int64_t MoeMlp::fc_local() const { return (gelu() ? 1 : 2) * hidden_local(); }

std::int64_t MoeMlp::expert_rows() const {
  if (ep_.size() == 1) return rows();
  // Every rank of the group may send all its choices here: dropless reserves for that; with a
  // capacity each local expert takes at most `capacity` of each of the group's sequences.
  const std::int64_t all = rows() * ep_.size();
  if (capacity_ == 0) return all;
  return std::min(all, capacity_ * ep_.local_experts() * ctx_.B * ep_.size());
}

void MoeMlp::declare(ActivationTable::Rows& rows, const std::string& key, StageSet stage) {
  const DType act = ctx_.act(), f32 = DType::f32, i32 = DType::i32;
  const std::int64_t N = ctx_.N, E = o_.n_experts, k = o_.top_k, R = this->rows(), Rx = expert_rows(),
                     C = ctx_.cfg.n_embd;
  const bool moves = ep_.size() > 1;
  if (shared_) shared_->declare(rows, key + ".shared", stage);
  rows.saved(logits_, key + ".logits", act, {N, E}, stage);
  rows.saved(scores_, key + ".scores", f32, {N, E}, stage);
  rows.saved(lse_, key + ".lse", f32, {N}, stage);
  rows.saved(experts_, key + ".experts", i32, {N, k}, stage);
  rows.saved(gates_, key + ".gates", f32, {N, k}, stage);
  rows.saved(offsets_, key + ".offsets", i32, {E + 1}, stage);
  rows.saved(row_of_, key + ".row_of", i32, {N, k}, stage);
  rows.saved(source_, key + ".source", i32, {R}, stage);
  // The experts' input rows: the grouped rows themselves on one rank; with expert parallelism the
  // rows received (the grouped rows before dispatch are scratch of the forward). Kept for FC1's
  // backward unless FC1 keeps its own copy (ops::GroupedLinearImpl::keeps_input).
  const ops::GroupedLinearImpl &fc1 = impl(fc_linear_), &fc2 = impl(proj_linear_);
  if (moves) rows.scratch(x_perm_, "moe.x_grouped", act, {R, C});
  if (fc1.keeps_input)
    rows.scratch(x_in_, "moe.x_expert", act, {Rx, C});
  else
    rows.saved(x_in_, key + ".x_expert", act, {Rx, C}, stage);
  if (moves && o_.expert_dropout > 0) rows.saved(ids_in_, key + ".ids_expert", i32, {Rx}, stage);
  rows.saved(pre_, key + ".pre", act, {Rx, fc_local()}, stage);
  act_output_ = act_output_for(fc2.prologues.has(gelu() ? ops::Prologue::gelu : ops::Prologue::swiglu) &&
                                   o_.expert_dropout == 0,
                               fc2.keeps_input, ctx_.cfg.recompute_gelu && !rows.recomputes(stage));
  dact_on_load_ = fc1.prologues.has(gelu() ? ops::Prologue::dgelu : ops::Prologue::dswiglu);
  if (act_output_ == ActOutput::saved)
    rows.saved(act_, key + ".act", act, {Rx, hidden_local()}, stage);
  else if (act_output_ != ActOutput::on_load)
    rows.scratch(act_, "moe.act", act, {Rx, hidden_local()});
  // The experts' outputs back in grouped order: written by stage `out`, which no recompute runs.
  rows.kept(y_, act, {R, C});  // the experts' outputs: the combine's backward reads them
  if (moves) rows.scratch(y_out_, "moe.y_expert", act, {Rx, C});
  rows.scratch(loss_terms_, "moe.loss_terms", f32, {2});
  if (!bias_.empty()) rows.own(bias_dev_, f32, {E});
  if (shared_) rows.scratch(shared_out_, "moe.shared_out", act, {ctx_.Nl, C});
  rows.backward_scratch(dlogits_, "moe.dlogits", act, {N, E});
  rows.backward_scratch(dgates_, "moe.dgates", f32, {N, k});
  rows.backward_scratch(dy_, "moe.dy_expert", act, {Rx, C});
  if (moves) rows.backward_scratch(dy_out_, "moe.dy_grouped", act, {R, C});
  rows.backward_scratch(dact_, "moe.dact", act, {Rx, hidden_local()});
  if (!dact_on_load_) rows.backward_scratch(dpre_, "moe.dpre", act, {Rx, fc_local()});
  rows.backward_scratch(dx_in_, "moe.dx_expert", act, {Rx, C});
  rows.backward_scratch(drouter_, "moe.drouter", act, {N, C});
}

void MoeMlp::draw(rng::RngStatesTracker* tracker, float) {
  dropout_rng_ = {};
  if (!dropout_on() || !tracker) return;
  // Expert-parallel RNG (Megatron's expert-parallel-rng): one draw per element of the step's
  // [tokens, experts, hidden] activations, whichever rank computes it.
  auto scope = tracker->fork(rng::kExpertParallelRng);
  dropout_rng_ =
      tracker->draw(static_cast<std::uint64_t>(ctx_.batch_sequences) * ctx_.T * o_.n_experts * o_.hidden);
}

bool MoeMlp::first_micro_batch() const {
  const auto* run = ctx_.world.try_resource<RunControl>();
  return !run || run->micro_batch == 0;  // GradWrittenFirst: the step's first micro-batch writes them
}

const ops::GroupedLinearImpl& MoeMlp::impl(Entity linear) const {
  const auto* attached = ctx_.world.try_get<ops::GroupedLinearImpl>(linear);
  return attached ? *attached : ctx_.backend_grouped_linear;
}

TensorView MoeMlp::weight(Entity e, bool grad) const {
  const TensorView w = ctx_.param(e, grad);
  const std::int64_t El = ep_.local_experts();
  return w.reshape({El, w.shape[0] / El, w.shape[1]});
}

ops::MoeDropout MoeMlp::dropout_args(const TensorView& t) const {
  const std::int64_t used = ep_.size() > 1 ? routing().plan.received() : routing().offsets_host.back();
  return {.x = t,
          .ids = ep_.size() > 1 ? ids_in_ : source_,
          .rows = used,
          .p = o_.expert_dropout,
          .rng = dropout_rng_,
          .col_offset = ctx_.tp.rank() * hidden_local(),
          .cols_total = o_.hidden};
}

MoeMlp::LossCoeffs MoeMlp::loss_coeffs() const {
  // The load-balancing loss is a mean over the global batch's sequences, the z-loss over its tokens.
  const auto sequences = static_cast<float>(ctx_.batch_sequences);
  return {o_.aux_loss_coeff / sequences, o_.z_loss_coeff / (sequences * static_cast<float>(ctx_.T))};
}

ops::MoeRoute MoeMlp::route_args() {
  const LossCoeffs c = loss_coeffs();
  return {.scores = scores_,
          .lse = lse_,
          .experts = experts_,
          .gates = gates_,
          .logits = logits_,
          .bias = bias_dev_,
          .loss_terms = loss_terms_,
          .score = o_.score,
          .normalize = o_.normalize_gates,
          .seq_len = ctx_.T,
          .aux_coeff = c.aux,
          .z_coeff = c.z};
}

void MoeMlp::activate() {
  const std::int64_t used = ep_.size() > 1 ? routing().plan.received() : routing().offsets_host.back();
  const TensorView act = act_.rows(0, used), pre = pre_.rows(0, used);
  if (gelu())
    ctx_.be.gelu_forward({act, pre});
  else
    ctx_.be.swiglu_forward({act, pre});
  if (dropout_on()) ctx_.be.moe_dropout(dropout_args(act_));
}

ops::LinearInput MoeMlp::fc2_input() const {
  if (act_output_ != ActOutput::on_load) return act_;
  if (gelu()) return ops::GeluOnLoad{pre_};
  return ops::SwigluOnLoad{pre_};
}

void MoeMlp::forward_in(const NormOutput& x, float p) {
  ops::Backend& be = ctx_.be;
  const bool moves = ep_.size() > 1;
  // Every row of the normalised input: gathered under sequence parallelism by the shared experts'
  // FC1, or here.
  if (shared_) {
    NormOutput gathered = x;
    gathered.read_after = true;  // the router reads it next, whatever the norm keeps
    shared_->forward_in(gathered, p);
  } else
    ctx_.tp.enter(ops::plain_tensor(x.input), x.local);
  const TensorView input = ops::plain_tensor(x.input);
  router_.forward_whole({logits_, {}, input});
  if (bias_dev_ && bias_dirty_) {
    be.copy(bias_dev_, TensorView(bias_.data(), {o_.n_experts}, DType::f32, Device::cpu));
    bias_dirty_ = false;
  }
  be.moe_route(route_args());
  // The group sizes reach the host (for the grouped linears and the dispatch: a synchronisation)
  // while the rows are gathered; under expert parallelism with every rank's, after the gather.
  routing().offsets_host.resize(static_cast<std::size_t>(o_.n_experts + 1));
  be.moe_permute({.offsets = offsets_,
                  .row_of = row_of_,
                  .source = source_,
                  .out = moves ? x_perm_ : x_in_,
                  .x = input,
                  .experts = experts_,
                  .n_experts = o_.n_experts,
                  .seq_len = ctx_.T,
                  .capacity = capacity_,
                  .token_offset = ctx_.seq_offset * ctx_.T,
                  // Under expert parallelism the plan reads every rank's offsets back at once.
                  .offsets_host = moves ? nullptr : routing().offsets_host.data()});
  const std::int32_t* local = routing().offsets_host.data();
  if (moves) {
    routing().plan = ep_.plan(offsets_, routing().offsets_host.data());
    KILN_CHECK(routing().plan.received() <= x_in_.shape[0], "mixture of experts: ", routing().plan.received(),
               " rows for this rank's experts exceed the ", x_in_.shape[0], " reserved");
    ep_.dispatch(x_in_, x_perm_, routing().plan);
    if (ids_in_) ep_.dispatch(ids_in_, source_, routing().plan);
    local = routing().plan.local_offsets.data();
  }
  impl(fc_linear_).forward({pre_, x_in_, weight(fc_, false), local, false, row_groups(), expert_of()});
  if (act_output_ != ActOutput::on_load) activate();
}

void MoeMlp::forward_out(const TensorView& out_local) {
  ops::Backend& be = ctx_.be;
  const bool moves = ep_.size() > 1;
  const std::int32_t* local = moves ? routing().plan.local_offsets.data() : routing().offsets_host.data();
  if (shared_) {
    shared_->forward_out(out_local);
    be.copy(shared_out_, out_local);
  }
  impl(proj_linear_).forward(
      {moves ? y_out_ : y_, fc2_input(), weight(proj_, false), local, /*weight_in_out=*/true, row_groups(), expert_of()});
  if (moves) ep_.combine(y_, y_out_, routing().plan);
  // Each token's experts' outputs, weighted: this rank's part of the experts' hidden features, a
  // partial sum over TP like a row-parallel output, summed over the group into this rank's rows.
  const TensorView full = ctx_.tp.sequence_parallel() ? ctx_.stream.row_out : out_local;
  be.moe_combine({full, y_, gates_, row_of_});
  ctx_.tp.exit(out_local, full);
  if (shared_) be.residual_forward({out_local, out_local, shared_out_, {}});
  if (!ctx_.training) return;
  // The step's numbers (stage `out` runs once per forward: no recompute repeats it); the loss
  // terms stay on the device until collect_stats.
  if (forwards_++ == 0)
    be.copy(terms_sum_, loss_terms_);
  else
    be.add(terms_sum_, loss_terms_);
  for (int e = 0; e < o_.n_experts; ++e) tokens_[static_cast<std::size_t>(e)] += routing().offsets_host[e + 1] - routing().offsets_host[e];
  dropped_ += static_cast<double>(rows() - routing().offsets_host.back());
}

TensorView MoeMlp::backward(const TensorView& dout_local, const ops::LinearInput& x, const TensorView& dx_local,
                            float p) {
  ops::Backend& be = ctx_.be;
  const bool moves = ep_.size() > 1, sp = ctx_.tp.sequence_parallel();
  const std::int32_t* local = moves ? routing().plan.local_offsets.data() : routing().offsets_host.data();
  if (act_output_ == ActOutput::refilled) activate();
  if (shared_) be.copy(shared_out_, shared_->backward(dout_local, x, dx_local, p));
  // Every row of the output's gradient.
  TensorView dout = dout_local;
  if (sp) {
    ctx_.tp.exit_backward(ctx_.stream.full, dout_local);
    dout = ctx_.stream.full;
  }
  const TensorView dy_grouped = moves ? dy_out_ : dy_;
  be.moe_combine_backward({dy_grouped, dgates_, dout, y_, gates_, row_of_});
  ctx_.tp.all_reduce(dgates_);  // the outputs were this rank's partial sums
  // The rows' gradients go to the experts' ranks while the router's backward (it needs the gates'
  // gradient alone) runs.
  if (moves) ep_.dispatch_beside(dy_, dy_out_, routing().plan);
  const LossCoeffs c = loss_coeffs();
  be.moe_route_backward({.dlogits = dlogits_,
                         .dgates = dgates_,
                         .scores = scores_,
                         .lse = lse_,
                         .experts = experts_,
                         .logits = logits_,
                         .score = o_.score,
                         .normalize = o_.normalize_gates,
                         .seq_len = ctx_.T,
                         .aux_coeff = c.aux,
                         .z_coeff = c.z});
  router_.backward_whole({.dx = drouter_, .dout = dlogits_, .x = x});
  if (moves) ep_.join();
  // FC2, then the activation's backward (in FC1's load of its output gradient where FC1 takes that;
  // else with GELU and no dropout in FC2's data gradient; else on its own), then FC1.
  const bool fuse_gelu = gelu() && !dropout_on() && !dact_on_load_;
  impl(proj_linear_).backward({.dx = fuse_gelu ? dpre_ : dact_,
                              .dweight = weight(proj_, true),
                              .dout = dy_,
                              .x = fc2_input(),
                              .weight = weight(proj_, false),
                              .dx_gelu_pre = fuse_gelu ? pre_ : TensorView{},
                              .offsets_host = local,
                              .weight_in_out = true,
                              .dweight_overwrite = first_micro_batch(),
                              .groups = row_groups(),
                              .expert_of = expert_of()});
  if (dropout_on()) be.moe_dropout(dropout_args(dact_));
  ops::OutputGrad dfc = dpre_;
  if (dact_on_load_) {
    dfc = gelu() ? ops::OutputGrad(ops::DgeluOnLoad{dact_, pre_}) : ops::OutputGrad(ops::DswigluOnLoad{dact_, pre_});
  } else if (!fuse_gelu) {
    const std::int64_t used = moves ? routing().plan.received() : routing().offsets_host.back();
    if (gelu())
      be.gelu_backward({dpre_.rows(0, used), dact_.rows(0, used), pre_.rows(0, used)});
    else
      be.swiglu_backward({dpre_.rows(0, used), dact_.rows(0, used), pre_.rows(0, used)});
  }
  // The input rows' gradients go back to their ranks beside FC1's weight gradient.
  const TensorView dx_grouped = moves ? dy_out_ : dx_in_;  // dy_out_ is free again
  bool returned = !moves;
  const auto send_back = [&] {
    ep_.combine_beside(dx_grouped, dx_in_, routing().plan);
    returned = true;
  };
  impl(fc_linear_).backward({.dx = dx_in_,
                              .dweight = weight(fc_, true),
                              .dout = dfc,
                              .x = impl(fc_linear_).keeps_input ? TensorView{} : x_in_,
                              .weight = weight(fc_, false),
                              .offsets_host = local,
                              .dweight_overwrite = first_micro_batch(),
                              .dgrad_queued = moves ? std::function<void()>(send_back) : std::function<void()>(),
                              .groups = row_groups(),
                              .expert_of = expert_of()});
  if (!returned) send_back();  // an implementation that did not say when dx was queued
  if (moves) ep_.join();
  const TensorView col_dx = ctx_.stream.col_dx;
  be.moe_permute_backward({col_dx, dx_grouped, row_of_});
  // The router's input gradient is whole on every TP rank: added once (on rank 0) before the sum of
  // the experts' partial ones over the group.
  if (ctx_.tp.rank() == 0) be.residual_forward({col_dx, col_dx, drouter_, {}});
  const TensorView dx = sp ? dx_local : col_dx;
  ctx_.tp.enter_backward(dx, col_dx);
  if (shared_) be.residual_forward({dx, dx, shared_out_, {}});
  return dx;
}

std::size_t MoeMlp::scratch_bytes() const {
  std::size_t bytes = router_.scratch_bytes(ctx_.N);
  if (shared_) bytes = std::max(bytes, shared_->scratch_bytes());
  return bytes;
}

double MoeMlp::flops_per_token() const {
  // 6 per weight element a token meets: the router's, and k experts' FC1 and FC2.
  const double C = ctx_.cfg.n_embd, H = o_.hidden, fc = gelu() ? H : 2 * H;
  double flops = 6.0 * (C * o_.n_experts + o_.top_k * (C * fc + H * C));
  if (shared_) flops += shared_->flops_per_token();
  return flops;
}

std::int64_t MoeMlp::inactive_parameters() const {
  const std::int64_t C = ctx_.cfg.n_embd, H = o_.hidden, fc = gelu() ? H : 2 * H;
  return static_cast<std::int64_t>(o_.n_experts - o_.top_k) * (fc * C + H * C);
}

void MoeMlp::collect_stats(std::span<const float> device, std::vector<float>& sums) {
  // terms_sum_ is written by the step's first training forward: nothing before it.
  sums.push_back(forwards_ > 0 ? device[0] : 0.0f);
  sums.push_back(forwards_ > 0 ? device[1] : 0.0f);
  sums.push_back(static_cast<float>(dropped_));
  for (double t : tokens_) sums.push_back(static_cast<float>(t));
  forwards_ = 0;
  dropped_ = 0;
  std::fill(tokens_.begin(), tokens_.end(), 0.0);
}

std::size_t MoeMlp::end_step(std::span<const float> sums, std::size_t at, const std::string& name,
                             std::vector<std::pair<std::string, double>>& out) {
  // The sums over the data-parallel ranks of every rank's view; under TP each TP rank routed the same
  // tokens (they are counted once: the DP group holds one rank of each TP group).
  const double aux = sums[at], z = sums[at + 1], dropped = sums[at + 2];
  const auto tokens = sums.subspan(at + 3, static_cast<std::size_t>(o_.n_experts));
  // The totals over the layers (made by the first layer that reports, added to by the others).
  const std::pair<const char*, double> totals[] = {{"moe.aux_loss", aux}, {"moe.z_loss", z}, {"moe.dropped", dropped}};
  for (const auto& total : totals) {
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& m) { return m.first == total.first; });
    if (it == out.end())
      out.push_back({total.first, total.second});
    else
      it->second += total.second;
  }
  out.push_back({name + ".aux_loss", aux});
  out.push_back({name + ".z_loss", z});
  out.push_back({name + ".dropped", dropped});
  double lo = tokens[0], hi = tokens[0], mean = 0, var = 0;
  for (float t : tokens) lo = std::min<double>(lo, t), hi = std::max<double>(hi, t), mean += t;
  mean /= static_cast<double>(tokens.size());
  for (float t : tokens) var += (t - mean) * (t - mean);
  var /= static_cast<double>(tokens.size());
  out.push_back({name + ".tokens_min", lo});
  out.push_back({name + ".tokens_max", hi});
  out.push_back({name + ".tokens_cv", mean > 0 ? std::sqrt(var) / mean : 0.0});
  // DeepSeek-V3's aux-loss-free balancing: each expert's bias moves towards the mean load.
  if (!bias_.empty() && mean > 0 && o_.bias_update_rate > 0) {
    for (std::size_t e = 0; e < bias_.size(); ++e) {
      const double load = tokens[e];
      if (load < mean) bias_[e] += o_.bias_update_rate;
      else if (load > mean) bias_[e] -= o_.bias_update_rate;
    }
    bias_dirty_ = true;
  }
  return at + 3 + tokens.size();
}

void MoeMlp::set_state(std::span<const float> values) {
  KILN_CHECK(values.size() == bias_.size(), "mixture of experts: a saved router bias of ", values.size(),
             " values for ", bias_.size(), " experts");
  std::copy(values.begin(), values.end(), bias_.begin());
  bias_dirty_ = true;
}

}  // namespace kiln::model
