#include "cpu_backend.hpp"
#include "kiln/ops/grad_staging.hpp"

namespace kiln::ops::cpu {

namespace {
// The table's rows as [begin, end) of the whole vocabulary.
struct Rows {
  std::int64_t begin, end;
  bool mine(std::int32_t t) const { return t >= begin && t < end; }
};
}  // namespace

void CpuBackend::embedding_forward(const EmbeddingForward& a) {
  Timer timer(*this, "embedding_forward");
  const EmbeddingDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const Rows rows{a.vocab_begin, a.vocab_begin + d.V};
  const auto* tok = a.tokens.as<std::int32_t>();
  const float* wte = a.wte.as<float>();
  const float* wpe = a.wpe.as<float>();
  float* out = a.out.as<float>();
  check_tokens("embedding_forward", "tokens", tok, N, d.vocab_total);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* e = rows.mine(tok[n]) ? wte + (std::int64_t(tok[n]) - rows.begin) * C : nullptr;
    const float* p = a.positions ? wpe + (n % a.T) * C : nullptr;
    for (std::int64_t c = 0; c < C; ++c) out[n * C + c] = store((e ? e[c] : 0.0f) + (p ? p[c] : 0.0f));
  }
}

void CpuBackend::embedding_backward(const EmbeddingBackward& a) {
  Timer timer(*this, "embedding_backward");
  const EmbeddingDims d = check_args(a, kTarget);
  const std::int64_t N = d.N, C = d.C;
  const Rows rows{a.vocab_begin, a.vocab_begin + d.V};
  const auto* tok = a.tokens_host;
  check_tokens("embedding_backward", "tokens_host", tok, N, d.vocab_total);
  const float* dout = a.dout.as<float>();
  GradStaging wte_grad(a.dwte), wpe_grad(a.dwpe);  // f32 in place, bf16 through an f32 copy
  float* dwte = wte_grad.data();
  float* dwpe = wpe_grad.data();
  // Each thread owns a slice of columns and walks every token in order: deterministic.
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t n = 0; n < N; ++n) {
      float g = dout[n * C + c];
      if (rows.mine(tok[n])) dwte[(std::int64_t(tok[n]) - rows.begin) * C + c] += g;
      if (dwpe) dwpe[(n % a.T) * C + c] += g;
    }
  wte_grad.finish();
  wpe_grad.finish();
}

}  // namespace kiln::ops::cpu
