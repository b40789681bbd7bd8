// Generator: weights upload, the KV-cached forward pass, and the sampling loop.
#include "kiln/model/generator.hpp"

#include <algorithm>
#include <cmath>

#include "kiln/core/error.hpp"
#include "kiln/model/spec.hpp"

namespace kiln::model {

Generator::Generator(const ModelConfig& cfg, ops::Backend& backend, const WeightSource& weights)
    : cfg_(cfg),
      spec_(model_spec(cfg)),
      be_(backend),
      C_(cfg.n_embd),
      H_(cfg.n_head),
      K_(cfg.kv_heads()),
      D_(cfg.head_dim()),
      F_(cfg.mlp_hidden()),
      Vp_(cfg.padded_vocab()),
      Tmax_(cfg.max_seq_len),
      logit_rows_(std::min(cfg.max_seq_len, 64)) {
  KILN_CHECK(cfg.n_layer > 0 && H_ > 0 && C_ % H_ == 0 && Tmax_ > 0 && cfg.vocab_size > 0,
             "generator: invalid model config");
  KILN_CHECK(!cfg.moe.enabled(), "generator: a mixture of experts (model.moe) does not generate yet");
  const DType act = be_.act_dtype();
  const std::int64_t C = C_, T = Tmax_, W = qkv_width(), F = F_, fc_rows = spec_.mlp_in_parts() * F;
  const bool norm_bias = spec_.norm == NormKind::layernorm, attn_bias = spec_.attention.bias,
             mlp_bias = spec_.mlp_options.bias;
  weights_.request(&wte_, act, {Vp_, C});
  if (spec_.positions == Positions::learned) weights_.request(&wpe_, act, {T, C});
  blocks_.resize(static_cast<std::size_t>(cfg.n_layer));
  for (Block& b : blocks_) {
    for (TensorView* v : {&b.ln1_w, &b.ln2_w}) weights_.request(v, act, {C});
    if (norm_bias)
      for (TensorView* v : {&b.ln1_b, &b.ln2_b}) weights_.request(v, act, {C});
    weights_.request(&b.qkv_w, act, {W, C});
    if (attn_bias) weights_.request(&b.qkv_b, act, {W});
    weights_.request(&b.proj_w, act, {C, C});
    if (attn_bias) weights_.request(&b.proj_b, act, {C});
    weights_.request(&b.fc_w, act, {fc_rows, C});
    if (mlp_bias) weights_.request(&b.fc_b, act, {fc_rows});
    weights_.request(&b.fcp_w, act, {C, F});
    if (mlp_bias) weights_.request(&b.fcp_b, act, {C});
    acts_.request(&b.cache, act, {T, W});
  }
  weights_.request(&lnf_w_, act, {C});
  if (norm_bias) weights_.request(&lnf_b_, act, {C});
  if (!cfg.tie_embeddings) weights_.request(&head_w_, act, {Vp_, C});
  weights_.allocate(be_);
  if (cfg.tie_embeddings) head_w_ = wte_;

  acts_.request(&tokens_, DType::i32, {T});
  acts_.request(&doc_start_, DType::i32, {T});
  for (TensorView* v : {&x_, &ln_, &atty_, &tmp_}) acts_.request(v, act, {T, C});
  acts_.request(&mean_, DType::f32, {T});
  acts_.request(&rstd_, DType::f32, {T});
  acts_.request(&lse_, DType::f32, {H_ * T});
  acts_.request(&fc_pre_, act, {T, fc_rows});
  acts_.request(&fc_, act, {T, F});
  acts_.request(&logits_, act, {logit_rows_, Vp_});
  acts_.request(&logits_f32_, DType::f32, {logit_rows_, Vp_});
  acts_.allocate(be_);
  upload(weights);
}

void Generator::upload(const WeightSource& weights) {
  // The f32 weights go through a device f32 buffer and the backend's conversion, so they are
  // rounded exactly as the training model's compute copy is.
  Buffer staging;
  auto put = [&](const std::string& name, const TensorView& dst) {
    std::vector<float> host = weights(name);
    KILN_CHECK(static_cast<std::int64_t>(host.size()) == dst.numel(), "generator: weight '", name, "' has ",
               host.size(), " values, expected ", dst.numel(), " (shape ", dst.shape.str(), ")");
    const std::size_t bytes = host.size() * sizeof(float);
    if (staging.bytes() < bytes) staging = be_.alloc(bytes);
    const TensorView dev = staging.view(DType::f32, dst.shape);
    be_.copy(dev, TensorView(host.data(), dst.shape, DType::f32, Device::cpu));
    be_.convert(dst, dev);
    be_.synchronize();  // before `host` and the staging buffer are reused
  };
  // The training model's names (the parts'): a weight the spec does not have (a position table, a
  // bias) was not requested above.
  auto put_if = [&](const std::string& name, const TensorView& dst) {
    if (dst) put(name, dst);
  };
  const std::string norm = spec_.norm_stem();
  put("wte", wte_);
  put_if("wpe", wpe_);
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    Block& b = blocks_[l];
    put(p + norm + "1.weight", b.ln1_w);
    put_if(p + norm + "1.bias", b.ln1_b);
    put(p + "attn.qkv.weight", b.qkv_w);
    put_if(p + "attn.qkv.bias", b.qkv_b);
    put(p + "attn.proj.weight", b.proj_w);
    put_if(p + "attn.proj.bias", b.proj_b);
    put(p + norm + "2.weight", b.ln2_w);
    put_if(p + norm + "2.bias", b.ln2_b);
    put(p + "mlp.fc.weight", b.fc_w);
    put_if(p + "mlp.fc.bias", b.fc_b);
    put(p + "mlp.proj.weight", b.fcp_w);
    put_if(p + "mlp.proj.bias", b.fcp_b);
  }
  put(norm + "f.weight", lnf_w_);
  put_if(norm + "f.bias", lnf_b_);
  if (head_w_.data != wte_.data) put("lm_head.weight", head_w_);
}

