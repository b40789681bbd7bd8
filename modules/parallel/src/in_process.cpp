#include "kiln/parallel/in_process.hpp"

#include <algorithm>
#include <cstring>
#include <deque>

#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"

#ifdef KILN_WITH_CUDA
#include "kiln/tensor/cuda_check.hpp"
#endif

namespace kiln::parallel {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

struct InProcessHub::Group {
  std::vector<int> members;
  std::mutex m;
  std::condition_variable cv;
  std::uint64_t generation = 0;
  int arrived = 0;
  std::vector<bool> present;
  std::vector<const void*> in;
  std::vector<std::string> op;  // what each rank called, to catch mismatched collectives
  // Point-to-point messages posted and not yet received, by (sender, receiver) index in the group.
  struct Message {
    std::vector<char> bytes;
    DType dtype = DType::f32;
    std::int64_t numel = 0;
    std::string what;
  };
  std::map<std::pair<int, int>, std::deque<Message>> mail;
};

namespace {

// Reads element i of a buffer as float / writes it back, for the dtypes collectives accept.
float load(const void* p, DType t, std::int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::bf16: return bf16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case DType::i32: return static_cast<float>(static_cast<const std::int32_t*>(p)[i]);
    default: KILN_THROW("collectives support f32, bf16 and i32, not ", name_of(t));
  }
}

// A collective's buffer in host memory: the tensor itself, or (a device tensor) a host copy taken
// once `stream` has finished its queued work, written back by store_back(). Ranks as threads on
// one GPU (tests, one-GPU runs of multi-rank code) then collect through the host; the collective
// completes before returning, which is stronger than queueing it on the stream.
class HostStage {
 public:
  HostStage(const TensorView& t, void* stream, bool copy_in) : t_(t), host_(t) {
    if (t.device == Device::cpu) {
      KILN_CHECK(!stream, "a host tensor's collective takes no stream, got one for ", t.str());
      return;
    }
#ifdef KILN_WITH_CUDA
    KILN_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    bytes_.resize(t.bytes());
    host_ = TensorView(bytes_.data(), t.shape, t.dtype, Device::cpu);
    if (copy_in) KILN_CUDA_CHECK(cudaMemcpy(bytes_.data(), t.data, t.bytes(), cudaMemcpyDeviceToHost));
#else
    (void)copy_in;
    KILN_THROW("a device tensor in a build without CUDA: ", t.str());
#endif
  }
  const TensorView& host() const { return host_; }
  void store_back() {
#ifdef KILN_WITH_CUDA
    if (t_.device != Device::cpu) KILN_CUDA_CHECK(cudaMemcpy(t_.data, bytes_.data(), t_.bytes(), cudaMemcpyHostToDevice));
#endif
  }

