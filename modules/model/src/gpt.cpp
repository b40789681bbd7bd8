// GptModel: parameter entities, the flat parameter buffers, activation memory, initialisation.
#include <algorithm>
#include <array>
#include <cmath>

#include "kiln/model/gpt.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::model {

namespace {
enum BlockParam { kLn1W, kLn1B, kQkvW, kQkvB, kProjW, kProjB, kLn2W, kLn2B, kFcW, kFcB, kFcpW, kFcpB };

// The fused QKV's rows: the query heads, then the key and the value heads, each split over TP
// (GPT-2: three parts of n_embd rows).
std::vector<std::int64_t> qkv_parts(const ModelConfig& cfg) {
  const std::int64_t D = cfg.head_dim(), K = cfg.kv_heads();
  return {cfg.n_head * D, K * D, K * D};
}
// FC1's rows: GPT-2's hidden layer, or SwiGLU's gate and up projections (each split over TP).
std::vector<std::int64_t> mlp_in_parts(const ModelConfig& cfg) {
  const std::int64_t F = cfg.mlp_hidden();
  if (cfg.llama()) return {F, F};
  return {F};
}
}  // namespace

GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : ModelBase(world, cfg, B, T, micro_batches),
      C_(cfg.n_embd),
      H_(cfg.n_head),
      K_(cfg.kv_heads()),
      F_(cfg.mlp_hidden()),
      Vp_(cfg.padded_vocab()),
      L_(cfg.n_layer),
      llama_(cfg.llama()),
      embedding_(tp_, Vp_, C_),
      qkv_(tp_, C_, qkv_parts(cfg)),
      mlp_in_(tp_, C_, mlp_in_parts(cfg)),
      lm_head_(tp_, C_, Vp_, 1, tp_.vocab_parallel()),
      attn_out_(tp_, C_, C_),
      mlp_out_(tp_, F_, C_),
      loss_(tp_, Vp_, cfg.vocab_size, N_) {
  for (const auto& d : tensor_parallel_splits(cfg, N_, tp_.sequence_parallel(), tp_.vocab_parallel())) tp_.require(d);
  Hl_ = H_ / tp_.size();
  Kl_ = K_ / tp_.size();
  head_begin_ = static_cast<int>(tp_.split(H_).first);
  const float std = cfg.init_std;
  // Residual projections scaled by 1/sqrt(2L): GPT-2's, and Megatron's output_layer_init_method
  // for Llama (Hugging Face's Llama draws them with init_std like every other matrix).
  const float proj_std = std / std::sqrt(2.0f * L_);
  const std::int64_t C = C_, D = C_ / H_;
  const TensorShard whole;
  const bool bias = !llama_;

  // Unit 0: embeddings (GPT-2's learned positions too). A tied LM head reuses wte.
  Entity emb = make_layer(0, LayerKind::embedding, -1, "embeddings");
  auto& emb_params = world_.get<Layer>(emb).params;
  wte_ = add_param("wte", {Vp_, C}, embedding_.weight_shard(), 0, true, std, 0, emb_params);
  if (!llama_) wpe_ = add_param("wpe", {cfg.max_seq_len, C}, whole, 0, true, std, 0, emb_params);

  using nn::LinearRole;
  const std::string norm = llama_ ? "norm_" : "ln_";
  const std::int64_t qkv_rows = (H_ + 2 * K_) * D;
  for (int l = 0; l < L_; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    const int unit = l + 1;
    Entity layer = make_layer(unit, LayerKind::block, l, "blocks." + std::to_string(l));
    auto& lp = world_.get<Layer>(layer).params;
    std::array<Entity, 12> e{};
    // Column-parallel: QKV (heads split, per q/k/v) and FC1 (hidden split, per gate/up); row-parallel:
    // the attention projection and FC2 (input split; their biases are replicated). Llama has no
    // biases and its RMSNorms no shift: those entries stay empty (kNoParam).
    e.fill(kNoParam);
    e[kLn1W] = add_norm_param(p + norm + "1.weight", unit, 1.0f, lp);
    if (bias) e[kLn1B] = add_norm_param(p + norm + "1.bias", unit, 0.0f, lp);
    e[kQkvW] = add_param(p + "attn.qkv.weight", {qkv_rows, C}, qkv_.weight_shard(), unit, true, std, 0, lp);
    if (bias) e[kQkvB] = add_param(p + "attn.qkv.bias", {qkv_rows}, qkv_.weight_shard(), unit, false, 0, 0.0f, lp);
    e[kProjW] = add_param(p + "attn.proj.weight", {C, C}, attn_out_.weight_shard(), unit, true, proj_std, 0, lp);
    if (bias) e[kProjB] = add_param(p + "attn.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    e[kLn2W] = add_norm_param(p + norm + "2.weight", unit, 1.0f, lp);
    if (bias) e[kLn2B] = add_norm_param(p + norm + "2.bias", unit, 0.0f, lp);
    e[kFcW] = add_param(p + "mlp.fc.weight", {mlp_in_.out(), C}, mlp_in_.weight_shard(), unit, true, std, 0, lp);
    if (bias) e[kFcB] = add_param(p + "mlp.fc.bias", {mlp_in_.out()}, mlp_in_.weight_shard(), unit, false, 0, 0.0f, lp);
    e[kFcpW] = add_param(p + "mlp.proj.weight", {C, F_}, mlp_out_.weight_shard(), unit, true, proj_std, 0, lp);
    if (bias) e[kFcpB] = add_param(p + "mlp.proj.bias", {C}, whole, unit, false, 0, 0.0f, lp);
    block_params_.push_back(e);
    auto opt = [&](int k) { return e[k] == kNoParam ? std::nullopt : std::optional<Entity>(e[k]); };
    const BlockLinears lin{
        add_linear(p + "attn.qkv", LinearRole::qkv, unit, e[kQkvW], opt(kQkvB), C, qkv_.local_out()),
        add_linear(p + "attn.proj", LinearRole::attn_out, unit, e[kProjW], opt(kProjB), attn_out_.local_in(), C),
        add_linear(p + "mlp.fc", LinearRole::mlp_in, unit, e[kFcW], opt(kFcB), C, mlp_in_.local_out()),
        add_linear(p + "mlp.proj", LinearRole::mlp_out, unit, e[kFcpW], opt(kFcpB), mlp_out_.local_in(), C)};
    block_linears_.push_back(lin);
    // Norm outputs feed only QKV / FC1, GELU (SwiGLU) outputs only FC2; attention reads its own output.
    for (Entity r : {lin.qkv, lin.mlp_in}) world_.get<Linear>(r).input_stored_for_backward = !cfg_.recompute_norm;
    world_.get<Linear>(lin.mlp_out).input_stored_for_backward = !cfg_.recompute_gelu;
    // Each block weight's gradient comes from its linear alone (the tied wte has two producers).
    for (std::size_t k : {kQkvW, kProjW, kFcW, kFcpW}) world_.emplace<nn::GradWrittenFirst>(e[k]);
  }
  Entity fin = make_layer(L_ + 1, LayerKind::final_norm, -1, llama_ ? "norm_f" : "ln_f");
  auto& fp = world_.get<Layer>(fin).params;
  lnf_w_ = add_norm_param(llama_ ? "norm_f.weight" : "ln_f.weight", L_ + 1, 1.0f, fp);
  if (bias) lnf_b_ = add_norm_param("ln_f.bias", L_ + 1, 0.0f, fp);
  // The LM head: tied to wte, or its own weight (split like wte: by vocabulary rows under
  // vocabulary parallelism, else whole on every rank), in the final norm's unit.
  head_w_ = wte_;
  if (!cfg.tie_embeddings) {
    head_w_ = add_param("lm_head.weight", {Vp_, C}, lm_head_.weight_shard(), L_ + 1, true, std, 0, fp);
    world_.emplace<nn::GradWrittenFirst>(head_w_);
  }
  lm_head_entity_ = add_linear("lm_head", LinearRole::lm_head, L_ + 1, head_w_, std::nullopt, C, lm_head_.local_out());
  // The flat buffers are laid out and allocated in Phase::setup ("params.allocate"), once a module
  // that shards them has said how.
}

std::vector<parallel::SplitDim> GptModel::tensor_parallel_splits(const ModelConfig& cfg, std::int64_t tokens,
                                                                 bool sequence_parallel, bool vocab_parallel) {
  // The heads split the attention (and with them the width: n_embd = n_head x head dim); the key
  // and value heads, the MLP's hidden width; sequence parallelism the tokens; vocabulary
  // parallelism the padded vocabulary.
  std::vector<parallel::SplitDim> dims = {{cfg.n_head, "model.n_head", "attention heads"}};
  if (cfg.n_kv_head > 0) dims.push_back({cfg.n_kv_head, "model.n_kv_head", "key/value heads"});
  dims.push_back({cfg.mlp_hidden(), cfg.ffn_hidden > 0 ? "model.ffn_hidden" : "model.n_embd",
                    "MLP hidden features (model.ffn_hidden, or its default from model.n_embd)"});
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
  const std::int64_t fc_pre_cols = mlp_in_.local_out(), fc_cols = mlp_out_.local_in();  // GPT-2: equal
  const DType act = be_.act_dtype();
  // A LayerNorm or GELU output needs storing (or recomputing) only for a consumer whose backward
  // reads its input: an implementation that keeps its own copy (LinearImpl::keeps_input) does not.
  auto kept_by_impl = [&](Entity BlockLinears::*linear) {
    std::vector<Entity> all;
    for (const auto& lin : block_linears_) all.push_back(lin.*linear);
    return inputs_kept(all);
  };
  // FC2 computing the GELU of FC1's pre-activation (LinearImpl::takes_gelu_input), or the SwiGLU
  // of FC1's [gate | up] output (takes_swiglu_input), itself: no GELU or SwiGLU output is stored,
  // recomputed, or even written.
  act_in_fc2_ = !block_linears_.empty();
  for (const auto& lin : block_linears_) {
    const auto* impl = world_.try_get<ops::LinearImpl>(lin.mlp_out);
    act_in_fc2_ = act_in_fc2_ && impl && (llama_ ? impl->takes_swiglu_input : impl->takes_gelu_input);
  }
  const bool ln_kept = kept_by_impl(&BlockLinears::qkv) && kept_by_impl(&BlockLinears::mlp_in),
             gelu_kept = act_in_fc2_ || kept_by_impl(&BlockLinears::mlp_out);
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
      {&BlockActs::ln1_mean, kAttnGroup, DType::f32, {Nl}, !llama_},  // RMSNorm: no mean
      {&BlockActs::ln1_rstd, kAttnGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln1, kAttnGroup, act, {N, C}, keep_ln},
      {&BlockActs::qkv, kAttnGroup, act, llama_ ? Shape{B_, T_, Hl_ + 2 * Kl_, D} : Shape{B_, T_, 3, Hl_, D}, true},
      {&BlockActs::atty, kAttnGroup, act, {B_, T_, Hl_, D}, true},
      {&BlockActs::lse, kAttnGroup, DType::f32, {B_, Hl_, T_}, true},
      {&BlockActs::res2, kRes2Group, act, {Nl, C}, true},
      {&BlockActs::ln2_mean, kMlpGroup, DType::f32, {Nl}, !llama_},
      {&BlockActs::ln2_rstd, kMlpGroup, DType::f32, {Nl}, true},
      {&BlockActs::ln2, kMlpGroup, act, {N, C}, keep_ln},
      {&BlockActs::fc_pre, kMlpGroup, act, {N, fc_pre_cols}, true},
      {&BlockActs::fc, kMlpGroup, act, {N, fc_cols}, keep_fc},
  };

  request_io();
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
  if (!keep_fc && !act_in_fc2_) arena_.request(&fc_shared_, act, {N, fc_cols});
  for (const auto& f : fields) {
    if (!f.own) continue;
    for (int l = 0; l < L_; ++l)
      if (kept(l, f.group)) arena_.request(&(acts_[static_cast<std::size_t>(l)].*f.member), f.dtype, f.shape);
    if (shared_group[f.group]) arena_.request(&(shared_acts_.*f.member), f.dtype, f.shape);
  }
  arena_.request(&lnf_, act, {N, C});
  if (!llama_) arena_.request(&lnf_mean_, DType::f32, {Nl});
  arena_.request(&lnf_rstd_, DType::f32, {Nl});
  arena_.request(&logits_, act, {N, lm_head_.local_out()});
  arena_.request(&scratch_c_, act, {N, C});
  arena_.request(&dres_, act, {Nl, C});
  if (tp_.sequence_parallel()) {
    arena_.request(&local_c_, act, {Nl, C});
    arena_.request(&full_c_, act, {N, C});
  }
  arena_.request(&dln_, act, {N, C});  // also the LM head's input gradient: not in the logits
  arena_.allocate(be_);
  place_block_grads(N, fc_pre_cols, fc_cols);

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

void GptModel::place_block_grads(std::int64_t N, std::int64_t fc_pre_cols, std::int64_t fc_cols) {
  // Gradients the blocks' backward passes use and nothing else: from the LM head's backward on, the
  // logits buffer is dead (the next forward rewrites it after the blocks), so they can live in it.
  const DType act = be_.act_dtype();
  if (cfg_.dropout > 0) block_grads_.request(&dtmp_, act, {Nl_, C_});
  block_grads_.request(&datty_, act, {N, attn_out_.local_in()});
  block_grads_.request(&dqkv_, act, {N, qkv_.local_out()});
  block_grads_.request(&dfc_, act, {N, fc_pre_cols});
  if (llama_) block_grads_.request(&dact_, act, {N, fc_cols});
  // What the blocks' linears may borrow as scratch meanwhile (nn::BlockScratch): up to N (2 out +
  // in) bytes for the largest (one-byte copies of its output gradient, twice, and of its input).
  const std::int64_t C = C_;
  const std::int64_t widths[4][2] = {{C, qkv_.local_out()}, {attn_out_.local_in(), C}, {C, fc_pre_cols}, {fc_cols, C}};
  std::int64_t borrow = 0;
  for (const auto& [in, out] : widths) borrow = std::max(borrow, N * (2 * out + in));
  const std::size_t logits = logits_.bytes(), grads = Arena::align_up(block_grads_.bytes());
  if (grads + static_cast<std::size_t>(borrow) <= logits) {
    const std::size_t lent = (logits - grads) / Arena::kAlign * Arena::kAlign;  // the grads at the end, aligned
    block_grads_.place(static_cast<char*>(logits_.data) + lent, logits_.device);
    lent_ = {logits_.data, lent};
    grads_in_logits_ = true;
  } else {
    block_grads_.allocate(be_);
    lent_ = {logits_.data, logits_.bytes()};
  }
}

bool GptModel::layernorm_on_load(Entity linear) const {
  const auto* impl = world_.try_get<ops::LinearImpl>(linear);
  return !llama_ && recompute_ln_ && !tp_.sequence_parallel() && impl && impl->takes_layernorm_input;
}

GptModel::BlockWeights GptModel::block_weights(int l, bool grads) const {
  const auto& e = block_params_[static_cast<std::size_t>(l)];
  auto t = [&](int i) { return tensor(e[i], grads); };
  return {t(kLn1W), t(kLn1B), t(kQkvW), t(kQkvB), t(kProjW), t(kProjB),
          t(kLn2W), t(kLn2B), t(kFcW),  t(kFcB),  t(kFcpW), t(kFcpB)};
}

double GptModel::flops_per_token() const {
  // Matmul FLOPs: 6 per weight element per token (forward + two backward GEMMs) for the block
  // linears (GPT-2: 12 C^2 per block; in general C (H + 2K) D for QKV, C^2 for the projection, and
  // C x FC1's and FC2's widths) and the LM head (Vp x C); attention scores and values add
  // 12 * L * T * C (forward 4 T C per layer, times 3), counted without causal savings (PaLM).
  const double C = C_, L = L_, D = static_cast<double>(C_) / H_;
  const double block = C * (H_ + 2.0 * K_) * D + C * C + C * double(mlp_in_.out()) + double(F_) * C;
  return 6.0 * (L * block + double(Vp_) * C) + 12.0 * L * T_ * C;
}

}  // namespace kiln::model
