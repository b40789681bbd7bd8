// Elementwise and utility kernels: dtype conversion, fill, Philox normal init, sum of squares, and the
// unfused GEMM epilogues used when cuBLASLt cannot fuse one (gemm.cpp).
#include "common.cuh"
#include "kiln/ops/cuda/moments.cuh"
#include "kiln/ops/epilogue.hpp"
#include "kiln/ops/formulas.hpp"
#include "kiln/ops/grads.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

// Grid-stride over chunks of 8 elements; `vec` (both pointers 16-byte aligned) enables 16-byte
// accesses, and the last, partial chunk goes element by element, so any n works.
__global__ void f32_to_bf16_kernel(bf16* dst, const float* src, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n; i += stride * 8) {
    if (vec && i + 8 <= n) {
      float f[8];
      load8(src + i, f);
      store8(dst + i, f);
    } else {
      for (std::int64_t j = i; j < n && j < i + 8; ++j) dst[j] = __float2bfloat16_rn(src[j]);
    }
  }
}

__global__ void bf16_to_f32_kernel(float* dst, const bf16* src, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n; i += stride * 8) {
    if (vec && i + 8 <= n) {
      float f[8];
      load8(src + i, f);
      store8(dst + i, f);
    } else {
      for (std::int64_t j = i; j < n && j < i + 8; ++j) dst[j] = __bfloat162float(src[j]);
    }
  }
}

__global__ void fill_kernel(float* dst, float value, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride * 4) {
    if (vec && i + 4 <= n) {
      *reinterpret_cast<float4*>(dst + i) = make_float4(value, value, value, value);
    } else {
      for (std::int64_t j = i; j < n && j < i + 4; ++j) dst[j] = value;
    }
  }
}

__global__ void add_kernel(float* dst, const float* src, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n; i += stride * 4) {
    if (vec && i + 4 <= n) {
      float4 d = *reinterpret_cast<const float4*>(dst + i);
      const float4 a = *reinterpret_cast<const float4*>(src + i);
      d.x += a.x;
      d.y += a.y;
      d.z += a.z;
      d.w += a.w;
      *reinterpret_cast<float4*>(dst + i) = d;
    } else {
      for (std::int64_t j = i; j < n && j < i + 4; ++j) dst[j] += src[j];
    }
  }
}

// bf16 gradients: dst = round(float(dst) + float(src)), 8 at a time where aligned.
__global__ void add_bf16_kernel(bf16* dst, const bf16* src, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n; i += stride * 8) {
    if (vec && i + 8 <= n) {
      float d[8], a[8];
      load8(dst + i, d);
      load8(src + i, a);
#pragma unroll
      for (int k = 0; k < 8; ++k) d[k] += a[k];
      store8(dst + i, d);
    } else {
      for (std::int64_t j = i; j < n && j < i + 8; ++j)
        dst[j] = __float2bfloat16_rn(__bfloat162float(dst[j]) + __bfloat162float(src[j]));
    }
  }
}

// GELU of chunks of 8 bf16 (the same ops::gelu as the CPU); out may alias x (each thread reads
// its chunk before writing it).
__global__ void gelu_kernel(bf16* out, const bf16* x, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n; i += stride * 8) {
    if (vec && i + 8 <= n) {
      float f[8];
      load8(x + i, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = ops::gelu(f[k]);
      store8(out + i, f);
    } else {
      for (std::int64_t j = i; j < n && j < i + 8; ++j) out[j] = __float2bfloat16_rn(ops::gelu(__bfloat162float(x[j])));
    }
  }
}

// dx = dout * gelu'(x) over chunks of 8 bf16 (the same ops::gelu_grad as the CPU).
__global__ void gelu_backward_kernel(bf16* dx, const bf16* dout, const bf16* x, std::int64_t n, bool vec) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n; i += stride * 8) {
    if (vec && i + 8 <= n) {
      float f[8], g[8];
      load8(x + i, f);
      load8(dout + i, g);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = g[k] * ops::gelu_grad(f[k]);
      store8(dx + i, f);
    } else {
      for (std::int64_t j = i; j < n && j < i + 8; ++j)
        dx[j] = __float2bfloat16_rn(__bfloat162float(dout[j]) * ops::gelu_grad(__bfloat162float(x[j])));
    }
  }
}