 private:
  TensorView t_, host_;
  std::vector<char> bytes_;
};

}  // namespace

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessHub> hub, std::shared_ptr<InProcessHub::Group> g, std::string name,
                        int me, int global_rank)
      : hub_(std::move(hub)), g_(std::move(g)), name_(std::move(name)), me_(me), global_(global_rank) {}

  int rank() const override { return me_; }
  int size() const override { return static_cast<int>(g_->members.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return g_->members; }

  void all_reduce(const TensorView& buf, ReduceOp op, void* stream) override {
    check(buf, "all_reduce");
    HostStage b(buf, stream, true);
    const std::string what = cat("all_reduce(", reduce_op_name(op), ", ", buf.str(), ")");
    enter(b.host().data, what);
    std::vector<float> result = reduce(buf.dtype, buf.numel(), 0, op);
    sync(what);
    store(b.host(), result);
    b.store_back();
  }

  void all_gather(const TensorView& out, const TensorView& in, void* stream) override {
    check(in, "all_gather");
    check(out, "all_gather");
    KILN_CHECK(out.dtype == in.dtype && out.numel() == in.numel() * size(), name_, " all_gather: out ", out.str(),
               " must hold ", size(), " x ", in.str());
    HostStage i(in, stream, true), o(out, stream, false);
    const std::string what = cat("all_gather(", in.str(), ")");
    enter(i.host().data, what);
    const std::size_t bytes = in.bytes();
    for (int r = 0; r < size(); ++r) {
      char* to = static_cast<char*>(o.host().data) + r * bytes;
      const void* from = g_->in[static_cast<std::size_t>(r)];
      if (to != from) std::memcpy(to, from, bytes);  // in place: this rank's part is there already
    }
    sync(what);
    o.store_back();
  }

  void reduce_scatter(const TensorView& out, const TensorView& in, ReduceOp op, void* stream) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    KILN_CHECK(out.dtype == in.dtype && in.numel() == out.numel() * size(), name_, " reduce_scatter: in ", in.str(),
               " must hold ", size(), " x ", out.str());
    HostStage i(in, stream, true), o(out, stream, false);
    const std::string what = cat("reduce_scatter(", reduce_op_name(op), ", ", in.str(), ")");
    enter(i.host().data, what);
    std::vector<float> result = reduce(in.dtype, out.numel(), out.numel() * me_, op);
    sync(what);
    store(o.host(), result);
    o.store_back();
  }

  void broadcast(const TensorView& buf, int root, void* stream) override {
    check(buf, "broadcast");
    KILN_CHECK(root >= 0 && root < size(), name_, " broadcast: root ", root, " outside the group of ", size());
    HostStage b(buf, stream, true);
    const std::string what = cat("broadcast(root ", root, ", ", buf.str(), ")");
    enter(b.host().data, what);
    if (me_ != root) std::memcpy(b.host().data, g_->in[static_cast<std::size_t>(root)], buf.bytes());
    sync(what);
    b.store_back();
  }

  void barrier() override {
    enter(nullptr, "barrier");
  }

  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) override {
    // Every rank posts its sends (host views, device buffers staged), then reads what its peers posted
    // for it: the i-th receive from a peer takes that peer's i-th send to this rank.
    std::vector<std::unique_ptr<HostStage>> staged_sends, staged_recvs;
    std::vector<Transfer> posted;
    for (const auto& t : sends) {
      check_transfer(t, "send");
      staged_sends.push_back(std::make_unique<HostStage>(t.buf, stream, true));
      posted.push_back({t.peer, staged_sends.back()->host()});
    }
    for (const auto& t : recvs) {
      check_transfer(t, "receive");
      staged_recvs.push_back(std::make_unique<HostStage>(t.buf, stream, false));
    }
    const std::string what = "send_recv";
    enter(&posted, what);
    std::vector<std::size_t> taken(static_cast<std::size_t>(size()), 0);
    for (std::size_t i = 0; i < recvs.size(); ++i) {
      const int peer = recvs[i].peer;
      const auto& theirs = *static_cast<const std::vector<Transfer>*>(g_->in[static_cast<std::size_t>(peer)]);
      const Transfer* match = nullptr;
      std::size_t seen = 0;
      for (const auto& t : theirs)
        if (t.peer == me_ && seen++ == taken[peer]) {
          match = &t;
          break;
        }
      const TensorView& dst = staged_recvs[i]->host();
      const int from = g_->members[static_cast<std::size_t>(peer)];
      if (!match || match->buf.numel() != dst.numel() || match->buf.dtype != dst.dtype) {
        const auto msg = cat(name_, " send_recv: rank ", global_, "'s receive ", taken[peer], " from rank ", from, " (",
                             dst.str(), ") meets ", match ? match->buf.str() : std::string("no send"));
        hub_->abort(msg);
        KILN_THROW(msg);
      }
      ++taken[peer];
      std::memcpy(dst.data, match->buf.data, dst.bytes());
    }
    sync(what);  // every rank has read what it was sent before the buffers may change
    for (auto& r : staged_recvs) r->store_back();
  }

  void p2p(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
           const std::string& what) override {
    // Sends are posted (copied) at once; receives wait for the peer's send (in order per peer).
    for (const auto& t : sends) {
      check_transfer(t, "send");
      HostStage staged(t.buf, stream, true);
      InProcessHub::Group::Message msg{std::vector<char>(staged.host().bytes()), t.buf.dtype, t.buf.numel(), what};
      std::memcpy(msg.bytes.data(), staged.host().data, msg.bytes.size());
      std::lock_guard lk(g_->m);
      g_->mail[{me_, t.peer}].push_back(std::move(msg));
    }
    if (!sends.empty()) {
      std::lock_guard lk(g_->m);
      g_->cv.notify_all();
    }
    for (const auto& t : recvs) {
      check_transfer(t, "receive");
      HostStage staged(t.buf, stream, false);
      const int from = g_->members[static_cast<std::size_t>(t.peer)];
      InProcessHub::Group::Message msg;
      {
        std::unique_lock lk(g_->m);
        auto& box = g_->mail[{t.peer, me_}];
        const auto deadline = std::chrono::steady_clock::now() + hub_->timeout_;
        while (box.empty()) {
          if (hub_->aborted())
            KILN_THROW("rank ", global_, ": stopped in ", name_, " ", what, " receiving from rank ", from, " because ",
                       hub_->abort_reason());
          if (g_->cv.wait_until(lk, deadline) == std::cv_status::timeout && box.empty()) {
            const auto msg_text = cat("rank ", global_, ": timed out after ",
                                      std::chrono::duration<double>(hub_->timeout_).count(), " s in ", name_, " ", what,
                                      " waiting for rank ", from, "'s send");
            lk.unlock();
            hub_->abort(msg_text);
            KILN_THROW(msg_text);
          }
        }
        msg = std::move(box.front());
        box.pop_front();
      }
      const TensorView& dst = staged.host();
      if (msg.numel != dst.numel() || msg.dtype != dst.dtype) {
        const auto text = cat(name_, " ", what, ": rank ", global_, " receives ", dst.str(), " from rank ", from,
                              ", which sent ", msg.numel, " ", name_of(msg.dtype), " elements (", msg.what, ")");
        hub_->abort(text);
        KILN_THROW(text);
      }
      std::memcpy(dst.data, msg.bytes.data(), msg.bytes.size());
      staged.store_back();
    }
  }

 private:
  void check(const TensorView& t, const char* op) const {
    KILN_CHECK(t.contiguous(), name_, " ", op, " needs a contiguous tensor, got ", t.str());
  }
  void check_transfer(const Transfer& t, const char* what) const {
    KILN_CHECK(t.peer >= 0 && t.peer < size(), name_, " send_recv: a ", what, " with peer ", t.peer,
               " outside the group of ", size());
    check(t.buf, "send_recv");
  }

  // Publishes this rank's input and waits for the whole group; the last rank to arrive checks that
  // everyone called the same collective (under the lock, before anyone can move on).
  void enter(const void* in, const std::string& what) {
    {
      std::lock_guard lk(g_->m);
      g_->in[static_cast<std::size_t>(me_)] = in;
      g_->op[static_cast<std::size_t>(me_)] = what;
    }
    sync(what, true);
  }

  // A generation barrier over the group, failing on abort or timeout.
  void sync(const std::string& what, bool check_ops = false) {
    std::unique_lock lk(g_->m);
    const std::uint64_t gen = g_->generation;
    g_->present[static_cast<std::size_t>(me_)] = true;
    if (++g_->arrived == size()) {
      if (check_ops)
        for (int r = 0; r < size(); ++r)
          if (g_->op[static_cast<std::size_t>(r)] != what) {
            auto msg = cat("mismatched collectives in group '", name_, "': rank ", global_, " called ", what,
                           ", rank ", g_->members[static_cast<std::size_t>(r)], " called ",
                           g_->op[static_cast<std::size_t>(r)]);
            lk.unlock();
            hub_->abort(msg);
            KILN_THROW("rank ", global_, ": ", msg);
          }
      g_->arrived = 0;
      std::fill(g_->present.begin(), g_->present.end(), false);
      ++g_->generation;
      g_->cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + hub_->timeout_;
    while (g_->generation == gen) {
      if (hub_->aborted())
        KILN_THROW("rank ", global_, ": stopped in ", name_, " ", what, " because ", hub_->abort_reason());
      if (g_->cv.wait_until(lk, deadline) == std::cv_status::timeout && g_->generation == gen) {
        std::string missing;
        for (std::size_t r = 0; r < g_->members.size(); ++r)
          if (!g_->present[r]) missing += cat(missing.empty() ? "" : ", ", g_->members[r]);
        auto msg = cat("rank ", global_, ": timed out after ",
                       std::chrono::duration<double>(hub_->timeout_).count(), " s in ", name_, " ", what,
                       " waiting for rank(s) ", missing);
        lk.unlock();
        hub_->abort(msg);
        KILN_THROW(msg);
      }
    }
  }

  std::vector<float> reduce(DType t, std::int64_t n, std::int64_t offset, ReduceOp op) const {
    std::vector<float> acc(static_cast<std::size_t>(n));
    for (int r = 0; r < size(); ++r) {
      const void* src = g_->in[static_cast<std::size_t>(r)];
      for (std::int64_t i = 0; i < n; ++i) {
        float v = load(src, t, offset + i);
        if (r == 0)
          acc[i] = v;
        else
          acc[i] = op == ReduceOp::max ? std::max(acc[i], v) : acc[i] + v;
      }
    }
    if (op == ReduceOp::avg)
      for (auto& v : acc) v /= static_cast<float>(size());
    return acc;
  }

  static void store(const TensorView& dst, const std::vector<float>& v) {
    const auto n = static_cast<std::int64_t>(v.size());
    switch (dst.dtype) {
      case DType::f32: std::copy(v.begin(), v.end(), dst.as<float>()); break;
      case DType::bf16:
        for (std::int64_t i = 0; i < n; ++i) dst.as<std::uint16_t>()[i] = float_to_bf16_bits(v[i]);
        break;
      case DType::i32:
        for (std::int64_t i = 0; i < n; ++i) dst.as<std::int32_t>()[i] = static_cast<std::int32_t>(v[i]);
        break;
      default: KILN_THROW("collectives support f32, bf16 and i32, not ", name_of(dst.dtype));
    }
  }

  std::shared_ptr<InProcessHub> hub_;
  std::shared_ptr<InProcessHub::Group> g_;
  std::string name_;
  int me_, global_;
};

