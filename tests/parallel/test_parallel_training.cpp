// Tensor and data parallel training on CPU threads against the single-rank run: the same global
// batch, so the same losses and the same (logical) gradients to fp32 rounding, step after step.
#include <doctest/doctest.h>


#include "../model/parallel_fixture.hpp"
#include "kiln_test.hpp"
#include "kiln/builtin.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/parallel/grad_buckets.hpp"
#include "kiln/parallel/thread_ranks.hpp"
#include "kiln/parallel/module.hpp"

using namespace kiln;

namespace {

using test::Trace;

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 20
seed = 5
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 4
n_embd = 32
vocab_size = 96
max_seq_len = 32
[optim]
lr = 2e-3
warmup_steps = 3
[data]
synthetic_vocab = 96
[parallel]
timeout_s = 60
)";

// Equivalence runs: 20 steps (fewer under the sanitizers, test::equivalence_steps); a test's own
// train.steps wins.
Trace run(int nproc, const test::Sets& sets) {
  return test::run_ranks(kTiny, nproc, test::operator+(test::Sets{test::equivalence_steps(20)}, sets));
}
void compare(const Trace& a, const Trace& ref, const char* what) { test::compare_traces(a, ref, what, 1e-5); }

}  // namespace

TEST_CASE("tensor and data parallel runs on CPU threads match the single-rank run over 20 steps") {
  const Trace single = run(1, {});
  REQUIRE(single.loss.size() == static_cast<std::size_t>(test::equivalence_step_count(20)));
  for (double l : single.loss) CHECK(std::isfinite(l));
  compare(run(2, {"parallel.tp=2"}), single, "tp=2");
  compare(run(4, {"parallel.tp=4"}), single, "tp=4");
  compare(run(2, {}), single, "dp=2");
  compare(run(4, {"parallel.tp=2"}), single, "tp=2 x dp=2");
  compare(run(4, {"parallel.tp=2", "train.micro_batch_size=2"}), single, "tp=2 x dp=2 with 2 micro-batches");
  compare(run(2, {"parallel.tp=2", "parallel.sequence_parallel=true"}), single, "tp=2, sequence parallel");
  compare(run(4, {"parallel.tp=4", "parallel.sequence_parallel=true"}), single, "tp=4, sequence parallel");
  compare(run(4, {"parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2"}), single,
          "tp=2 x dp=2, sequence parallel, 2 micro-batches");
}

