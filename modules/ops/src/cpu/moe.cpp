// The mixture-of-experts ops (moe.hpp) on the CPU: the reference.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_backend.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::ops::cpu {

namespace {

// A row's scores (softmax, or sigmoid per expert) and the log-sum-exp of its logits.
void row_scores(const float* l, std::int64_t E, MoeScore score, float* out, float& lse) {
  float mx = -INFINITY;
  for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  float sum = 0;
  for (std::int64_t e = 0; e < E; ++e) sum += std::exp(l[e] - mx);
  lse = mx + std::log(sum);
  for (std::int64_t e = 0; e < E; ++e)
    out[e] = score == MoeScore::softmax ? std::exp(l[e] - lse) : 1.0f / (1.0f + std::exp(-l[e]));
}

// The probabilities the load-balancing loss averages: the softmax scores themselves, or the sigmoid
// scores divided by their sum; `sum` returns that sum (1 for softmax).
void balance_probs(const float* s, std::int64_t E, MoeScore score, float* p, float& sum) {
  sum = 1;
  if (score == MoeScore::sigmoid) {
    sum = 0;
    for (std::int64_t e = 0; e < E; ++e) sum += s[e];
  }
  for (std::int64_t e = 0; e < E; ++e) p[e] = score == MoeScore::sigmoid ? s[e] / sum : s[e];
}

// f[s, e]: the share of sequence s's T k choices that chose expert e.
std::vector<float> choice_shares(const std::int32_t* experts, std::int64_t N, std::int64_t k, std::int64_t E,
                                 std::int64_t T) {
  std::vector<float> f(static_cast<std::size_t>(N / T * E), 0.0f);
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) f[static_cast<std::size_t>(t / T * E + experts[t * k + j])] += 1.0f;
  for (float& v : f) v /= static_cast<float>(T * k);
  return f;
}

}  // namespace

void CpuBackend::moe_route(const MoeRoute& a) {
  Timer timer(*this, "moe_route");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, E = d.E, k = d.k;
  const float* logits = a.logits.as<float>();
  const float* bias = a.bias ? a.bias.as<float>() : nullptr;
  float *scores = a.scores.as<float>(), *lse = a.lse.as<float>(), *gates = a.gates.as<float>();
  auto* experts = a.experts.as<std::int32_t>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t t = 0; t < N; ++t) {
    float* s = scores + t * E;
    row_scores(logits + t * E, E, a.score, s, lse[t]);
    // The k best keys, best first; a tie goes to the lower expert.
    std::vector<bool> taken(static_cast<std::size_t>(E), false);
    float sum = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      std::int64_t best = -1;
      float best_key = 0;
      for (std::int64_t e = 0; e < E; ++e) {
        if (taken[e]) continue;
        const float key = bias ? s[e] + bias[e] : s[e];
        if (best < 0 || key > best_key) best = e, best_key = key;
      }
      taken[best] = true;
      experts[t * k + j] = static_cast<std::int32_t>(best);
      gates[t * k + j] = s[best];
      sum += s[best];
    }
    if (a.normalize)
      for (std::int64_t j = 0; j < k; ++j) gates[t * k + j] /= sum;
  }
  if (!a.loss_terms) return;
  const std::int64_t T = a.seq_len;
  const std::vector<float> f = choice_shares(experts, N, k, E, T);
  std::vector<float> p(static_cast<std::size_t>(E));
  std::vector<double> P(f.size(), 0.0);  // sum over the sequence's tokens of p
  double z = 0;
  for (std::int64_t t = 0; t < N; ++t) {
    float sum = 0;
    balance_probs(scores + t * E, E, a.score, p.data(), sum);
    for (std::int64_t e = 0; e < E; ++e) P[static_cast<std::size_t>(t / T * E + e)] += p[e];
    z += static_cast<double>(lse[t]) * lse[t];
  }
  double aux = 0;
  for (std::size_t i = 0; i < P.size(); ++i) aux += static_cast<double>(f[i]) * (P[i] / static_cast<double>(T));
  float* out = a.loss_terms.as<float>();
  out[0] = static_cast<float>(static_cast<double>(a.aux_coeff) * static_cast<double>(E) * aux);
  out[1] = static_cast<float>(static_cast<double>(a.z_coeff) * z);
}