InProcessHub::InProcessHub(int world_size, std::chrono::milliseconds timeout)
    : world_size_(world_size), timeout_(timeout) {}

std::unique_ptr<Communicator> InProcessHub::communicator(const std::string& name, const std::vector<int>& members,
                                                         int global_rank) {
  auto it = std::find(members.begin(), members.end(), global_rank);
  KILN_CHECK(it != members.end(), "rank ", global_rank, " is not a member of group '", name, "'");
  std::shared_ptr<Group> g;
  {
    std::lock_guard lk(mutex_);
    auto& slot = groups_[members];
    if (!slot) {
      slot = std::make_shared<Group>();
      slot->members = members;
      slot->present.assign(members.size(), false);
      slot->in.assign(members.size(), nullptr);
      slot->op.assign(members.size(), "");
      all_groups_.push_back(slot);
    }
    g = slot;
  }
  return std::make_unique<InProcessCommunicator>(shared_from_this(), g, name,
                                                 static_cast<int>(it - members.begin()), global_rank);
}

void InProcessHub::abort(const std::string& reason) {
  std::vector<std::shared_ptr<Group>> groups;
  {
    std::lock_guard lk(mutex_);
    if (aborted_) return;
    aborted_ = true;
    reason_ = reason;
    for (auto& w : all_groups_)
      if (auto g = w.lock()) groups.push_back(g);
  }
  for (auto& g : groups) {
    std::lock_guard lk(g->m);  // no waiter can miss the wake-up between its check and its wait
    g->cv.notify_all();
  }
}

