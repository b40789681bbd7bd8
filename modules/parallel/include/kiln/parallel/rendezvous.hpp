#pragma once
// A small TCP rendezvous for ranks in different processes (torchrun-style MASTER_ADDR/MASTER_PORT).
// Rank 0 listens; every other rank connects and says hello; rank 0 then sends each of them the same
// payload (the NCCL unique id). The connections stay open afterwards as a liveness channel: when a
// rank's connection drops without a goodbye (the process exited or crashed), rank 0 tells every
// other rank which one it was, so they can stop at once and name it instead of hanging in a
// collective.
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kiln::parallel {

class Rendezvous {
 public:
  // Connects (or listens, on rank 0) and exchanges the payload; throws kiln::Error naming the
  // ranks that did not show up within `timeout`.
  Rendezvous(const std::string& addr, int port, int rank, int world, const std::string& root_payload,
             std::chrono::milliseconds timeout);
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  ~Rendezvous();

  // The payload rank 0 handed out.
  const std::string& payload() const { return payload_; }
  // Set once another rank dropped out without saying goodbye: "rank 2 disconnected (...)".
  std::optional<std::string> failure() const;
  // Announces a clean exit (rank 0 waits for everyone's goodbye, up to the timeout, before closing).
  // A rank whose Rendezvous is destroyed without finish() is reported to the others as failed.
  void finish();

 private:
  void serve();   // rank 0's monitor thread
  void listen();  // the other ranks' reader thread
  void fail(const std::string& why);

  int rank_, world_;
  std::chrono::milliseconds timeout_;
  std::string payload_;
  int listen_fd_ = -1;
  std::vector<int> peers_;  // rank 0: socket of rank r (index r); others: [0] = the socket to rank 0
  std::vector<bool> done_;
  mutable std::mutex mutex_;
  std::optional<std::string> failure_;
  std::atomic<bool> stopping_{false};
  bool finished_ = false;
  int wake_[2] = {-1, -1};  // self-pipe that stops the monitor thread
  std::thread monitor_;
};

// How this process was launched: by kiln run --nproc (RANK, WORLD_SIZE, LOCAL_RANK, ...), torchrun,
// mpirun (OMPI_COMM_WORLD_*, PMI_*) or srun (SLURM_*). world == 1 when none of them is set.
struct LaunchEnv {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "none";  // "kiln", "torchrun", "mpirun", "srun"
};
LaunchEnv detect_launch_env();

}  // namespace kiln::parallel
