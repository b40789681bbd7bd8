#include "profiled_ops.hpp"

#include <algorithm>
#include <map>
#include <string>

#include "kiln/core/error.hpp"

namespace kiln::fp8 {

namespace {

class ProfiledOps final : public Fp8Ops {
 public:
  ProfiledOps(std::unique_ptr<Fp8Ops> inner, ops::Backend& backend) : in_(std::move(inner)), be_(backend) {}
  Device device() const override { return in_->device(); }
  DType act_dtype() const override { return in_->act_dtype(); }
  Buffer alloc(std::size_t bytes) override { return in_->alloc(bytes); }
  void copy(void* dst, const void* src, std::size_t bytes) override { in_->copy(dst, src, bytes); }
  void copy_on_device(void* dst, const void* src, std::size_t bytes) override { in_->copy_on_device(dst, src, bytes); }
  void zero(void* dst, std::size_t bytes) override { in_->zero(dst, bytes); }
  void synchronize() override { in_->synchronize(); }

  void amax(const TensorView& x, float* amax) override {
    Scope s(be_, "fp8_amax");
    in_->amax(x, amax);
  }
  void scale_from_amax(const float* amax, float* scale, float* scale_inv, float fp8_max, int margin) override {
    Scope s(be_, "fp8_scale_from_amax");
    in_->scale_from_amax(amax, scale, scale_inv, fp8_max, margin);
  }
  void quantize(const TensorView& x, const Fp8TensorView& out, float* amax) override {
    Scope s(be_, out.rowwise && out.colwise ? "fp8_quantize_both" : out.rowwise ? "fp8_quantize_rowwise"
                                                                                : "fp8_quantize_colwise");
    in_->quantize(x, out, amax);
  }
  void quantize_grouped(const GroupedQuantizeArgs& a) override {
    // fp8_quantize_grouped[_<prologue>]_<copies>, e.g. fp8_quantize_grouped_dswiglu_both.
    static constexpr const char* kNames[5][4] = {
        {"fp8_quantize_grouped_both", "fp8_quantize_grouped_rowwise", "fp8_quantize_grouped_colwise",
         "fp8_quantize_grouped_amax"},
        {"fp8_quantize_grouped_gelu_both", "fp8_quantize_grouped_gelu_rowwise", "fp8_quantize_grouped_gelu_colwise",
         "fp8_quantize_grouped_gelu_amax"},
        {"fp8_quantize_grouped_swiglu_both", "fp8_quantize_grouped_swiglu_rowwise",
         "fp8_quantize_grouped_swiglu_colwise", "fp8_quantize_grouped_swiglu_amax"},
        {"fp8_quantize_grouped_dgelu_both", "fp8_quantize_grouped_dgelu_rowwise", "fp8_quantize_grouped_dgelu_colwise",
         "fp8_quantize_grouped_dgelu_amax"},
        {"fp8_quantize_grouped_dswiglu_both", "fp8_quantize_grouped_dswiglu_rowwise",
         "fp8_quantize_grouped_dswiglu_colwise", "fp8_quantize_grouped_dswiglu_amax"}};
    const int copies = a.out.rowwise && a.out.colwise ? 0 : a.out.rowwise ? 1 : a.out.colwise ? 2 : 3;
    Scope s(be_, kNames[a.x.index()][copies]);
    in_->quantize_grouped(a);
  }
  void quantize_blocks(const BlockQuantizeArgs& a) override {
    Scope s(be_, block_name(a.x, a.mode, !a.rowwise.empty(), !a.colwise.empty(), !a.dbias.empty(), false));
    in_->quantize_blocks(a);
  }
  void quantize_blocks_grouped(const GroupedBlockQuantizeArgs& a) override {
    const auto with_rows = std::find_if(a.groups.begin(), a.groups.end(), [](const BlockGroup& g) { return g.rows > 0; });
    const bool row = with_rows != a.groups.end() && with_rows->rowwise, col = with_rows != a.groups.end() && with_rows->colwise;
    Scope s(be_, block_name(a.x, a.mode, row, col, false, true));
    in_->quantize_blocks_grouped(a);
  }
  void block_part_amax(const BlockPart& p, float* tile_amax) override {
    Scope s(be_, "fp8_block_part_amax");
    in_->block_part_amax(p, tile_amax);
  }
  void block_scales(const float* tile_amax, std::int64_t rows, std::int64_t cols, Format f, bool pow2, float* scale,
                    float* row_scale_inv, float* col_scale_inv) override {
    Scope s(be_, "fp8_block_scales");
    in_->block_scales(tile_amax, rows, cols, f, pow2, scale, row_scale_inv, col_scale_inv);
  }
  void quantize_block_part(const BlockPart& p, const float* scale, Format f, std::uint8_t* codes) override {
    Scope s(be_, "fp8_quantize_block_part");
    in_->quantize_block_part(p, scale, f, codes);
  }
  void adamw_quantize_blocks(const AdamWQuantizeArgs& u, const BlockQuantizeArgs& out) override {
    Scope s(be_, "fp8_adamw_quantize_blocks");
    in_->adamw_quantize_blocks(u, out);
  }
  void adamw_quantize_blocks_grouped(const AdamWQuantizeArgs& u, const GroupedBlockQuantizeArgs& out) override {
    Scope s(be_, "fp8_adamw_quantize_blocks_grouped");
    in_->adamw_quantize_blocks_grouped(u, out);
  }
  void quantize_gelu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    Scope s(be_, out.rowwise && out.colwise ? "fp8_quantize_gelu_both" : out.rowwise ? "fp8_quantize_gelu_rowwise"
                                                                                     : "fp8_quantize_gelu_colwise");
    in_->quantize_gelu(pre, out, amax);
  }
  void quantize_layernorm(const ops::LayerNormOnLoad& ln, const Fp8TensorView& out, float* amax) override {
    Scope s(be_, out.rowwise && out.colwise ? "fp8_quantize_layernorm_both"
                 : out.rowwise             ? "fp8_quantize_layernorm_rowwise"
                                           : "fp8_quantize_layernorm_colwise");
    in_->quantize_layernorm(ln, out, amax);
  }
  void layernorm_stats(const ops::LayerNormOnLoad& ln, float* amax) override {
    Scope s(be_, amax ? "fp8_layernorm_stats_amax" : "fp8_layernorm_stats");
    in_->layernorm_stats(ln, amax);
  }
  void amax_gelu(const TensorView& pre, float* amax) override {
    Scope s(be_, "fp8_amax_gelu");
    in_->amax_gelu(pre, amax);
  }
  void quantize_swiglu(const TensorView& pre, const Fp8TensorView& out, float* amax) override {
    Scope s(be_, out.rowwise && out.colwise ? "fp8_quantize_swiglu_both"
                 : out.rowwise             ? "fp8_quantize_swiglu_rowwise"
                                           : "fp8_quantize_swiglu_colwise");
    in_->quantize_swiglu(pre, out, amax);
  }
  void amax_swiglu(const TensorView& pre, float* amax) override {
    Scope s(be_, "fp8_amax_swiglu");
    in_->amax_swiglu(pre, amax);
  }
  void quantize_grad(const GradQuantizeArgs& a) override {
    Scope s(be_, a.xent       ? "fp8_quantize_grad_xent"
                 : a.gelu_pre ? (a.dbias ? "fp8_quantize_grad_dgelu_dbias" : "fp8_quantize_grad_dgelu")
                              : (a.dbias ? "fp8_quantize_grad_dbias" : "fp8_quantize_grad"));
    in_->quantize_grad(a);
  }
  void dgelu(const TensorView& dy, const TensorView& pre) override {
    Scope s(be_, "fp8_dgelu");
    in_->dgelu(dy, pre);
  }
  void xent_grad(const ops::XentOnLoad& x) override {
    Scope s(be_, "fp8_xent_grad");
    in_->xent_grad(x);
  }
  void transpose(const TensorView& out, const TensorView& in) override {
    Scope s(be_, "fp8_transpose");
    in_->transpose(out, in);
  }
  void dequantize(const TensorView& out, const TensorView& q, const float* scale_inv) override {
    Scope s(be_, "fp8_dequantize");
    in_->dequantize(out, q, scale_inv);
  }
  // Under the name the caller gave (Fp8Linear: forward, forward with GELU, dgrad, wgrad).
  void gemm(const GemmArgs& g) override {
    Scope s(be_, g.what ? g.what : "fp8_gemm");
    in_->gemm(g);
  }
  void gemm_grouped(std::span<const GemmArgs> gs) override {
    Scope s(be_, !gs.empty() && gs.front().what ? gs.front().what : "fp8_gemm_grouped");
    in_->gemm_grouped(gs);
  }
  void bias_grad(const TensorView& dbias, const TensorView& dy) override {
    Scope s(be_, "fp8_bias_grad");
    in_->bias_grad(dbias, dy);
  }
  void update_delayed(const DelayedUpdateArgs& a) override {
    Scope s(be_, "fp8_scale_update");
    in_->update_delayed(a);
  }
  void adamw_quantize(const AdamWQuantizeArgs& a) override {
    Scope s(be_, a.out.rowwise ? "fp8_adamw_quantize" : "fp8_adamw");
    in_->adamw_quantize(a);
  }

