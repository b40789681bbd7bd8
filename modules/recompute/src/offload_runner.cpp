#include "kiln/recompute/offload_runner.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"

namespace kiln::recompute {

OffloadRunner::OffloadRunner(ops::Backend& be, std::vector<int> units, int slots)
    : be_(be),
      compute_(be.stream()),
      units_(std::move(units)),
      slots_(std::min<int>(slots, static_cast<int>(units_.size()))),
      out_(parallel::SideStream::create(be.stream())),
      in_(parallel::SideStream::create(be.stream())),
      resident_(static_cast<std::size_t>(slots_), -1),
      saved_(static_cast<std::size_t>(slots_)),
      loaded_(static_cast<std::size_t>(slots_)) {
  KILN_CHECK(std::is_sorted(units_.begin(), units_.end()) && slots_ >= 1, "offloaded units must be ascending");
}

void OffloadRunner::setup(std::vector<TensorView> regions) {
  KILN_CHECK(regions.size() == units_.size(), "offload: ", regions.size(), " regions for ", units_.size(), " blocks");
  regions_ = std::move(regions);
  const int n = static_cast<int>(units_.size());
  for (int k = 0; k < n; ++k) {
    const TensorView& r = regions_[static_cast<std::size_t>(k)];
    KILN_CHECK(r && r.contiguous(), "offload: block unit ", units_[static_cast<std::size_t>(k)], " has no region");
    KILN_CHECK(r.data == regions_[static_cast<std::size_t>(slot(k))].data, "offload: unit ",
               units_[static_cast<std::size_t>(k)], "'s region is not its slot's");
    if (k >= n - slots_) {
      host_.emplace_back();  // stays in its slot
      continue;
    }
    try {
      host_.push_back(be_.alloc_host(r.bytes()));
    } catch (const Error& e) {
      KILN_THROW("activation_offload: pinning ", r.bytes() >> 20, " MiB of host memory for block unit ",
                 units_[static_cast<std::size_t>(k)], " (", host_bytes() >> 20, " MiB pinned for the blocks before it) "
                 "failed; lower activation_offload.blocks: ", e.what());
    }
  }
}

std::size_t OffloadRunner::host_bytes() const {
  std::size_t n = 0;
  for (const auto& b : host_) n += b.bytes();
  return n;
}

int OffloadRunner::ordinal(int unit) const {
  const auto it = std::lower_bound(units_.begin(), units_.end(), unit);
  return it != units_.end() && *it == unit ? static_cast<int>(it - units_.begin()) : -1;
}

void OffloadRunner::forward_begin(int unit, bool training) {
  const int k = ordinal(unit);
  if (k < 0 || !training) return;
  const auto s = static_cast<std::size_t>(slot(k));
  saved_[s].wait(compute_);  // the slot's previous block has left for the host
  resident_[s] = k;
}

void OffloadRunner::forward_end(int unit, bool training) {
  const int k = ordinal(unit);
  if (k < 0 || !training || k >= static_cast<int>(units_.size()) - slots_) return;  // the last stay in their slots
  const auto s = static_cast<std::size_t>(slot(k));
  void* out = out_ ? out_->stream() : nullptr;
  fork_.record(compute_);
  fork_.wait(out);
  const Buffer& host = host_[static_cast<std::size_t>(k)];
  be_.copy_on(out, host.view(DType::u8, {static_cast<std::int64_t>(host.bytes())}), regions_[static_cast<std::size_t>(k)]);
  saved_[s].record(out);
  ++copies_out_;
}

void OffloadRunner::load(int k) {
  const auto s = static_cast<std::size_t>(slot(k));
  void* in = in_ ? in_->stream() : nullptr;
  fork_.record(compute_);  // the slot's previous block's backward pass is queued
  fork_.wait(in);
  const Buffer& host = host_[static_cast<std::size_t>(k)];
  KILN_CHECK(host, "offload: block ordinal ", k, " was never copied out");
  be_.copy_on(in, regions_[static_cast<std::size_t>(k)], host.view(DType::u8, {static_cast<std::int64_t>(host.bytes())}));
  loaded_[s].record(in);
  resident_[s] = k;
  ++copies_in_;
}

void OffloadRunner::backward_begin(int unit) {
  const int k = ordinal(unit);
  if (k < 0) return;
  const auto s = static_cast<std::size_t>(slot(k));
  if (resident_[s] != k) load(k);  // not queued ahead (a pass that began with this block)
  loaded_[s].wait(compute_);
}

void OffloadRunner::backward_end(int unit) {
  const int k = ordinal(unit);
  if (k < slots_) return;  // nothing offloaded comes after it into its slot
  load(k - slots_);
}

void OffloadRunner::graph_begin() {
  for (auto* side : {out_.get(), in_.get()}) {
    if (!side) continue;
    join_.record(side->stream());
    join_.wait(compute_);
  }
  for (auto& e : saved_) e.forget();
  for (auto& e : loaded_) e.forget();
  fork_.forget();
  join_.forget();
}

void OffloadRunner::capture_end() {
  // Every copy a pass queues is waited for within it; a copy stream still in the capture is joined
  // all the same, as a capture must end.
  for (auto* side : {out_.get(), in_.get()}) {
    if (!side || !side->capturing()) continue;
    join_.record(side->stream());
    join_.wait(compute_);
  }
}

void OffloadRunner::replayed() {
  for (auto& e : saved_) e.record(compute_);
  for (auto& e : loaded_) e.record(compute_);
  fork_.forget();
  join_.forget();
}

}  // namespace kiln::recompute
