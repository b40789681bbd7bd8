#pragma once
// FP8 meta: the scaling state of every FP8 tensor of a rank, in one flat f32 buffer so that the
// amax reduction is one all-reduce and the delayed update is one kernel. Training state (a
// checkpoint saves state()).
//
// Layout for n slots (one slot per FP8 tensor; a linear layer has three, see TensorRole):
//   history   [len, n]  row 0: this step's amaxes (max-accumulated; the all-reduce buffer)
//                       rows 1..len-1: the previous steps, most recent first
//   scale     [n]       the scale tensors are quantised with
//   fp8_max   [n]       448 (e4m3) or 57344 (e5m2), constant
//   amax_now  [n]       scratch: the amax of a tensor being quantised with current scaling
//   scale_inv [n, 4]    1 / scale in column 0, the GEMMs' operand scales: one 16-byte slot each,
//                       because cuBLASLt wants 16-byte-aligned scale pointers
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kiln/fp8/ops.hpp"
#include "kiln/fp8/recipe.hpp"

namespace kiln::fp8 {

// Pointers to one tensor's entries in the meta buffer.
struct ScalingSlot {
  int index = -1;
  Format format = Format::e4m3;
  float fp8_max = 448.0f;
  float* amax = nullptr;      // history row 0
  float* amax_now = nullptr;
  float* scale = nullptr;
  float* scale_inv = nullptr;
};

// A meta store's state by value, as a checkpoint saves it.
struct Fp8MetaSnapshot {
  int n = 0, len = 0;
  std::vector<std::uint8_t> formats, ready;  // per slot
  std::vector<float> state;                  // Fp8MetaStore::state()
  std::string serialize() const;             // little-endian bytes
  static Fp8MetaSnapshot deserialize(std::string_view bytes);  // throws kiln::Error on malformed bytes
  // The states of several ranks' stores of the same slots as one: each slot's amax history the
  // elementwise maximum, its scale the smallest (its inverse to match), ready if any was: the
  // scaling the whole tensors would have had, never one that overflows a rank's part.
  static Fp8MetaSnapshot combine(const std::vector<Fp8MetaSnapshot>& ranks);
};

class Fp8MetaStore {
 public:
  // One slot per entry of `formats`; scales start at 1, histories at 0. Memory from ops.alloc.
  Fp8MetaStore(Fp8Ops& ops, std::vector<Format> formats, int history_len);

  int size() const { return n_; }
  int history_len() const { return len_; }
  ScalingSlot slot(int i) const;

  TensorView amaxes() const { return view(0, {n_}); }             // history row 0: all-reduce this
  TensorView history() const { return view(0, {len_, n_}); }
  TensorView scales() const { return view(len_ * n_, {n_}); }
  TensorView fp8_maxes() const { return view((len_ + 1) * n_, {n_}); }
  TensorView amaxes_now() const { return view((len_ + 2) * n_, {n_}); }
  TensorView scale_invs() const { return view(inv_offset(), {n_, kScaleInvStride}); }  // column 0
  TensorView state() const { return view(0, {inv_offset() + kScaleInvStride * n_}); }  // everything
  static constexpr int kScaleInvStride = 4;
  // Where scale_invs() starts in state(), for n slots and histories of len.
  static std::int64_t scale_inv_offset(int n, int len) { return (static_cast<std::int64_t>(len + 3) * n + 3) / 4 * 4; }
  const std::vector<Format>& formats() const { return formats_; }

  // Delayed scaling before a slot's first update has no history to draw a scale from: the first
  // quantisation of such a slot computes its scale from its own amax (see Fp8Linear), and marks it
  // ready. The first update marks every slot ready (a restored checkpoint should, too).
  bool ready(int i) const { return ready_[static_cast<std::size_t>(i)] != 0; }
  void set_ready(int i) { ready_[static_cast<std::size_t>(i)] = 1; }
  void set_all_ready() { std::fill(ready_.begin(), ready_.end(), 1); }

  // The delayed update of every slot (see DelayedUpdateArgs); marks them ready.
  void update(Fp8Ops& ops, AmaxAlgo algo, int margin);

  Fp8MetaSnapshot snapshot(Fp8Ops& ops) const;
  // Throws a kiln::Error naming both unless the snapshot has this store's slots, formats and history.
  void restore(Fp8Ops& ops, const Fp8MetaSnapshot& s);

 private:
  TensorView view(std::int64_t offset, Shape shape) const;
  std::int64_t inv_offset() const { return scale_inv_offset(n_, len_); }
  int n_ = 0, len_ = 0;
  std::vector<Format> formats_;
  std::vector<std::uint8_t> ready_;
  Buffer buf_;
  Device device_ = Device::cpu;
};

// Component on an nn::Linear entity whose GEMMs run in FP8: its three slots in the rank's
// Fp8MetaStore (input, weight, grad_output = first_slot + role) and their formats.
struct Fp8Meta {
  int first_slot = 0;
  std::array<Format, kRolesPerLinear> formats{};
  int slot(TensorRole r) const { return first_slot + static_cast<int>(r); }
};

}  // namespace kiln::fp8
