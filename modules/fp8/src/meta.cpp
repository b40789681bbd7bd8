#include "kiln/fp8/meta.hpp"

#include "kiln/core/error.hpp"

namespace kiln::fp8 {

Fp8MetaStore::Fp8MetaStore(Fp8Ops& ops, std::vector<Format> formats, int history_len)
    : n_(static_cast<int>(formats.size())),
      len_(history_len),
      formats_(std::move(formats)),
      ready_(formats_.size(), 0),
      device_(ops.device()) {
  KILN_CHECK(history_len >= 1, "FP8 amax history length ", history_len, " must be at least 1");
  const std::int64_t floats = inv_offset() + kScaleInvStride * n_;
  std::vector<float> init(static_cast<std::size_t>(floats), 0.0f);
  for (int i = 0; i < n_; ++i) {
    init[static_cast<std::size_t>(len_ * n_ + i)] = 1.0f;  // scale
    init[static_cast<std::size_t>((len_ + 1) * n_ + i)] = max_value(formats_[static_cast<std::size_t>(i)]);
    init[static_cast<std::size_t>(inv_offset() + kScaleInvStride * i)] = 1.0f;  // scale_inv
  }
  buf_ = ops.alloc(static_cast<std::size_t>(std::max<std::int64_t>(floats, 1)) * sizeof(float));
  if (floats > 0) ops.copy(buf_.data(), init.data(), init.size() * sizeof(float));
}

TensorView Fp8MetaStore::view(std::int64_t offset, Shape shape) const {
  return buf_.view(DType::f32, shape, static_cast<std::size_t>(offset) * sizeof(float));
}

ScalingSlot Fp8MetaStore::slot(int i) const {
  KILN_CHECK(i >= 0 && i < n_, "FP8 meta slot ", i, " outside 0..", n_ - 1);
  float* base = static_cast<float*>(buf_.data());
  ScalingSlot s;
  s.index = i;
  s.format = formats_[static_cast<std::size_t>(i)];
  s.fp8_max = max_value(s.format);
  s.amax = base + i;
  s.scale = base + static_cast<std::int64_t>(len_) * n_ + i;
  s.scale_inv = base + inv_offset() + kScaleInvStride * i;
  s.amax_now = base + static_cast<std::int64_t>(len_ + 2) * n_ + i;
  return s;
}

void Fp8MetaStore::update(Fp8Ops& ops, AmaxAlgo algo, int margin) {
  if (n_ == 0) return;
  DelayedUpdateArgs a;
  a.history = history().as<float>();
  a.scale = scales().as<float>();
  a.scale_inv = scale_invs().as<float>();
  a.scale_inv_stride = kScaleInvStride;
  a.fp8_max = fp8_maxes().as<float>();
  a.len = len_;
  a.n = n_;
  a.algo = algo;
  a.margin = margin;
  ops.update_delayed(a);
  set_all_ready();
}

}  // namespace kiln::fp8