void CpuBackend::moe_route_backward(const MoeRouteBackward& a) {
  Timer timer(*this, "moe_route_backward");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, E = d.E, k = d.k, T = a.seq_len;
  const float *scores = a.scores.as<float>(), *lse = a.lse.as<float>(), *dgates = a.dgates.as<float>(),
              *logits = a.logits.as<float>();
  const auto* experts = a.experts.as<std::int32_t>();
  float* dlogits = a.dlogits.as<float>();
  const std::vector<float> f = choice_shares(experts, N, k, E, T);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t t = 0; t < N; ++t) {
    const float* s = scores + t * E;
    const std::int32_t* ex = experts + t * k;
    const float* dg = dgates + t * k;
    std::vector<float> ds(static_cast<std::size_t>(E), 0.0f), p(static_cast<std::size_t>(E)),
        dp(static_cast<std::size_t>(E));
    // Through the gates: g_j = s[e_j] (divided by S, the chosen scores' sum, with normalize).
    float S = 0, dot = 0;
    for (std::int64_t j = 0; j < k; ++j) S += s[ex[j]];
    if (a.normalize)
      for (std::int64_t j = 0; j < k; ++j) dot += dg[j] * (s[ex[j]] / S);
    for (std::int64_t j = 0; j < k; ++j) ds[ex[j]] += a.normalize ? (dg[j] - dot) / S : dg[j];
    // Through the load-balancing loss: d/dp[t, e] = aux_coeff E f[s, e] / T.
    float psum = 1;
    balance_probs(s, E, a.score, p.data(), psum);
    float pdp = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      dp[e] = a.aux_coeff * static_cast<float>(E) * f[static_cast<std::size_t>(t / T * E + e)] / static_cast<float>(T);
      pdp += p[e] * dp[e];
    }
    for (std::int64_t e = 0; e < E; ++e) ds[e] += a.score == MoeScore::softmax ? dp[e] : (dp[e] - pdp) / psum;
    // To the logits: the softmax's or the sigmoid's derivative; and the z-loss's, 2 z lse softmax(l).
    float sds = 0;
    if (a.score == MoeScore::softmax)
      for (std::int64_t e = 0; e < E; ++e) sds += s[e] * ds[e];
    const float* l = logits + t * E;
    for (std::int64_t e = 0; e < E; ++e) {
      float g = a.score == MoeScore::softmax ? s[e] * (ds[e] - sds) : ds[e] * s[e] * (1.0f - s[e]);
      if (a.z_coeff != 0) g += a.z_coeff * 2.0f * lse[t] * std::exp(l[e] - lse[t]);
      dlogits[t * E + e] = store(g);
    }
  }
}

