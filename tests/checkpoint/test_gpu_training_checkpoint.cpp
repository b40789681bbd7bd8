// Training-state checkpoints on the GPU: a run stopped after its checkpoint and resumed continues
// bit-identically (bf16 with dropout, FP8 delayed scaling with cuDNN's deterministic attention, FSDP
// on two thread ranks sharing the GPU, async saves through pinned memory). Skipped without a GPU.
#include <doctest/doctest.h>

#include "../model/parallel_fixture.hpp"
#include "kiln/checkpoint/reader.hpp"
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
attention_deterministic = true
[train]
steps = 8
seed = 29
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
[data]
synthetic_vocab = 300
[parallel]
timeout_s = 120
)";

}  // namespace

TEST_CASE("CUDA: resumed runs continue bit-identically: bf16 with dropout, FP8 delayed, FSDP, async saves") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  struct Case {
    const char* what;
    int ranks;
    Sets sets;
  };
  const std::vector<Case> cases = {
      {"bf16, dropout 0.1", 1, {"model.dropout=0.1"}},
      {"FP8 delayed scaling, cuDNN attention", 1, {"fp8.enabled=true", "fp8.recipe=delayed", "backend.attention=auto"}},
      {"FSDP full_shard, two ranks on one GPU, FP8", 2, {"fsdp.strategy=full_shard", "fp8.enabled=true"}},
      {"async saves", 1, {"model.dropout=0.1", "checkpoint.async=true"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.what);
    test::TempDir dir(std::string("gpu-ckpt-") + std::to_string(&c - cases.data()));
    const std::string d = dir.path().string();
    Sets ref_sets;
    for (auto& s : c.sets)
      if (s.rfind("checkpoint.", 0) != 0) ref_sets.push_back(s);
    const test::Trace ref = test::run_ranks(kModel, c.ranks, ref_sets);
    test::run_ranks(kModel, c.ranks, c.sets + Sets{"checkpoint.dir=" + d, "train.exit_interval=4"});
    REQUIRE(checkpoint::latest_checkpoint(d) == d + "/step_000004");
    const test::Trace resumed = test::run_ranks(kModel, c.ranks, c.sets + Sets{"checkpoint.dir=" + d});
    for (std::size_t s = 5; s <= 8; ++s) CHECK(resumed.loss[s - 1] == ref.loss[s - 1]);
    CHECK(resumed.weights == ref.weights);
  }
}
