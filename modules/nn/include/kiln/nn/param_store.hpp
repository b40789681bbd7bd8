#pragma once
// Parameters live in one contiguous f32 master buffer; the compute copy (act dtype) and the f32
// gradients are buffers of the same layout. A parameter is a view at its offset in each buffer.
#include <vector>

#include "kiln/engine/world.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/tensor/buffer.hpp"

namespace kiln::nn {

inline constexpr std::int64_t kParamAlign = 64;  // elements: 256-byte aligned f32, 128-byte bf16

struct ParamStore {
  std::int64_t total = 0;     // elements, with alignment padding
  std::vector<Entity> order;  // parameter entities in layout order
  Buffer master;              // f32
  Buffer compute;             // act dtype
  Buffer grads;               // f32
  DType act = DType::f32;
  void* stream = nullptr;     // the compute stream (cudaStream_t) that writes them; collectives use it

  TensorView master_flat() const { return master.view(DType::f32, {total}); }
  TensorView compute_flat() const { return compute.view(act, {total}); }
  TensorView grads_flat() const { return grads.view(DType::f32, {total}); }
  TensorView master_view(const Param& p) const { return at(master, DType::f32, p); }
  TensorView compute_view(const Param& p) const { return at(compute, act, p); }
  TensorView grad_view(const Param& p) const { return at(grads, DType::f32, p); }
  // p's view in any flat buffer laid out like the store (e.g. the optimizer's moments).
  static TensorView view_in(const TensorView& flat, const Param& p) {
    return TensorView(static_cast<char*>(flat.data) + static_cast<std::size_t>(p.offset) * size_of(flat.dtype), p.shape,
                      flat.dtype, flat.device);
  }

 private:
  static TensorView at(const Buffer& b, DType t, const Param& p) {
    return b.view(t, p.shape, static_cast<std::size_t>(p.offset) * size_of(t));
  }
};

}  // namespace kiln::nn
