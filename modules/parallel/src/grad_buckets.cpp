#include "kiln/parallel/grad_buckets.hpp"

#include <algorithm>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

std::vector<GradBucket> plan_buckets(std::vector<UnitSpan> spans, std::int64_t bucket_elems, bool bridge_gaps) {
  std::sort(spans.begin(), spans.end(), [](const UnitSpan& a, const UnitSpan& b) { return a.unit > b.unit; });
  for (std::size_t i = 0; i < spans.size(); ++i) {
    KILN_CHECK(spans[i].begin <= spans[i].end, "unit ", spans[i].unit, ": span [", spans[i].begin, ", ", spans[i].end,
               ")");
    if (i > 0)
      KILN_CHECK(spans[i].unit != spans[i - 1].unit && spans[i].end <= spans[i - 1].begin, "units ", spans[i].unit,
                 " and ", spans[i - 1].unit, ": gradient spans must be disjoint and in ascending unit order");
  }
  std::vector<GradBucket> buckets;
  std::int64_t elems = 0;  // in the current bucket (its spans alone without bridge_gaps)
  for (const auto& s : spans) {
    if (buckets.empty() || (bucket_elems > 0 && elems >= bucket_elems)) {
      buckets.push_back({s.begin, s.end, {}, {}});
      elems = 0;
    }
    auto& b = buckets.back();
    b.begin = s.begin;  // extend downwards: the units arrive in descending order
    b.units.push_back(s.unit);
    if (bridge_gaps) {
      elems = b.end - b.begin;
    } else {
      elems += s.end - s.begin;
      if (s.end == s.begin) continue;
      if (!b.runs.empty() && b.runs.back().first == s.end)
        b.runs.back().first = s.begin;
      else
        b.runs.push_back({s.begin, s.end});
    }
  }
  return buckets;
}

DpGradSync::DpGradSync(Communicator& comm, const TensorView& grads, std::vector<GradBucket> buckets,
                       void* compute_stream)
    : comm_(comm),
      grads_(grads),
      buckets_(std::move(buckets)),
      side_(SideStream::create(compute_stream)),
      compute_stream_(compute_stream) {
  KILN_CHECK((grads.dtype == DType::f32 || grads.dtype == DType::bf16) && grads.ndim() == 1,
             "flat f32 or bf16 gradients expected, got ", grads.str());
  int max_unit = -1;
  for (auto& b : buckets_) {
    KILN_CHECK(b.begin >= 0 && b.end <= grads.numel() && b.begin <= b.end, "bucket [", b.begin, ", ", b.end,
               ") outside the ", grads.numel(), " gradients");
    for (int u : b.units) max_unit = std::max(max_unit, u);
  }
  bucket_of_unit_.assign(static_cast<std::size_t>(max_unit + 1), -1);
  unit_done_.assign(static_cast<std::size_t>(max_unit + 1), false);
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    for (int u : buckets_[b].units) bucket_of_unit_[static_cast<std::size_t>(u)] = static_cast<int>(b);
  pending_.resize(buckets_.size());
  launched_.assign(buckets_.size(), false);
  for (std::size_t b = 0; b < buckets_.size(); ++b) pending_[b] = static_cast<int>(buckets_[b].units.size());
}

void DpGradSync::unit_ready(int unit) {
  if (unit < 0 || unit >= static_cast<int>(bucket_of_unit_.size())) return;
  const int b = bucket_of_unit_[static_cast<std::size_t>(unit)];
  if (b < 0) return;
  auto&& done = unit_done_[static_cast<std::size_t>(unit)];
  KILN_CHECK(!done, "unit ", unit, " reported its gradients ready twice in one step");
  done = true;
  if (--pending_[static_cast<std::size_t>(b)] == 0) {
    launch(static_cast<std::size_t>(b));
    ++launched_now_;
  }
}

void DpGradSync::launch(std::size_t b) {
  const auto& bucket = buckets_[b];
  launched_[b] = true;
  std::vector<std::pair<std::int64_t, std::int64_t>> runs = bucket.runs;
  if (runs.empty() && bucket.end > bucket.begin) runs.push_back({bucket.begin, bucket.end});
  if (runs.empty()) return;
  if (side_) side_->wait_for_compute();
  for (const auto& [begin, end] : runs)
    comm_.all_reduce(grads_.flat_slice(begin, end - begin), ReduceOp::sum, side_ ? side_->stream() : compute_stream_);
}

void DpGradSync::capture_end() {
  if (side_ && side_->capturing()) side_->compute_waits();
  captured_ = launched_;
}

void DpGradSync::replayed() {
  KILN_CHECK(captured_.size() == launched_.size(), "gradient buckets replayed without a capture");
  launched_ = captured_;
  launched_now_ = static_cast<int>(std::count(captured_.begin(), captured_.end(), true));
}

void DpGradSync::finish() {
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    if (!launched_[b]) launch(b);
  if (side_) side_->compute_waits();
  launched_early_ = launched_now_;
  launched_now_ = 0;
  unit_done_.assign(unit_done_.size(), false);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<int>(buckets_[b].units.size());
    launched_[b] = false;
  }
}

}  // namespace kiln::parallel
