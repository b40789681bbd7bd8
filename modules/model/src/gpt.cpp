// GptModel: parameter entities, the flat parameter buffers, activation memory, initialisation.
#include <array>
#include <cmath>

#include "kiln/model/gpt.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::model {

namespace {
enum BlockParam { kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFcpW, kFcpB };
}

GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : world_(world),
      cfg_(cfg),
      be_(world.resource<ops::ActiveBackend>().get()),
      tp_(parallel::tensor_parallel(world, be_)),
      dp_(parallel::data_parallel(world)),
      B_(B),
      T_(T),
      slots_(micro_batches),
      C_(cfg.n_embd),
      H_(cfg.n_head),
      Vp_(cfg.padded_vocab()),
      L_(cfg.n_layer),
      N_(static_cast<std::int64_t>(B) * T),
      batch_sequences_(world.resource<train::TrainConfig>().batch_size),
      Nl_(tp_.local_rows(N_)),
      embedding_(tp_, Vp_, C_),
      qkv_(tp_, C_, 3 * C_, 3),
      mlp_in_(tp_, C_, 4 * C_),
      lm_head_(tp_, C_, Vp_, 1, tp_.vocab_parallel()),
      attn_out_(tp_, C_, C_),
      mlp_out_(tp_, 4 * C_, C_),
      loss_(tp_, Vp_, cfg.vocab_size, N_),
      backend_linear_(ops::backend_linear_impl(be_)) {
  KILN_CHECK(T <= cfg.max_seq_len, "train.seq_len ", T, " exceeds model.max_seq_len ", cfg.max_seq_len);
  for (const auto& d : tensor_parallel_splits(cfg, N_, tp_.sequence_parallel(), tp_.vocab_parallel())) tp_.require(d);
  Hl_ = H_ / tp_.size();
  head_begin_ = static_cast<int>(tp_.split(H_).first);
  const float std = cfg.init_std;
  const float proj_std = std / std::sqrt(2.0f * L_);  // GPT-2: residual projections scaled by 1/sqrt(2L)
  const std::int64_t C = C_;
  world_.emplace_resource<ParamStore>();

  auto make_layer = [&](int unit, LayerKind kind, int block, const std::string& name) {
    Entity e = world_.create(name);
    world_.emplace<Layer>(e, Layer{unit, block, kind, {}});
    layers_.push_back(e);
    return e;
  };
  const TensorShard whole;

  // Unit 0: embeddings. The LM head reuses wte.
  Entity emb = make_layer(0, LayerKind::embedding, -1, "embeddings");
  auto& emb_params = world_.get<Layer>(emb).params;
  wte_ = add_param("wte", {Vp_, C}, embedding_.weight_shard(), 0, true, std, 0, emb_params);
  wpe_ = add_param("wpe", {cfg.max_seq_len, C}, whole, 0, true, std, 0, emb_params);

  using nn::LinearRole;
  for (int l = 0; l < L_; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    const int unit = l + 1;
    Entity layer = make_layer(unit, LayerKind::block, l, "blocks." + std::to_string(l));
    auto& lp = world_.get<Layer>(layer).params;
    std::array<Entity, 12> e{};
    // Column-parallel: QKV (heads split, per q/k/v) and FC1 (hidden split); row-parallel: the
    // attention projection and FC2 (input split; their biases are replicated).
    e[kLn1W] = add_norm_param(p + "ln_1.weight", unit, 1.0f, lp);
    e[kLn1B] = add_norm_param(p + "ln_1.bias", unit, 0.0f, lp);
    e[kQkvW] = add_param(p + "attn.qkv.weight", {3 * C, C}, qkv_.weight_shard(), unit, true, std, 0, lp);
    e[kQkvB] = add_param(p + "attn.qkv.bias", {3 * C}, qkv_.weight_shard(), unit, false, 0, 0.0f, lp);
    e[kProjW] = add_param(p + "attn.proj.weight", {C, C}, attn_out_.weight_shard(), unit, true, proj_std, 0, lp);
    e[kProjB] = add_param(p + "attn.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    e[kLn2W] = add_norm_param(p + "ln_2.weight", unit, 1.0f, lp);
    e[kLn2B] = add_norm_param(p + "ln_2.bias", unit, 0.0f, lp);
    e[kFcW] = add_param(p + "mlp.fc.weight", {4 * C, C}, mlp_in_.weight_shard(), unit, true, std, 0, lp);
    e[kFcB] = add_param(p + "mlp.fc.bias", {4 * C}, mlp_in_.weight_shard(), unit, false, 0, 0.0f, lp);
    e[kFcpW] = add_param(p + "mlp.proj.weight", {C, 4 * C}, mlp_out_.weight_shard(), unit, true, proj_std, 0, lp);
    e[kFcpB] = add_param(p + "mlp.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    block_params_.push_back(e);
    const BlockLinears lin{
        add_linear(p + "attn.qkv", LinearRole::qkv, unit, e[kQkvW], e[kQkvB], C, qkv_.local_out()),
        add_linear(p + "attn.proj", LinearRole::attn_out, unit, e[kProjW], e[kProjB], attn_out_.local_in(), C),
        add_linear(p + "mlp.fc", LinearRole::mlp_in, unit, e[kFcW], e[kFcB], C, mlp_in_.local_out()),
        add_linear(p + "mlp.proj", LinearRole::mlp_out, unit, e[kFcpW], e[kFcpB], mlp_out_.local_in(), C)};
    block_linears_.push_back(lin);
    // LayerNorm outputs feed only QKV / FC1, GELU outputs only FC2; attention reads its own output.
    for (Entity r : {lin.qkv, lin.mlp_in}) world_.get<Linear>(r).input_stored_for_backward = !cfg_.recompute_norm;
    world_.get<Linear>(lin.mlp_out).input_stored_for_backward = !cfg_.recompute_gelu;
    // Each block weight's gradient comes from its linear alone (the tied wte has two producers).
    for (std::size_t k : {kQkvW, kProjW, kFcW, kFcpW}) world_.emplace<nn::GradWrittenFirst>(e[k]);
  }
  Entity fin = make_layer(L_ + 1, LayerKind::final_norm, -1, "ln_f");
  auto& fp = world_.get<Layer>(fin).params;
  lnf_w_ = add_norm_param("ln_f.weight", L_ + 1, 1.0f, fp);
  lnf_b_ = add_norm_param("ln_f.bias", L_ + 1, 0.0f, fp);
  lm_head_entity_ = add_linear("lm_head", LinearRole::lm_head, L_ + 1, wte_, std::nullopt, C, lm_head_.local_out());
  // The flat buffers are laid out and allocated in Phase::setup ("params.allocate"), once a module
  // that shards them has said how.
}

std::vector<parallel::SplitDim> GptModel::tensor_parallel_splits(const ModelConfig& cfg, std::int64_t tokens,
                                                                 bool sequence_parallel, bool vocab_parallel) {
  // The heads split the attention (and with them the width: n_embd = n_head x head dim, and the
  // MLP's 4 x n_embd); sequence parallelism the tokens; vocabulary parallelism the padded vocabulary.
  std::vector<parallel::SplitDim> dims = {{cfg.n_head, "model.n_head", "attention heads"}};
  if (sequence_parallel)
    dims.push_back({tokens, "parallel.sequence_parallel",
                    "tokens of a micro-batch (train.micro_batch_size x train.seq_len)"});
  if (vocab_parallel)
    dims.push_back({cfg.padded_vocab(), "parallel.vocab_parallel",
                    cat("vocabulary rows (model.vocab_size ", cfg.vocab_size, " padded to a multiple of model.vocab_multiple = ",
                        cfg.vocab_multiple, ")")});
  return dims;
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
  auto inputs_kept = [&](Entity BlockLinears::*linear) {
    if (block_linears_.empty()) return false;
    for (const auto& lin : block_linears_) {
      const auto* impl = world_.try_get<ops::LinearImpl>(lin.*linear);
      if (!impl || !impl->keeps_input) return false;
    }
    return true;
  };
  // FC2 computing the GELU of FC1's pre-activation itself (LinearImpl::takes_gelu_input): no GELU
  // output is stored, recomputed, or even written.
  gelu_in_fc2_ = !block_linears_.empty();
  for (const auto& lin : block_linears_) {
    const auto* impl = world_.try_get<ops::LinearImpl>(lin.mlp_out);
    gelu_in_fc2_ = gelu_in_fc2_ && impl && impl->takes_gelu_input;
  }
  const bool ln_kept = inputs_kept(&BlockLinears::qkv) && inputs_kept(&BlockLinears::mlp_in),
             gelu_kept = gelu_in_fc2_ || inputs_kept(&BlockLinears::mlp_out);
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
    plan.distribute = r->distribute_input && tp_.size() > 1;
    KILN_CHECK(!plan.distribute || !tp_.sequence_parallel(), "block ", l,
               ": distributed saved inputs need sequence parallelism off");
    if (plan.distribute) tp_.require({N, cat("block ", l, "'s saved input"), "token rows"});
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
      {&BlockActs::fc_pre, kMlpGroup, act, {N, mlp_in_.local_out()}, true},
      {&BlockActs::fc, kMlpGroup, act, {N, mlp_in_.local_out()}, keep_fc},
  };

  arena_.request(&tokens_, DType::i32, {N});
  arena_.request(&targets_, DType::i32, {N});
  arena_.request(&losses_, DType::f32, {static_cast<std::int64_t>(slots_), N});
  res_.resize(static_cast<std::size_t>(L_ + 1));
  res_saved_.resize(static_cast<std::size_t>(L_));
  acts_.resize(static_cast<std::size_t>(L_));
  for (int l = 0; l <= L_; ++l) {
    if (l < L_ && plan_[static_cast<std::size_t>(l)].distribute)
      arena_.request(&res_saved_[static_cast<std::size_t>(l)], act, {N / tp_.size(), C});
    else
      arena_.request(&res_[static_cast<std::size_t>(l)], act, {Nl, C});
  }
  if (any_distributed)
    for (auto& r : res_pingpong_) arena_.request(&r, act, {N, C});
  if (!keep_ln) arena_.request(&ln_shared_, act, {N, C});
  if (!keep_fc && !gelu_in_fc2_) arena_.request(&fc_shared_, act, {N, mlp_in_.local_out()});
  for (const auto& f : fields) {
    if (!f.own) continue;
    for (int l = 0; l < L_; ++l)
      if (kept(l, f.group)) arena_.request(&(acts_[static_cast<std::size_t>(l)].*f.member), f.dtype, f.shape);
    if (shared_group[f.group]) arena_.request(&(shared_acts_.*f.member), f.dtype, f.shape);
  }
  arena_.request(&lnf_, act, {N, C});
  arena_.request(&lnf_mean_, DType::f32, {Nl});
  arena_.request(&lnf_rstd_, DType::f32, {Nl});
  arena_.request(&logits_, act, {N, lm_head_.local_out()});
  arena_.request(&scratch_c_, act, {N, C});
  arena_.request(&dres_, act, {Nl, C});
  arena_.request(&dtmp_, act, {Nl, C});
  if (tp_.sequence_parallel()) {
    arena_.request(&local_c_, act, {Nl, C});
    arena_.request(&full_c_, act, {N, C});
  }
  arena_.request(&datty_, act, {N, attn_out_.local_in()});
  arena_.request(&dln_, act, {N, C});
  arena_.request(&dqkv_, act, {N, qkv_.local_out()});
  arena_.request(&dfc_, act, {N, mlp_in_.local_out()});
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
  if (!tp_.sequence_parallel()) local_c_ = full_c_ = scratch_c_;  // without sequence parallelism local is full
  allocated_ = true;
}

Entity GptModel::add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit, bool decay,
                           float std, float value, std::vector<Entity>& layer_params) {
  Param p;
  p.name = name;
  p.global_shape = global_shape;
  p.shard = shard;
  p.shape = shard.local_shape(global_shape);
  p.weight_decay = decay;
  p.init_std = std;
  p.init_value = value;
  p.unit = unit;
  const Entity e = world_.resource<ParamStore>().add(world_, std::move(p));
  layer_params.push_back(e);
  return e;
}

