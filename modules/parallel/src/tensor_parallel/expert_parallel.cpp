#include "kiln/parallel/expert_parallel.hpp"

#include "kiln/core/error.hpp"
#include "kiln/parallel/grad_buckets.hpp"

namespace kiln::parallel {

namespace {
// Runs a step of the dispatch, naming it in any error (a rank that failed or hangs stops the others
// inside it: they say they were dispatching tokens).
template <class F>
void dispatching(const Communicator& comm, const char* what, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    KILN_THROW("expert-parallel token ", what, " over group '", comm.name(), "': ", e.what());
  }
}
}  // namespace

ExpertParallel::ExpertParallel(Communicator& comm, ops::Backend& backend, int n_experts)
    : comm_(comm), be_(backend), size_(comm.size()), rank_(comm.rank()), n_experts_(n_experts) {
  KILN_CHECK(n_experts > 0 && n_experts % size_ == 0, n_experts, " experts do not split over the ", size_,
             " ranks of the expert-parallel group '", comm.name(), "'");
}

ExpertParallel::Plan ExpertParallel::plan(const TensorView& offsets, std::int32_t* offsets_host) {
  const int E = n_experts_, P = size_;
  KILN_CHECK(offsets.dtype == DType::i32 && offsets.numel() == E + 1 && offsets.contiguous(),
             "expert-parallel plan: offsets ", offsets.str(), " for ", E, " experts");
  const std::int64_t n = static_cast<std::int64_t>(E + 1) * P;
  const Device dev = be_.device();
  if (offsets_all_.bytes() < static_cast<std::size_t>(n) * sizeof(std::int32_t))
    offsets_all_ = Buffer(dev, static_cast<std::size_t>(n) * sizeof(std::int32_t));
  const TensorView all(offsets_all_.data(), {n}, DType::i32, dev);
  dispatching(comm_, "counts exchange", [&] { comm_.all_gather(all, offsets, be_.stream()); });
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(std::int32_t);
  if (host_.bytes() < bytes) host_ = be_.alloc_host(bytes);
  be_.copy_to_host_async(TensorView(host_.data(), {n}, DType::i32, Device::cpu), all);
  be_.synchronize();  // the host waits here: for the gather's copy, the last work queued
  const auto* got = static_cast<const std::int32_t*>(host_.data());
  const std::int32_t* own = got + static_cast<std::ptrdiff_t>(rank_) * (E + 1);
  std::copy(own, own + E + 1, offsets_host);
  return plan_from(got);
}

ExpertParallel::Plan ExpertParallel::plan_from(const std::int32_t* gathered) const {
  const int E = n_experts_, El = local_experts(), P = size_;
  const std::int32_t* own = gathered + static_cast<std::ptrdiff_t>(rank_) * (E + 1);
  Plan p;
  p.send_at.assign(static_cast<std::size_t>(P), 0);
  p.send_rows = p.recv_at = p.recv_rows = p.send_at;
  for (int q = 0; q < P; ++q) {
    p.send_at[q] = own[q * El];
    p.send_rows[q] = own[(q + 1) * El] - own[q * El];
  }
  // Received rows by source rank, then local expert: group q El + l.
  p.local_offsets.assign(static_cast<std::size_t>(P * El + 1), 0);
  p.expert_of.resize(static_cast<std::size_t>(P * El));
  std::int64_t at = 0;
  for (int q = 0; q < P; ++q) {
    p.recv_at[q] = at;
    for (int l = 0; l < El; ++l) {
      p.local_offsets[static_cast<std::size_t>(q * El + l)] = static_cast<std::int32_t>(at);
      p.expert_of[static_cast<std::size_t>(q * El + l)] = l;
      const std::int32_t* o = gathered + static_cast<std::ptrdiff_t>(q) * (E + 1) + first_expert() + l;
      at += o[1] - o[0];  // rank q's rows for this rank's expert l
    }
    p.recv_rows[q] = at - p.recv_at[q];
  }
  KILN_CHECK(at < (std::int64_t{1} << 31), "expert-parallel group '", comm_.name(), "': ", at,
             " rows for this rank's experts exceed 32-bit offsets");
  p.local_offsets[static_cast<std::size_t>(P * El)] = static_cast<std::int32_t>(at);
  return p;
}

void ExpertParallel::exchange(const TensorView& to, const TensorView& from, const Plan& p, bool forward,
                              void* stream) const {
  // One transfer a peer that has rows (its rows for the peer's experts are consecutive in grouped
  // order, and the rows from it consecutive here): the i-th send to a peer meets its i-th receive.
  const TensorView& grouped = forward ? from : to;  // this rank's rows in grouped (by global expert) order
  const TensorView& expert = forward ? to : from;   // the rows of this rank's experts, by source rank
  std::vector<Communicator::Transfer> by_destination, by_origin;
  for (int q = 0; q < size_; ++q) {
    if (p.send_rows[q] > 0) by_destination.push_back({q, grouped.rows(p.send_at[q], p.send_rows[q])});
    if (p.recv_rows[q] > 0) by_origin.push_back({q, expert.rows(p.recv_at[q], p.recv_rows[q])});
  }
  dispatching(comm_, forward ? "dispatch (all-to-all)" : "combine (all-to-all)", [&] {
    if (forward)
      comm_.send_recv(by_destination, by_origin, stream);
    else
      comm_.send_recv(by_origin, by_destination, stream);
  });
}

void ExpertParallel::dispatch(const TensorView& recv, const TensorView& send, const Plan& plan) const {
  exchange(recv, send, plan, true, be_.stream());
}

void ExpertParallel::combine(const TensorView& out, const TensorView& back, const Plan& plan) const {
  exchange(out, back, plan, false, be_.stream());
}

void* ExpertParallel::side_stream() {
  if (!be_.stream()) return nullptr;
  // High priority: the exchange's blocks are dispatched before a GEMM's waiting ones.
  if (!side_) side_ = SideStream::create(be_.stream(), true);
  side_->wait_for_compute();
  side_pending_ = true;
  return side_->stream();
}

void ExpertParallel::dispatch_beside(const TensorView& recv, const TensorView& send, const Plan& plan) {
  exchange(recv, send, plan, true, side_stream());
}

void ExpertParallel::combine_beside(const TensorView& out, const TensorView& back, const Plan& plan) {
  exchange(out, back, plan, false, side_stream());
}

void ExpertParallel::join() {
  if (!side_pending_) return;
  side_->compute_waits();
  side_pending_ = false;
}

TensorShard expert_row_shard(const TensorParallel& tp, const ExpertParallel& ep, const std::vector<std::int64_t>& parts) {
  TensorShard s;
  if (tp.size() == 1 && ep.size() == 1) return s;
  std::int64_t per_expert = 0;
  for (const std::int64_t part : parts) {
    KILN_CHECK(part > 0 && part % tp.size() == 0, "an expert's part of ", part, " rows does not split over ",
               tp.size(), " tensor-parallel ranks");
    per_expert += part;
  }
  s.dim = 0;
  for (int e = ep.first_expert(); e < ep.first_expert() + ep.local_experts(); ++e) {
    std::int64_t at = e * per_expert;
    for (const std::int64_t part : parts) {
      const auto [b, end] = tp.split(part);
      s.ranges.push_back({at + b, at + end});
      at += part;
    }
  }
  return s;
}

}  // namespace kiln::parallel
