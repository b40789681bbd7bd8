// FSDP's device path (gathers and reduce-scatters on a communication stream, the events between it
// and the compute stream) and expert parallelism's (its exchanges beside the compute, its row groups)
// on one GPU: two ranks as threads of this process share it, their collectives going through host
// memory. Skipped without a GPU.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "../model/parallel_fixture.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {

using test::Sets;
using test::operator+;

const char* kModel = R"(
[engine]
device = "cuda"
[backend]
cuda_device = 0
[train]
steps = 8
seed = 23
batch_size = 8
seq_len = 64
[model]
n_layer = 3
n_head = 4
n_embd = 128
vocab_size = 300
max_seq_len = 64
[optim]
lr = 1e-3
grad_clip = 0
[data]
synthetic_vocab = 300
[parallel]
timeout_s = 120
)";

}  // namespace

TEST_CASE("CUDA: FSDP on two thread ranks sharing a GPU computes what data parallelism does, bf16 and FP8") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // FP8: plain DP quantises each whole weight from its f32 master (fused into the AdamW step under
  // delayed and block scaling); FSDP quantises each rank's part with the agreed scale (block: the
  // agreed scales of its 128x128 tiles) and gathers the codes.
  for (const Sets& precision : {Sets{}, Sets{"fp8.enabled=true"}, Sets{"fp8.enabled=true", "fp8.recipe=current"},
                                Sets{"fp8.enabled=true", "fp8.recipe=block"}}) {
    const test::Trace dp = test::run_ranks(kModel, 2, precision);
    for (const Sets& fsdp : {Sets{"fsdp.strategy=full_shard"}, Sets{"fsdp.strategy=full_shard", "fsdp.prefetch=2",
                                                                     "train.micro_batch_size=2"},
                             Sets{"fsdp.strategy=shard_grad_op"},
                             Sets{"fsdp.strategy=full_shard", "fsdp.reduce=step", "train.micro_batch_size=2"}}) {
      std::string what;
      for (const auto& s : precision + fsdp) what += s + " ";
      const test::Trace f = test::run_ranks(kModel, 2, precision + fsdp);
      // Micro-batches reduced one by one add each one's reduced part rather than reduce the sum (DP): another
      // order, fp32 rounding, which bf16 weights and FP8 scales turn into gradient differences of
      // 1e-3 to 1e-1 within 8 steps; the losses stay within 1e-4. Otherwise the same bits.
      const bool micro = std::find(fsdp.begin(), fsdp.end(), "train.micro_batch_size=2") != fsdp.end();
      if (!micro) {
        test::compare_traces(f, dp, what, 0);
        continue;
      }
      const test::Trace ref = test::run_ranks(kModel, 2, precision + Sets{"train.micro_batch_size=2"});
      // Reduced once a step, FSDP sums what DP sums: the micro-batches' gradients, then the ranks'.
      // (Under delayed scaling the fused update takes each whole weight here and each part there:
      // ops::adamw_update rounds every operation on its own so that both give the same bits.)
      if (std::find(fsdp.begin(), fsdp.end(), "fsdp.reduce=step") != fsdp.end()) {
        test::compare_traces(f, ref, what, 0);
        continue;
      }
      REQUIRE(f.loss.size() == ref.loss.size());
      for (std::size_t s = 0; s < ref.loss.size(); ++s)
        CHECK_MESSAGE(std::fabs(f.loss[s] - ref.loss[s]) <= 1e-4 * std::fabs(ref.loss[s]), what, "step ", s + 1);
    }
  }
}

TEST_CASE("CUDA: expert parallelism on two thread ranks sharing a GPU trains as the experts held whole, bf16 and FP8") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // ep = 2: each rank holds 2 of the 4 experts, its rows move as one piece a source rank and run as
  // row groups by (source, expert) (ExpertParallel::Plan), the backward's exchanges beside the compute
  // (on the in-process communicator: through host memory after each stream's work). Against the same
  // two data-parallel ranks holding every expert: the experts' GEMMs split their rows differently, so
  // the losses agree to GEMM rounding, not bit for bit.
  const Sets moe = {"model.arch=llama", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=128"};
  for (const Sets& precision : {Sets{}, Sets{"fp8.enabled=true"}}) {
    const test::Trace whole = test::run_ranks(kModel, 2, moe + precision);
    const test::Trace ep = test::run_ranks(kModel, 2, moe + precision + Sets{"parallel.ep=2"});
    REQUIRE(ep.loss.size() == whole.loss.size());
    for (std::size_t s = 0; s < whole.loss.size(); ++s)
      CHECK_MESSAGE(std::fabs(ep.loss[s] - whole.loss[s]) <= 2e-3 * std::fabs(whole.loss[s]), precision.size(), " step ",
                    s + 1, ": ", ep.loss[s], " against ", whole.loss[s]);
  }
}
