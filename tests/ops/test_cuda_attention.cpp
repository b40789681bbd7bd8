// CUDA flash attention (forward, deterministic backward) against the CPU reference backend.
//
// Tolerances: bf16 outputs (out, dq, dk, dv) by relative L2 error < 1e-2 -- the kernels round P and
// dS to bf16 for the tensor-core products and take D_i from the stored bf16 output, which gives
// about 3e-3; lse (fp32) < 1e-4. Inputs are normals with std 1.5 for q and k, so the scaled scores
// q.k / sqrt(D) have std ~2 (softmax rows neither flat nor one-hot).
#include <algorithm>
#include <optional>
#include <cmath>
#include <vector>

#include "kiln/rng/philox.hpp"
#include "op_harness.hpp"

namespace {

using namespace kiln;
using namespace kiln::test;

constexpr double kActTol = 1e-2;
constexpr double kLseTol = 1e-4;

struct Dims {
  int B, T, H, D;
};

// The tensors of one attention call, on both backends.
struct Attn {
  BackendPair& p;
  Dims s;
  float dropout;
  int head_offset, heads_total;
  std::int64_t seq_offset = 0;
  rng::PhiloxArgs rng{0x5eed1234ull, 17, nullptr};
  Dual qkv, out, lse, dout, dqkv;
  std::optional<Dual> doc_start;  // [B, T] i32: packed documents (set_documents)

  Attn(BackendPair& pair, Dims d, float drop = 0, int ho = 0, int ht = 0, std::uint64_t seed = 1)
      : p(pair),
        s(d),
        dropout(drop),
        head_offset(ho),
        heads_total(ht),
        qkv(pair, Kind::act, {d.B, d.T, 3, d.H, d.D}),
        out(pair, Kind::act, {d.B, d.T, d.H, d.D}),
        lse(pair, Kind::f32, {d.B, d.H, d.T}),
        dout(pair, Kind::act, {d.B, d.T, d.H, d.D}),
        dqkv(pair, Kind::act, {d.B, d.T, 3, d.H, d.D}) {
    qkv.set(random_values(static_cast<std::size_t>(qkv.numel()), 100 + seed * 7 + d.T * 31 + d.D, 1.5f));
    dout.set(random_values(static_cast<std::size_t>(dout.numel()), 200 + seed * 7 + d.T * 31 + d.D));
  }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(s.D)); }
  // Documents of random lengths (1 to max_len tokens) packed into each sequence; the first may have
  // begun before the window.
  void set_documents(int max_len, std::uint64_t seed) {
    std::vector<std::int32_t> starts(static_cast<std::size_t>(s.B) * s.T);
    std::uint64_t n = 0;
    for (int b = 0; b < s.B; ++b) {
      int start = 0, left = 1 + static_cast<int>(rng::philox_u32(seed, 0, n++) % max_len);
      for (int t = 0; t < s.T; ++t, --left) {
        if (left == 0) {
          start = t;
          left = 1 + static_cast<int>(rng::philox_u32(seed, 0, n++) % max_len);
        }
        starts[static_cast<std::size_t>(b) * s.T + t] = start;
      }
    }
    doc_start.emplace(p, Kind::i32, Shape{s.B, s.T});
    doc_start->set_ints(starts);
  }
  TensorView docs(bool gpu) const { return doc_start ? (gpu ? doc_start->gpu() : doc_start->cpu()) : TensorView{}; }
  ops::AttentionForward fwd_args(bool gpu) const {
    return {gpu ? out.gpu() : out.cpu(), gpu ? lse.gpu() : lse.cpu(), gpu ? qkv.gpu() : qkv.cpu(), scale(),
            dropout, rng, head_offset, heads_total, seq_offset, 0, docs(gpu)};
  }
  ops::AttentionBackward bwd_args(bool gpu) const {
    return {gpu ? dqkv.gpu() : dqkv.cpu(), gpu ? dout.gpu() : dout.cpu(), gpu ? out.gpu() : out.cpu(),
            gpu ? lse.gpu() : lse.cpu(),   gpu ? qkv.gpu() : qkv.cpu(),   scale(),
            dropout, rng, head_offset, heads_total, seq_offset, 0, docs(gpu)};
  }
  void forward() {
    out.poison();
    lse.poison();
    p.cpu->attention_forward(fwd_args(false));
    p.gpu->attention_forward(fwd_args(true));
    p.gpu->synchronize();
  }
  // Each backend differentiates its own forward outputs, as in training.
  void backward() {
    dqkv.poison();
    p.cpu->attention_backward(bwd_args(false));
    p.gpu->attention_backward(bwd_args(true));
    p.gpu->synchronize();
  }
};

