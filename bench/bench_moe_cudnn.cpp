// A probe of cuDNN's grouped matmul for mixtures of experts (cuDNN >= 9.15, the backend API's
// CUDNN_BACKEND_OPERATION_MOE_GROUPED_MATMUL_DESCRIPTOR): one call over every expert's rows, the
// experts' first rows read from device memory (no host value per call, so a captured step could hold
// it). Against one cublasGemmEx per expert (kiln's bf16 path is one cuBLASLt matmul per expert), on
// the data GEMMs of pipelines/moe-1b.toml (8 experts, 32768 routed rows), balanced and imbalanced.
// bf16 checked against the per-expert products; FP8 (e4m3 in, bf16 out) tried and its plan's status
// printed. Prints TFLOP/s per method and GEMM.
//   bench_moe_cudnn [iters]
#include <cublas_v2.h>
#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_random.hpp"
#include "bench_timer.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

using namespace kiln;

namespace {

void check(cudnnStatus_t s, const char* what) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char msg[1024] = {0};
  cudnnGetLastErrorString(msg, sizeof msg);
  throw std::runtime_error(std::string(what) + ": " + cudnnGetErrorString(s) + " " + msg);
}

// A backend descriptor, destroyed with its owner.
struct Desc {
  cudnnBackendDescriptor_t d = nullptr;
  explicit Desc(cudnnBackendDescriptorType_t t) { check(cudnnBackendCreateDescriptor(t, &d), "create descriptor"); }
  Desc(const Desc&) = delete;
  ~Desc() {
    if (d) cudnnBackendDestroyDescriptor(d);
  }
  template <class T>
  void set(cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, std::int64_t n, const T* v) {
    check(cudnnBackendSetAttribute(d, a, t, n, v), "set attribute");
  }
  void finalize(const char* what) { check(cudnnBackendFinalize(d), what); }
};

std::unique_ptr<Desc> tensor(std::int64_t uid, cudnnDataType_t type, std::vector<std::int64_t> dims,
                             std::vector<std::int64_t> strides) {
  auto t = std::make_unique<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const std::int64_t align = 16;
  t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
  t->set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 3, dims.data());
  t->set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 3, strides.data());
  t->set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
  t->set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
  t->finalize("tensor");
  return t;
}

// out[T, N] = token[T, K] @ W_e^T for the rows [first[e], first[e + 1]) of expert e; W [E, N, K].
struct MoePlan {
  std::vector<std::unique_ptr<Desc>> keep;
  cudnnBackendDescriptor_t plan = nullptr;
  std::int64_t workspace = 0;
};

MoePlan build(cudnnHandle_t h, int E, std::int64_t T, std::int64_t K, std::int64_t N, cudnnDataType_t in) {
  MoePlan p;
  auto token = tensor(1, in, {1, T, K}, {T * K, K, 1});
  auto weight = tensor(2, in, {E, K, N}, {K * N, 1, K});
  auto first = tensor(3, CUDNN_DATA_INT32, {E, 1, 1}, {1, 1, 1});
  auto out = tensor(4, CUDNN_DATA_BFLOAT16, {1, T, N}, {T * N, N, 1});
  auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_MOE_GROUPED_MATMUL_DESCRIPTOR);
  const cudnnMoeGroupedMatmulMode_t mode = CUDNN_MOE_GROUPED_MATMUL_MODE_NONE;
  const cudnnDataType_t prec = CUDNN_DATA_FLOAT;
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_MODE, CUDNN_TYPE_MOE_GROUPED_MATMUL_MODE, 1, &mode);
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_TOKEN_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &token->d);
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_WEIGHT_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &weight->d);
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_FIRST_TOKEN_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &first->d);
  op->set(CUDNN_ATTR_OPERATION_MOE_GROUPED_MATMUL_OUTPUT_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &out->d);
  op->finalize("moe grouped matmul operation");
  auto graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &op->d);
  graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
  graph->finalize("operation graph");
  auto heur = std::make_unique<Desc>(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  const cudnnBackendHeurMode_t hm = CUDNN_HEUR_MODE_A;
  heur->set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph->d);
  heur->set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &hm);
  heur->finalize("heuristics");
  std::int64_t count = 0;
  check(cudnnBackendGetAttribute(heur->d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                 nullptr),
        "heuristic results");
  if (count == 0) throw std::runtime_error("no engine config");
  std::vector<std::unique_ptr<Desc>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (std::int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->d);
  }
  check(cudnnBackendGetAttribute(heur->d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                                 raw.data()),
        "heuristic results");
  std::string why;
  for (std::int64_t i = 0; i < count; ++i) {
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &raw[i]);
    const cudnnStatus_t s = cudnnBackendFinalize(plan->d);
    if (s != CUDNN_STATUS_SUCCESS) {
      char msg[512] = {0};
      cudnnGetLastErrorString(msg, sizeof msg);
      why += std::string("; config ") + std::to_string(i) + ": " + cudnnGetErrorString(s) + " " + msg;
      continue;
    }
    std::int64_t n = 0;
    check(cudnnBackendGetAttribute(plan->d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                   &p.workspace),
          "workspace size");
    p.plan = plan->d;
    for (auto* d : {&token, &weight, &first, &out, &op, &graph, &heur}) p.keep.push_back(std::move(*d));
    for (auto& c : configs) p.keep.push_back(std::move(c));
    p.keep.push_back(std::move(plan));
    return p;
  }
  throw std::runtime_error("no plan finalizes" + why);
}