 private:
  struct Scope {
    Scope(ops::Backend& b, const char* op) : b_(b), token_(b.begin_op(op)) {}
    ~Scope() { b_.end_op(token_); }
    ops::Backend& b_;
    int token_;
  };
  std::unique_ptr<Fp8Ops> in_;
  ops::Backend& be_;
  // fp8_quantize_blocks[_grouped]_<mode>[_<prologue>]_<copies>[_dbias], e.g.
  // fp8_quantize_blocks_1x128_dgelu_both_dbias (the profiler keeps the name's pointer: it lives as
  // long as this object).
  const char* block_name(const QuantizeSource& x, ScalingMode mode, bool rowwise, bool colwise, bool dbias,
                         bool grouped) {
    static constexpr const char* kSource[] = {"", "_layernorm", "_gelu", "_swiglu", "_dgelu", "_dswiglu"};
    const int copies = rowwise && colwise ? 0 : rowwise ? 1 : 2, row = mode == ScalingMode::block_1x128 ? 0 : 1;
    const int key = (((row * 6 + static_cast<int>(x.index())) * 3 + copies) * 2 + (dbias ? 1 : 0)) * 2 + (grouped ? 1 : 0);
    auto [it, made] = names_.try_emplace(key);
    if (made)
      it->second = cat("fp8_quantize_blocks_", grouped ? "grouped_" : "", row == 0 ? "1x128" : "128x128",
                       kSource[x.index()], copies == 0 ? "_both" : copies == 1 ? "_rowwise" : "_colwise",
                       dbias ? "_dbias" : "");
    return it->second.c_str();
  }
  std::map<int, std::string> names_;  // quantize_blocks' op names by their variant
};

}  // namespace

std::unique_ptr<Fp8Ops> make_profiled_ops(std::unique_ptr<Fp8Ops> inner, ops::Backend& backend) {
  return std::make_unique<ProfiledOps>(std::move(inner), backend);
}

}  // namespace kiln::fp8
