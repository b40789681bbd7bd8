#pragma once
// Joining a job launched by MPI (mpirun/mpiexec): rank 0's NCCL unique id, and the address of the
// TCP rendezvous that then serves as the liveness channel, reach every rank through MPI_Bcast, so
// no MASTER_ADDR is needed. kiln does not link MPI: the broadcast lives in a small plugin,
// libkiln_mpi_bootstrap.so (built where CMake finds MPI, installed next to kiln's libraries), loaded
// at run time against the job's own libmpi; $KILN_MPI_BOOTSTRAP names another copy, e.g. one built
// against a different MPI with `mpicxx -shared -fPIC modules/parallel/mpi/kiln_mpi_bootstrap.cpp`.
// MPI is initialised for the broadcast and finalised right after; nothing else uses it.
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "kiln/parallel/rendezvous.hpp"

namespace kiln::parallel {

class MpiBootstrap {
 public:
  // The plugin, or nullopt with the reason in *why_not (no plugin, or libmpi cannot be loaded).
  static std::optional<MpiBootstrap> load(std::string* why_not);
  // Every rank passes a buffer of the same size; rank 0's content comes back on every rank. Checks
  // that MPI's rank and size are `rank` and `world` (the launcher's environment).
  std::string broadcast(std::string bytes, int rank, int world) const;
  const std::string& path() const { return path_; }

 private:
  using Fn = int (*)(char*, int, int*, int*, char*, int);
  MpiBootstrap(Fn fn, std::string path) : fn_(fn), path_(std::move(path)) {}
  Fn fn_;
  std::string path_;
};

// The rendezvous of an MPI-launched job: rank 0 picks its address (MASTER_ADDR, else 127.0.0.1 when
// every rank is on its node, else its host name) and port (MASTER_PORT, else a free one) and
// broadcasts them with `root_payload` over MPI; every rank then joins the TCP rendezvous there.
// nullptr with *why_not set when MPI cannot be used (callers fall back to MASTER_ADDR).
std::shared_ptr<Rendezvous> mpi_rendezvous(const LaunchEnv& env, const std::string& root_payload,
                                           std::chrono::milliseconds timeout, std::string* why_not);

}  // namespace kiln::parallel
