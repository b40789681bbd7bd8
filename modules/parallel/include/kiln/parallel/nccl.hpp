#pragma once
// NCCL communicators for ranks in separate processes (one per GPU). One world communicator comes
// from the rendezvous' unique id; group communicators are split from it with ncclCommSplit. All are
// non-blocking so that a watchdog thread can abort them: when a collective does not finish within
// the timeout, when NCCL reports an error, or when the rendezvous reports a rank gone, every
// communicator is aborted and the next collective (or check()) throws, naming the rank or the
// collective.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "kiln/parallel/communicator.hpp"
#include "kiln/parallel/rendezvous.hpp"

namespace kiln::parallel {

// cudaSetDevice for this process's GPU, before anything else touches CUDA.
void use_device(int device);

class NcclWorld {
 public:
  // The unique id rank 0 hands out through the rendezvous (bytes of an ncclUniqueId).
  static std::string make_unique_id();

  NcclWorld(int rank, int world, int device, std::shared_ptr<Rendezvous> rendezvous,
            std::chrono::milliseconds timeout);
  NcclWorld(const NcclWorld&) = delete;
  NcclWorld& operator=(const NcclWorld&) = delete;
  ~NcclWorld();

  // The communicator of the group `members` (global ranks, ascending) this rank belongs to.
  // Collective over the world: every rank asks for its groups of one kind at the same time.
  // Non-blocking by default: the watchdog can always abort them. Blocking communicators cost ~100 us
  // less per call (small messages run at NCCL's own speed) but measured on 2 H200s an abort did not
  // free a rank stuck in one, so a dead peer could hang the job: not yet safe to use.
  std::unique_ptr<Communicator> group(const std::string& name, int color, const std::vector<int>& members,
                                      bool blocking = false);
  // Throws kiln::Error if the job was aborted.
  void check() const;
  // The watchdog times the work queued on `stream` so far as one collective named `what`. Every
  // collective is tracked as it is queued, except while its stream is being captured into a CUDA
  // graph: whoever launches the graph tracks each launch with this.
  void track(void* stream, const std::string& what);
  int rank() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace kiln::parallel