// Part `which` (0 = q, 1 = k, 2 = v) of a [B, T, 3, H, D] tensor.
std::vector<float> qkv_part(const std::vector<float>& x, const Dims& s, int which) {
  std::vector<float> r;
  const std::size_t hd = static_cast<std::size_t>(s.H) * s.D;
  r.reserve(x.size() / 3);
  for (std::size_t bt = 0; bt < static_cast<std::size_t>(s.B) * s.T; ++bt)
    r.insert(r.end(), x.begin() + (bt * 3 + which) * hd, x.begin() + (bt * 3 + which + 1) * hd);
  return r;
}

void check_forward(Attn& a) {
  INFO("B=" << a.s.B << " T=" << a.s.T << " H=" << a.s.H << " D=" << a.s.D << " dropout=" << a.dropout);
  a.forward();
  KILN_CHECK_CLOSE(a.out, kActTol);
  KILN_CHECK_CLOSE(a.lse, kLseTol);
}

void check_backward(Attn& a) {
  INFO("B=" << a.s.B << " T=" << a.s.T << " H=" << a.s.H << " D=" << a.s.D << " dropout=" << a.dropout);
  a.forward();
  a.backward();
  const auto g = a.dqkv.gpu_values(), c = a.dqkv.cpu_values();
  const char* names[3] = {"dq", "dk", "dv"};
  for (int w = 0; w < 3; ++w) {
    const auto gp = qkv_part(g, a.s, w), cp = qkv_part(c, a.s, w);
    INFO(names[w]);
    const bool cpu_zero = std::all_of(cp.begin(), cp.end(), [](float v) { return v == 0.0f; });
    if ((a.s.T == 1 && w < 2) || cpu_zero) {
      // One key (T = 1, or one-token documents): dS = P (dP - D_i) is exactly 0 on the CPU and
      // rounding noise on the GPU, so a relative error means nothing; check that the gradient is
      // (nearly) zero and was written.
      double mx = 0;
      for (float v : gp) mx = std::max(mx, static_cast<double>(std::fabs(v)));
      CHECK(mx < 1e-2);
    } else {
      const double err = rel_error(gp, cp);
      INFO("relative error " << err);
      CHECK(err < kActTol);
    }
  }
}

const Dims kShapes[] = {{3, 77, 5, 0}, {2, 129, 2, 0}, {1, 1, 3, 0}, {1, 256, 2, 0}};
const int kHeadDims[] = {16, 32, 64, 128};

ops::CudaOptions with_attention(ops::AttentionImpl impl, bool deterministic = true) {
  return {.attention = impl, .attention_deterministic = deterministic};
}

void forward_at_awkward_shapes(BackendPair& p) {
  for (int D : kHeadDims)
    for (Dims s : kShapes) {
      s.D = D;
      Attn a(p, s);
      check_forward(a);
    }
}

void backward_at_awkward_shapes(BackendPair& p) {
  for (int D : kHeadDims)
    for (Dims s : kShapes) {
      s.D = D;
      Attn a(p, s);
      check_backward(a);
    }
}

