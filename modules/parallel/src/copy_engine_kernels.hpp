#pragma once
// The one kernel the copy-engine communicator needs (copy_engine.hpp): the sums.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "kiln/parallel/communicator.hpp"

namespace kiln::parallel::detail {

constexpr int kMaxCopyEngineRanks = 8;

// out[i] = ins[0][i] op ins[1][i] op ... op ins[n-1][i] for i < count, left to right (bf16 through
// f32, rounded once); avg divides the sum by n. f32, bf16 and i32 (sum, max; avg for the floats).
// `out` may be one of `ins`.
void reduce_into(void* out, const void* const* ins, int n, std::size_t count, DType dtype, ReduceOp op,
                 cudaStream_t stream);

// Whether reduce_into takes this dtype and op.
bool reducible(DType dtype, ReduceOp op);

// One thread waits until the 32-bit flag (written by a peer GPU) is 1, then sets it to 0. A kernel,
// not a stream-ordered wait (cuStreamWaitValue32): a stream blocked on a flag can hold back other
// streams that share its hardware queue, and with waits on another GPU's progress that can close a
// cycle (seen: two data-parallel ranks hung). After `timeout_ns` it traps, so the process fails
// instead of hanging.
void take_flag(unsigned* flag, unsigned long long timeout_ns, cudaStream_t stream);

}  // namespace kiln::parallel::detail
