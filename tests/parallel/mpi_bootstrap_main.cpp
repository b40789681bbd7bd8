// Run under mpirun (see tests/parallel/CMakeLists.txt): every rank joins through the MPI bootstrap
// and must receive rank 0's payload, by MPI and by the TCP rendezvous it then connects to.
#include <chrono>
#include <iostream>

#include "kiln/parallel/mpi_bootstrap.hpp"

int main() {
  using namespace kiln::parallel;
  try {
    const LaunchEnv env = detect_launch_env();
    if (env.launcher != "mpirun" || env.world < 2) {
      std::cerr << "not launched by mpirun with 2 or more ranks (launcher " << env.launcher << ", world " << env.world
                << ")\n";
      return 1;
    }
    const std::string payload = "nccl-id:" + std::string(100, 'x') + ":end";
    std::string why;
    auto rdv = mpi_rendezvous(env, env.rank == 0 ? payload : std::string(), std::chrono::seconds(30), &why);
    if (!rdv) {
      std::cerr << "rank " << env.rank << ": " << why << "\n";
      return 1;
    }
    if (rdv->payload() != payload) {
      std::cerr << "rank " << env.rank << ": wrong payload '" << rdv->payload() << "'\n";
      return 1;
    }
    rdv->finish();
    std::cout << "rank " << env.rank << " of " << env.world << ": ok\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
}