// Two runs of forward + backward on the same inputs give the same bits.
void check_reproducible(BackendPair& p, Dims s, float drop) {
  INFO("dropout " << drop);
  Attn a(p, s, drop);
  a.forward();
  a.backward();
  const auto out1 = a.out.gpu_values(), lse1 = a.lse.gpu_values(), d1 = a.dqkv.gpu_values();
  a.dqkv.poison();
  p.gpu->attention_forward(a.fwd_args(true));
  p.gpu->attention_backward(a.bwd_args(true));
  p.gpu->synchronize();
  CHECK(a.out.gpu_values() == out1);
  CHECK(a.lse.gpu_values() == lse1);
  CHECK(a.dqkv.gpu_values() == d1);
}

TEST_CASE("cuda attention_forward (kiln's kernels) matches the CPU reference at awkward shapes") {
  auto p = backend_pair(with_attention(ops::AttentionImpl::kiln));
  KILN_REQUIRE_GPU(p);
  forward_at_awkward_shapes(p);
}

TEST_CASE("cuda attention_backward (kiln's kernels) matches the CPU reference at awkward shapes") {
  auto p = backend_pair(with_attention(ops::AttentionImpl::kiln));
  KILN_REQUIRE_GPU(p);
  backward_at_awkward_shapes(p);
}

TEST_CASE("cuda attention within packed documents (kiln's kernels, also when cuDNN is asked) matches the CPU") {
  for (auto impl : {ops::AttentionImpl::kiln, ops::AttentionImpl::cudnn}) {
    auto p = backend_pair(with_attention(impl));
    KILN_REQUIRE_GPU(p);
    for (int D : kHeadDims)
      for (Dims s : {Dims{3, 77, 2, 0}, Dims{2, 300, 3, 0}, Dims{1, 129, 1, 0}})
        for (int max_len : {1, 9, 70, 1000}) {  // one-token documents, short ones, long ones, one document
          s.D = D;
          CAPTURE(max_len);
          Attn a(p, s);
          a.set_documents(max_len, static_cast<std::uint64_t>(D * 1000 + s.T + max_len));
          check_backward(a);
          KILN_CHECK_CLOSE(a.out, kActTol);
          KILN_CHECK_CLOSE(a.lse, kLseTol);
        }
    // With dropout, and on a head shard.
    Attn a(p, {2, 130, 2, 64}, 0.1f, 1, 4);
    a.set_documents(40, 7);
    check_backward(a);
    KILN_CHECK_CLOSE(a.out, kActTol);
  }
}

TEST_CASE("cuda attention_forward (cuDNN) matches the CPU reference at awkward shapes") {
  auto p = cudnn_pair();
  KILN_REQUIRE_GPU(p);
  forward_at_awkward_shapes(p);
}

TEST_CASE("cuda attention_backward (cuDNN, deterministic and atomic dQ) matches the CPU reference") {
  for (bool deterministic : {true, false}) {
    INFO("deterministic " << deterministic);
    auto p = cudnn_pair(deterministic);
    KILN_REQUIRE_GPU(p);
    backward_at_awkward_shapes(p);
  }
}

TEST_CASE("cuda attention: a cuDNN backward follows a kiln forward and the reverse (same lse)") {
  auto kp = backend_pair(with_attention(ops::AttentionImpl::kiln));
  KILN_REQUIRE_GPU(kp);
  auto cp = cudnn_pair();
  KILN_REQUIRE_GPU(cp);
  const Dims s{2, 150, 3, 64};
  Attn k(kp, s), c(cp, s);
  k.forward();
  c.forward();
  KILN_CHECK_CLOSE(c.lse, kLseTol);
  // kiln's forward outputs into cuDNN's backward, and cuDNN's into kiln's (the CPU reference
  // backward takes the same values).
  const auto k_out = k.out.gpu_values(), k_lse = k.lse.gpu_values();
  k.out.set(c.out.gpu_values());
  k.lse.set(c.lse.gpu_values());
  c.out.set(k_out);
  c.lse.set(k_lse);
  k.backward();
  c.backward();
  KILN_CHECK_CLOSE(k.dqkv, kActTol);
  KILN_CHECK_CLOSE(c.dqkv, kActTol);
}

