#include "cpu_backend.hpp"

namespace kiln::ops::cpu {

namespace {
// The table's rows as [begin, end) of the whole vocabulary, and the vocabulary's size.
struct Rows {
  std::int64_t begin, end, total;
  bool mine(std::int32_t t) const { return t >= begin && t < end; }
};
Rows rows_of(std::int64_t begin, std::int64_t total, std::int64_t V) {
  const std::int64_t all = total ? total : V;
  KILN_CHECK(begin >= 0 && begin + V <= all, "embedding rows [", begin, ", ", begin + V, ") outside a vocabulary of ", all);
  return {begin, begin + V, all};
}
}  // namespace

void CpuBackend::embedding_forward(const EmbeddingForward& a) {
  Timer timer(*this, "embedding_forward");
  const std::int64_t N = a.out.size(0), C = a.out.size(1), V = a.wte.size(0);
  expect_tensor(a.out, DType::f32, {N, C}, "embedding_forward out");
  expect_tensor(a.tokens, DType::i32, {N}, "embedding_forward tokens");
  expect_tensor(a.wte, DType::f32, {V, C}, "embedding_forward wte");
  KILN_CHECK(a.T > 0 && N % a.T == 0 && a.wpe.size(0) >= a.T, "embedding_forward: T=", a.T, " N=", N);
  const Rows rows = rows_of(a.vocab_begin, a.vocab_total, V);
  const auto* tok = a.tokens.as<std::int32_t>();
  const float* wte = a.wte.as<float>();
  const float* wpe = a.wpe.as<float>();
  float* out = a.out.as<float>();
  for (std::int64_t n = 0; n < N; ++n)
    KILN_CHECK(tok[n] >= 0 && tok[n] < rows.total, "token ", tok[n], " at position ", n, " outside the vocabulary of ",
               rows.total);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t n = 0; n < N; ++n) {
    const float* e = rows.mine(tok[n]) ? wte + (std::int64_t(tok[n]) - rows.begin) * C : nullptr;
    const float* p = wpe + (n % a.T) * C;
    for (std::int64_t c = 0; c < C; ++c) out[n * C + c] = store((e ? e[c] : 0.0f) + (a.positions ? p[c] : 0.0f));
  }
}

void CpuBackend::embedding_backward(const EmbeddingBackward& a) {
  Timer timer(*this, "embedding_backward");
  const std::int64_t N = a.dout.size(0), C = a.dout.size(1);
  const Rows rows = rows_of(a.vocab_begin, a.vocab_total, a.dwte.size(0));
  const auto* tok = a.tokens_host ? a.tokens_host : a.tokens.as<std::int32_t>();
  const float* dout = a.dout.as<float>();
  float* dwte = a.dwte.as<float>();
  float* dwpe = a.dwpe.as<float>();
  // Each thread owns a slice of columns and walks every token in order: deterministic.
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t n = 0; n < N; ++n) {
      float g = dout[n * C + c];
      if (rows.mine(tok[n])) dwte[(std::int64_t(tok[n]) - rows.begin) * C + c] += g;
      dwpe[(n % a.T) * C + c] += g;
    }
}

}  // namespace kiln::ops::cpu
