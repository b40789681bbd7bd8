// GptModel: parameter entities, the flat parameter buffers, activation memory, initialisation.
#include <array>
#include <cmath>

#include "kiln/model/gpt.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"

namespace kiln::model {

namespace {
enum BlockParam { kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFcpW, kFcpB };
}

GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : world_(world),
      cfg_(cfg),
      be_(world.resource<ops::ActiveBackend>().get()),
      B_(B),
      T_(T),
      slots_(micro_batches),
      C_(cfg.n_embd),
      H_(cfg.n_head),
      Vp_(cfg.padded_vocab()),
      L_(cfg.n_layer) {
  KILN_CHECK(T <= cfg.max_seq_len, "train.seq_len ", T, " exceeds model.max_seq_len ", cfg.max_seq_len);
  auto& comms = world_.resource<parallel::Communicators>();
  tp_comm_ = comms.tp.get();
  dp_comm_ = comms.dp.get();
  tp_ = tp_comm_->size();
  tp_rank_ = tp_comm_->rank();
  KILN_CHECK(H_ % tp_ == 0 && C_ % tp_ == 0, "model.n_head ", H_, " and model.n_embd ", C_,
             " must be divisible by parallel.tp = ", tp_);
  Hl_ = H_ / tp_;
  const std::int64_t tokens = static_cast<std::int64_t>(B) * T;
  sp_ = tp_ > 1 && world_.resource<parallel::ParallelState>().sequence_parallel;
  KILN_CHECK(!sp_ || tokens % tp_ == 0, "sequence parallelism needs the tokens of a micro-batch (", tokens,
             ") to be divisible by parallel.tp = ", tp_);
  Nl_ = sp_ ? tokens / tp_ : tokens;
  vp_ = tp_ > 1 && world_.resource<parallel::ParallelState>().vocab_parallel;
  KILN_CHECK(!vp_ || Vp_ % tp_ == 0, "vocabulary parallelism needs the padded vocabulary (", Vp_,
             ") to be divisible by parallel.tp = ", tp_);
  Vl_ = vp_ ? Vp_ / tp_ : Vp_;
  vocab_begin_ = vp_ ? static_cast<std::int64_t>(tp_rank_) * Vl_ : 0;
  const float std = cfg.init_std;
  const float proj_std = std / std::sqrt(2.0f * L_);  // GPT-2: residual projections scaled by 1/sqrt(2L)
  const std::int64_t C = C_, Cl = C_ / tp_, r = tp_rank_;
  world_.emplace_resource<ParamStore>();

  auto make_layer = [&](int unit, LayerKind kind, int block, const std::string& name) {
    Entity e = world_.create(name);
    world_.emplace<Layer>(e, Layer{unit, block, kind, {}});
    layers_.push_back(e);
    return e;
  };
  // Shards of this TP rank: `parts` equal row blocks of `rows` rows each (q, k, v: 3 parts) of which
  // this rank takes its 1/tp slice of every part; or its 1/tp slice of the columns.
  auto rows_of = [&](std::int64_t parts, std::int64_t rows) {
    TensorShard s;
    if (tp_ == 1) return s;
    s.dim = 0;
    for (std::int64_t q = 0; q < parts; ++q) s.ranges.push_back({q * rows + r * rows / tp_, q * rows + (r + 1) * rows / tp_});
    return s;
  };
  auto cols_of = [&](std::int64_t cols) {
    TensorShard s;
    if (tp_ == 1) return s;
    s.dim = 1;
    s.ranges.push_back({r * cols / tp_, (r + 1) * cols / tp_});
    return s;
  };
  const TensorShard whole;

  // Unit 0: embeddings. The LM head reuses wte.
  Entity emb = make_layer(0, LayerKind::embedding, -1, "embeddings");
  auto& emb_params = world_.get<Layer>(emb).params;
  wte_ = add_param("wte", {Vp_, C}, vp_ ? rows_of(1, Vp_) : whole, 0, true, std, 0, emb_params);
  wpe_ = add_param("wpe", {cfg.max_seq_len, C}, whole, 0, true, std, 0, emb_params);

  for (int l = 0; l < L_; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    const int unit = l + 1;
    Entity layer = make_layer(unit, LayerKind::block, l, "blocks." + std::to_string(l));
    auto& lp = world_.get<Layer>(layer).params;
    std::array<Entity, 12> e{};
    // Column-parallel: QKV (heads split, per q/k/v) and FC1 (hidden split); row-parallel: the
    // attention projection and FC2 (input split; their biases are replicated).
    e[kLn1W] = add_param(p + "ln_1.weight", {C}, whole, unit, false, 0, 1.0f, lp);
    e[kLn1B] = add_param(p + "ln_1.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    e[kQkvW] = add_param(p + "attn.qkv.weight", {3 * C, C}, rows_of(3, C), unit, true, std, 0, lp);
    e[kQkvB] = add_param(p + "attn.qkv.bias", {3 * C}, rows_of(3, C), unit, false, 0, 0.0f, lp);
    e[kProjW] = add_param(p + "attn.proj.weight", {C, C}, cols_of(C), unit, true, proj_std, 0, lp);
    e[kProjB] = add_param(p + "attn.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    e[kLn2W] = add_param(p + "ln_2.weight", {C}, whole, unit, false, 0, 1.0f, lp);
    e[kLn2B] = add_param(p + "ln_2.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    e[kFcW] = add_param(p + "mlp.fc.weight", {4 * C, C}, rows_of(1, 4 * C), unit, true, std, 0, lp);
    e[kFcB] = add_param(p + "mlp.fc.bias", {4 * C}, rows_of(1, 4 * C), unit, false, 0, 0.0f, lp);
    e[kFcpW] = add_param(p + "mlp.proj.weight", {C, 4 * C}, cols_of(4 * C), unit, true, proj_std, 0, lp);
    e[kFcpB] = add_param(p + "mlp.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    block_params_.push_back(e);
    block_linears_.push_back({add_linear(p + "attn.qkv", "qkv", unit, e[kQkvW], e[kQkvB], C, 3 * Cl),
                              add_linear(p + "attn.proj", "attn_proj", unit, e[kProjW], e[kProjB], Cl, C),
                              add_linear(p + "mlp.fc", "fc", unit, e[kFcW], e[kFcB], C, 4 * Cl),
                              add_linear(p + "mlp.proj", "fc_proj", unit, e[kFcpW], e[kFcpB], 4 * Cl, C)});
    // LayerNorm outputs feed only QKV / FC1, GELU outputs only FC2; attention reads its own output.
    const auto& lin = block_linears_.back();
    for (std::size_t r : {0u, 2u}) world_.get<Linear>(lin[r]).input_stored_for_backward = !cfg_.recompute_norm;
    world_.get<Linear>(lin[3]).input_stored_for_backward = !cfg_.recompute_gelu;
    // Each block weight's gradient comes from its linear alone (the tied wte has two producers).
    for (std::size_t k : {kQkvW, kProjW, kFcW, kFcpW}) world_.emplace<nn::GradWrittenFirst>(e[k]);
  }
  Entity fin = make_layer(L_ + 1, LayerKind::final_norm, -1, "ln_f");
  auto& fp = world_.get<Layer>(fin).params;
  lnf_w_ = add_param("ln_f.weight", {C}, whole, L_ + 1, false, 0, 1.0f, fp);
  lnf_b_ = add_param("ln_f.bias", {C}, whole, L_ + 1, false, 0, 0.0f, fp);
  lm_head_ = add_linear("lm_head", "lm_head", L_ + 1, wte_, std::nullopt, C, Vl_);

  // Under sequence parallelism the LayerNorms see only this rank's tokens.
  if (sp_)
    for (Entity e : world_.view<Param>()) {
      auto& p = world_.get<Param>(e);
      if (p.name.find("ln_") != std::string::npos) p.tp_partial_grad = true;
    }

  // The flat buffers.
  auto& store = world_.resource<ParamStore>();
  store.act = be_.act_dtype();
  store.master = be_.alloc(static_cast<std::size_t>(store.total) * 4);
  store.compute = be_.alloc(static_cast<std::size_t>(store.total) * size_of(store.act));
  store.grads = be_.alloc(static_cast<std::size_t>(store.total) * 4);
  store.stream = be_.stream();
  be_.zero(store.master_flat());  // alignment padding stays zero
  be_.zero(store.grads_flat());
}

namespace {
// The activations a block keeps for its backward pass, in three groups by what recomputes them.
enum ActGroup { kAttnGroup, kRes2Group, kMlpGroup };
}  // namespace

void GptModel::allocate_activations() {
  KILN_CHECK(!allocated_, "the model's activations are allocated once");
  const std::int64_t N = static_cast<std::int64_t>(B_) * T_, C = C_, Nl = Nl_, D = C_ / H_;
  const DType act = be_.act_dtype();
  // A LayerNorm or GELU output needs storing (or recomputing) only for a consumer whose backward
  // reads its input: an implementation that keeps its own copy (LinearImpl::keeps_input) does not.
  auto inputs_kept = [&](int role) {
    if (block_linears_.empty()) return false;
    for (const auto& lin : block_linears_) {
      const auto* impl = world_.try_get<ops::LinearImpl>(lin[static_cast<std::size_t>(role)]);
      if (!impl || !impl->keeps_input) return false;
    }
    return true;
  };
  // FC2 computing the GELU of FC1's pre-activation itself (LinearImpl::takes_gelu_input): no GELU
  // output is stored, recomputed, or even written.
  gelu_in_fc2_ = !block_linears_.empty();
  for (const auto& lin : block_linears_) {
    const auto* impl = world_.try_get<ops::LinearImpl>(lin[3]);
    gelu_in_fc2_ = gelu_in_fc2_ && impl && impl->takes_gelu_input;
  }
  const bool ln_kept = inputs_kept(0) && inputs_kept(2), gelu_kept = gelu_in_fc2_ || inputs_kept(3);
  recompute_ln_ = cfg_.recompute_norm && !ln_kept;
  recompute_gelu_ = cfg_.recompute_gelu && !gelu_kept;
  const bool keep_ln = !cfg_.recompute_norm && !ln_kept, keep_fc = !cfg_.recompute_gelu && !gelu_kept;

  // The plan: each block's recompute scope, from the component a module attached to its layer.
  using nn::RecomputeScope;
  plan_.assign(static_cast<std::size_t>(L_), BlockPlan{});
  bool shared_group[3] = {false, false, false}, any_distributed = false;
  for (int l = 0; l < L_; ++l) {
    const auto* r = world_.try_get<nn::ActivationRecompute>(layers_[static_cast<std::size_t>(l + 1)]);
    if (!r || r->scope == RecomputeScope::none) continue;
    auto& plan = plan_[static_cast<std::size_t>(l)];
    plan.scope = r->scope;
    plan.distribute = r->distribute_input && tp_ > 1;
    KILN_CHECK(!plan.distribute || !sp_, "block ", l, ": distributed saved inputs need sequence parallelism off");
    KILN_CHECK(!plan.distribute || N % tp_ == 0, "block ", l, ": distributing the saved input needs the ", N,
               " tokens of a micro-batch to be divisible by parallel.tp = ", tp_);
    any_distributed |= plan.distribute;
    shared_group[kAttnGroup] |= r->scope == RecomputeScope::attention || r->scope == RecomputeScope::full;
    shared_group[kRes2Group] |= r->scope == RecomputeScope::full;
    shared_group[kMlpGroup] |= r->scope == RecomputeScope::mlp || r->scope == RecomputeScope::full;
  }
  auto kept = [&](int l, int group) {
    const auto scope = plan_[static_cast<std::size_t>(l)].scope;
    if (scope == RecomputeScope::full) return false;
    if (group == kAttnGroup) return scope != RecomputeScope::attention;
    if (group == kMlpGroup) return scope != RecomputeScope::mlp;
    return true;
  };

  // A block's activations: (member, group, dtype, shape, allocated per block or shared elsewhere).
  // With sequence parallelism the LayerNorm statistics and res2 hold this rank's Nl rows; the
  // inputs of the TP regions hold all N.
  struct Field {
    TensorView BlockActs::*member;
    int group;
    DType dtype;
    Shape shape;
    bool own;  // false: the recompute_norm / recompute_gelu scratch, refilled in the backward pass
  };
  const Field fields[] = {
      {&BlockActs::ln1_mean, kAttnGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln1_rstd, kAttnGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln1, kAttnGroup, act, {N, C}, keep_ln},
      {&BlockActs::qkv, kAttnGroup, act, {B_, T_, 3, Hl_, D}, true},
      {&BlockActs::atty, kAttnGroup, act, {B_, T_, Hl_, D}, true},
      {&BlockActs::lse, kAttnGroup, DType::f32, {B_, Hl_, T_}, true},
      {&BlockActs::res2, kRes2Group, act, {Nl, C}, true},
      {&BlockActs::ln2_mean, kMlpGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln2_rstd, kMlpGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln2, kMlpGroup, act, {N, C}, keep_ln},
      {&BlockActs::fc_pre, kMlpGroup, act, {N, 4 * C / tp_}, true},
      {&BlockActs::fc, kMlpGroup, act, {N, 4 * C / tp_}, keep_fc},
  };

  arena_.request(&tokens_, DType::i32, {N});
  arena_.request(&targets_, DType::i32, {N});
  arena_.request(&losses_, DType::f32, {static_cast<std::int64_t>(slots_), N});
  res_.resize(static_cast<std::size_t>(L_ + 1));
  res_saved_.resize(static_cast<std::size_t>(L_));
  acts_.resize(static_cast<std::size_t>(L_));
  for (int l = 0; l <= L_; ++l) {
    if (l < L_ && plan_[static_cast<std::size_t>(l)].distribute)
      arena_.request(&res_saved_[static_cast<std::size_t>(l)], act, {N / tp_, C});
    else
      arena_.request(&res_[static_cast<std::size_t>(l)], act, {Nl, C});
  }
  if (any_distributed)
    for (auto& r : res_pingpong_) arena_.request(&r, act, {N, C});
  if (!keep_ln) arena_.request(&ln_shared_, act, {N, C});
  if (!keep_fc && !gelu_in_fc2_) arena_.request(&fc_shared_, act, {N, 4 * C / tp_});
  for (const auto& f : fields) {
    if (!f.own) continue;
    for (int l = 0; l < L_; ++l)
      if (kept(l, f.group)) arena_.request(&(acts_[static_cast<std::size_t>(l)].*f.member), f.dtype, f.shape);
    if (shared_group[f.group]) arena_.request(&(shared_acts_.*f.member), f.dtype, f.shape);
  }
  arena_.request(&lnf_, act, {N, C});
  arena_.request(&lnf_mean_, DType::f32, {Nl});
  arena_.request(&lnf_rstd_, DType::f32, {Nl});
  arena_.request(&logits_, act, {N, Vl_});
  if (vp_) {
    arena_.request(&ce_stats_, DType::f32, {N, 3});
    arena_.request(&ce_all_stats_, DType::f32, {tp_, N, 3});
  }
  arena_.request(&scratch_c_, act, {N, C});
  arena_.request(&dres_, act, {Nl, C});
  arena_.request(&dtmp_, act, {Nl, C});
  if (sp_) {
    arena_.request(&local_c_, act, {Nl, C});
    arena_.request(&full_c_, act, {N, C});
  }
  arena_.request(&datty_, act, {N, C / tp_});
  arena_.request(&dln_, act, {N, C});
  arena_.request(&dqkv_, act, {N, 3 * C / tp_});
  arena_.request(&dfc_, act, {N, 4 * C / tp_});
  arena_.allocate(be_);

  // Views that share memory: the LayerNorm and GELU outputs refilled in the backward pass, the
  // recomputed groups of recomputing blocks, and the full-width inputs of distributed blocks.
  auto share_scratch = [&](BlockActs& a) {
    if (!keep_ln) a.ln1 = a.ln2 = ln_shared_;
    if (!keep_fc) a.fc = fc_shared_;
  };
  share_scratch(shared_acts_);
  for (int l = 0; l < L_; ++l) {
    auto& a = acts_[static_cast<std::size_t>(l)];
    for (const auto& f : fields)
      if (f.own && !kept(l, f.group)) a.*f.member = shared_acts_.*f.member;
    share_scratch(a);
    if (plan_[static_cast<std::size_t>(l)].distribute) res_[static_cast<std::size_t>(l)] = res_pingpong_[l % 2];
  }
  if (!sp_) local_c_ = full_c_ = scratch_c_;  // without sequence parallelism local is full
  allocated_ = true;
}

Entity GptModel::add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit,
                           bool decay, float std, float value, std::vector<Entity>& layer_params) {
  auto& store = world_.resource<ParamStore>();
  Param p;
  p.name = name;
  p.global_shape = global_shape;
  p.shard = shard;
  p.shape = global_shape;
  if (shard.sharded()) p.shape.dims[shard.dim] = shard.extent();
  p.numel = p.shape.numel();
  p.offset = store.total;
  p.weight_decay = decay;
  p.init_std = std;
  p.init_value = value;
  p.unit = unit;
  store.total += (p.numel + nn::kParamAlign - 1) / nn::kParamAlign * nn::kParamAlign;
  Entity e = world_.create(name);
  world_.emplace<Param>(e, std::move(p));
  store.order.push_back(e);
  layer_params.push_back(e);
  return e;
}

Entity GptModel::add_linear(const std::string& name, const std::string& role, int unit, Entity w,
                            std::optional<Entity> b, int in, int out) {
  Entity e = world_.create(name);
  world_.emplace<Linear>(e, Linear{role, unit, w, b, in, out});
  return e;
}

bool GptModel::layernorm_on_load(Entity linear) const {
  const auto* impl = world_.try_get<ops::LinearImpl>(linear);
  return recompute_ln_ && !sp_ && impl && impl->takes_layernorm_input;
}

void GptModel::linear_forward(Entity linear, const ops::LinearForward& a) {
  if (auto* impl = world_.try_get<ops::LinearImpl>(linear))
    impl->forward(a);
  else
    be_.linear_forward(a);
}

void GptModel::linear_backward(Entity linear, const ops::LinearBackward& args) {
  ops::LinearBackward a = args;
  // A step's first micro-batch writes the gradients nothing else adds to (the zeroing skipped them).
  const auto* run = world_.try_resource<RunControl>();
  a.dweight_overwrite = (!run || run->micro_batch == 0) && world_.has<nn::GradWrittenFirst>(world_.get<Linear>(linear).weight);
  if (auto* impl = world_.try_get<ops::LinearImpl>(linear))
    impl->backward(a);
  else
    be_.linear_backward(a);
}

void GptModel::initialise(rng::RngStatesTracker& tracker) {
  auto& store = world_.resource<ParamStore>();
  for (Entity e : store.order) {
    const auto& p = world_.get<Param>(e);
    TensorView v = store.master_view(p).reshape({p.numel});
    if (p.init_std > 0) {
      // One draw of the whole logical tensor from the default state: element i of the logical
      // tensor is Philox element i of the draw, whatever part of it this rank holds.
      auto r = tracker.draw(static_cast<std::uint64_t>(p.global_shape.numel()));
      init_shard(v, p, r);
    } else {
      be_.fill(v, p.init_value);
    }
  }
  be_.convert(store.compute_flat(), store.master_flat());
}

void GptModel::init_shard(const TensorView& local, const Param& p, const rng::PhiloxArgs& r) {
  if (!p.shard.sharded()) {
    be_.init_normal(local, p.init_std, r, 0);
    return;
  }
  const std::int64_t cols = p.global_shape.ndim > 1 ? p.global_shape[1] : 1;
  const std::int64_t local_cols = p.shape.ndim > 1 ? p.shape[1] : 1;
  if (p.shard.dim == 0) {
    std::int64_t at = 0;
    for (auto [b, e] : p.shard.ranges) {  // whole rows: one contiguous global block per range
      const std::int64_t n = (e - b) * cols;
      be_.init_normal(local.flat_slice(at, n), p.init_std, r, b * cols);
      at += n;
    }
    return;
  }
  for (std::int64_t row = 0; row < p.shape[0]; ++row) {  // column ranges: one block per row and range
    std::int64_t c0 = 0;
    for (auto [b, e] : p.shard.ranges) {
      be_.init_normal(local.flat_slice(row * local_cols + c0, e - b), p.init_std, r, row * cols + b);
      c0 += e - b;
    }
  }
}

TensorView GptModel::tensor(Entity e, bool grad) const {
  const auto& store = world_.resource<ParamStore>();
  const auto& p = world_.get<Param>(e);
  return grad ? store.grad_view(p) : store.compute_view(p);
}

GptModel::BlockWeights GptModel::block_weights(int l, bool grads) const {
  const auto& e = block_params_[static_cast<std::size_t>(l)];
  auto t = [&](int i) { return tensor(e[i], grads); };
  return {t(kLn1W), t(kLn1B), t(kQkvW), t(kQkvB), t(kProjW), t(kProjB),
          t(kLn2W), t(kLn2B), t(kFcW),  t(kFcB),  t(kFcpW), t(kFcpB)};
}

ops::DropoutArgs GptModel::hidden_dropout(float p, const rng::PhiloxArgs& r) const {
  ops::DropoutArgs d;
  d.p = p;
  d.row_offset = sp_ ? static_cast<std::int64_t>(tp_rank_) * Nl_ : 0;  // this rank's rows of the [N, C] tensor
  d.rng = r;
  return d;
}

std::int64_t GptModel::parameter_count() const {
  std::int64_t n = 0;
  for (Entity e : world_.resource<ParamStore>().order) n += world_.get<Param>(e).numel;
  return n;
}

double GptModel::flops_per_token() const {
  // Matmul FLOPs: 6 per weight element per token (forward + two backward GEMMs) for the block
  // linears (12 C^2 per block) and the LM head (Vp x C); attention scores and values add
  // 12 * L * T * C (forward 4 T C per layer, times 3), counted without causal savings (PaLM).
  const double C = C_, L = L_;
  return 6.0 * (12.0 * L * C * C + double(Vp_) * C) + 12.0 * L * T_ * C;
}

}  // namespace kiln::model