TEST_CASE("cuda attention with dropout draws the CPU's masks") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  // T % 4 != 0 puts the Philox blocks off the key tiles (the unaligned path); head shards included.
  {
    Attn a(p, {2, 77, 3, 64}, 0.1f);
    check_backward(a);
    KILN_CHECK_CLOSE(a.out, kActTol);
  }
  {
    Attn a(p, {1, 130, 2, 32}, 0.1f);
    check_backward(a);
    KILN_CHECK_CLOSE(a.out, kActTol);
  }
  {
    Attn a(p, {1, 128, 2, 128}, 0.1f, 1, 4);
    check_backward(a);
    KILN_CHECK_CLOSE(a.out, kActTol);
  }
  {
    Attn a(p, {2, 200, 1, 16}, 0.1f, 2, 3);
    check_backward(a);
    KILN_CHECK_CLOSE(a.out, kActTol);
  }
}

TEST_CASE("cuda attention dropout masks are bit-exact (one-hot values expose every mask bit)") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  // With v_j = e_j, out[i][j] = P_ij m_ij / (1 - p): zero exactly where (i, j) is dropped. With
  // dO_i = e_i, dV[j][i] = P_ij m_ij / (1 - p) likewise. Needs T <= D.
  const Dims s{2, 100, 2, 128};
  const int ho = 1, ht = 3;
  const float drop = 0.5f;
  Attn a(p, s, drop, ho, ht);
  auto qkv = a.qkv.cpu_values();
  std::vector<float> dout(static_cast<std::size_t>(a.dout.numel()));
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int h = 0; h < s.H; ++h)
        for (int d = 0; d < s.D; ++d) {
          qkv[((static_cast<std::size_t>(b) * s.T + t) * 3 + 2) * s.H * s.D + h * s.D + d] = d == t ? 1.0f : 0.0f;
          dout[((static_cast<std::size_t>(b) * s.T + t) * s.H + h) * s.D + d] = d == t ? 1.0f : 0.0f;
        }
  a.qkv.set(qkv);
  a.dout.set(dout);
  a.forward();
  a.backward();
  const auto out = a.out.gpu_values(), dqkv = a.dqkv.gpu_values();
  const std::uint32_t threshold = rng::dropout_threshold(drop);
  long wrong_out = 0, wrong_dv = 0, kept = 0, total = 0;
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h)
      for (int i = 0; i < s.T; ++i)
        for (int j = 0; j <= i; ++j) {
          const std::uint64_t n = ((static_cast<std::uint64_t>(b) * ht + ho + h) * s.T + i) * s.T + j;
          const bool keep = rng::dropout_keep(rng::philox_u32(a.rng.seed, a.rng.start(), n), threshold);
          const float o = out[((static_cast<std::size_t>(b) * s.T + i) * s.H + h) * s.D + j];
          const float dv = dqkv[((static_cast<std::size_t>(b) * s.T + j) * 3 + 2) * s.H * s.D + h * s.D + i];
          wrong_out += (o != 0.0f) != keep;
          wrong_dv += (dv != 0.0f) != keep;
          kept += keep;
          ++total;
        }
  CHECK(wrong_out == 0);
  CHECK(wrong_dv == 0);
  CHECK(kept > total / 3);  // sanity: p = 0.5 keeps about half
  CHECK(kept < 2 * total / 3);
  KILN_CHECK_CLOSE(a.out, kActTol);
}

TEST_CASE("cuda attention is deterministic (same bits run after run)") {
  {
    auto p = backend_pair(with_attention(ops::AttentionImpl::kiln));
    KILN_REQUIRE_GPU(p);
    for (float drop : {0.0f, 0.1f}) check_reproducible(p, {2, 300, 3, 64}, drop);
  }
  auto p = cudnn_pair();
  KILN_REQUIRE_GPU(p);
  check_reproducible(p, {2, 300, 3, 64}, 0.0f);
  check_reproducible(p, {1, 1024, 4, 128}, 0.0f);
}