void CpuBackend::moe_permute(const MoePermute& a) {
  Timer timer(*this, "moe_permute");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, E = d.E, k = d.k, R = d.R, C = d.C;
  const auto* experts = a.experts.as<std::int32_t>();
  auto *offsets = a.offsets.as<std::int32_t>(), *row_of = a.row_of.as<std::int32_t>(),
       *source = a.source.as<std::int32_t>();
  for (std::int64_t i = 0; i < N * k; ++i)
    if (experts[i] < 0 || experts[i] >= E)
      KILN_THROW("moe_permute experts: expert ", experts[i], " of choice ", i, " outside [0, ", E, ")");
  // Each choice's place among its expert's, in choice order; beyond the capacity of its sequence it
  // is dropped.
  std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0), in_seq(static_cast<std::size_t>(E), 0),
      rank(static_cast<std::size_t>(N * k), -1);
  const std::int64_t per_seq = a.capacity > 0 ? a.seq_len * k : N * k;
  for (std::int64_t i = 0; i < N * k; ++i) {
    if (i % per_seq == 0) std::fill(in_seq.begin(), in_seq.end(), 0);
    const auto e = static_cast<std::size_t>(experts[i]);
    if (a.capacity > 0 && in_seq[e] >= a.capacity) continue;
    ++in_seq[e];
    rank[i] = counts[e]++;
  }
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + static_cast<std::int32_t>(counts[e]);
  if (a.offsets_host) std::copy(offsets, offsets + E + 1, a.offsets_host);
  std::fill(source, source + R, -1);
  for (std::int64_t i = 0; i < N * k; ++i) {
    row_of[i] = rank[i] < 0 ? -1 : offsets[experts[i]] + static_cast<std::int32_t>(rank[i]);
    if (row_of[i] >= 0) source[row_of[i]] = static_cast<std::int32_t>((a.token_offset + i / k) * E + experts[i]);
  }
  if (!a.out) return;
  const float* x = a.x.as<float>();
  float* out = a.out.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t r = 0; r < R; ++r) {
    float* o = out + r * C;
    if (source[r] < 0)
      std::fill(o, o + C, 0.0f);
    else
      std::copy(x + (source[r] / E - a.token_offset) * C, x + (source[r] / E - a.token_offset) * C + C, o);
  }
}

void CpuBackend::moe_permute_backward(const MoePermuteBackward& a) {
  Timer timer(*this, "moe_permute_backward");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, k = d.k, C = d.C;
  const auto* row_of = a.row_of.as<std::int32_t>();
  const float* dout = a.dout.as<float>();
  float* dx = a.dx.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t c = 0; c < C; ++c) {
      float acc = 0;
      for (std::int64_t j = 0; j < k; ++j)
        if (const std::int32_t r = row_of[t * k + j]; r >= 0) acc += dout[r * C + c];
      dx[t * C + c] = store(acc);
    }
}

void CpuBackend::moe_combine(const MoeCombine& a) {
  Timer timer(*this, "moe_combine");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, k = d.k, C = d.C;
  const auto* row_of = a.row_of.as<std::int32_t>();
  const float *y = a.y.as<float>(), *gates = a.gates.as<float>();
  float* out = a.out.as<float>();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t c = 0; c < C; ++c) {
      float acc = 0;
      for (std::int64_t j = 0; j < k; ++j)
        if (const std::int32_t r = row_of[t * k + j]; r >= 0) acc += gates[t * k + j] * y[r * C + c];
      out[t * C + c] = store(acc);
    }
}

void CpuBackend::moe_combine_backward(const MoeCombineBackward& a) {
  Timer timer(*this, "moe_combine_backward");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, k = d.k, C = d.C, R = d.R;
  const auto* row_of = a.row_of.as<std::int32_t>();
  const float *y = a.y.as<float>(), *gates = a.gates.as<float>(), *dout = a.dout.as<float>();
  float *dy = a.dy.as<float>(), *dgates = a.dgates.as<float>();
  std::fill(dy, dy + R * C, 0.0f);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t r = row_of[t * k + j];
      float dot = 0;
      if (r >= 0)
        for (std::int64_t c = 0; c < C; ++c) {
          dy[r * C + c] = store(gates[t * k + j] * dout[t * C + c]);
          dot += dout[t * C + c] * y[r * C + c];
        }
      dgates[t * k + j] = dot;
    }
}

void CpuBackend::grouped_linear_forward(const GroupedLinearForward& a) {
  Timer timer(*this, "grouped_linear_forward");
  const GroupedDims d = check_args(a, kTarget);
  const std::int64_t G = d.G, IC = d.IC, OC = d.OC;
  const float *x = d.x.as<float>(), *w = a.weight.as<float>();
  float* out = a.out.as<float>();
  const std::int32_t* off = a.offsets_host;
  // Element (o, i) of expert e's weight as an [out, in] matrix.
  const std::int64_t so = a.weight_in_out ? 1 : IC, si = a.weight_in_out ? OC : 1;
  for (int e = 0; e < static_cast<int>(G); ++e) {  // e: the row group, through its expert's weight
    const float* we = w + group_expert(a.expert_of, e) * OC * IC;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t r = off[e]; r < off[e + 1]; ++r)
      for (std::int64_t o = 0; o < OC; ++o) {
        float acc = 0;
        for (std::int64_t i = 0; i < IC; ++i) acc += x[r * IC + i] * we[o * so + i * si];
        out[r * OC + o] = store(acc);
      }
  }
}

