#include <cuda_bf16.h>

#include <cstdio>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "copy_engine_kernels.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::parallel::detail {
namespace {

struct Inputs {
  const void* p[kMaxCopyEngineRanks];
};

template <class T>
struct Acc {
  using type = float;
};
template <>
struct Acc<int> {
  using type = int;
};

__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ int to_acc(int v) { return v; }
__device__ __forceinline__ void from_acc(float v, __nv_bfloat16& o) { o = __float2bfloat16_rn(v); }
__device__ __forceinline__ void from_acc(float v, float& o) { o = v; }
__device__ __forceinline__ void from_acc(int v, int& o) { o = v; }

template <class A>
__device__ __forceinline__ A combine(A a, A b, bool is_max) {
  return is_max ? (a > b ? a : b) : a + b;
}

// VEC: every pointer 16-byte aligned, 16 bytes per thread per step; else one element.
template <class T, bool VEC>
__global__ void reduce_kernel(T* out, Inputs ins, int n, std::size_t count, bool is_max, bool avg) {
  using A = typename Acc<T>::type;
  constexpr int W = VEC ? 16 / sizeof(T) : 1;
  const std::size_t groups = count / W;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t g = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; g < groups; g += stride) {
    T v[W];
    A acc[W];
    if constexpr (VEC) {
      *reinterpret_cast<uint4*>(v) = reinterpret_cast<const uint4*>(ins.p[0])[g];
    } else {
      v[0] = static_cast<const T*>(ins.p[0])[g];
    }
#pragma unroll
    for (int j = 0; j < W; ++j) acc[j] = to_acc(v[j]);
    for (int k = 1; k < n; ++k) {
      if constexpr (VEC) {
        *reinterpret_cast<uint4*>(v) = reinterpret_cast<const uint4*>(ins.p[k])[g];
      } else {
        v[0] = static_cast<const T*>(ins.p[k])[g];
      }
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = combine(acc[j], to_acc(v[j]), is_max);
    }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      if constexpr (!std::is_same_v<A, int>) {
        if (avg) acc[j] /= static_cast<A>(n);
      }
      from_acc(acc[j], v[j]);
    }
    if constexpr (VEC) {
      reinterpret_cast<uint4*>(out)[g] = *reinterpret_cast<uint4*>(v);
    } else {
      out[g] = v[0];
    }
  }
}

template <class T>
void launch(void* out, const void* const* in, int n, std::size_t count, ReduceOp op, cudaStream_t s) {
  Inputs ins{};
  bool aligned = reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  for (int k = 0; k < n; ++k) {
    ins.p[k] = in[k];
    aligned = aligned && reinterpret_cast<std::uintptr_t>(in[k]) % 16 == 0;
  }
  constexpr std::size_t W = 16 / sizeof(T);
  const bool is_max = op == ReduceOp::max, avg = op == ReduceOp::avg;
  const int threads = 256;
  auto blocks = [&](std::size_t work) {
    return static_cast<unsigned>(std::min<std::size_t>((work + threads - 1) / threads, 132 * 8));
  };
  std::size_t done = 0;
  if (aligned && count >= W) {
    const std::size_t groups = count / W;
    reduce_kernel<T, true><<<blocks(groups), threads, 0, s>>>(static_cast<T*>(out), ins, n, groups * W, is_max, avg);
    KILN_CUDA_CHECK(cudaGetLastError());
    done = groups * W;
  }
  if (done < count) {
    Inputs rest{};
    for (int k = 0; k < n; ++k) rest.p[k] = static_cast<const T*>(in[k]) + done;
    reduce_kernel<T, false>
        <<<blocks(count - done), threads, 0, s>>>(static_cast<T*>(out) + done, rest, n, count - done, is_max, avg);
    KILN_CUDA_CHECK(cudaGetLastError());
  }
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void take_flag_kernel(unsigned* flag, unsigned long long timeout_ns) {
  volatile unsigned* f = flag;
  const unsigned long long t0 = global_ns();
  while (*f != 1u) {
    if (global_ns() - t0 > timeout_ns) {
      printf("kiln copy engine: a peer's data or slot did not come within %llu s\n", timeout_ns / 1000000000ull);
      __trap();
    }
    __nanosleep(64);
  }
  *f = 0u;
  __threadfence_system();
}

}  // namespace

void take_flag(unsigned* flag, unsigned long long timeout_ns, cudaStream_t stream) {
  take_flag_kernel<<<1, 1, 0, stream>>>(flag, timeout_ns);
  KILN_CUDA_CHECK(cudaGetLastError());
}

bool reducible(DType dtype, ReduceOp op) {
  switch (dtype) {
    case DType::f32:
    case DType::bf16: return true;
    case DType::i32: return op != ReduceOp::avg;
    default: return false;
  }
}

void reduce_into(void* out, const void* const* ins, int n, std::size_t count, DType dtype, ReduceOp op,
                 cudaStream_t stream) {
  KILN_CHECK(n >= 1 && n <= kMaxCopyEngineRanks && reducible(dtype, op), "copy-engine reduction of ", n, " ",
             name_of(dtype), " inputs (", reduce_op_name(op), ")");
  if (count == 0) return;
  switch (dtype) {
    case DType::f32: launch<float>(out, ins, n, count, op, stream); break;
    case DType::bf16: launch<__nv_bfloat16>(out, ins, n, count, op, stream); break;
    default: launch<int>(out, ins, n, count, op, stream); break;
  }
}

}  // namespace kiln::parallel::detail
