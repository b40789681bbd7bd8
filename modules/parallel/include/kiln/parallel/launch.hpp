#pragma once
// Launching local processes, one per GPU (kiln::parallel, no World involved).
#include <string>
#include <vector>

namespace kiln::parallel {

// `kiln run --nproc N` with GPUs: starts N copies of this program (argv: its arguments after the
// program name, without --nproc), one per GPU, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT set as torchrun does. Their standard error is prefixed with
// "[rank r] ". When one exits with an error the others are stopped (they normally notice first,
// through the rendezvous); returns the first failing rank's exit code, or 0.
int run_local_processes(int nproc, const std::vector<std::string>& argv, double timeout_s);

}  // namespace kiln::parallel
