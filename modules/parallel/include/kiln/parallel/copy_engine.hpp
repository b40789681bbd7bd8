#pragma once
// A communicator whose large device-buffer collectives move data with the GPUs' copy engines over
// NVLink instead of NCCL's kernels (parallel.copy_engine; the idea of TransformerEngine's
// userbuffers).
//
// Every rank of the group maps every other rank's staging memory into its address space (CUDA IPC)
// once. A transfer is a cudaMemcpyAsync from the sender's buffer into a slot of the receiver's
// staging memory, followed by a 32-bit flag the sender writes into the receiver's memory
// (cuStreamWriteValue32, with the fence that orders it after the copy); on the receiver's stream a
// one-thread kernel waits for the flag, then the slot is read and given back with a flag in the
// sender's memory. (Not cuStreamWaitValue32: a stream blocked on another GPU can hold back the other
// streams that share its hardware queue, and two data-parallel ranks hung that way.) No streaming
// multiprocessor runs while data moves, so a GEMM beside it keeps every SM: only the sums
// (all-reduce, reduce-scatter) run a small kernel, on the rank that owns each part of the result, in
// rank order, so every rank gets the same bits.
//
// The flags say "full" and "free", never a count, so the same queued work can be replayed from a CUDA
// graph. Messages are cut into pieces of at most `slot_bytes`; the copies run on a stream of the
// communicator's own, forked from the caller's and joined back within each call, so the receiver's
// sums and copies of one piece overlap the next piece's transfer; a call's sends and receives are
// queued a window of `slots` pieces at a time (commands of streams that share a hardware queue run
// in the order queued). Every rank issues the same calls in the same order, as with NCCL. Host
// buffers, messages under `min_bytes` and broadcasts stay on the wrapped communicator; the wrapped
// NCCL world's watchdog times each call as one collective.
#include <cstddef>
#include <memory>

#include "kiln/parallel/communicator.hpp"

namespace kiln::parallel {

class NcclWorld;

struct CopyEngineOptions {
  std::size_t min_bytes = 256 << 10;  // smaller device messages go through the wrapped communicator
  std::size_t slot_bytes = 16 << 20;  // staging per slot; messages are cut into slots
  int slots = 4;                      // per peer
  // A message moves in pieces of a quarter of it (at least min_piece_bytes, at most a slot), so that
  // the receiver sums or copies one piece while the next is on the link. (On two H200s, 1.3B TP=2:
  // pieces of 1 MiB to a quarter cost 1 ms a step more than 16 MiB ones: each piece costs host calls.)
  std::size_t min_piece_bytes = 16 << 20;
  // Two ranks: an all-reduce moves the whole buffer to the peer once and both sum it (one transfer,
  // no copy); else, and with more ranks, a reduce-scatter then an all-gather.
  bool one_shot = true;
  // A wait for a peer's data or slot longer than this fails the process (the NCCL world's watchdog,
  // which times every call, normally reports it first, naming the call).
  double timeout_s = 300;
};

// Wraps `inner` (an NCCL communicator of `world`, every member a GPU of this host; it keeps `world`
// alive). Collective over the group: every member calls it at the same time. Throws, naming the group
// and the ranks, where the GPUs cannot reach each other's memory.
std::unique_ptr<Communicator> make_copy_engine_communicator(std::unique_ptr<Communicator> inner,
                                                            std::shared_ptr<NcclWorld> world,
                                                            const CopyEngineOptions& options = {});

}  // namespace kiln::parallel
