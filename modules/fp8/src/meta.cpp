#include "kiln/fp8/meta.hpp"

#include <algorithm>
#include <cstring>

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

Fp8MetaSnapshot Fp8MetaStore::snapshot(Fp8Ops& ops) const {
  Fp8MetaSnapshot s;
  s.n = n_;
  s.len = len_;
  for (auto f : formats_) s.formats.push_back(static_cast<std::uint8_t>(f));
  s.ready = ready_;
  s.state.resize(static_cast<std::size_t>(state().numel()));
  ops.synchronize();
  if (!s.state.empty()) ops.copy(s.state.data(), buf_.data(), s.state.size() * sizeof(float));
  return s;
}

void Fp8MetaStore::restore(Fp8Ops& ops, const Fp8MetaSnapshot& s) {
  std::vector<std::uint8_t> formats;
  for (auto f : formats_) formats.push_back(static_cast<std::uint8_t>(f));
  KILN_CHECK(s.n == n_ && s.len == len_, "FP8 scaling state of ", s.n, " tensors with amax histories of ", s.len,
             " steps; this run has ", n_, " tensors with ", len_, " (fp8.amax_history_len, or another model)");
  KILN_CHECK(s.formats == formats, "FP8 scaling state with other formats (fp8.format) than this run's");
  KILN_CHECK(static_cast<std::int64_t>(s.state.size()) == state().numel(), "FP8 scaling state of ", s.state.size(),
             " values, this store has ", state().numel());
  ops.synchronize();
  if (!s.state.empty()) ops.copy(buf_.data(), s.state.data(), s.state.size() * sizeof(float));
  ops.synchronize();
  ready_ = s.ready;
}

namespace {
template <class T>
void put(std::string& out, const T* p, std::size_t n) {
  out.append(reinterpret_cast<const char*>(p), n * sizeof(T));
}
template <class T>
void take(std::string_view& in, T* p, std::size_t n) {
  KILN_CHECK(in.size() >= n * sizeof(T), "FP8 scaling state: ", in.size(), " bytes left where ", n * sizeof(T),
             " were expected");
  std::memcpy(p, in.data(), n * sizeof(T));
  in.remove_prefix(n * sizeof(T));
}
constexpr std::uint32_t kMagic = 0x38504b46;  // "FKP8"
}  // namespace

std::string Fp8MetaSnapshot::serialize() const {
  std::string out;
  const std::uint32_t head[4] = {kMagic, 1, static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(len)};
  const std::uint64_t floats = state.size();
  put(out, head, 4);
  put(out, &floats, 1);
  put(out, formats.data(), formats.size());
  put(out, ready.data(), ready.size());
  put(out, state.data(), state.size());
  return out;
}

Fp8MetaSnapshot Fp8MetaSnapshot::deserialize(std::string_view in) {
  std::uint32_t head[4];
  std::uint64_t floats = 0;
  take(in, head, 4);
  KILN_CHECK(head[0] == kMagic && head[1] == 1, "not FP8 scaling state (or of an unknown version)");
  take(in, &floats, 1);
  Fp8MetaSnapshot s;
  s.n = static_cast<int>(head[2]);
  s.len = static_cast<int>(head[3]);
  KILN_CHECK(floats <= (std::uint64_t{1} << 32) && in.size() == 2 * static_cast<std::size_t>(s.n) + floats * 4,
             "FP8 scaling state of ", in.size(), " bytes does not hold ", s.n, " slots and ", floats, " values");
  s.formats.resize(static_cast<std::size_t>(s.n));
  s.ready.resize(static_cast<std::size_t>(s.n));
  s.state.resize(floats);
  take(in, s.formats.data(), s.formats.size());
  take(in, s.ready.data(), s.ready.size());
  take(in, s.state.data(), s.state.size());
  return s;
}

Fp8MetaSnapshot Fp8MetaSnapshot::combine(const std::vector<Fp8MetaSnapshot>& ranks) {
  KILN_CHECK(!ranks.empty(), "combining no FP8 scaling states");
  Fp8MetaSnapshot out = ranks.front();
  const std::size_t n = static_cast<std::size_t>(out.n), len = static_cast<std::size_t>(out.len);
  const auto inv = static_cast<std::size_t>(Fp8MetaStore::scale_inv_offset(out.n, out.len));
  for (auto& r : ranks) {
    KILN_CHECK(r.n == out.n && r.len == out.len && r.state.size() == out.state.size() && r.formats == out.formats,
               "ranks saved FP8 scaling states of different shapes");
    for (std::size_t i = 0; i < len * n; ++i) out.state[i] = std::max(out.state[i], r.state[i]);
    for (std::size_t i = 0; i < n; ++i) {
      float& scale = out.state[len * n + i];
      if (r.state[len * n + i] < scale) {
        scale = r.state[len * n + i];
        out.state[inv + Fp8MetaStore::kScaleInvStride * i] = r.state[inv + Fp8MetaStore::kScaleInvStride * i];
      }
      out.ready[i] = out.ready[i] | r.ready[i];
    }
  }
  return out;
}

}  // namespace kiln::fp8