bool InProcessHub::aborted() const {
  std::lock_guard lk(mutex_);
  return aborted_;
}

std::string InProcessHub::abort_reason() const {
  std::lock_guard lk(mutex_);
  return reason_;
}

// ---- the group of one ----

namespace {
class SelfCommunicator final : public Communicator {
 public:
  SelfCommunicator(std::string name, int global_rank) : name_(std::move(name)), members_{global_rank} {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  const std::string& name() const override { return name_; }
  const std::vector<int>& members() const override { return members_; }
  void all_reduce(const TensorView&, ReduceOp, void*) override {}
  void all_gather(const TensorView& out, const TensorView& in, void* stream) override { copy(out, in, stream); }
  void reduce_scatter(const TensorView& out, const TensorView& in, ReduceOp, void* stream) override {
    copy(out, in, stream);
  }
  void broadcast(const TensorView&, int, void*) override {}
  void barrier() override {}
  void p2p(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
           const std::string&) override {
    send_recv(sends, recvs, stream);
  }
  void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) override {
    KILN_CHECK(sends.size() == recvs.size(), name_, " send_recv on one rank: ", sends.size(), " sends but ",
               recvs.size(), " receives");
    for (std::size_t i = 0; i < sends.size(); ++i) {
      KILN_CHECK(sends[i].peer == 0 && recvs[i].peer == 0, name_, " send_recv on one rank: a peer other than 0");
      copy(recvs[i].buf, sends[i].buf, stream);
    }
  }

 private:
  // With one rank, gathering or scattering is a copy (nothing at all when out is in).
  static void copy(const TensorView& out, const TensorView& in, void* stream) {
    KILN_CHECK(out.numel() == in.numel() && out.dtype == in.dtype, "one-rank collective: ", in.str(), " -> ",
               out.str());
    if (out.data == in.data) return;
    if (out.device == Device::cpu && in.device == Device::cpu) {
      std::memmove(out.data, in.data, in.bytes());
      return;
    }
#ifdef KILN_WITH_CUDA
    KILN_CUDA_CHECK(cudaMemcpyAsync(out.data, in.data, in.bytes(), cudaMemcpyDefault, static_cast<cudaStream_t>(stream)));
#else
    (void)stream;
    KILN_THROW("device buffers need a CUDA build");
#endif
  }
  std::string name_;
  std::vector<int> members_;
};
}  // namespace

std::unique_ptr<Communicator> make_self_communicator(const std::string& name, int global_rank) {
  return std::make_unique<SelfCommunicator>(name, global_rank);
}

}  // namespace kiln::parallel