void run(cudnnHandle_t h, const MoePlan& p, void* token, void* weight, void* first, void* out, void* ws) {
  std::int64_t uids[4] = {1, 2, 3, 4};
  void* ptrs[4] = {token, weight, first, out};
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, 4, uids);
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, 4, ptrs);
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  pack.finalize("variant pack");
  check(cudnnBackendExecute(h, p.plan, pack.d), "execute");
}

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Random e4m3 bytes of magnitude below 1 over the whole device buffer.
void fill_random_e4m3(Buffer& b) {
  std::uint32_t x = 12345;
  std::vector<std::uint8_t> v(b.bytes());
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = static_cast<std::uint8_t>(((x >> 24) & 0x80) | ((x >> 16) % 0x38));
  }
  KILN_CUDA_CHECK(cudaMemcpy(b.data(), v.data(), v.size(), cudaMemcpyHostToDevice));
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20;
  std::printf("cuDNN %zu (runtime), built against %d.%d.%d\n", cudnnGetVersion(), CUDNN_MAJOR, CUDNN_MINOR,
              CUDNN_PATCHLEVEL);
  cudaStream_t s;
  KILN_CUDA_CHECK(cudaStreamCreate(&s));
  cudnnHandle_t dnn;
  check(cudnnCreate(&dnn), "cudnnCreate");
  check(cudnnSetStream(dnn, s), "cudnnSetStream");
  cublasHandle_t blas;
  KILN_CUBLAS_CHECK(cublasCreate(&blas));
  KILN_CUBLAS_CHECK(cublasSetStream(blas, s));
  bench::EventTimer timer(s, false, 3, iters);
  const int E = 8, R = 32768;
  const std::vector<std::vector<int>> splits = {std::vector<int>(E, R / E),
                                                {5500, 3000, 4100, 4600, 3600, 4300, 2900, 4768}};
  struct Problem {
    const char* name;
    int K, N;
  };
  const Problem problems[] = {{"fc1 fwd [R,1024]x[5632,1024]^T", 1024, 5632}, {"fc2 fwd [R,2816]x[1024,2816]^T", 2816, 1024}};
  Buffer x(Device::cuda, std::size_t(R) * 2816 * 2), w(Device::cuda, std::size_t(E) * 5632 * 2816 * 2),
      y(Device::cuda, std::size_t(R) * 5632 * 2), yref(Device::cuda, std::size_t(R) * 5632 * 2),
      x8(Device::cuda, std::size_t(R) * 2816), w8(Device::cuda, std::size_t(E) * 5632 * 2816),
      first(Device::cuda, 64 * sizeof(int)), ws(Device::cuda, 256u << 20);
  bench::fill_random_bf16(x);
  bench::fill_random_bf16(w);
  fill_random_e4m3(x8);
  fill_random_e4m3(w8);
  const float one = 1.0f, zero = 0.0f;
  std::printf("%-34s %-10s %12s %12s %12s  %s\n", "gemm", "split", "per-expert", "cudnn bf16", "cudnn fp8", "check");
  for (const auto& p : problems)
    for (std::size_t si = 0; si < splits.size(); ++si) {
      const auto& rows = splits[si];
      std::vector<int> off(E + 1, 0);
      for (int e = 0; e < E; ++e) off[e + 1] = off[e] + rows[e];
      KILN_CUDA_CHECK(cudaMemcpy(first.data(), off.data(), E * sizeof(int), cudaMemcpyHostToDevice));
      const double flops = 2.0 * R * p.K * p.N;
      auto tf = [&](double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; };
      auto* X = static_cast<char*>(x.data());
      auto* W = static_cast<char*>(w.data());
      auto per_expert = [&] {
        for (int e = 0; e < E; ++e)
          KILN_CUBLAS_CHECK(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, p.N, rows[e], p.K, &one,
                                         W + std::size_t(e) * p.N * p.K * 2, CUDA_R_16BF, p.K,
                                         X + std::size_t(off[e]) * p.K * 2, CUDA_R_16BF, p.K, &zero,
                                         static_cast<char*>(yref.data()) + std::size_t(off[e]) * p.N * 2, CUDA_R_16BF,
                                         p.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      const double te = timer.median_ms(per_expert);
      double tb = 0, t8 = 0;
      std::string note;
      try {
        const MoePlan plan = build(dnn, E, R, p.K, p.N, CUDNN_DATA_BFLOAT16);
        if (plan.workspace > static_cast<std::int64_t>(ws.bytes())) throw std::runtime_error("workspace too large");
        auto call = [&] { run(dnn, plan, x.data(), w.data(), first.data(), y.data(), ws.data()); };
        tb = timer.median_ms(call);
        // Against the per-expert products: the largest difference relative to the largest value.
        std::vector<std::uint16_t> a(std::size_t(R) * p.N), b(a.size());
        KILN_CUDA_CHECK(cudaMemcpy(a.data(), y.data(), a.size() * 2, cudaMemcpyDeviceToHost));
        KILN_CUDA_CHECK(cudaMemcpy(b.data(), yref.data(), b.size() * 2, cudaMemcpyDeviceToHost));
        double worst = 0, scale = 1e-30;
        std::size_t same = 0;
        for (std::size_t i = 0; i < a.size(); ++i) {
          const double u = bf16_to_float(a[i]), v = bf16_to_float(b[i]);
          worst = std::max(worst, std::fabs(u - v));
          scale = std::max(scale, std::fabs(v));
          same += a[i] == b[i];
        }
        char buf[160];
        std::snprintf(buf, sizeof buf, "bf16 max |diff| / max |ref| = %.2e, %.1f%% same bits, workspace %lld B",
                      worst / scale, 100.0 * same / a.size(), static_cast<long long>(plan.workspace));
        note = buf;
      } catch (const std::exception& e) {
        note = std::string("bf16: ") + e.what();
      }
      try {
        const MoePlan plan = build(dnn, E, R, p.K, p.N, CUDNN_DATA_FP8_E4M3);
        if (plan.workspace > static_cast<std::int64_t>(ws.bytes())) throw std::runtime_error("workspace too large");
        t8 = timer.median_ms([&] { run(dnn, plan, x8.data(), w8.data(), first.data(), y.data(), ws.data()); });
      } catch (const std::exception& e) {
        note += std::string("; fp8: ") + e.what();
      }
      std::printf("%-34s %-10s %11.0fT %11.0fT %11.0fT  %s\n", p.name, si == 0 ? "balanced" : "cv 0.2", tf(te), tf(tb),
                  tf(t8), note.c_str());
      std::printf("%-34s %-10s %11.3fms %10.3fms %10.3fms\n", "", "", te, tb, t8);
    }
  cublasDestroy(blas);
  cudnnDestroy(dnn);
  return 0;
}
