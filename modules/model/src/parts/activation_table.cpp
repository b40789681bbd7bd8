#include "kiln/model/parts/activation_table.hpp"

#include "kiln/core/error.hpp"

namespace kiln::model {

void ActivationTable::Rows::saved(TensorView& slot, const std::string& key, DType dtype, Shape shape,
                                  StageSet stage) {
  const bool recomputed = (recomputed_ & stage) != 0, offloaded = !recomputed && offload_slot_ >= 0;
  table_.saved_rows_.push_back({block_, key, dtype, shape, recomputed, offloaded ? offload_slot_ : -1});
  if (recomputed) {
    add(table_.recomputed_, key, {&slot, dtype, shape});
  } else if (offloaded) {
    auto& slots = table_.offloaded_;
    if (slots.size() <= static_cast<std::size_t>(offload_slot_)) slots.resize(static_cast<std::size_t>(offload_slot_) + 1);
    add(slots[static_cast<std::size_t>(offload_slot_)], key, {&slot, dtype, shape});
  } else {
    table_.kept_.request(&slot, dtype, shape);
  }
}

void ActivationTable::Rows::kept(TensorView& slot, DType dtype, Shape shape) { table_.kept_.request(&slot, dtype, shape); }

void ActivationTable::Rows::scratch(TensorView& slot, const std::string& key, DType dtype, Shape shape) {
  add(table_.scratch_, key, {&slot, dtype, shape});
}

void ActivationTable::Rows::backward_scratch(TensorView& slot, const std::string& key, DType dtype, Shape shape) {
  add(table_.backward_rows_, key, {&slot, dtype, shape});
}

void ActivationTable::Rows::own(TensorView& slot, DType dtype, Shape shape) { table_.arena_.request(&slot, dtype, shape); }

void ActivationTable::add(std::map<std::string, Shared>& to, const std::string& key, const Slot& s) {
  Shared& shared = to[key];
  shared.slots.push_back(s);
  shared.bytes = std::max(shared.bytes, static_cast<std::size_t>(s.shape.numel()) * size_of(s.dtype));
}

void ActivationTable::request(Arena& arena, std::map<std::string, Shared>& rows) {
  for (auto& [key, shared] : rows) arena.request(&shared.memory, DType::u8, {static_cast<std::int64_t>(shared.bytes)});
}

void ActivationTable::point(std::map<std::string, Shared>& rows) {
  for (auto& [key, shared] : rows)
    for (const Slot& s : shared.slots)
      *s.view = TensorView(shared.memory.data, s.shape, s.dtype, shared.memory.device);
}

void ActivationTable::allocate(ops::Backend& be, int copies) {
  request(arena_, recomputed_);
  request(arena_, scratch_);
  arena_.allocate(be);
  kept_.allocate_copies(be, copies);
  point(recomputed_);
  point(scratch_);
  request(backward_, backward_rows_);  // sized now, placed by place_backward_scratch
  // Each offload slot's rows in one allocation of their own: the region moved to and from the host.
  offload_arenas_ = std::vector<Arena>(offloaded_.size());
  for (std::size_t s = 0; s < offloaded_.size(); ++s) {
    KILN_CHECK(!offloaded_[s].empty(), "offload slot ", s, " has no rows (the slots in use are numbered from 0)");
    KILN_CHECK(copies == 1, "offloaded activations with ", copies, " copies of the saved rows (pipeline stages)");
    request(offload_arenas_[s], offloaded_[s]);
    offload_arenas_[s].allocate(be);
    point(offloaded_[s]);
  }
}

TensorView ActivationTable::offload_region(int slot) const {
  KILN_CHECK(slot >= 0 && static_cast<std::size_t>(slot) < offload_arenas_.size(), "offload slot ", slot, " of ",
             offload_arenas_.size());
  return offload_arenas_[static_cast<std::size_t>(slot)].all();
}

void ActivationTable::select_copy(int copy) {
  KILN_CHECK(copy >= 0 && copy < kept_.copies(), "activation copy ", copy, " of ", kept_.copies());
  kept_.select(copy);
}

std::size_t ActivationTable::backward_scratch_bytes() const {
  std::size_t n = 0;  // as request() lays the rows out, then place_backward_scratch's alignment
  for (const auto& [key, shared] : backward_rows_) n = Arena::align_up(n) + shared.bytes;
  return Arena::align_up(n) + Arena::kAlign;
}

nn::BlockScratch ActivationTable::place_backward_scratch(ops::Backend& be, const TensorView& host, std::size_t borrow) {
  const std::size_t bytes = host.bytes(), rows = Arena::align_up(backward_.bytes());
  nn::BlockScratch lent{host.data, bytes};
  if (rows + borrow <= bytes) {
    const std::size_t at = (bytes - rows) / Arena::kAlign * Arena::kAlign;  // the rows at the end, aligned
    backward_.place(static_cast<char*>(host.data) + at, host.device);
    lent.bytes = at;
    backward_apart_ = false;
  } else {
    backward_.allocate(be);
    backward_apart_ = true;
  }
  point(backward_rows_);
  return lent;
}

}  // namespace kiln::model
