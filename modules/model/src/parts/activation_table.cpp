#include "kiln/model/parts/activation_table.hpp"

#include "kiln/core/error.hpp"

namespace kiln::model {

void ActivationTable::Rows::saved(TensorView& slot, const std::string& key, DType dtype, Shape shape,
                                  StageSet stage) {
  table_.saved_rows_.push_back({block_, key, dtype, shape, (recomputed_ & stage) != 0});
  if (recomputed_ & stage)
    add(table_.recomputed_, key, {&slot, dtype, shape});
  else
    table_.kept_.request(&slot, dtype, shape);
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
