#include "kiln/parallel/pipeline_parallel.hpp"


#include "kiln/core/error.hpp"

namespace kiln::parallel {

namespace {
std::string name(const PipelineMessage& m) {
  return cat(m.activation ? "activation" : "gradient", " of micro-batch ", m.micro_batch, " from stage ", m.from,
             " to stage ", m.to());
}
}  // namespace

void PipelineParallel::transfer(const PipelineTransfers& call, const Buffers& buffers, void* stream) const {
  if (call.sends.empty() && call.recvs.empty()) return;
  std::vector<Communicator::Transfer> sends, recvs;
  std::string what;
  for (const auto& m : call.sends) {
    sends.push_back({rank_of(m.to()), buffers(m, true)});
    what += cat(what.empty() ? "" : ", ", "send of the ", name(m));
  }
  for (const auto& m : call.recvs) {
    recvs.push_back({rank_of(m.from), buffers(m, false)});
    what += cat(what.empty() ? "" : ", ", "receive of the ", name(m));
  }
  comm_.p2p(sends, recvs, stream, what);
}

void PipelineParallel::post(const PipelineTransfers& call, const Buffers& buffers, void* compute) {
  if (!compute) return transfer(call, buffers, nullptr);
  if (call.sends.empty() && call.recvs.empty()) return;
  if (!side_) side_ = SideStream::create(compute);
  side_->wait_for_compute();
  transfer(call, buffers, side_->stream());
  unwaited_ = true;
}

void PipelineParallel::wait_posted(void* compute) {
  if (!compute || !unwaited_) return;  // the compute stream waits for every call posted already
  side_->compute_waits();
  unwaited_ = false;
}

void PipelineParallel::mark_posted(StreamEvent& done) const {
  if (side_) done.record(side_->stream());
}

void PipelineParallel::receive_activation(int v, const TensorView& into, void* stream) const {
  comm_.p2p({}, {{rank_of(v - 1), into}}, stream, cat("receive of the activation entering stage ", v));
}

void PipelineParallel::send_activation(int v, const TensorView& from, void* stream) const {
  comm_.p2p({{rank_of(v + 1), from}}, {}, stream, cat("send of the activation leaving stage ", v));
}

double PipelineParallel::from_last(double value) const {
  if (size() == 1) return value;
  float v = static_cast<float>(value);  // f32, as the losses' means travel
  comm_.broadcast(TensorView(&v, {1}, DType::f32, Device::cpu), size() - 1, nullptr);
  return v;
}

std::vector<std::vector<std::int64_t>> PipelineParallel::gather(const std::vector<std::int64_t>& mine) const {
  const auto n = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size()));
  if (n > 0) {
    // Sent as twice as many i32 words: an all-gather copies bytes.
    std::vector<std::int64_t> in = mine;
    comm_.all_gather(TensorView(all.data(), {2 * n * size()}, DType::i32, Device::cpu),
                     TensorView(in.data(), {2 * n}, DType::i32, Device::cpu), nullptr);
  }
  std::vector<std::vector<std::int64_t>> out;
  for (int r = 0; r < size(); ++r) out.emplace_back(all.begin() + r * n, all.begin() + (r + 1) * n);
  return out;
}

void PipelineParallel::sum_with(int peer, const TensorView& grad, const TensorView& scratch, void* stream,
                                const std::string& what,
                                const std::function<void(const TensorView& into, const TensorView& other)>& add) const {
  comm_.p2p({{peer, grad}}, {{peer, scratch}}, stream, what);
  add(grad, scratch);
}

}  // namespace kiln::parallel
