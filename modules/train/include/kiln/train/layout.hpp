#pragma once
// This rank's place in the job's parallel layout, as plain numbers: a World resource the parallel
// module emplaces at install (Megatron's rank order: tp fastest, then cp, ep, dp, pp). Modules that
// need only the numbers (the batch split over data-parallel ranks, the RNG seeds) read it here, in
// the vocabulary every module shares, instead of depending on the parallel module.
namespace kiln::train {

struct ParallelLayout {
  int world = 1;                                                       // ranks in the job
  int tp = 1, cp = 1, ep = 1, dp = 1, pp = 1;                          // group sizes
  int tp_rank = 0, cp_rank = 0, ep_rank = 0, dp_rank = 0, pp_rank = 0;  // this rank's coordinates
  // dp and dp_rank are data parallelism's, expert parallelism included (the ep ranks of an
  // expert-parallel group are data-parallel ranks too: Megatron-Core's layout).
};

}  // namespace kiln::train
