#include "kiln/parallel/nccl.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "kiln/core/error.hpp"
#include "kiln/parallel/stream_event.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::parallel {

namespace {
using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::u8: return ncclUint8;
    default: KILN_THROW("NCCL collectives support f32, bf16, i32 and u8, not ", name_of(t));
  }
}
ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}
}  // namespace

struct NcclWorld::Impl {
  int rank = 0, world = 1, device = 0;
  std::chrono::milliseconds timeout{};
  std::shared_ptr<Rendezvous> rendezvous;
  ncclComm_t world_comm = nullptr;

  mutable std::mutex m;
  std::vector<ncclComm_t> comms;  // every communicator, for abort and destroy
  struct Pending {
    cudaEvent_t event;
    std::string what;
    Clock::time_point start;
  };
  std::deque<Pending> pending;
  std::vector<cudaEvent_t> free_events;
  std::atomic<bool> aborted{false};
  std::string reason;
  std::atomic<bool> stop{false};
  std::thread watchdog;

  void abort(const std::string& why) {
    std::vector<ncclComm_t> to_abort;
    {
      std::lock_guard lk(m);
      if (aborted) return;
      reason = why;
      aborted = true;
      to_abort = comms;
    }
    for (auto c : to_abort) ncclCommAbort(c);
  }

  void check(const std::string& what) const {
    if (!aborted) return;
    std::lock_guard lk(m);
    KILN_THROW("rank ", rank, ": stopped", what.empty() ? "" : " in " + what, " because ", reason);
  }

  // Waits for a non-blocking NCCL call to finish (init, split, or a collective that said so).
  void settle(ncclComm_t c, const std::string& what) {
    const auto deadline = Clock::now() + timeout;
    ncclResult_t state = ncclInProgress;
    while (true) {
      ncclCommGetAsyncError(c, &state);
      if (state != ncclInProgress) break;
      if (rendezvous)
        if (auto f = rendezvous->failure()) abort(*f);
      check(what);
      if (Clock::now() > deadline) {
        abort(cat("NCCL ", what, " did not finish within ", std::chrono::duration<double>(timeout).count(), " s"));
        check(what);
      }
      std::this_thread::yield();
    }
    if (state != ncclSuccess) {
      abort(cat("NCCL error in ", what, ": ", ncclGetErrorString(state), " (", ncclGetLastError(c), ")"));
      check(what);
    }
  }

  void track(cudaStream_t s, const std::string& what) {
    cudaEvent_t e;
    {
      std::lock_guard lk(m);
      if (free_events.empty()) {
        KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      } else {
        e = free_events.back();
        free_events.pop_back();
      }
    }
    KILN_CUDA_CHECK(cudaEventRecord(e, s));
    std::lock_guard lk(m);
    pending.push_back({e, what, Clock::now()});
  }

  void watch() {
    cudaSetDevice(device);
    while (!stop) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (aborted) continue;
      if (rendezvous)
        if (auto f = rendezvous->failure()) {
          std::string during;
          {
            std::lock_guard lk(m);
            if (!pending.empty()) during = " (this rank was waiting in " + pending.front().what + ")";
          }
          abort(*f + during);
          continue;
        }
      std::string timed_out;
      {
        std::lock_guard lk(m);
        while (!pending.empty()) {
          auto& p = pending.front();
          cudaError_t q = cudaEventQuery(p.event);
          if (q == cudaSuccess) {
            free_events.push_back(p.event);
            pending.pop_front();
            continue;
          }
          if (q != cudaErrorNotReady) cudaGetLastError();
          if (Clock::now() - p.start > timeout)
            timed_out = cat("a collective timed out after ", std::chrono::duration<double>(timeout).count(), " s: ",
                            p.what, " did not finish (a rank stopped arriving or hangs)");
          break;
        }
      }
      if (!timed_out.empty()) {
        abort(timed_out);
        continue;
      }
      std::vector<ncclComm_t> cs;
      {
        std::lock_guard lk(m);
        cs = comms;
      }
      for (auto c : cs) {
        ncclResult_t st = ncclSuccess;
        ncclCommGetAsyncError(c, &st);
        if (st != ncclSuccess && st != ncclInProgress) {
          abort(cat("NCCL reported ", ncclGetErrorString(st), ": ", ncclGetLastError(c)));
          break;
        }
      }
    }
  }
};

namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<NcclWorld::Impl> w, ncclComm_t c, std::string name, std::vector<int> members)
      : w_(std::move(w)), comm_(c), name_(std::move(name)), members_(std::move(members)) {
    int r = 0, n = 0;
    ncclCommUserRank(comm_, &r);
    ncclCommCount(comm_, &n);
    rank_ = r;
    size_ = n;
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }

  void all_reduce(const TensorView& buf, ReduceOp op, void* stream) override {
    const std::string what = cat(name_, " all_reduce(", reduce_op_name(op), ", ", buf.str(), ")");
    staged(buf, stream, what, [&](void* data, cudaStream_t s) {
      ncclAllReduce(data, data, static_cast<std::size_t>(buf.numel()), nccl_type(buf.dtype), nccl_op(op), comm_, s);
    });
  }
  void all_gather(const TensorView& out, const TensorView& in, void* stream) override {
    KILN_CHECK(out.numel() == in.numel() * size_ && out.dtype == in.dtype, name_, " all_gather: ", in.str(), " -> ",
               out.str());
    const std::string what = cat(name_, " all_gather(", in.str(), ")");
    staged(out, in, stream, what, [&](void* o, const void* i, cudaStream_t s) {
      ncclAllGather(i, o, static_cast<std::size_t>(in.numel()), nccl_type(in.dtype), comm_, s);
    });
  }
  void reduce_scatter(const TensorView& out, const TensorView& in, ReduceOp op, void* stream) override {
    KILN_CHECK(in.numel() == out.numel() * size_ && out.dtype == in.dtype, name_, " reduce_scatter: ", in.str(),
               " -> ", out.str());
    const std::string what = cat(name_, " reduce_scatter(", reduce_op_name(op), ", ", in.str(), ")");
    staged(out, in, stream, what, [&](void* o, const void* i, cudaStream_t s) {
      ncclReduceScatter(i, o, static_cast<std::size_t>(out.numel()), nccl_type(in.dtype), nccl_op(op), comm_, s);
    });
  }
  void broadcast(const TensorView& buf, int root, void* stream) override {
    const std::string what = cat(name_, " broadcast(root ", root, ", ", buf.str(), ")");
    staged(buf, stream, what, [&](void* data, cudaStream_t s) {
      ncclBroadcast(data, data, static_cast<std::size_t>(buf.numel()), nccl_type(buf.dtype), root, comm_, s);
    });
  }
  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) override {
    grouped(sends, recvs, stream, cat(name_, " send_recv (", sends.size(), " sends, ", recvs.size(), " receives)"));
  }
  void p2p(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
           const std::string& what) override {
    std::string peers;
    for (const auto* list : {&sends, &recvs})
      for (const auto& t : *list) peers += cat(peers.empty() ? "" : ", ", list == &sends ? "to " : "from ", members_[static_cast<std::size_t>(t.peer)]);
    grouped(sends, recvs, stream, cat(name_, " ", what, " (", peers, ")"));
  }
  void barrier() override {
    std::int32_t one = 1;
    all_reduce(TensorView(&one, {1}, DType::i32, Device::cpu), ReduceOp::sum, nullptr);
  }

 private:
  // NCCL's grouped sends and receives: only the peers named take part.
  void grouped(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
               const std::string& what) {
    if (sends.empty() && recvs.empty()) return;
    for (const auto* list : {&sends, &recvs})
      for (const auto& t : *list)
        KILN_CHECK(t.buf.device == Device::cuda && t.peer >= 0 && t.peer < size_, what, ": ", t.buf.str(),
                   " with peer ", t.peer, " (device buffers, peers inside the group)");
    run(stream, what, [&](cudaStream_t s) {
      ncclGroupStart();
      for (const auto& t : sends)
        ncclSend(t.buf.data, static_cast<std::size_t>(t.buf.numel()), nccl_type(t.buf.dtype), t.peer, comm_, s);
      for (const auto& t : recvs)
        ncclRecv(t.buf.data, static_cast<std::size_t>(t.buf.numel()), nccl_type(t.buf.dtype), t.peer, comm_, s);
      ncclGroupEnd();
    });
  }

  // Enqueues a collective on `stream`, tracked by the watchdog.
  template <class F>
  void run(void* stream, const std::string& what, F&& call) {
    w_->check(what);
    auto s = static_cast<cudaStream_t>(stream);
    call(s);
    w_->settle(comm_, what);
    if (!capturing(s)) w_->track(s, what);  // a captured one is tracked at each launch
  }

  // Device buffers go straight to NCCL; host buffers (scalars: losses, norms; the checkpoint's
  // agreement flags and manifest parts) are staged through a device buffer on a private stream and
  // copied back before returning.
  template <class F>
  void staged(const TensorView& buf, void* stream, const std::string& what, F&& call) {
    staged(buf, buf, stream, what, [&](void* out, const void*, cudaStream_t s) { call(out, s); });
  }
  // The same for a collective from `in` to `out` (the same tensor when in place): both on the
  // device, or both on the host.
  template <class F>
  void staged(const TensorView& out, const TensorView& in, void* stream, const std::string& what, F&& call) {
    if (out.device != in.device) KILN_THROW(what, ": the input and the output must both be on the device or the host, got ",
                                            in.str(), " and ", out.str());
    if (out.device == Device::cuda) {
      run(stream, what, [&](cudaStream_t s) { call(out.data, in.data, s); });
      return;
    }
    const bool in_place = out.data == in.data;
    const std::size_t in_at = (out.bytes() + 255) / 256 * 256, need = in_place ? out.bytes() : in_at + in.bytes();
    if (!own_stream_) KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
    if (staging_.bytes() < need) staging_ = Buffer(Device::cuda, std::max<std::size_t>(need, 256));
    auto* dev = static_cast<char*>(staging_.data());
    char* dev_in = in_place ? dev : dev + in_at;
    KILN_CUDA_CHECK(cudaMemcpyAsync(dev_in, in.data, in.bytes(), cudaMemcpyHostToDevice, own_stream_));
    run(own_stream_, what, [&](cudaStream_t s) { call(dev, dev_in, s); });
    KILN_CUDA_CHECK(cudaMemcpyAsync(out.data, dev, out.bytes(), cudaMemcpyDeviceToHost, own_stream_));
    // The watchdog aborts a hung collective, which lets this wait return; then report why.
    cudaStreamSynchronize(own_stream_);
    w_->check(what);
  }

  std::shared_ptr<NcclWorld::Impl> w_;
  ncclComm_t comm_;
  std::string name_;
  std::vector<int> members_;
  int rank_ = 0, size_ = 1;
  cudaStream_t own_stream_ = nullptr;
  Buffer staging_;
};

}  // namespace