std::int64_t Generator::qkv_width() const { return static_cast<std::int64_t>(H_ + 2 * K_) * D_; }

void Generator::norm(const TensorView& out, const TensorView& x, const TensorView& w, const TensorView& b, int rows) {
  if (spec_.norm == NormKind::rmsnorm)
    be_.rmsnorm_forward({out, rstd_.rows(0, rows), x, w, cfg_.norm_eps});
  else
    be_.layernorm_forward({out, mean_.rows(0, rows), rstd_.rows(0, rows), x, w, b, cfg_.norm_eps});
}

void Generator::check_tokens(std::span<const int> tokens) const {
  for (std::size_t i = 0; i < tokens.size(); ++i)
    KILN_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size, "generator: token ", tokens[i], " at ", i,
               " is outside the vocabulary of ", cfg_.vocab_size);
}

void Generator::forward(std::span<const int> tokens, std::span<const std::int32_t> doc_start) {
  const int n = static_cast<int>(tokens.size()), pos = length_;
  KILN_CHECK(n > 0 && (pos == 0 || n == 1), "generator: a prompt starts at position 0, later tokens come one at a time");
  KILN_CHECK(doc_start.empty() || static_cast<int>(doc_start.size()) == n, "generator: ", doc_start.size(),
             " document starts for ", n, " tokens");
  for (int i = 0; i < static_cast<int>(doc_start.size()); ++i)
    KILN_CHECK(doc_start[static_cast<std::size_t>(i)] >= 0 && doc_start[static_cast<std::size_t>(i)] <= i,
               "generator: document start ", doc_start[static_cast<std::size_t>(i)], " of position ", i,
               " is not in [0, ", i, "]");
  KILN_CHECK(pos + n <= Tmax_, "generator: position ", pos + n - 1, " is beyond the context of ", Tmax_,
             " positions (model.max_seq_len)");
  check_tokens(tokens);
  host_tokens_.assign(tokens.begin(), tokens.end());
  const TensorView tok = tokens_.rows(0, n);
  be_.copy(tok, TensorView(host_tokens_.data(), {n}, DType::i32, Device::cpu));
  const TensorView docs = doc_start.empty() ? TensorView{} : doc_start_.rows(0, n).reshape({1, n});
  if (!doc_start.empty()) {
    host_doc_start_.assign(doc_start.begin(), doc_start.end());
    be_.copy(docs, TensorView(host_doc_start_.data(), {1, n}, DType::i32, Device::cpu));
  }

  const TensorView x = x_.rows(0, n), ln = ln_.rows(0, n), atty = atty_.rows(0, n), tmp = tmp_.rows(0, n);
  const TensorView fc_pre = fc_pre_.rows(0, n), fc = fc_.rows(0, n);
  const TensorView lse = lse_.flat_slice(0, static_cast<std::int64_t>(H_) * n).reshape({1, H_, n});
  const float scale = 1.0f / std::sqrt(static_cast<float>(D_));
  // The cache rows as attention reads them: [1, positions, 3, H, D] for multi-head attention, else
  // [1, positions, H + 2K, D] (the same bytes); kv_heads 0 is multi-head attention.
  const int kv_heads = K_ == H_ ? 0 : K_;
  auto heads = [&](const TensorView& rows, std::int64_t positions) {
    return kv_heads ? rows.reshape({1, positions, H_ + 2 * K_, D_}) : rows.reshape({1, positions, 3, H_, D_});
  };
  // Learned positions: wpe rows from `pos` (the op adds row n % T of the table it is given). Rotary
  // positions: applied to the new rows' query and key heads as the cache takes them.
  const bool learned = spec_.positions == Positions::learned;
  be_.embedding_forward({x, tok, wte_, learned ? wpe_.rows(pos, n) : TensorView{}, n, 0, 0, learned});
  for (const Block& b : blocks_) {
    norm(ln, x, b.ln1_w, b.ln1_b, n);
    const TensorView rows = b.cache.rows(pos, n);
    be_.linear_forward({rows, {}, ln, b.qkv_w, b.qkv_b});
    if (spec_.attention.rope)
      be_.rope({rows.reshape({1, n, H_ + 2 * K_, D_}), H_ + K_, spec_.attention.rope->theta, pos, false,
                spec_.attention.rope->scaling});
    if (pos == 0) {
      ops::AttentionForward a{atty.reshape({1, n, H_, D_}), lse, heads(b.cache.rows(0, n), n), scale};
      a.kv_heads = kv_heads;
      a.doc_start = docs;
      be_.attention_forward(a);
    } else {
      ops::AttentionDecode a{atty.reshape({1, H_, D_}), heads(b.cache, Tmax_), pos + 1, scale};
      a.kv_heads = kv_heads;
      be_.attention_decode(a);
    }
    be_.linear_forward({tmp, {}, atty, b.proj_w, b.proj_b});
    be_.residual_forward({x, x, tmp});
    norm(ln, x, b.ln2_w, b.ln2_b, n);
    if (spec_.mlp == MlpKind::swiglu) {  // FC1 writes [gate | up]
      be_.linear_forward({fc_pre, {}, ln, b.fc_w, b.fc_b});
      be_.swiglu_forward({fc, fc_pre});
    } else {  // the GELU in FC1's epilogue, as the training model's FC1 writes it
      be_.linear_forward({fc, fc_pre, ln, b.fc_w, b.fc_b});
    }
    be_.linear_forward({tmp, {}, fc, b.fcp_w, b.fcp_b});
    be_.residual_forward({x, x, tmp});
  }
  length_ = pos + n;
}