TEST_CASE("cuda attention on a head shard draws what the whole tensor draws") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const Dims full{2, 93, 4, 32};
  const int ho = 1, hs = 2;  // the shard holds heads [1, 3) of 4
  Attn a(p, full, 0.2f);
  a.forward();
  a.backward();
  Attn b(p, {full.B, full.T, hs, full.D}, 0.2f, ho, full.H);
  // Copy the shard's heads out of the full inputs.
  auto slice = [&](const std::vector<float>& x, int groups) {  // x: [B, T, groups, H, D] -> heads [ho, ho + hs)
    std::vector<float> r;
    for (int bt = 0; bt < full.B * full.T; ++bt)
      for (int gi = 0; gi < groups; ++gi)
        for (int h = ho; h < ho + hs; ++h) {
          const auto at = x.begin() + ((static_cast<std::size_t>(bt) * groups + gi) * full.H + h) * full.D;
          r.insert(r.end(), at, at + full.D);
        }
    return r;
  };
  auto slice_lse = [&](const std::vector<float>& x) {  // [B, H, T]
    std::vector<float> r;
    for (int bi = 0; bi < full.B; ++bi)
      for (int h = ho; h < ho + hs; ++h) {
        const auto at = x.begin() + (static_cast<std::size_t>(bi) * full.H + h) * full.T;
        r.insert(r.end(), at, at + full.T);
      }
    return r;
  };
  b.qkv.set(slice(a.qkv.cpu_values(), 3));
  b.dout.set(slice(a.dout.cpu_values(), 1));
  b.forward();
  b.backward();
  // Same kernels on the same per-head data: identical bits, not just close.
  CHECK(b.out.gpu_values() == slice(a.out.gpu_values(), 1));
  CHECK(b.lse.gpu_values() == slice_lse(a.lse.gpu_values()));
  CHECK(b.dqkv.gpu_values() == slice(a.dqkv.gpu_values(), 3));
  // And the shard agrees with the CPU reference of the shard.
  KILN_CHECK_CLOSE(b.out, kActTol);
  KILN_CHECK_CLOSE(b.dqkv, kActTol);
}

TEST_CASE("cuda attention on a batch's later sequences draws what the whole batch draws for them") {
  auto p = backend_pair();
  KILN_REQUIRE_GPU(p);
  const Dims full{3, 77, 2, 64};
  const int first = 1;  // the part holds sequences [1, 3): a data-parallel rank's, or a micro-batch's
  Attn a(p, full, 0.2f);
  a.forward();
  a.backward();
  Attn b(p, {full.B - first, full.T, full.H, full.D}, 0.2f);
  b.seq_offset = first;
  auto tail = [&](const std::vector<float>& x) {  // sequences [first, B) of any [B, ...] tensor
    const std::size_t per = x.size() / full.B;
    return std::vector<float>(x.begin() + static_cast<std::ptrdiff_t>(per * first), x.end());
  };
  b.qkv.set(tail(a.qkv.cpu_values()));
  b.dout.set(tail(a.dout.cpu_values()));
  b.forward();
  b.backward();
  CHECK(b.out.gpu_values() == tail(a.out.gpu_values()));
  CHECK(b.lse.gpu_values() == tail(a.lse.gpu_values()));
  CHECK(b.dqkv.gpu_values() == tail(a.dqkv.gpu_values()));
  KILN_CHECK_CLOSE(b.out, kActTol);
  KILN_CHECK_CLOSE(b.dqkv, kActTol);
}

TEST_CASE("cuda attention (kiln's kernels) rejects an unsupported head dim") {
  auto p = backend_pair(with_attention(ops::AttentionImpl::kiln));
  KILN_REQUIRE_GPU(p);
  Attn a(p, {1, 8, 1, 48});
  CHECK_THROWS_AS(p.gpu->attention_forward(a.fwd_args(true)), kiln::Error);
  CHECK_THROWS_AS(p.gpu->attention_backward(a.bwd_args(true)), kiln::Error);
}

}  // namespace