Entity GptModel::add_norm_param(const std::string& name, int unit, float value, std::vector<Entity>& layer_params) {
  Entity e = add_param(name, {C_}, TensorShard{}, unit, false, 0, value, layer_params);
  world_.get<Param>(e).tp_partial_grad = tp_.sequence_parallel();  // LayerNorms see this rank's rows only
  return e;
}

Entity GptModel::add_linear(const std::string& name, nn::LinearRole role, int unit, Entity w, std::optional<Entity> b,
                            std::int64_t in, std::int64_t out) {
  Entity e = world_.create(name);
  world_.emplace<Linear>(e, Linear{role, unit, w, b, static_cast<int>(in), static_cast<int>(out)});
  return e;
}

bool GptModel::layernorm_on_load(Entity linear) const {
  const auto* impl = world_.try_get<ops::LinearImpl>(linear);
  return recompute_ln_ && !tp_.sequence_parallel() && impl && impl->takes_layernorm_input;
}

const ops::LinearImpl& GptModel::impl(Entity linear) const {
  const auto* attached = world_.try_get<ops::LinearImpl>(linear);
  return attached ? *attached : backend_linear_;
}

ops::LinearBackward GptModel::backward_args(Entity linear, ops::LinearBackward a) const {
  const auto* run = world_.try_resource<RunControl>();
  a.dweight_overwrite =
      (!run || run->micro_batch == 0) && world_.has<nn::GradWrittenFirst>(world_.get<Linear>(linear).weight);
  return a;
}

void GptModel::initialise(rng::RngStatesTracker& tracker) {
  auto& store = world_.resource<ParamStore>();
  const TensorView master = store.master_flat();
  for (Entity e : store.order) {
    const auto& p = world_.get<Param>(e);
    // One draw of the whole logical tensor from the default state, on every rank: element i of the
    // logical tensor is Philox element i of the draw, whatever part of it this rank holds (its
    // tensor-parallel shard, and of that its part of the unit under FSDP).
    const rng::PhiloxArgs r =
        p.init_std > 0 ? tracker.draw(static_cast<std::uint64_t>(p.global_shape.numel())) : rng::PhiloxArgs{};
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      const TensorView held = ParamStore::held_view(master, part);
      if (p.init_std == 0) {
        be_.fill(held, p.init_value);
        return;
      }
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        be_.init_normal(held.flat_slice(b.local - part.first, b.count), p.init_std, r, b.global);
      });
    });
  }
  be_.convert(store.compute_flat(), store.master_flat());
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
  // This rank's rows of the step's [batch tokens, C] tensor: its micro-batch's, under sequence
  // parallelism its part of them.
  d.row_offset = seq_offset_ * T_ + tp_.first_local_row(N_);
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