// One thread per Philox block: its 4 words give 4 normals (two Box-Muller pairs), the arithmetic
// of rng::philox_normal step by step (all explicitly rounded), so the bits equal the CPU's.
__global__ void init_normal_kernel(float* dst, std::int64_t n, float stddev, rng::PhiloxArgs r, std::int64_t g0) {
  const std::uint64_t start = r.start();  // on the device: reads offset_ptr in graph-safe mode
  const std::int64_t b0 = g0 / 4, b1 = (g0 + n + 3) / 4;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t b = b0 + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < b1; b += stride) {
    const rng::Philox4 w = rng::philox_block(r.seed, start + static_cast<std::uint64_t>(b));
    float z[4];
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const float u1 = rng::u32_to_uniform_pos(w.v[2 * pair]);
      const float u2 = rng::u32_to_uniform(w.v[2 * pair + 1]);
      const float radius = rng::sqrt_rn(rng::mul_rn(-2.0f, rng::portable_log(u1)));
      float s, c;
      rng::portable_sincos_2pi(u2, s, c);
      z[2 * pair] = rng::mul_rn(radius, c);
      z[2 * pair + 1] = rng::mul_rn(radius, s);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const std::int64_t e = 4 * b + k - g0;
      if (e >= 0 && e < n) dst[e] = rng::mul_rn(stddev, z[k]);
    }
  }
}

// Fixed blocking: the grid size is a function of n only, each thread walks a fixed set of float4s
// and sums in double, then a fixed-order block reduction writes one partial per block.
constexpr std::int64_t kSumPerBlock = 8192;
constexpr std::int64_t kSumMaxBlocks = 1024;

__host__ __device__ inline std::int64_t sum_squares_partials_device(std::int64_t n) {
  if (n <= 0) return 0;
  const std::int64_t blocks = (n + kSumPerBlock - 1) / kSumPerBlock;
  return blocks < kSumMaxBlocks ? blocks : kSumMaxBlocks;
}

// Block `block` of `blocks` over x's n elements: its partial sum of squares (the same arithmetic
// whether the blocks of one tensor are a grid of their own or part of sum_squares_many_kernel's). T:
// float, or std::uint16_t holding bf16 bits (a bf16 gradient), each element read as f32 exactly: the
// same partials as an f32 tensor of the same values. vec: x 16-byte aligned.
template <class T>
__device__ void sum_squares_block(float* partial, const T* x, std::int64_t n, bool vec, std::int64_t block,
                                  std::int64_t blocks) {
  __shared__ double warp_totals[kThreads / kWarp];
  double acc = 0;
  const std::int64_t stride = blocks * blockDim.x;
  auto add4 = [&](const float (&v)[4]) {
    acc += double(v[0]) * v[0];
    acc += double(v[1]) * v[1];
    acc += double(v[2]) * v[2];
    acc += double(v[3]) * v[3];
  };
  auto add_at = [&](std::int64_t i) {  // the four elements from i, or those of them before n
    if (vec && i + 4 <= n) {
      float v[4];
      load4(x + i, v);
      add4(v);
    } else {
      for (std::int64_t j = i; j < n && j < i + 4; ++j) {
        const float v = ops::grad_load(x, j);
        acc += double(v) * v;
      }
    }
  };
  // A bf16 tensor four of the thread's steps at a time, their loads issued before any is summed (a
  // bf16 step loads 8 bytes: one at a time, too few bytes are in flight to fill the memory's
  // bandwidth); the sum's order is the one-step loop's, which f32 keeps.
  constexpr int U = sizeof(T) == 2 ? 4 : 1;
  const std::int64_t step = stride * 4;
  for (std::int64_t i = (block * blockDim.x + threadIdx.x) * 4; i < n; i += U * step) {
    if (vec && i + (U - 1) * step + 4 <= n) {
      float v[U][4];
#pragma unroll
      for (int u = 0; u < U; ++u) load4(x + i + u * step, v[u]);
#pragma unroll
      for (int u = 0; u < U; ++u) add4(v[u]);
    } else {
      for (int u = 0; u < U && i + u * step < n; ++u) add_at(i + u * step);
    }
  }
  acc = warp_sum(acc);
  if (threadIdx.x % kWarp == 0) warp_totals[threadIdx.x / kWarp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0;
    for (int w = 0; w < kThreads / kWarp; ++w) total += warp_totals[w];
    *partial = static_cast<float>(total);
  }
}

template <class T>
__global__ void sum_squares_kernel(float* partials, const T* x, std::int64_t n, bool vec) {
  sum_squares_block(partials + blockIdx.x, x, n, vec, blockIdx.x, gridDim.x);
}

// Every tensor's blocks in one grid: block b belongs to the last segment whose first partial is <= b.
__global__ void sum_squares_many_kernel(float* partials, const SumSquaresSegment* segs, int n_segs) {
  const std::int64_t b = blockIdx.x;
  int lo = 0, hi = n_segs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (segs[mid].first <= b) lo = mid; else hi = mid - 1;
  }
  const SumSquaresSegment g = segs[lo];
  if (g.bf16)
    sum_squares_block(partials + b, static_cast<const std::uint16_t*>(g.x), g.n, aligned16(g.x), b - g.first,
                      sum_squares_partials_device(g.n));
  else
    sum_squares_block(partials + b, static_cast<const float*>(g.x), g.n, aligned16(g.x), b - g.first,
                      sum_squares_partials_device(g.n));
}

