#pragma once
// Collective communication over one group of ranks. Two implementations: NCCL (GPUs) and
// in-process (ranks as threads in one process, for the CPU backend and tests). FP8 amax reductions,
// tensor-parallel activations and data-parallel gradients all go through this interface.
#include <memory>
#include <string>
#include <vector>

#include "kiln/tensor/tensor.hpp"

namespace kiln::parallel {

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;  // index in the group
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;           // "tp", "dp", "world": used in messages
  virtual const std::vector<int>& members() const = 0;   // global ranks, in group order

  // All operations are asynchronous on `stream` (a cudaStream_t for device buffers; nullptr for host
  // buffers, where they complete before returning). Buffers are f32, bf16 or i32, contiguous.
  // In place: buf = op over the group of buf.
  virtual void all_reduce(const TensorView& buf, ReduceOp op, void* stream) = 0;
  // out = concatenation of every rank's `in`, in group order; out.numel() == size() * in.numel().
  virtual void all_gather(const TensorView& out, const TensorView& in, void* stream) = 0;
  // out = the rank-th chunk of op over the group of `in`; in.numel() == size() * out.numel().
  virtual void reduce_scatter(const TensorView& out, const TensorView& in, ReduceOp op, void* stream) = 0;
  virtual void broadcast(const TensorView& buf, int root, void* stream) = 0;
  // Point-to-point within the group, all at once (NCCL's grouped send/recv): each `sends` buffer goes
  // to its peer (an index in the group; this rank itself too), each `recvs` buffer is filled from its
  // peer. A rank's sends to a peer, in order, meet that peer's receives from it, in order, buffer by
  // buffer (same dtype and element count). Every rank of the group calls it, with what it moves (its
  // lists may be empty). (The all-to-all of a mixture of experts' token dispatch.)
  struct Transfer {
    int peer = 0;
    TensorView buf;
  };
  virtual void send_recv(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream) = 0;
  // Point-to-point with some peers only (pipeline stages): only this rank and the peers it names take
  // part, each calling p2p with its side. A rank's sends to a peer, in order, meet that peer's receives
  // from it, in order, buffer by buffer (same dtype and element count), across calls. Sends and
  // receives of one call start together (NCCL's grouped send/recv), so a call that sends to a peer
  // and receives from it needs the peer's matching call to do the same; a send may complete before its
  // receive is posted, but no caller may rely on it (NCCL's sends of large buffers wait). `what` names
  // the transfer in errors (a peer that never comes, or died, is named with it).
  virtual void p2p(const std::vector<Transfer>& sends, const std::vector<Transfer>& recvs, void* stream,
                   const std::string& what) = 0;
  // Blocks the host until every rank of the group arrives.
  virtual void barrier() = 0;
};

// A group of one rank: every collective is the identity (or a copy).
std::unique_ptr<Communicator> make_self_communicator(const std::string& name, int global_rank);

}  // namespace kiln::parallel
