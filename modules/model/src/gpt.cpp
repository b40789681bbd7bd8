// GptModel: parameter entities, the flat parameter buffers, activation memory, initialisation.
#include <array>
#include <cmath>

#include "kiln/model/gpt.hpp"
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
  const float std = cfg.init_std;
  const float proj_std = std / std::sqrt(2.0f * L_);  // GPT-2: residual projections scaled by 1/sqrt(2L)
  const int C = C_;
  world_.emplace_resource<ParamStore>();

  auto make_layer = [&](int unit, LayerKind kind, int block, const std::string& name) {
    Entity e = world_.create(name);
    world_.emplace<Layer>(e, Layer{unit, block, kind, {}});
    layers_.push_back(e);
    return e;
  };

  // Unit 0: embeddings. The LM head reuses wte.
  Entity emb = make_layer(0, LayerKind::embedding, -1, "embeddings");
  auto& emb_params = world_.get<Layer>(emb).params;
  wte_ = add_param("wte", {Vp_, C}, 0, true, std, 0, emb_params);
  wpe_ = add_param("wpe", {cfg.max_seq_len, C}, 0, true, std, 0, emb_params);

  for (int l = 0; l < L_; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    Entity layer = make_layer(l + 1, LayerKind::block, l, "blocks." + std::to_string(l));
    auto& lp = world_.get<Layer>(layer).params;
    std::array<Entity, 12> e{};
    e[kLn1W] = add_param(p + "ln_1.weight", {C}, l + 1, false, 0, 1.0f, lp);
    e[kLn1B] = add_param(p + "ln_1.bias", {C}, l + 1, false, 0, 0.0f, lp);
    e[kQkvW] = add_param(p + "attn.qkv.weight", {3 * C, C}, l + 1, true, std, 0, lp);
    e[kQkvB] = add_param(p + "attn.qkv.bias", {3 * C}, l + 1, false, 0, 0.0f, lp);
    e[kProjW] = add_param(p + "attn.proj.weight", {C, C}, l + 1, true, proj_std, 0, lp);
    e[kProjB] = add_param(p + "attn.proj.bias", {C}, l + 1, false, 0, 0.0f, lp);
    e[kLn2W] = add_param(p + "ln_2.weight", {C}, l + 1, false, 0, 1.0f, lp);
    e[kLn2B] = add_param(p + "ln_2.bias", {C}, l + 1, false, 0, 0.0f, lp);
    e[kFcW] = add_param(p + "mlp.fc.weight", {4 * C, C}, l + 1, true, std, 0, lp);
    e[kFcB] = add_param(p + "mlp.fc.bias", {4 * C}, l + 1, false, 0, 0.0f, lp);
    e[kFcpW] = add_param(p + "mlp.proj.weight", {C, 4 * C}, l + 1, true, proj_std, 0, lp);
    e[kFcpB] = add_param(p + "mlp.proj.bias", {C}, l + 1, false, 0, 0.0f, lp);
    block_params_.push_back(e);
    add_linear(p + "attn.qkv", "qkv", l + 1, e[kQkvW], e[kQkvB], C, 3 * C);
    add_linear(p + "attn.proj", "attn_proj", l + 1, e[kProjW], e[kProjB], C, C);
    add_linear(p + "mlp.fc", "fc", l + 1, e[kFcW], e[kFcB], C, 4 * C);
    add_linear(p + "mlp.proj", "fc_proj", l + 1, e[kFcpW], e[kFcpB], 4 * C, C);
  }
  Entity fin = make_layer(L_ + 1, LayerKind::final_norm, -1, "ln_f");
  auto& fp = world_.get<Layer>(fin).params;
  lnf_w_ = add_param("ln_f.weight", {C}, L_ + 1, false, 0, 1.0f, fp);
  lnf_b_ = add_param("ln_f.bias", {C}, L_ + 1, false, 0, 0.0f, fp);
  add_linear("lm_head", "lm_head", L_ + 1, wte_, std::nullopt, C, Vp_);

  // The flat buffers.
  auto& store = world_.resource<ParamStore>();
  store.act = be_.act_dtype();
  store.master = be_.alloc(static_cast<std::size_t>(store.total) * 4);
  store.compute = be_.alloc(static_cast<std::size_t>(store.total) * size_of(store.act));
  store.grads = be_.alloc(static_cast<std::size_t>(store.total) * 4);
  be_.zero(store.master_flat());  // alignment padding stays zero
  be_.zero(store.grads_flat());

  // Activations for one micro-batch, kept for the backward pass.
  const std::int64_t N = static_cast<std::int64_t>(B) * T;
  const DType act = be_.act_dtype();
  arena_.request(&tokens_, DType::i32, {N});
  arena_.request(&targets_, DType::i32, {N});
  arena_.request(&losses_, DType::f32, {static_cast<std::int64_t>(slots_), N});
  res_.resize(L_ + 1);
  acts_.resize(L_);
  for (auto& r : res_) arena_.request(&r, act, {N, C});
  // With recompute_norm_gelu, every block's LayerNorm outputs and GELU output share one scratch
  // tensor each, refilled in the backward pass.
  const bool keep = !cfg.recompute_norm_gelu;
  if (!keep) {
    arena_.request(&ln_shared_, act, {N, C});
    arena_.request(&fc_shared_, act, {N, 4 * C});
  }
  for (auto& a : acts_) {
    arena_.request(&a.ln1_mean, DType::f32, {N});
    arena_.request(&a.ln1_rstd, DType::f32, {N});
    if (keep) arena_.request(&a.ln1, act, {N, C});
    arena_.request(&a.qkv, act, {B, T, 3, H_, C / H_});
    arena_.request(&a.atty, act, {B, T, H_, C / H_});
    arena_.request(&a.lse, DType::f32, {B, H_, T});
    arena_.request(&a.res2, act, {N, C});
    arena_.request(&a.ln2_mean, DType::f32, {N});
    arena_.request(&a.ln2_rstd, DType::f32, {N});
    if (keep) arena_.request(&a.ln2, act, {N, C});
    arena_.request(&a.fc_pre, act, {N, 4 * C});
    if (keep) arena_.request(&a.fc, act, {N, 4 * C});
  }
  arena_.request(&lnf_, act, {N, C});
  arena_.request(&lnf_mean_, DType::f32, {N});
  arena_.request(&lnf_rstd_, DType::f32, {N});
  arena_.request(&logits_, act, {N, Vp_});
  arena_.request(&scratch_c_, act, {N, C});
  arena_.request(&dres_, act, {N, C});
  arena_.request(&dtmp_, act, {N, C});
  arena_.request(&datty_, act, {N, C});
  arena_.request(&dln_, act, {N, C});
  arena_.request(&dqkv_, act, {N, 3 * C});
  arena_.request(&dfc_, act, {N, 4 * C});
  arena_.allocate(be_);
  if (!keep)
    for (auto& a : acts_) {
      a.ln1 = a.ln2 = ln_shared_;
      a.fc = fc_shared_;
    }
}

Entity GptModel::add_param(const std::string& name, Shape shape, int unit, bool decay, float std, float value,
                           std::vector<Entity>& layer_params) {
  auto& store = world_.resource<ParamStore>();
  Param p;
  p.name = name;
  p.shape = shape;
  p.numel = shape.numel();
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

void GptModel::add_linear(const std::string& name, const std::string& role, int unit, Entity w,
                          std::optional<Entity> b, int in, int out) {
  world_.emplace<Linear>(world_.create(name), Linear{role, unit, w, b, in, out});
}

void GptModel::initialise(rng::RngStatesTracker& tracker) {
  auto& store = world_.resource<ParamStore>();
  for (Entity e : store.order) {
    const auto& p = world_.get<Param>(e);
    TensorView v = store.master_view(p).reshape({p.numel});
    if (p.init_std > 0) {
      // One draw of the whole logical tensor from the default state: element i of the parameter is
      // Philox element i of the draw, whatever part of it a rank holds.
      auto r = tracker.draw(static_cast<std::uint64_t>(p.numel));
      be_.init_normal(v, p.init_std, r, 0);
    } else {
      be_.fill(v, p.init_value);
    }
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