void use_device(int device) { KILN_CUDA_CHECK(cudaSetDevice(device)); }

std::string NcclWorld::make_unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) KILN_THROW("ncclGetUniqueId failed: ", ncclGetErrorString(r));
  return std::string(id.internal, sizeof id.internal);
}

NcclWorld::NcclWorld(int rank, int world, int device, std::shared_ptr<Rendezvous> rendezvous,
                     std::chrono::milliseconds timeout)
    : impl_(std::make_shared<Impl>()) {
  auto& w = *impl_;
  w.rank = rank;
  w.world = world;
  w.device = device;
  w.timeout = timeout;
  w.rendezvous = std::move(rendezvous);
  KILN_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  const std::string& bytes = w.rendezvous->payload();
  KILN_CHECK(bytes.size() == sizeof id.internal, "rendezvous payload of ", bytes.size(), " bytes is not an NCCL id");
  std::memcpy(id.internal, bytes.data(), sizeof id.internal);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = ncclCommInitRankConfig(&w.world_comm, world, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    KILN_THROW("rank ", rank, ": ncclCommInitRankConfig failed: ", ncclGetErrorString(r));
  {
    std::lock_guard lk(w.m);
    w.comms.push_back(w.world_comm);
  }
  w.settle(w.world_comm, "creating the world communicator");
  w.watchdog = std::thread([&w] { w.watch(); });
}

NcclWorld::~NcclWorld() {
  auto& w = *impl_;
  w.stop = true;
  if (w.watchdog.joinable()) w.watchdog.join();
  if (!w.aborted) {
    cudaDeviceSynchronize();
    for (auto c : w.comms) ncclCommDestroy(c);
  }
  for (auto& p : w.pending) cudaEventDestroy(p.event);
  for (auto e : w.free_events) cudaEventDestroy(e);
}

std::unique_ptr<Communicator> NcclWorld::group(const std::string& name, int color, const std::vector<int>& members,
                                               bool blocking) {
  auto& w = *impl_;
  w.check("creating the " + name + " communicator");
  if (!blocking && static_cast<int>(members.size()) == w.world)
    return std::make_unique<NcclCommunicator>(impl_, w.world_comm, name, members);
  // A group is split from the (non-blocking) world communicator; see the header on blocking ones.
  ncclComm_t c = nullptr;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking ? 1 : 0;
  ncclResult_t r = ncclCommSplit(w.world_comm, color, w.rank, &c, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    KILN_THROW("rank ", w.rank, ": ncclCommSplit for the ", name, " group failed: ", ncclGetErrorString(r));
  w.settle(w.world_comm, "splitting the " + name + " communicator");
  if (c) w.settle(c, "creating the " + name + " communicator");
  {
    std::lock_guard lk(w.m);
    w.comms.push_back(c);
  }
  return std::make_unique<NcclCommunicator>(impl_, c, name, members);
}

void NcclWorld::check() const { impl_->check(""); }
void NcclWorld::track(void* stream, const std::string& what) { impl_->track(static_cast<cudaStream_t>(stream), what); }
int NcclWorld::rank() const { return impl_->rank; }

}  // namespace kiln::parallel
