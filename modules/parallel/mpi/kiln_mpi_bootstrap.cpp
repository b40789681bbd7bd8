// The MPI side of kiln's bootstrap (see kiln/parallel/mpi_bootstrap.hpp): one broadcast from rank 0.
// Self-contained (MPI's C API only) so it can be rebuilt against any MPI:
//   mpicxx -shared -fPIC -O2 kiln_mpi_bootstrap.cpp -o libkiln_mpi_bootstrap.so
#include <mpi.h>

#include <cstdio>

extern "C" int kiln_mpi_broadcast(char* buf, int bytes, int* rank, int* size, char* err, int errlen) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized && MPI_Init(nullptr, nullptr) != MPI_SUCCESS) {
    std::snprintf(err, static_cast<size_t>(errlen), "MPI_Init failed");
    return 1;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, rank);
  MPI_Comm_size(MPI_COMM_WORLD, size);
  const int rc = MPI_Bcast(buf, bytes, MPI_BYTE, 0, MPI_COMM_WORLD);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  if (rc != MPI_SUCCESS) {
    std::snprintf(err, static_cast<size_t>(errlen), "MPI_Bcast failed (error %d)", rc);
    return 1;
  }
  return 0;
}
