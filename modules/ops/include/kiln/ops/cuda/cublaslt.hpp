#pragma once
// What kiln's cuBLASLt GEMM runners (bf16 in ops, FP8 in fp8) share: the epilogue mapping and small
// RAII pieces.
#include <cublasLt.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "kiln/ops/epilogue.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {

// cuBLASLt's epilogue for an ops::Epilogue; `with_bias`: a GELU epilogue also adds the bias.
inline cublasLtEpilogue_t lt_epilogue(ops::Epilogue e, bool with_bias) {
  switch (e) {
    case ops::Epilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case ops::Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case ops::Epilogue::gelu: return with_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case ops::Epilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}
// Whether the epilogue writes or reads the aux matrix (the GELU's pre-activation).
constexpr bool uses_aux(ops::Epilogue e) { return e == ops::Epilogue::gelu || e == ops::Epilogue::dgelu; }

template <class T>
void set_attr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value) {
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

struct LtPreference {
  cublasLtMatmulPreference_t p = nullptr;
  LtPreference() { KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p)); }
  ~LtPreference() { cublasLtMatmulPreferenceDestroy(p); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
  template <class T>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
    KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
  }
};

// Split-K partial sums kept in the compute type (f32), or no split: a gradient held in bf16 is not
// rounded once per split, as cuBLASLt's in-place and output-type reductions would round it.
inline void keep_partials_in_f32(LtPreference& pref) {
  pref.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
}

// A matmul descriptor, its three layouts (cuBLASLt's A, B and C = D) and the chosen algorithm.
struct LtMatmulPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool fused = true;  // false: cuBLASLt cannot fuse the epilogue; a plain GEMM and a kernel instead

  LtMatmulPlan() = default;
  LtMatmulPlan(const LtMatmulPlan&) = delete;
  LtMatmulPlan& operator=(const LtMatmulPlan&) = delete;
  ~LtMatmulPlan() { release(); }
  void release() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    op = nullptr;
    a = b = d = nullptr;
  }
};

// A matrix layout made for one call and destroyed after it (a cheap host object).
struct LtLayout {
  cublasLtMatrixLayout_t l = nullptr;
  LtLayout(cudaDataType_t type, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld));
  }
  ~LtLayout() { cublasLtMatrixLayoutDestroy(l); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
};

// The heuristic's first algorithm for `op` on layouts a, b and c (= d) within `workspace_bytes`, or
// nothing (the reason in *why) when it has none.
inline std::optional<cublasLtMatmulAlgo_t> lt_first_algo(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                                         cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                         cublasLtMatrixLayout_t c, std::size_t workspace_bytes,
                                                         const char** why = nullptr) {
  LtPreference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref.p, 1, &result, &found);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) return result.algo;
  if (why)
    *why = st != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusName(st)
           : found == 0                ? "the heuristic returned no algorithm"
                                       : cublasLtGetStatusName(result.state);
  return std::nullopt;
}

// Up to `n` of the heuristic's algorithms for `op` on layouts a, b and c (= d), in its order.
inline std::vector<cublasLtMatmulAlgo_t> lt_candidates(cublasLtHandle_t h, cublasLtMatmulDesc_t op,
                                                       cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                                       cublasLtMatrixLayout_t c, std::size_t workspace_bytes, int n) {
  LtPreference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(workspace_bytes));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(n));
  int found = 0;
  std::vector<cublasLtMatmulAlgo_t> out;
  if (cublasLtMatmulAlgoGetHeuristic(h, op, a, b, c, c, pref.p, n, results.data(), &found) != CUBLAS_STATUS_SUCCESS)
    return out;
  for (int i = 0; i < found; ++i)
    if (results[static_cast<std::size_t>(i)].state == CUBLAS_STATUS_SUCCESS) out.push_back(results[static_cast<std::size_t>(i)].algo);
  return out;
}

// One matmul D = op(A) op(B) (beta 0) as a tuner runs it: operands, layouts, where D may be written.
struct LtTuneCall {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t op;
  const void *a, *b;
  cublasLtMatrixLayout_t la, lb, lc;
  std::size_t d_bytes;  // D's size
  void* workspace;
  std::size_t workspace_bytes;
  cudaStream_t stream;
};
// The index of the fastest of `algos` (timed on the stream, the call's own operands, D written into
// memory of its own, freed after) among those whose D equals algos[0]'s bit for bit; 0 where none
// is faster. It synchronises the stream. With bit-equal results a tuned choice changes no number:
// the run stays reproducible whichever candidate the timing picks.
int lt_fastest_same_bits(const LtTuneCall& c, std::span<const cublasLtMatmulAlgo_t> algos);

