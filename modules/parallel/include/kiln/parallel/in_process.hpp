#pragma once
// In-process collectives: every rank is a thread of one process with its own World; a shared
// InProcessHub connects them. Reductions run in group order on every rank, so all ranks get
// identical bits. A failing rank aborts the hub, and every rank waiting in (or later entering) a
// collective stops with a message naming the failed rank; a rank that never arrives makes the
// others stop after the timeout, naming the ranks they waited for and the collective. Device
// tensors (ranks as threads sharing one GPU) go through host memory: the collective waits for the
// stream's queued work, and is complete when it returns.
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/parallel/communicator.hpp"

namespace kiln::parallel {

class InProcessHub : public std::enable_shared_from_this<InProcessHub> {
 public:
  InProcessHub(int world_size, std::chrono::milliseconds timeout);
  int world_size() const { return world_size_; }
  // The communicator of `global_rank` in the group `members` (global ranks, ascending).
  std::unique_ptr<Communicator> communicator(const std::string& name, const std::vector<int>& members, int global_rank);
  // Makes every current and future collective of every group fail with `reason`.
  void abort(const std::string& reason);
  bool aborted() const;
  std::string abort_reason() const;

  struct Group;  // shared state of one group (implementation detail)

 private:
  friend class InProcessCommunicator;
  int world_size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::map<std::vector<int>, std::shared_ptr<Group>> groups_;
  std::vector<std::weak_ptr<Group>> all_groups_;
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace kiln::parallel