TEST_CASE("the LM head in chunks of rows matches the single-rank run: TP, SP, vocabulary parallel, DP, FSDP") {
  using test::operator+;
  const test::Sets c = {"model.head_chunk_rows=24"}, drop = {"model.dropout=0.1", "activation_checkpoint.mode=full"};
  const Trace single = run(1, {}), single_drop = run(1, drop);
  compare(run(1, c), single, "chunks of 24 rows");
  compare(run(2, c + test::Sets{"parallel.tp=2"}), single, "tp=2 (the head whole on each rank), chunks of 24");
  compare(run(2, c + test::Sets{"parallel.tp=2", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true"}),
          single, "tp=2, sequence and vocabulary parallel, chunks of 24");
  compare(run(2, c + test::Sets{"train.micro_batch_size=2"}), single, "dp=2, 2 micro-batches, chunks of 24");
  compare(run(2, c + drop + test::Sets{"fsdp.strategy=full_shard", "train.micro_batch_size=2"}), single_drop,
          "full_shard on 2, 2 micro-batches, dropout, full recompute, chunks of 24");
  compare(run(4, c + drop + test::Sets{"fsdp.strategy=full_shard", "parallel.tp=2", "parallel.vocab_parallel=true"}),
          single_drop, "tp=2 (vocabulary parallel) x full_shard on 2, dropout, full recompute, chunks of 24");
}

TEST_CASE("an FP8 LM head under vocabulary parallelism matches one rank's (its cross-entropy gradient made on load "
          "from each rank's columns)") {
  using test::operator+;
  // The ranks share the scales (amaxes reduced over TP); the logsumexp is combined from every
  // rank's statistics, so it rounds apart from one rank's: within FP8's rounding, not bit for bit
  // (an E5M2 gradient code is 12.5% from its neighbour: the FP8 blocks alone under tp = 2 differ from
  // one rank by 4.0% in the worst gradient, with the FP8 head 4.8-5.1%; losses by 1.5e-4-2e-4).
  const test::Sets head = {"fp8.enabled=true", "fp8.lm_head=true", "train.steps=6"};
  const Trace single = run(1, head);
  auto check = [&](const Trace& t, const char* what) {
    test::compare_traces(t, single, what, 0.1);
    for (std::size_t i = 0; i < single.loss.size(); ++i) CHECK(t.loss[i] == doctest::Approx(single.loss[i]).epsilon(1e-3));
  };
  check(run(2, head + test::Sets{"parallel.tp=2", "parallel.vocab_parallel=true"}), "tp=2, vocabulary parallel, FP8 head");
  check(run(2, head + test::Sets{"parallel.tp=2", "parallel.vocab_parallel=true", "parallel.sequence_parallel=true",
                                 "model.head_chunk_rows=32"}),
        "tp=2, sequence and vocabulary parallel, FP8 head in chunks of 32");
}

TEST_CASE("tensor-parallel communication overlapped with the GEMMs trains bit for bit as without") {
  // The same steps in pieces (parallel.tp_comm_overlap): exactly the plain run's losses, with
  // sequence parallelism, dropout and full recompute. FP8 layers (delayed, current and block
  // scaling) take part in the column-parallel backward's sum (one call, the dGELU on load), their
  // other calls whole.
  using test::operator+;
  const test::Sets lapped = {"parallel.tp_comm_overlap=true", "parallel.tp_comm_chunks=3"};
  // Block scaling with whole 128-blocks on each rank, at a small cost.
  const test::Sets block_sp = {"parallel.tp=2", "parallel.sequence_parallel=true", "fp8.enabled=true",
                               "fp8.recipe=block", "backend.cpu_round_bf16=true", "model.n_embd=256",
                               "model.n_head=2", "train.steps=2", "train.batch_size=4"};
  const test::Sets cases[] = {
      {"parallel.tp=2"},
      {"parallel.tp=4", "parallel.sequence_parallel=true", "model.dropout=0.1"},
      {"parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1", "activation_checkpoint.mode=full",
       "train.micro_batch_size=2", "model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64"},
      {"parallel.tp=2", "parallel.sequence_parallel=true", "fp8.enabled=true"},
      {"parallel.tp=2", "fp8.enabled=true", "model.dropout=0.1", "activation_checkpoint.mode=full"},
      {"parallel.tp=2", "fp8.enabled=true", "fp8.recipe=current", "model.arch=llama", "model.n_kv_head=2",
       "model.ffn_hidden=64"},
      block_sp,
  };
  for (const auto& sets : cases) {
    std::string what = "overlapped:";
    for (const auto& s : sets) what += " " + s;
    const int nproc = sets.front() == "parallel.tp=4" ? 4 : 2;
    test::compare_traces(run(nproc, sets + lapped), run(nproc, sets), what.c_str(), 0);
  }
  // Block-scaled layers keeping their inputs' transposes under sequence parallelism (the norms'
  // outputs gathered once in the forward, never again): the recomputing run's bits, overlapped or not.
  const test::Sets stored = {"model.recompute_norm=false", "model.recompute_gelu=false"};
  const auto recomputed = run(2, block_sp);
  test::compare_traces(run(2, block_sp + stored), recomputed, "block, inputs kept", 0);
  test::compare_traces(run(2, block_sp + stored + lapped), recomputed, "block, inputs kept, overlapped", 0);
}

namespace {
// A module after fp8 that takes ops::LinearImpl::forward_gathered from every linear: the layers then
// gather their inputs in bf16 and quantise them whole, as before FP8 codes were gathered.
struct Bf16GatherConfig {
  bool on = true;
};
KILN_CONFIG(Bf16GatherConfig, (on, "take forward_gathered from every linear implementation"))
void register_bf16_gather(ModuleRegistry& r) {
  r.add(make_module<Bf16GatherConfig>("test_bf16_gather", "", {"fp8"}, [](World& w, const Bf16GatherConfig& cfg) {
    if (!cfg.on) return;
    w.each<ops::LinearImpl>([](Entity, ops::LinearImpl& impl) { impl.forward_gathered = {}; });
  }));
}
}  // namespace

TEST_CASE("FP8 layers under sequence parallelism gather their inputs as one-byte codes, with the bf16 gather's bits") {
  // The attention's and the MLP's first linears gather FP8 codes where their norm's output is not
  // kept for the backward (recomputed and gathered again there, or kept by the FP8 layer itself:
  // recompute_norm = false); the same run with bf16 gathers gives the same bits. Delayed and current
  // scaling, the collectives overlapped too.
  using test::operator+;
  const test::Sets sp = {test::equivalence_steps(12), "parallel.tp=2", "parallel.sequence_parallel=true",
                         "fp8.enabled=true"};
  for (const test::Sets& c : {test::Sets{}, test::Sets{"fp8.recipe=current"}, test::Sets{"model.recompute_norm=false"},
                              test::Sets{"parallel.tp_comm_overlap=true", "model.dropout=0.1"}}) {
    std::string what = "FP8 codes vs bf16 gathered, tp=2 sequence parallel:";
    for (const auto& s : c) what += " " + s;
    test::compare_traces(test::run_ranks(kTiny, 2, sp + c), test::run_ranks(kTiny, 2, sp + c + test::Sets{"test_bf16_gather.on=true"}, register_bf16_gather),
                         what.c_str(), 0);
  }
}

TEST_CASE("data-parallel gradients reduced in buckets during the backward pass equal one reduction after it") {
  // 0.01 MB buckets: every layer unit of the tiny model is a bucket of its own.
  const Trace whole = run(2, {"parallel.dp_bucket_mb=0"});
  compare(run(2, {"parallel.dp_bucket_mb=0.01"}), whole, "dp=2, 0.01 MB buckets vs one all-reduce");
  test::compare_traces(run(2, {"parallel.dp_bucket_mb=0.01"}), whole, "dp=2 buckets, bit-identical", 0);
  test::compare_traces(run(4, {"parallel.tp=2", "parallel.dp_bucket_mb=0.01", "train.micro_batch_size=2"}),
                       run(4, {"parallel.tp=2", "parallel.dp_bucket_mb=0", "train.micro_batch_size=2"}),
                       "tp=2 x dp=2, 2 micro-batches, buckets", 0);
  // Every bucket started from a LayerBackwardEnd of the step's last micro-batch, none at the sync.
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.dp_bucket_mb=0.01", "train.steps=2", "train.micro_batch_size=2"});
  std::mutex m;
  std::vector<std::pair<int, int>> seen;  // (buckets, launched early) per rank
  auto outcomes = parallel::run_thread_ranks(2, config::resolve(doc, "tiny.toml", reg), reg, [&](World& w) {
    w.systems().add({"test.buckets", Phase::step_end, [&](World& world) {
                       auto& sync = *world.resource<parallel::DpGradState>().sync;
                       std::lock_guard lk(m);
                       seen.emplace_back(static_cast<int>(sync.buckets().size()), sync.launched_early());
                     }});
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  REQUIRE(seen.size() == 4);
  for (auto [buckets, early] : seen) {
    CHECK(buckets == 3);  // the final LayerNorm with block 2, block 1, the embeddings
    CHECK(early == buckets);
  }
}

TEST_CASE("with dropout, tensor parallel runs match the single-rank run (layout-invariant masks)") {
  const Trace single = run(1, {"model.dropout=0.1"});
  compare(run(2, {"parallel.tp=2", "model.dropout=0.1"}), single, "tp=2, dropout 0.1");
  compare(run(4, {"parallel.tp=4", "model.dropout=0.1"}), single, "tp=4, dropout 0.1");
  compare(run(2, {"parallel.tp=2", "parallel.sequence_parallel=true", "model.dropout=0.1"}), single,
          "tp=2, sequence parallel, dropout 0.1");
}

TEST_CASE("vocabulary-parallel embedding and cross-entropy match the single-rank run") {
  // Vocabulary 96 padded to 128: with tp=4 the last rank's 32 rows are all padding.
  const Trace single = run(1, {});
  const std::vector<std::string> vp = {"parallel.vocab_parallel=true"};
  compare(run(2, {"parallel.tp=2", "parallel.vocab_parallel=true"}), single, "tp=2, vocabulary parallel");
  compare(run(4, {"parallel.tp=4", "parallel.vocab_parallel=true"}), single, "tp=4, vocabulary parallel");
  compare(run(2, {"parallel.tp=2", "parallel.vocab_parallel=true", "parallel.sequence_parallel=true"}), single,
          "tp=2, vocabulary and sequence parallel");
  compare(run(4, {"parallel.tp=2", "parallel.vocab_parallel=true", "train.micro_batch_size=2"}), single,
          "tp=2 x dp=2, vocabulary parallel, 2 micro-batches");
  compare(run(2, {"parallel.tp=2", "parallel.vocab_parallel=true", "model.dropout=0.1"}),
          run(1, {"model.dropout=0.1"}), "tp=2, vocabulary parallel, dropout 0.1");
  // The embedding rows and the logits are split: each rank holds Vp / tp rows of wte.
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "parallel.vocab_parallel=true", "train.steps=1"});
  std::mutex m;
  std::vector<std::int64_t> rows;
  auto outcomes = parallel::run_thread_ranks(2, config::resolve(doc, "tiny.toml", reg), reg, {}, [&](World& w) {
    for (Entity e : w.view<nn::Param>())
      if (w.get<nn::Param>(e).name == "wte") {
        std::lock_guard lk(m);
        rows.push_back(w.get<nn::Param>(e).shape[0]);
      }
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  CHECK(rows == std::vector<std::int64_t>{64, 64});
  // A padded vocabulary that tp does not divide is a config error naming the key, where it was set
  // and the sizes.
  auto bad = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(bad, {"parallel.tp=2", "parallel.vocab_parallel=true", "model.vocab_size=97",
                                "model.vocab_multiple=1", "data.synthetic_vocab=97"});
  auto failed = parallel::run_thread_ranks(2, config::resolve(bad, "tiny.toml", reg), reg);
  for (auto& o : failed) {
    CHECK_FALSE(o.ok);
    CHECK(o.config_error);
    CHECK(o.error.find("--set parallel.vocab_parallel=true: parallel.vocab_parallel: 97 vocabulary rows "
                       "(model.vocab_size 97 padded to a multiple of model.vocab_multiple = 1) do not split over "
                       "the 2 ranks") != std::string::npos);
  }
}

TEST_CASE("sequence parallelism keeps only this rank's tokens in the residual stream") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "parallel.sequence_parallel=true", "train.steps=1"});
  auto cfg = config::resolve(doc, "tiny.toml", reg);
  int partial = 0;
  auto outcomes = parallel::run_thread_ranks(2, cfg, reg, {}, [&partial](World& w) {
    if (w.resource<RankInfo>().rank != 0) return;
    for (Entity e : w.view<nn::Param>()) partial += w.get<nn::Param>(e).tp_partial_grad;
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  CHECK(partial == 2 * 2 * 2 + 2);  // ln_1 and ln_2 of 2 blocks (weight and bias), and ln_f
}

TEST_CASE("a failing rank stops a CPU run and the others name it") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.tp=2", "train.steps=50"});
  auto cfg = config::resolve(doc, "tiny.toml", reg);
  auto outcomes = parallel::run_thread_ranks(2, cfg, reg, [](World& w) {
    if (w.resource<RankInfo>().rank != 1) return;
    w.systems().add({"test.die", Phase::forward, [](World& world) {
                       if (world.resource<RunControl>().step == 3) KILN_THROW("rank 1 was killed at step 3");
                     },
                     {}, {"model.forward"}});
  });
  REQUIRE_FALSE(outcomes[1].ok);
  REQUIRE_FALSE(outcomes[0].ok);
  CHECK(outcomes[1].error.find("killed at step 3") != std::string::npos);
  CHECK(outcomes[0].error.find("rank 1 failed") != std::string::npos);
  auto text = parallel::describe_failures(outcomes);
  CHECK(text.rfind("[rank 1]", 0) == 0);  // the root cause first
}