void CpuBackend::grouped_linear_backward(const GroupedLinearBackward& a) {
  Timer timer(*this, "grouped_linear_backward");
  const GroupedDims d = check_args(a, kTarget);
  const std::int64_t E = d.E, G = d.G, R = d.R, IC = d.IC, OC = d.OC;
  const float *x = d.x.as<float>(), *w = a.weight.as<float>(), *dout = d.dout.as<float>();
  const float* pre = a.dx_gelu_pre ? a.dx_gelu_pre.as<float>() : nullptr;
  const std::int32_t* off = a.offsets_host;
  const std::int64_t so = a.weight_in_out ? 1 : IC, si = a.weight_in_out ? OC : 1;
  if (a.dx) {
    float* dx = a.dx.as<float>();
    std::fill(dx + static_cast<std::int64_t>(off[G]) * IC, dx + R * IC, 0.0f);
    for (int e = 0; e < static_cast<int>(G); ++e) {  // e: the row group, through its expert's weight
      const float* we = w + group_expert(a.expert_of, e) * OC * IC;
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (std::int64_t r = off[e]; r < off[e + 1]; ++r) {
        std::vector<float> acc(static_cast<std::size_t>(IC), 0.0f);
        for (std::int64_t o = 0; o < OC; ++o) {
          const float g = dout[r * OC + o];
          for (std::int64_t i = 0; i < IC; ++i) acc[i] += g * we[o * so + i * si];
        }
        for (std::int64_t i = 0; i < IC; ++i)
          dx[r * IC + i] = store(pre ? acc[i] * gelu_grad(pre[r * IC + i]) : acc[i]);
      }
    }
  }
  if (a.dgrad_queued) a.dgrad_queued();
  float* dw = a.dweight.as<float>();
  // Each expert's rows: its groups' in group order, summed in one accumulator (the same sums as one
  // group per expert holding those rows).
  std::vector<std::vector<int>> of(static_cast<std::size_t>(E));
  for (int g = 0; g < static_cast<int>(G); ++g) of[static_cast<std::size_t>(group_expert(a.expert_of, g))].push_back(g);
  for (std::int64_t e = 0; e < E; ++e) {
    float* dwe = dw + e * OC * IC;
    const std::vector<int>& groups = of[static_cast<std::size_t>(e)];
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t o = 0; o < OC; ++o)
      for (std::int64_t i = 0; i < IC; ++i) {
        float acc = 0;
        for (const int g : groups)
          for (std::int64_t r = off[g]; r < off[g + 1]; ++r) acc += dout[r * OC + o] * x[r * IC + i];
        float& g = dwe[o * so + i * si];
        g = a.dweight_overwrite ? acc : g + acc;
      }
  }
}

void CpuBackend::moe_dropout(const MoeDropout& a) {
  Timer timer(*this, "moe_dropout");
  const MoeDims d = check_args(a, kTarget);
  const std::int64_t F = d.C, cols = a.cols_total > 0 ? a.cols_total : F;
  const auto* ids = a.ids.as<std::int32_t>();
  float* x = a.x.as<float>();
  const std::uint32_t threshold = rng::dropout_threshold(a.p);
  const float keep_scale = 1.0f / (1.0f - a.p);
  const std::uint64_t start = a.rng.start();
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t c = 0; c < F; ++c) {
      const auto n = static_cast<std::uint64_t>(ids[r]) * static_cast<std::uint64_t>(cols) +
                     static_cast<std::uint64_t>(a.col_offset + c);
      float& v = x[r * F + c];
      v = rng::dropout_keep(rng::philox_u32(a.rng.seed, start, n), threshold) ? store(v * keep_scale) : 0.0f;
    }
}

}  // namespace kiln::ops::cpu
