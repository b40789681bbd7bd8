#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_backend.hpp"
#include "kiln/core/error.hpp"

namespace kiln::ops::cpu {

namespace {
struct AttnShape {
  std::int64_t B, T, H, D, Htot, K;
  std::int64_t row() const { return (H + 2 * K) * D; }  // stride between positions in qkv
  // Offsets in a position's row of query head h and of the key and value heads it reads.
  std::int64_t q(std::int64_t h) const { return h * D; }
  std::int64_t k(std::int64_t h) const { return (H + h / (H / K)) * D; }
  std::int64_t v(std::int64_t h) const { return (H + K + h / (H / K)) * D; }
};

AttnShape shape_of(const AttentionDims& d) { return {d.B, d.T, d.H, d.D, d.heads_total, d.K}; }

// The first key position of each query row: doc_start's (checked: 0 <= start <= i), or 0.
std::vector<std::int64_t> first_keys(const TensorView& doc_start, const AttnShape& s) {
  std::vector<std::int64_t> first(static_cast<std::size_t>(s.B * s.T), 0);
  if (!doc_start) return first;
  const auto* ds = doc_start.as<std::int32_t>();
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t i = 0; i < s.T; ++i) {
      const std::int64_t v = ds[b * s.T + i];
      KILN_CHECK(v >= 0 && v <= i, "attention: doc_start[", b, ", ", i, "] = ", v, " is not a position in [0, ", i, "]");
      first[static_cast<std::size_t>(b * s.T + i)] = v;
    }
  return first;
}

// Philox element of attention probability (b, h, i, j); see AttentionForward.
inline std::uint64_t prob_index(const AttnShape& s, std::int64_t seq_offset, int head_offset, std::int64_t b,
                                std::int64_t h, std::int64_t i, std::int64_t j) {
  return static_cast<std::uint64_t>((((seq_offset + b) * s.Htot + head_offset + h) * s.T + i) * s.T + j);
}
}  // namespace

void CpuBackend::attention_forward(const AttentionForward& a) {
  Timer timer(*this, "attention_forward");
  const AttnShape s = shape_of(check_args(a, kTarget));
  const float* qkv = a.qkv.as<float>();
  float* out = a.out.as<float>();
  float* lse = a.lse.as<float>();
  const std::int64_t rs = s.row();
  const std::uint32_t threshold = rng::dropout_threshold(a.dropout);
  const float keep_scale = a.dropout > 0 ? 1.0f / (1.0f - a.dropout) : 1.0f;
  const std::uint64_t start = a.rng.start();
  const std::vector<std::int64_t> first = first_keys(a.doc_start, s);
#pragma omp parallel for collapse(2) num_threads(threads_) schedule(static)
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.H; ++h) {
      std::vector<float> p(static_cast<std::size_t>(s.T));
      for (std::int64_t i = 0; i < s.T; ++i) {
        const float* q = qkv + (b * s.T + i) * rs + s.q(h);
        const std::int64_t j0 = first[static_cast<std::size_t>(b * s.T + i)];
        float mx = -INFINITY;
        for (std::int64_t j = j0; j <= i; ++j) {
          const float* k = qkv + (b * s.T + j) * rs + s.k(h);
          float dot = 0;
          for (std::int64_t d = 0; d < s.D; ++d) dot += q[d] * k[d];
          p[j] = dot * a.scale;
          mx = std::max(mx, p[j]);
        }
        float sum = 0;
        for (std::int64_t j = j0; j <= i; ++j) {
          p[j] = std::exp(p[j] - mx);
          sum += p[j];
        }
        lse[(b * s.H + h) * s.T + i] = mx + std::log(sum);
        float* o = out + ((b * s.T + i) * s.H + h) * s.D;
        std::vector<float> acc(static_cast<std::size_t>(s.D), 0.0f);
        for (std::int64_t j = j0; j <= i; ++j) {
          float w = p[j] / sum;
          if (a.dropout > 0) {
            auto x = rng::philox_u32(a.rng.seed, start, prob_index(s, a.seq_offset, a.head_offset, b, h, i, j));
            w = rng::dropout_keep(x, threshold) ? w * keep_scale : 0.0f;
          }
          const float* v = qkv + (b * s.T + j) * rs + s.v(h);
          for (std::int64_t d = 0; d < s.D; ++d) acc[d] += w * v[d];
        }
        for (std::int64_t d = 0; d < s.D; ++d) o[d] = store(acc[d]);
      }
    }
}