std::vector<float> Generator::logits(int first, int count) {
  const int V = cfg_.vocab_size;
  std::vector<float> out(static_cast<std::size_t>(count) * V);
  std::vector<float> host(static_cast<std::size_t>(logit_rows_) * Vp_);
  for (int r0 = 0; r0 < count; r0 += logit_rows_) {
    const int r = std::min(logit_rows_, count - r0);
    const TensorView x = x_.rows(first + r0, r), ln = ln_.rows(first + r0, r);
    norm(ln, x, lnf_w_, lnf_b_, r);
    be_.linear_forward({logits_.rows(0, r), {}, ln, head_w_, {}});
    be_.convert(logits_f32_.rows(0, r), logits_.rows(0, r));
    be_.copy(TensorView(host.data(), {r, Vp_}, DType::f32, Device::cpu), logits_f32_.rows(0, r));
    be_.synchronize();
    for (int i = 0; i < r; ++i)  // the real vocabulary only: padding rows of wte are not tokens
      std::copy_n(host.begin() + static_cast<std::ptrdiff_t>(i) * Vp_, V,
                  out.begin() + static_cast<std::ptrdiff_t>(r0 + i) * V);
  }
  return out;
}

std::vector<float> Generator::prefill(std::span<const int> prompt, bool all_positions,
                                      std::span<const std::int32_t> doc_start) {
  KILN_CHECK(!prompt.empty(), "generator: an empty prompt (give at least one token, e.g. an end-of-text token)");
  length_ = 0;
  forward(prompt, doc_start);
  const int n = static_cast<int>(prompt.size());
  return all_positions ? logits(0, n) : logits(n - 1, 1);
}

std::vector<float> Generator::decode(int token) {
  forward(std::span<const int>(&token, 1));
  return logits(0, 1);
}

std::vector<int> Generator::generate(std::span<const int> prompt, int new_tokens, const SamplingOptions& options) {
  KILN_CHECK(new_tokens >= 0, "generator: ", new_tokens, " new tokens");
  KILN_CHECK(static_cast<int>(prompt.size()) <= Tmax_, "generator: a prompt of ", prompt.size(),
             " tokens exceeds the context of ", Tmax_, " (model.max_seq_len)");
  std::vector<int> out;
  // The context limit: stop once prompt + new tokens fill max_seq_len positions.
  const int n = std::min(new_tokens, Tmax_ - static_cast<int>(prompt.size()));
  if (n <= 0) return out;
  std::vector<float> next = prefill(prompt);
  for (int i = 0; i < n; ++i) {
    out.push_back(sample_token(next, options, static_cast<std::uint64_t>(i)));
    if (std::find(options.stop.begin(), options.stop.end(), out.back()) != options.stop.end()) break;
    if (i + 1 < n) next = decode(out.back());  // the last token is never fed
  }
  return out;
}

}  // namespace kiln::model