// Which of a matmul's dimensions changes from call to call (a mixture of experts' rows: cuBLASLt's
// n for a product of rows and a weight, its k for a weight gradient).
enum class LtRagged { n, k };

// Algorithms for matmuls one of whose dimensions changes from call to call (a mixture of experts'
// experts: their rows change every step, and a heuristic per call costs the host ~100 us): the
// heuristic's choice for the shape with that dimension rounded up to a bucket (128, 192, 256, 384,
// 512, ...: two buckets an octave) and the others to multiples of 128, cached per rounded shape and
// `kind` (whatever else decides the choice: types, transposes, beta), used where
// cublasLtMatmulAlgoCheck says it takes the exact shape within the workspace, else the exact
// shape's choice (cached too). Few buckets matter: every algorithm the heuristic picks is a kernel
// that CUDA loads on its first launch (lazily, 1-10 ms each), and with rows rounded to multiples of
// 128 moe-1b met a new one every few steps for its first 30. Deterministic: a shape always gets the
// same algorithm, or (tuned) one whose results have the same bits.
class LtRaggedAlgos {
 public:
  // The bucket of a changing dimension v >= 1: the least 2^j or 3 * 2^(j-1) >= v, at least 128.
  static int bucket(int v) {
    int b = 128;
    while (b < v) b = b % 3 == 0 ? b / 3 * 4 : b / 2 * 3;  // 128, 192, 256, 384, 512, ...
    return b;
  }
  // Picks among candidates for a rounded shape (their index), given those that take the exact call.
  using Tuner = std::function<int(std::span<const cublasLtMatmulAlgo_t>)>;
  // `make(m, n, k)`: an object with members a, b, c (LtLayouts) for a shape; `exact`: the call's.
  // With `tune`: a new rounded shape takes the candidate it picks among the heuristic's first eight
  // that take the exact call (lt_fastest_same_bits), else the heuristic's first.
  template <class Make, class Layouts>
  const cublasLtMatmulAlgo_t* find(cublasLtHandle_t h, cublasLtMatmulDesc_t op, std::int64_t kind, int m, int n,
                                   int k, LtRagged ragged, const Make& make, const Layouts& exact,
                                   std::size_t workspace_bytes, const char** why, const Tuner& tune = {}) {
    auto round = [](int v) { return (v + 127) / 128 * 128; };
    const Key rounded{kind, round(m), ragged == LtRagged::n ? bucket(n) : round(n), ragged == LtRagged::k ? bucket(k) : round(k)};
    auto it = algos_.find(rounded);
    if (it == algos_.end()) {
      const auto r = make(std::get<1>(rounded), std::get<2>(rounded), std::get<3>(rounded));
      std::vector<cublasLtMatmulAlgo_t> cands = lt_candidates(h, op, r.a.l, r.b.l, r.c.l, workspace_bytes, tune ? 8 : 1);
      if (cands.size() > 1) {  // those that take the exact call, the heuristic's first first
        std::vector<cublasLtMatmulAlgo_t> usable;
        for (const auto& a : cands) {
          cublasLtMatmulHeuristicResult_t check{};
          if (cublasLtMatmulAlgoCheck(h, op, exact.a.l, exact.b.l, exact.c.l, exact.c.l, &a, &check) ==
                  CUBLAS_STATUS_SUCCESS &&
              check.workspaceSize <= workspace_bytes)
            usable.push_back(a);
        }
        if (usable.size() > 1 && std::memcmp(&usable[0], &cands[0], sizeof(cublasLtMatmulAlgo_t)) == 0) {
          const int pick = tune(usable);
          cands.assign(1, usable[static_cast<std::size_t>(pick)]);
        }
      }
      if (!cands.empty()) it = algos_.emplace(rounded, cands[0]).first;
    }
    cublasLtMatmulHeuristicResult_t check{};
    if (it != algos_.end() &&
        cublasLtMatmulAlgoCheck(h, op, exact.a.l, exact.b.l, exact.c.l, exact.c.l, &it->second, &check) ==
            CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= workspace_bytes)
      return &it->second;
    const Key key{kind, m, n, k};
    auto e = algos_.find(key);
    if (e == algos_.end()) {
      auto algo = lt_first_algo(h, op, exact.a.l, exact.b.l, exact.c.l, workspace_bytes, why);
      if (!algo) return nullptr;
      e = algos_.emplace(key, *algo).first;
    }
    return &e->second;
  }

 private:
  using Key = std::tuple<std::int64_t, int, int, int>;
  std::map<Key, cublasLtMatmulAlgo_t> algos_;
};

}  // namespace kiln::cuda