// Unfused epilogues on a row-major [M, N] bf16 matrix (see gemm.cpp).
__global__ void gemm_epilogue_kernel(bf16* d, const bf16* aux, const bf16* bias, std::int64_t M, std::int64_t N,
                                     ops::Epilogue epilogue) {
  const std::int64_t total = M * N, stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    float v;
    if (epilogue == ops::Epilogue::bias) v = __bfloat162float(d[i]) + __bfloat162float(bias[i % N]);
    else if (epilogue == ops::Epilogue::gelu) v = ops::gelu(__bfloat162float(aux[i]));  // of the stored pre-activation
    else v = __bfloat162float(d[i]) * ops::gelu_grad(__bfloat162float(aux[i]));          // dgelu
    d[i] = __float2bfloat16_rn(v);
  }
}

}  // namespace

void convert_f32_to_bf16(bf16* dst, const float* src, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  f32_to_bf16_kernel<<<grid_for(ceil_div(n, 8), kThreads), kThreads, 0, s>>>(dst, src, n, aligned16(dst) && aligned16(src));
  KILN_CUDA_LAUNCH_CHECK();
}

void convert_bf16_to_f32(float* dst, const bf16* src, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  bf16_to_f32_kernel<<<grid_for(ceil_div(n, 8), kThreads), kThreads, 0, s>>>(dst, src, n, aligned16(dst) && aligned16(src));
  KILN_CUDA_LAUNCH_CHECK();
}

void fill_f32(float* dst, float value, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(ceil_div(n, 4), kThreads), kThreads, 0, s>>>(dst, value, n, aligned16(dst));
  KILN_CUDA_LAUNCH_CHECK();
}

void add_f32(float* dst, const float* src, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  add_kernel<<<grid_for(ceil_div(n, 4), kThreads), kThreads, 0, s>>>(dst, src, n, aligned16(dst) && aligned16(src));
  KILN_CUDA_LAUNCH_CHECK();
}

void add_bf16(bf16* dst, const bf16* src, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  add_bf16_kernel<<<grid_for(ceil_div(n, 8), kThreads), kThreads, 0, s>>>(dst, src, n, aligned16(dst) && aligned16(src));
  KILN_CUDA_LAUNCH_CHECK();
}

void gelu_forward(bf16* out, const bf16* x, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  gelu_kernel<<<grid_for(ceil_div(n, 8), kThreads), kThreads, 0, s>>>(out, x, n, aligned16(out) && aligned16(x));
  KILN_CUDA_LAUNCH_CHECK();
}

void gelu_backward(bf16* dx, const bf16* dout, const bf16* x, std::int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  gelu_backward_kernel<<<grid_for(ceil_div(n, 8), kThreads), kThreads, 0, s>>>(
      dx, dout, x, n, aligned16(dx) && aligned16(dout) && aligned16(x));
  KILN_CUDA_LAUNCH_CHECK();
}

void init_normal_f32(float* dst, std::int64_t n, float stddev, rng::PhiloxArgs rng, std::int64_t global_offset,
                     cudaStream_t s) {
  if (n <= 0) return;
  KILN_CHECK(global_offset >= 0, "init_normal: negative global offset ", global_offset);
  const std::int64_t blocks = (global_offset + n + 3) / 4 - global_offset / 4;
  init_normal_kernel<<<grid_for(blocks, kThreads), kThreads, 0, s>>>(dst, n, stddev, rng, global_offset);
  KILN_CUDA_LAUNCH_CHECK();
}

std::int64_t sum_squares_partials(std::int64_t n) { return sum_squares_partials_device(n); }

void sum_squares_many(float* partials, const SumSquaresSegment* segs, int n_segs, std::int64_t total_blocks,
                      cudaStream_t s) {
  if (total_blocks == 0) return;
  sum_squares_many_kernel<<<static_cast<unsigned>(total_blocks), kThreads, 0, s>>>(partials, segs, n_segs);
  KILN_CUDA_LAUNCH_CHECK();
}

void sum_squares_f32(float* partials, const float* x, std::int64_t n, cudaStream_t s) {
  const std::int64_t blocks = sum_squares_partials(n);
  if (blocks == 0) return;
  sum_squares_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(partials, x, n, aligned16(x));
  KILN_CUDA_LAUNCH_CHECK();
}

void sum_squares_bf16(float* partials, const std::uint16_t* x, std::int64_t n, cudaStream_t s) {
  const std::int64_t blocks = sum_squares_partials(n);
  if (blocks == 0) return;
  sum_squares_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(partials, x, n, aligned16(x));
  KILN_CUDA_LAUNCH_CHECK();
}

