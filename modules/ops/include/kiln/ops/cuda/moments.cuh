#pragma once
// AdamW's moments four at a time (a 4-aligned index) in the kernels that update them (ops' flat
// AdamW, the fp8 module's fused AdamW + quantisation): held as f32 (one float4) or as bf16 bits (one
// uint2), read as f32 and written rounded to nearest even, as ops::moment_load / moment_store.
#include <cuda_runtime.h>

#include <cstdint>

#include "kiln/tensor/bf16.hpp"

namespace kiln::cuda {

__device__ __forceinline__ void load4(const float* p, float o[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  o[0] = x.x, o[1] = x.y, o[2] = x.z, o[3] = x.w;
}
__device__ __forceinline__ void load4(const std::uint16_t* p, float o[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  o[0] = bf16_bits_to_float(static_cast<std::uint16_t>(x.x & 0xffffu));
  o[1] = bf16_bits_to_float(static_cast<std::uint16_t>(x.x >> 16));
  o[2] = bf16_bits_to_float(static_cast<std::uint16_t>(x.y & 0xffffu));
  o[3] = bf16_bits_to_float(static_cast<std::uint16_t>(x.y >> 16));
}
__device__ __forceinline__ void store4(float* p, const float o[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(o[0], o[1], o[2], o[3]);
}
__device__ __forceinline__ void store4(std::uint16_t* p, const float o[4]) {
  uint2 x;
  x.x = float_to_bf16_bits(o[0]) | (static_cast<unsigned>(float_to_bf16_bits(o[1])) << 16);
  x.y = float_to_bf16_bits(o[2]) | (static_cast<unsigned>(float_to_bf16_bits(o[3])) << 16);
  *reinterpret_cast<uint2*>(p) = x;
}

}  // namespace kiln::cuda
