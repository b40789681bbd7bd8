#pragma once
// Whether an address allows 16-byte (uint4 / float4 / cp.async) accesses: the one test every vectorised
// kernel path and every cuBLASLt pointer requirement of kiln asks.
#include <cstdint>

namespace kiln {

// Host and device code alike (kernels choose their vector paths by it too).
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

}  // namespace kiln