void CpuBackend::attention_backward(const AttentionBackward& a) {
  Timer timer(*this, "attention_backward");
  const AttnShape s = shape_of(check_args(a, kTarget));
  const float *qkv = a.qkv.as<float>(), *dout = a.dout.as<float>(), *lse = a.lse.as<float>();
  float* dqkv = a.dqkv.as<float>();
  const std::int64_t rs = s.row(), group = s.H / s.K;
  const std::uint32_t threshold = rng::dropout_threshold(a.dropout);
  const float keep_scale = a.dropout > 0 ? 1.0f / (1.0f - a.dropout) : 1.0f;
  const std::uint64_t start = a.rng.start();
  const std::vector<std::int64_t> first = first_keys(a.doc_start, s);
  // One (sequence, key/value head) per iteration: its query heads one after the other add to its
  // dk and dv (in fp32, stored once at the end).
#pragma omp parallel for collapse(2) num_threads(threads_) schedule(static)
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t kv = 0; kv < s.K; ++kv) {
      std::vector<float> dq(static_cast<std::size_t>(s.T * s.D)), dk(dq.size(), 0.0f), dv(dq.size(), 0.0f);
      std::vector<float> p(static_cast<std::size_t>(s.T)), dp(p.size());
      for (std::int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        std::fill(dq.begin(), dq.end(), 0.0f);
        for (std::int64_t i = 0; i < s.T; ++i) {
          const float* q = qkv + (b * s.T + i) * rs + s.q(h);
          const float* go = dout + ((b * s.T + i) * s.H + h) * s.D;
          const float l = lse[(b * s.H + h) * s.T + i];
          const std::int64_t j0 = first[static_cast<std::size_t>(b * s.T + i)];
          float dsum = 0;  // D_i = sum_j P_ij dP_ij
          for (std::int64_t j = j0; j <= i; ++j) {
            const float* k = qkv + (b * s.T + j) * rs + s.k(h);
            const float* v = qkv + (b * s.T + j) * rs + s.v(h);
            float dot = 0;
            for (std::int64_t d = 0; d < s.D; ++d) dot += q[d] * k[d];
            p[j] = std::exp(dot * a.scale - l);
            float m = 1.0f;  // mask / (1 - p_drop)
            if (a.dropout > 0) {
              auto x = rng::philox_u32(a.rng.seed, start, prob_index(s, a.seq_offset, a.head_offset, b, h, i, j));
              m = rng::dropout_keep(x, threshold) ? keep_scale : 0.0f;
            }
            float dpv = 0;
            for (std::int64_t d = 0; d < s.D; ++d) dpv += go[d] * v[d];
            dp[j] = dpv * m;
            dsum += p[j] * dp[j];
            float pd = p[j] * m;
            for (std::int64_t d = 0; d < s.D; ++d) dv[j * s.D + d] += pd * go[d];
          }
          for (std::int64_t j = j0; j <= i; ++j) {
            const float ds = p[j] * (dp[j] - dsum) * a.scale;
            const float* k = qkv + (b * s.T + j) * rs + s.k(h);
            for (std::int64_t d = 0; d < s.D; ++d) {
              dq[i * s.D + d] += ds * k[d];
              dk[j * s.D + d] += ds * q[d];
            }
          }
        }
        for (std::int64_t t = 0; t < s.T; ++t)
          for (std::int64_t d = 0; d < s.D; ++d) dqkv[(b * s.T + t) * rs + s.q(h) + d] = store(dq[t * s.D + d]);
      }
      const std::int64_t h0 = kv * group;  // any query head of the group names its key and value heads
      for (std::int64_t t = 0; t < s.T; ++t)
        for (std::int64_t d = 0; d < s.D; ++d) {
          float* row = dqkv + (b * s.T + t) * rs;
          row[s.k(h0) + d] = store(dk[t * s.D + d]);
          row[s.v(h0) + d] = store(dv[t * s.D + d]);
        }
    }
}

// Row length - 1 of attention_forward's loops (dropout 0), in the same order of operations.
void CpuBackend::attention_decode(const AttentionDecode& a) {
  Timer timer(*this, "attention_decode");
  const AttentionDecodeDims s = check_args(a, kTarget);
  const float* qkv = a.qkv.as<float>();
  float* out = a.out.as<float>();
  const AttnShape g{s.B, s.Tmax, s.H, s.D, s.H, s.K};
  const std::int64_t rs = g.row(), n = s.length;
#pragma omp parallel for collapse(2) num_threads(threads_) schedule(static)
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t h = 0; h < s.H; ++h) {
      const float* seq = qkv + b * s.Tmax * rs;
      const float* q = seq + (n - 1) * rs + g.q(h);
      std::vector<float> p(static_cast<std::size_t>(n)), acc(static_cast<std::size_t>(s.D), 0.0f);
      float mx = -INFINITY;
      for (std::int64_t j = 0; j < n; ++j) {
        const float* k = seq + j * rs + g.k(h);
        float dot = 0;
        for (std::int64_t d = 0; d < s.D; ++d) dot += q[d] * k[d];
        p[j] = dot * a.scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - mx);
        sum += p[j];
      }
      for (std::int64_t j = 0; j < n; ++j) {
        const float w = p[j] / sum;
        const float* v = seq + j * rs + g.v(h);
        for (std::int64_t d = 0; d < s.D; ++d) acc[d] += w * v[d];
      }
      float* o = out + (b * s.H + h) * s.D;
      for (std::int64_t d = 0; d < s.D; ++d) o[d] = store(acc[d]);
    }
}

}  // namespace kiln::ops::cpu