namespace detail {
// bias: d += bias (per column); gelu: d = gelu(aux); dgelu: d *= gelu'(aux). Declared in gemm.cpp.
void gemm_epilogue_fallback(bf16* d, const bf16* aux, const bf16* bias, std::int64_t M, std::int64_t N,
                            ops::Epilogue epilogue, cudaStream_t s) {
  KILN_CHECK(epilogue != ops::Epilogue::none, "gemm_epilogue_fallback: no epilogue to apply");
  if (M <= 0 || N <= 0) return;
  gemm_epilogue_kernel<<<grid_for(M * N, kThreads), kThreads, 0, s>>>(d, aux, bias, M, N, epilogue);
  KILN_CUDA_LAUNCH_CHECK();
}
}  // namespace detail

}  // namespace kiln::cuda

// ---- zero_many ----
namespace kiln::cuda {
namespace {

// A grid-stride loop over the work space, 4 elements of one piece per thread and step (a float4
// store where aligned); the table is tiny and read by every thread.
__global__ void zero_many_kernel(const ZeroRun* runs, int n, std::int64_t W) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x * 4;
  for (std::int64_t w = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4; w < W; w += stride) {
    const int lo = entry_at_work(runs, n, w);
    const std::int64_t local = w - __ldg(&runs[lo].work), count = __ldg(&runs[lo].count);
    if (local >= count) continue;  // the rounding after the piece's last element
    float* p = runs[lo].data + local;
    if (local + 4 <= count && aligned16(p)) {
      *reinterpret_cast<float4*>(p) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    } else {
      for (std::int64_t j = 0; j < 4 && local + j < count; ++j) p[j] = 0.0f;
    }
  }
}

}  // namespace

void zero_many(const ZeroRun* runs, int n, std::int64_t work, cudaStream_t s) {
  if (n <= 0 || work <= 0) return;
  zero_many_kernel<<<grid_for(ceil_div(work, 4), 256, 8192), 256, 0, s>>>(runs, n, work);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda

// ---- grad_clip_finish ----
namespace kiln::cuda {
namespace {

__global__ void grad_clip_finish_kernel(const float* partials, std::int64_t count, double max_norm, float* scalars,
                                        double* norm) {
  double sum = 0;
  for (std::int64_t i = 0; i < count; ++i) sum += partials[i];  // the host's order
  const double n = sqrt(sum);
  *norm = n;
  scalars[ops::kAdamWGradScale] = ops::grad_clip_scale(n, max_norm);
}

}  // namespace

void grad_clip_finish(const float* partials, std::int64_t count, double max_norm, float* scalars, double* norm,
                      cudaStream_t s) {
  grad_clip_finish_kernel<<<1, 1, 0, s>>>(partials, count, max_norm, scalars, norm);
  KILN_CUDA_LAUNCH_CHECK();
}

namespace {

__global__ void grad_clip_from_sum_kernel(const float* sum_squares, double max_norm, float* scalars, double* norm) {
  const double n = sqrt(static_cast<double>(*sum_squares));
  *norm = n;
  scalars[ops::kAdamWGradScale] = ops::grad_clip_scale(n, max_norm);
}

// Each part's quotient by a thread of its own (its partials added in order, as the host adds them),
// then the quotients added in order by thread 0: the host's arithmetic, with the parts in parallel.
__global__ void sum_squares_parts_kernel(const float* partials, const SumSquaresPart* parts, int n_parts,
                                         double* quotients, float* out) {
  for (int i = threadIdx.x; i < n_parts; i += blockDim.x) {
    const SumSquaresPart p = parts[i];
    double each = 0;
    if (p.divisor > 0)
      for (std::int64_t k = p.first; k < p.end; ++k) each += partials[k];
    quotients[i] = p.divisor > 0 ? each / p.divisor : 0.0;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double total = 0;
  for (int i = 0; i < n_parts; ++i)  // the host's order
    if (parts[i].divisor > 0) total += quotients[i];
  *out = static_cast<float>(total);
}

}  // namespace

void grad_clip_from_sum(const float* sum_squares, double max_norm, float* scalars, double* norm, cudaStream_t s) {
  grad_clip_from_sum_kernel<<<1, 1, 0, s>>>(sum_squares, max_norm, scalars, norm);
  KILN_CUDA_LAUNCH_CHECK();
}

void sum_squares_parts_finish(const float* partials, const SumSquaresPart* parts, int n_parts, double* quotients,
                              float* out, cudaStream_t s) {
  sum_squares_parts_kernel<<<1, 256, 0, s>>>(partials, parts, n_parts, quotients, out);
  KILN_CUDA_LAUNCH_CHECK();
}

}  // namespace kiln::cuda
