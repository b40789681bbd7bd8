#include "kiln/parallel/copy_engine.hpp"

#include <cuda.h>  // the driver's types; its functions come through cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "copy_engine_kernels.hpp"
#include "kiln/core/error.hpp"
#include "kiln/parallel/nccl.hpp"
#include "kiln/parallel/stream_event.hpp"
#include "kiln/tensor/buffer.hpp"
#include "kiln/tensor/cuda_check.hpp"

namespace kiln::parallel {
namespace {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// cuStreamWriteValue32 through the runtime, so that nothing links libcuda (a
// build runs its CPU tests on machines without a driver).
template <class Fn>
Fn driver_function(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  KILN_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  KILN_CHECK(q == cudaDriverEntryPointSuccess && fn, "the CUDA driver has no ", name);
  return reinterpret_cast<Fn>(fn);
}

// What every rank tells the others at setup: its staging memory and its GPU.
struct Card {
  cudaIpcMemHandle_t memory;
  char pci_bus[32];
};
constexpr int kCardInts = (sizeof(Card) + 3) / 4;

class CopyEngineCommunicator final : public Communicator {
 public:
  CopyEngineCommunicator(std::unique_ptr<Communicator> inner, std::shared_ptr<NcclWorld> world,
                         const CopyEngineOptions& o)
      : world_(std::move(world)), inner_(std::move(inner)), opt_(o), me_(inner_->rank()), n_(inner_->size()) {
    KILN_CHECK(n_ >= 2 && n_ <= detail::kMaxCopyEngineRanks, "parallel.copy_engine: the ", inner_->name(),
               " group has ", n_, " ranks (2 to ", detail::kMaxCopyEngineRanks, " on one host)");
    KILN_CHECK(opt_.slots >= 1 && opt_.slot_bytes >= 4096 && opt_.slot_bytes % 256 == 0,
               "copy-engine slots of ", opt_.slot_bytes, " bytes, ", opt_.slots, " per peer");
    write_ = driver_function<StreamValueFn>("cuStreamWriteValue32");
    timeout_ns_ = static_cast<unsigned long long>(opt_.timeout_s * 1e9);
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&push_, cudaStreamNonBlocking));
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));

    // This rank's memory: the flags, then one staging area per peer of `slots` slots.
    const std::size_t flag_count = 2 * static_cast<std::size_t>(n_) * opt_.slots;
    flags_bytes_ = (flag_count * 4 + 4095) / 4096 * 4096;
    const std::size_t bytes = flags_bytes_ + static_cast<std::size_t>(n_ - 1) * opt_.slots * opt_.slot_bytes;
    mine_ = Buffer(Device::cuda, bytes);
    std::vector<unsigned> init(flag_count, 0);  // full[p][k] = 0, free[p][k] = 1
    std::fill(init.begin() + static_cast<std::ptrdiff_t>(flag_count / 2), init.end(), 1u);
    KILN_CUDA_CHECK(cudaMemcpy(mine_.data(), init.data(), flag_count * 4, cudaMemcpyHostToDevice));

    int device = 0;
    KILN_CUDA_CHECK(cudaGetDevice(&device));
    Card card{};
    KILN_CUDA_CHECK(cudaIpcGetMemHandle(&card.memory, mine_.data()));
    KILN_CUDA_CHECK(cudaDeviceGetPCIBusId(card.pci_bus, sizeof card.pci_bus, device));
    const std::vector<Card> cards = exchange(card);

    peers_.assign(n_, nullptr);
    for (int p = 0; p < n_; ++p) {
      if (p == me_) continue;
      int peer_device = -1;
      if (cudaDeviceGetByPCIBusId(&peer_device, cards[p].pci_bus) == cudaSuccess) {
        int can = 0;
        KILN_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
        if (!can)
          KILN_THROW("parallel.copy_engine: in the ", inner_->name(), " group, rank ", members()[me_], "'s GPU (",
                     card.pci_bus, ") cannot reach rank ", members()[p], "'s (", cards[p].pci_bus,
                     ") as peer memory; set parallel.copy_engine = false");
      } else {
        cudaGetLastError();  // not visible to this process: CUDA IPC still maps it below
      }
      cudaError_t e = cudaIpcOpenMemHandle(&peers_[p], cards[p].memory, cudaIpcMemLazyEnablePeerAccess);
      if (e != cudaSuccess) {
        cudaGetLastError();
        KILN_THROW("parallel.copy_engine: rank ", members()[me_], " cannot map rank ", members()[p], "'s memory (",
                   inner_->name(), " group): ", cudaGetErrorString(e), "; set parallel.copy_engine = false");
      }
    }
    send_seq_.assign(n_, 0);
    recv_seq_.assign(n_, 0);
    inner_->barrier();
  }

  ~CopyEngineCommunicator() override {
    // Every rank's last transfers end before any rank unmaps or frees: a peer may still be writing
    // the flag that gives a slot back.
    cudaDeviceSynchronize();
    try {
      world_->check();
      inner_->barrier();
    } catch (...) {  // a rank died: nothing more arrives
    }
    for (void* p : peers_)
      if (p) cudaIpcCloseMemHandle(p);
    for (auto ev : marks_) cudaEventDestroy(ev);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    if (push_) cudaStreamDestroy(push_);
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  const std::vector<int>& members() const override { return inner_->members(); }

  void all_reduce(const TensorView& buf, ReduceOp op, void* stream) override {
    if (!takes(buf, stream) || !detail::reducible(buf.dtype, op) || buf.bytes() < opt_.min_bytes)
      return inner_->all_reduce(buf, op, stream);
    const std::string what = cat("copy-engine all_reduce of ", buf.str(), " over ", name());
    run(stream, what, [&](cudaStream_t s) {
      const std::size_t e = size_of(buf.dtype), count = static_cast<std::size_t>(buf.numel());
      char* base = static_cast<char*>(buf.data);
      if (n_ == 2 && opt_.one_shot) {
        // The whole buffer to the peer, piece by piece; each piece summed (rank 0's first) once the
        // peer's has arrived and this rank's own has left.
        const int peer = 1 - me_;
        const auto pieces = cut(count, e);
        in_windows(
            pieces.size(),
            [&](std::size_t i) {
              send(push_, peer, base + pieces[i].first * e, pieces[i].second * e);
              mark(push_, i);
            },
            [&](std::size_t i) {
              char* at = base + pieces[i].first * e;
              const Slot got = arrive(s, peer);
              await(s, i);
              const void* ins[2] = {me_ == 0 ? at : got.ptr, me_ == 0 ? got.ptr : at};
              detail::reduce_into(at, ins, 2, pieces[i].second, buf.dtype, op, s);
              release(s, peer, got);
            });
        return;
      }
      const auto parts = split(count, buf.dtype);
      auto at = [&](int p) { return base + parts[p] * e; };
      auto part_count = [&](int p) { return parts[p + 1] - parts[p]; };
      reduce_parts(s, buf.dtype, op, [&](int p) -> const void* { return at(p); }, part_count, at(me_));
      // This rank's sum leaves once it is made.
      mark(s, 0);
      await(push_, 0);
      gather_parts(s, buf.dtype, at(me_), part_count, [&](int p) { return at(p); });
    });
  }

  void all_gather(const TensorView& out, const TensorView& in, void* stream) override {
    if (!takes(out, stream) || !takes(in, stream) || out.bytes() < opt_.min_bytes)
      return inner_->all_gather(out, in, stream);
    KILN_CHECK(out.numel() == in.numel() * n_ && out.dtype == in.dtype, "all_gather over ", name(), ": ", out.str(),
               " from ", in.str());
    const std::string what = cat("copy-engine all_gather of ", in.str(), " over ", name());
    run(stream, what, [&](cudaStream_t s) {
      const std::size_t m = static_cast<std::size_t>(in.numel()), e = size_of(in.dtype);
      auto at = [&](int p) { return static_cast<char*>(out.data) + p * m * e; };
      if (at(me_) != in.data) KILN_CUDA_CHECK(cudaMemcpyAsync(at(me_), in.data, m * e, cudaMemcpyDeviceToDevice, s));
      gather_parts(s, in.dtype, static_cast<const char*>(in.data), [&](int) { return m; }, at);
    });
  }

  void reduce_scatter(const TensorView& out, const TensorView& in, ReduceOp op, void* stream) override {
    if (!takes(out, stream) || !takes(in, stream) || !detail::reducible(in.dtype, op) || in.bytes() < opt_.min_bytes)
      return inner_->reduce_scatter(out, in, op, stream);
    KILN_CHECK(in.numel() == out.numel() * n_ && out.dtype == in.dtype, "reduce_scatter over ", name(), ": ",
               out.str(), " from ", in.str());
    const std::string what = cat("copy-engine reduce_scatter of ", in.str(), " over ", name());
    run(stream, what, [&](cudaStream_t s) {
      const std::size_t m = static_cast<std::size_t>(out.numel()), e = size_of(in.dtype);
      reduce_parts(
          s, in.dtype, op, [&](int p) -> const void* { return static_cast<const char*>(in.data) + p * m * e; },
          [&](int) { return m; }, out.data);
    });
  }

  void broadcast(const TensorView& buf, int root, void* stream) override { inner_->broadcast(buf, root, stream); }

  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) override {
    bool device = stream != nullptr;
    for (const auto& t : sends) device = device && t.buf.device == Device::cuda;
    for (const auto& t : recvs) device = device && t.buf.device == Device::cuda;
    if (!device) return inner_->send_recv(sends, recvs, stream);
    const std::string what = cat("copy-engine send_recv over ", name());
    for (const auto& t : sends) KILN_CHECK(t.peer >= 0 && t.peer < n_, what, ": peer ", t.peer);
    for (const auto& t : recvs) KILN_CHECK(t.peer >= 0 && t.peer < n_, what, ": peer ", t.peer);
    run(stream, what, [&](cudaStream_t s) {
      // Each peer's transfers in order, cut into pieces: a send and its receive have the same size,
      // so both sides cut them alike. Pieces go round the peers (piece r to every peer, then r + 1),
      // on both sides, so that no rank waits on a slot a peer cannot yet give back.
      std::vector<std::vector<Piece>> out(n_), in(n_);
      auto cut_into = [&](std::vector<std::vector<Piece>>& lists, const Transfer& t) {
        const std::size_t e = size_of(t.buf.dtype);
        for (const auto& [at, count] : cut(static_cast<std::size_t>(t.buf.numel()), e))
          lists[t.peer].push_back({static_cast<char*>(t.buf.data) + at * e, count * e});
      };
      std::vector<const Transfer*> to_self, from_self;
      for (const auto& t : sends) t.peer == me_ ? to_self.push_back(&t) : cut_into(out, t);
      for (const auto& t : recvs) t.peer == me_ ? from_self.push_back(&t) : cut_into(in, t);
      KILN_CHECK(to_self.size() == from_self.size(), what, ": ", to_self.size(), " sends to this rank itself, ",
                 from_self.size(), " receives");
      for (std::size_t i = 0; i < to_self.size(); ++i) {
        KILN_CHECK(to_self[i]->buf.bytes() == from_self[i]->buf.bytes(), what, ": a send to itself of ",
                   to_self[i]->buf.str(), " meets a receive of ", from_self[i]->buf.str());
        KILN_CUDA_CHECK(cudaMemcpyAsync(from_self[i]->buf.data, to_self[i]->buf.data, to_self[i]->buf.bytes(),
                                        cudaMemcpyDeviceToDevice, s));
      }
      std::size_t rounds = 0;
      for (int p = 0; p < n_; ++p) rounds = std::max({rounds, out[p].size(), in[p].size()});
      in_windows(
          rounds,
          [&](std::size_t r) {
            for_peers([&](int p) {
              if (r < out[p].size()) send(push_, p, out[p][r].ptr, out[p][r].bytes);
            });
          },
          [&](std::size_t r) {
            for_peers([&](int p) {
              if (r >= in[p].size()) return;
              const Slot got = arrive(s, p);
              KILN_CUDA_CHECK(cudaMemcpyAsync(in[p][r].ptr, got.ptr, in[p][r].bytes, cudaMemcpyDeviceToDevice, s));
              release(s, p, got);
            });
          });
    });
  }

  void p2p(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
           const std::string& what) override {
    inner_->p2p(sends, recvs, stream, what);
  }
  void barrier() override { inner_->barrier(); }

 private:
  struct Piece {
    char* ptr;
    std::size_t bytes;
  };
  struct Slot {
    const char* ptr;
    int index;
  };

  bool takes(const TensorView& t, void* stream) const { return stream != nullptr && t.device == Device::cuda; }

  // The call's transfers leave on push_, forked from the caller's stream and joined back at the end.
  template <class F>
  void run(void* stream, const std::string& what, F&& body) {
    world_->check();
    auto s = static_cast<cudaStream_t>(stream);
    KILN_CUDA_CHECK(cudaEventRecord(fork_, s));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(push_, fork_, 0));
    body(s);
    KILN_CUDA_CHECK(cudaEventRecord(join_, push_));
    KILN_CUDA_CHECK(cudaStreamWaitEvent(s, join_, 0));
    if (!capturing(s)) world_->track(s, what);  // a captured one is timed at each launch
  }

  // Marks the work queued on `stream` as point i of this call; await(other, i) makes `other` follow it.
  void mark(cudaStream_t stream, std::size_t i) {
    while (marks_.size() <= i) {
      cudaEvent_t ev = nullptr;
      KILN_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      marks_.push_back(ev);
    }
    KILN_CUDA_CHECK(cudaEventRecord(marks_[i], stream));
  }
  void await(cudaStream_t stream, std::size_t i) { KILN_CUDA_CHECK(cudaStreamWaitEvent(stream, marks_[i], 0)); }

  // The pieces (first element, count) of `count` elements of `e` bytes: a quarter each, at least
  // min_piece_bytes, at most a slot, 256-byte aligned. The same on every rank for the same count.
  using Pieces = std::vector<std::pair<std::size_t, std::size_t>>;
  Pieces cut(std::size_t count, std::size_t e) const {
    const std::size_t bytes = count * e;
    std::size_t piece = std::max(opt_.min_piece_bytes, (bytes + 3) / 4);
    piece = std::min(opt_.slot_bytes, (piece + 255) / 256 * 256);
    const std::size_t per = std::max<std::size_t>(1, piece / e);
    Pieces out;
    for (std::size_t at = 0; at < count; at += per) out.emplace_back(at, std::min(per, count - at));
    return out;
  }

  // Rounds 0..rounds-1 queued a window of `slots` rounds at a time: the window's sends, then its
  // receives. A send that must wait for a slot the peer gives back is then queued after this rank's
  // receives that the peer's matching wait depends on: streams that share a hardware queue (more
  // streams than CUDA_DEVICE_MAX_CONNECTIONS) run their commands in the order queued, so a send
  // queued before them would hold them back and hang both ranks (seen with 13 pieces in 4 slots).
  template <class Send, class Receive>
  void in_windows(std::size_t rounds, Send&& send_round, Receive&& receive_round) const {
    const auto w = static_cast<std::size_t>(opt_.slots);
    for (std::size_t at = 0; at < rounds; at += w) {
      const std::size_t end = std::min(rounds, at + w);
      for (std::size_t r = at; r < end; ++r) send_round(r);
      for (std::size_t r = at; r < end; ++r) receive_round(r);
    }
  }

  // Peers in the order this rank serves them: the next rank first, so that the links all carry
  // something from the first transfer on.
  template <class F>
  void for_peers(F&& f) const {
    for (int i = 1; i < n_; ++i) f((me_ + i) % n_);
  }

  // Element offsets of the n parts of `count` elements, each part's start 16-byte aligned.
  std::vector<std::size_t> split(std::size_t count, DType dtype) const {
    const std::size_t align = std::max<std::size_t>(1, 16 / size_of(dtype));
    std::vector<std::size_t> at(n_ + 1, count);
    at[0] = 0;
    for (int p = 1; p < n_; ++p) at[p] = std::min(count, count * p / n_ / align * align);
    return at;
  }

  // The index of `from`'s staging in `to`'s memory (a rank has none for itself).
  int area(int to, int from) const { return from < to ? from : from - 1; }
  char* slot_ptr(char* base, int to, int from, int k) const {
    return base + flags_bytes_ + (static_cast<std::size_t>(area(to, from)) * opt_.slots + k) * opt_.slot_bytes;
  }
  // full[from][k] in the receiver's memory; free[to][k] in the sender's.
  unsigned* full_flag(void* base, int from, int k) const { return static_cast<unsigned*>(base) + from * opt_.slots + k; }
  unsigned* free_flag(void* base, int to, int k) const {
    return static_cast<unsigned*>(base) + (n_ + to) * opt_.slots + k;
  }

  void check_driver(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS)
      KILN_THROW("copy-engine ", what, " over ", name(), " failed: CUDA driver error ", static_cast<int>(r));
  }
  // Waits until the flag at `at` (in this rank's memory) is 1, then sets it to 0.
  void take(cudaStream_t s, unsigned* at) { detail::take_flag(at, timeout_ns_, s); }
  // Sets the flag at `at` (here or in a peer's memory) to 1 once the stream's earlier work is done;
  // the write is fenced after it.
  void give(cudaStream_t s, unsigned* at, const char* what) {
    check_driver(write_(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(at), 1, 0), what);
  }

  // Sends `bytes` (<= a slot) to peer p: once p has given the slot back, copy, then mark it full.
  void send(cudaStream_t s, int p, const void* src, std::size_t bytes) {
    const int k = static_cast<int>(send_seq_[p]++ % opt_.slots);
    take(s, free_flag(mine_.data(), p, k));
    KILN_CUDA_CHECK(
        cudaMemcpyAsync(slot_ptr(static_cast<char*>(peers_[p]), p, me_, k), src, bytes, cudaMemcpyDefault, s));
    give(s, full_flag(peers_[p], me_, k), "slot hand-over");
  }
  // Waits for peer p's next slot to be full; the caller reads it, then releases it.
  Slot arrive(cudaStream_t s, int p) {
    const int k = static_cast<int>(recv_seq_[p]++ % opt_.slots);
    take(s, full_flag(mine_.data(), p, k));
    return {slot_ptr(static_cast<char*>(mine_.data()), me_, p, k), k};
  }
  void release(cudaStream_t s, int p, const Slot& slot) { give(s, free_flag(peers_[p], me_, slot.index), "slot release"); }

  // Every rank's part (count(p) elements) cut into pieces, and the most pieces of any part.
  template <class Count>
  std::pair<std::vector<Pieces>, std::size_t> cut_parts(Count&& count, std::size_t e) const {
    std::vector<Pieces> pieces(n_);
    std::size_t rounds = 0;
    for (int p = 0; p < n_; ++p) rounds = std::max(rounds, (pieces[p] = cut(count(p), e)).size());
    return {std::move(pieces), rounds};
  }

  // Part p (count(p) elements at part(p), for every p) of every rank summed into `out` on its owner
  // p = this rank: every other rank's part arrives piece by piece and is reduced with this rank's
  // own, in rank order. `out` may be part(me) but no other part.
  template <class PartAt, class Count>
  void reduce_parts(cudaStream_t s, DType dtype, ReduceOp op, PartAt&& part, Count&& count, void* out) {
    const std::size_t e = size_of(dtype);
    const auto [pieces, rounds] = cut_parts(count, e);
    in_windows(
        rounds,
        [&](std::size_t r) {
          for_peers([&](int p) {
            if (r < pieces[p].size())
              send(push_, p, static_cast<const char*>(part(p)) + pieces[p][r].first * e, pieces[p][r].second * e);
          });
        },
        [&](std::size_t r) {
          if (r >= pieces[me_].size()) return;
          const auto [at, m] = pieces[me_][r];
          std::array<const void*, detail::kMaxCopyEngineRanks> ins{};
          std::array<Slot, detail::kMaxCopyEngineRanks> got{};
          for_peers([&](int p) {
            got[p] = arrive(s, p);
            ins[p] = got[p].ptr;
          });
          ins[me_] = static_cast<const char*>(part(me_)) + at * e;
          detail::reduce_into(static_cast<char*>(out) + at * e, ins.data(), n_, m, dtype, op, s);
          for_peers([&](int p) { release(s, p, got[p]); });
        });
  }

  // This rank's `count(me)` elements at `own` to every peer (sent from push_, which must already
  // follow whatever wrote `own`), and every peer's into dest(p) (on s).
  template <class Count, class Dest>
  void gather_parts(cudaStream_t s, DType dtype, const char* own, Count&& count, Dest&& dest) {
    const std::size_t e = size_of(dtype);
    const auto [pieces, rounds] = cut_parts(count, e);
    in_windows(
        rounds,
        [&](std::size_t r) {
          if (r < pieces[me_].size())
            for_peers([&](int p) { send(push_, p, own + pieces[me_][r].first * e, pieces[me_][r].second * e); });
        },
        [&](std::size_t r) {
          for_peers([&](int p) {
            if (r >= pieces[p].size()) return;
            const auto [at, m] = pieces[p][r];
            const Slot got = arrive(s, p);
            KILN_CUDA_CHECK(cudaMemcpyAsync(dest(p) + at * e, got.ptr, m * e, cudaMemcpyDeviceToDevice, s));
            release(s, p, got);
          });
        });
  }

  // Every rank's card to every rank, through the wrapped communicator (host buffers: it stages them
  // and returns once they have arrived).
  std::vector<Card> exchange(const Card& mine) {
    std::vector<int> in(kCardInts, 0), out(static_cast<std::size_t>(kCardInts) * n_);
    std::memcpy(in.data(), &mine, sizeof mine);
    inner_->all_gather(TensorView(out.data(), {static_cast<std::int64_t>(out.size())}, DType::i32, Device::cpu),
                       TensorView(in.data(), {kCardInts}, DType::i32, Device::cpu), nullptr);
    std::vector<Card> all(n_);
    for (int p = 0; p < n_; ++p) std::memcpy(&all[p], out.data() + static_cast<std::size_t>(p) * kCardInts, sizeof(Card));
    return all;
  }

  std::shared_ptr<NcclWorld> world_;     // outlives inner_ (destroyed after it)
  std::unique_ptr<Communicator> inner_;
  CopyEngineOptions opt_;
  int me_, n_;
  StreamValueFn write_ = nullptr;
  unsigned long long timeout_ns_ = 0;
  cudaStream_t push_ = nullptr;          // the transfers' stream
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  std::vector<cudaEvent_t> marks_;       // points within a call (mark / await)
  Buffer mine_;                          // the flags, then the staging slots (mapped by every peer)
  std::size_t flags_bytes_ = 0;
  std::vector<void*> peers_;
  std::vector<std::uint64_t> send_seq_, recv_seq_;  // slots used per peer, in call order
};

}  // namespace

std::unique_ptr<Communicator> make_copy_engine_communicator(std::unique_ptr<Communicator> inner,
                                                            std::shared_ptr<NcclWorld> world,
                                                            const CopyEngineOptions& options) {
  KILN_CHECK(inner && world, "a copy-engine communicator needs the NCCL communicator and world it wraps");
  return std::make_unique<CopyEngineCommunicator>(std::move(inner), std::move(world), options);
}

}  // namespace kiln::parallel
