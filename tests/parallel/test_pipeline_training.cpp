// Pipeline-parallel training on CPU threads against the single-rank run: the same global batch in
// the same micro-batches, so the same losses, gradients and weights to fp32 rounding.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <filesystem>
#include <map>
#include <mutex>

#include "../model/parallel_fixture.hpp"
#include "kiln_test.hpp"
#include "kiln/log/timeline.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/events.hpp"

using namespace kiln;

namespace {

using test::Trace;
using test::operator+;

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 20
seed = 5
batch_size = 8
micro_batch_size = 2
seq_len = 32
[model]
n_layer = 4
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

Trace run(int nproc, std::vector<std::string> sets) { return test::run_ranks(kTiny, nproc, std::move(sets)); }
// An equivalence test's run: 20 steps, fewer under the sanitizers (test::equivalence_steps); a
// test's own train.steps wins.
Trace run_eq(int nproc, const test::Sets& sets) { return run(nproc, test::Sets{test::equivalence_steps(20)} + sets); }

void compare(const Trace& a, const Trace& ref, const char* what) {
  test::compare_traces(a, ref, what, 1e-5);
  REQUIRE(a.weights.size() == ref.weights.size());
  double num = 0, den = 0;
  for (const auto& [name, w] : ref.weights) {
    const auto& v = a.weights.at(name);
    REQUIRE(v.size() == w.size());
    for (std::size_t i = 0; i < w.size(); ++i) {
      num += double(v[i] - w[i]) * (v[i] - w[i]);
      den += double(w[i]) * w[i];
    }
  }
  INFO(what);
  CHECK(std::sqrt(num / den) < 1e-5);
}

}  // namespace

TEST_CASE("pipeline stages on CPU threads match the single-rank run over 20 steps: GPT-2, tied embeddings") {
  const Trace single = run_eq(1, {});
  compare(run_eq(2, {"parallel.pp=2"}), single, "pp=2");
  compare(run_eq(4, {"parallel.pp=4"}), single, "pp=4");
  compare(run_eq(2, {"parallel.pp=2", "parallel.vpp=2"}), single, "pp=2 x vpp=2 (interleaved)");
  compare(run_eq(2, {"parallel.pp=2", "parallel.pp_layers=[3, 1]"}), single, "pp=2, blocks 3 + 1");
  compare(run_eq(4, {"parallel.pp=2", "parallel.tp=2"}), single, "pp=2 x tp=2");
  compare(run_eq(4, {"parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"}), single,
          "pp=2 x tp=2, sequence parallel");
  compare(run_eq(4, {"parallel.pp=2", "train.micro_batch_size=1"}), single, "pp=2 x dp=2, 4 micro-batches");
  compare(run_eq(2, {"parallel.pp=2", "train.micro_batch_size=1"}), single, "pp=2, 8 micro-batches");
}

TEST_CASE("pipeline stages with dropout and activation recompute draw one rank's masks: Llama, untied head") {
  const std::vector<std::string> llama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64",
                                          "model.tie_embeddings=false", "model.dropout=0.1"};
  const Trace single = run_eq(1, llama);
  compare(run_eq(2, test::Sets{"parallel.pp=2"} + llama), single, "llama pp=2, dropout");
  compare(run_eq(2, test::Sets{"parallel.pp=2", "parallel.vpp=2"} + llama), single, "llama pp=2 x vpp=2, dropout");
  compare(run_eq(2, test::Sets{"parallel.pp=2", "activation_checkpoint.mode=full"} + llama), single,
          "llama pp=2, dropout, full recompute");
  compare(run_eq(4, test::Sets{"parallel.pp=2", "parallel.tp=2", "activation_checkpoint.mode=selective",
                            "activation_checkpoint.selective=attention"} +
                     llama),
          single, "llama pp=2 x tp=2, dropout, attention recompute");
  compare(run_eq(2, test::Sets{"parallel.pp=2", "parallel.vpp=2", "model.head_chunk_rows=24"} + llama), single,
          "llama pp=2 x vpp=2, dropout, the LM head in chunks of 24 rows");
  // GPT-2's tied table with dropout too.
  compare(run_eq(4, {"parallel.pp=4", "model.dropout=0.1"}), run_eq(1, {"model.dropout=0.1"}), "gpt2 pp=4, dropout");
}

TEST_CASE("a stage holds only its blocks' parameters and the schedule's activation copies") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, {"parallel.pp=2", "train.steps=1"});
  std::mutex m;
  std::map<int, std::vector<std::string>> names;
  std::map<int, int> copies;
  auto outcomes = parallel::run_thread_ranks(2, config::resolve(doc, "tiny.toml", reg), reg, {}, [&](World& w) {
    std::lock_guard lk(m);
    const int r = w.resource<RankInfo>().rank;
    for (Entity e : w.resource<nn::ParamStore>().order()) names[r].push_back(w.get<nn::Param>(e).name);
    copies[r] = w.resource<model::GptModel>().activation_table().copies();
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  auto has = [&](int r, const std::string& n) {
    return std::find(names[r].begin(), names[r].end(), n) != names[r].end();
  };
  // The balanced split of 4 equal blocks with the head's cost (a quarter of a block's here) on the
  // last stage: 2 + 2.
  CHECK(has(0, "wte"));
  CHECK(has(0, "blocks.1.attn.qkv.weight"));
  CHECK_FALSE(has(0, "blocks.2.attn.qkv.weight"));
  CHECK_FALSE(has(0, "ln_f.weight"));
  CHECK(has(1, "blocks.2.attn.qkv.weight"));
  CHECK(has(1, "ln_f.weight"));
  CHECK(has(1, "wte"));  // the tied head's copy of the table
  CHECK_FALSE(has(1, "wpe"));
  CHECK(copies[0] == 2);  // 1F1B: stage 0 has pp = 2 micro-batches in flight
  CHECK(copies[1] == 1);
}

TEST_CASE("bad pipeline splits are config errors naming the key") {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto fails = [&](int nproc, std::vector<std::string> sets, const std::string& key, const std::string& words) {
    auto doc = config::parse_toml_text(kTiny, "tiny.toml");
    config::apply_overrides(doc, sets);
    auto outcomes = parallel::run_thread_ranks(nproc, config::resolve(doc, "tiny.toml", reg), reg);
    for (auto& o : outcomes) {
      CHECK_FALSE(o.ok);
      CHECK(o.config_error);
      INFO(o.error);
      CHECK(o.error.find(key) != std::string::npos);
      CHECK(o.error.find(words) != std::string::npos);
    }
  };
  fails(3, {"parallel.pp=3", "model.n_layer=2"}, "parallel.pp", "each chunk needs at least one block");
  fails(2, {"parallel.pp=2", "parallel.vpp=3"}, "parallel.pp", "6 pipeline chunks");
  fails(2, {"parallel.pp=2", "parallel.pp_layers=[2, 1]"}, "parallel.pp_layers", "model.n_layer");
  fails(2, {"parallel.pp=2", "parallel.pp_layers=[1, 1, 2]"}, "parallel.pp_layers", "3 chunks' blocks");
  fails(2, {"parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=8"}, "train.micro_batch_size",
        "groups of pp = 2");
}

namespace {
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kiln_pp_ckpt_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Stops after step `stop` (its checkpoint saved), then resumes in `load`'s layout to step 20.
Trace stop_and_resume(int nproc_save, const test::Sets& save, int nproc_load, const test::Sets& load, int stop) {
  TempDir d;
  run(nproc_save, save + test::Sets{"checkpoint.dir=" + d.path, "train.exit_interval=" + std::to_string(stop)});
  return run(nproc_load, load + test::Sets{"checkpoint.dir=" + d.path});
}
}  // namespace

TEST_CASE("pipeline checkpoints: resumed bit-identically at pp = 2, and loaded at pp = 1 and pp = 4") {
  const test::Sets drop = {"model.dropout=0.1"};
  const test::Sets pp2 = test::Sets{"parallel.pp=2"} + drop;
  const Trace ref = run(2, pp2);
  const Trace resumed = stop_and_resume(2, pp2, 2, pp2, 8);
  for (std::size_t s = 9; s <= ref.loss.size(); ++s) CHECK(resumed.loss[s - 1] == ref.loss[s - 1]);
  CHECK(resumed.weights == ref.weights);
  // Resharded by layer: the same training as one rank's, to fp32 rounding.
  const Trace single = run(1, drop);
  for (const auto& [nproc, layout] : std::vector<std::pair<int, test::Sets>>{{1, drop}, {4, test::Sets{"parallel.pp=4"} + drop}}) {
    const Trace other = stop_and_resume(2, pp2, nproc, layout, 8);
    CAPTURE(nproc);
    for (std::size_t s = 9; s <= single.loss.size(); ++s)
      CHECK(std::fabs(other.loss[s - 1] - single.loss[s - 1]) / single.loss[s - 1] < 1e-5);
  }
  // And a one-rank checkpoint loads at pp = 2.
  const Trace up = stop_and_resume(1, drop, 2, pp2, 8);
  for (std::size_t s = 9; s <= single.loss.size(); ++s)
    CHECK(std::fabs(up.loss[s - 1] - single.loss[s - 1]) / single.loss[s - 1] < 1e-5);
}

TEST_CASE("FP8 on pipeline stages: delayed, current and block scaling match one rank (current keeps each micro-batch's scales)") {
  // An untied Llama trains bit-identically over the stages (its gradients meet in no sum whose order
  // changes), so FP8's rounding cannot amplify a difference: 20 steps within 1e-5. The tied GPT-2's
  // table gradient adds the two stages' parts in another order (to fp32 rounding), which FP8's
  // quantisation amplifies over later steps: its first step is checked, before any update.
  const test::Sets llama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64",
                            "model.tie_embeddings=false"};
  for (const char* r : {"delayed", "current", "block"}) {
    const test::Sets f = {"fp8.enabled=true", std::string("fp8.recipe=\"") + r + "\""};
    const std::string what = std::string("fp8 ") + r;
    compare(run_eq(2, test::Sets{"parallel.pp=2"} + llama + f), run_eq(1, llama + f), (what + ", llama pp=2").c_str());
    test::compare_traces(run_eq(2, test::Sets{"parallel.pp=2", "train.steps=1"} + f),
                         run_eq(1, test::Sets{"train.steps=1"} + f), what + ", gpt2 pp=2, first step", 1e-5);
  }
  const test::Sets current = {"fp8.enabled=true", "fp8.recipe=\"current\""};
  compare(run_eq(4, test::Sets{"parallel.pp=2", "parallel.tp=2"} + llama + current),
          run_eq(2, test::Sets{"parallel.tp=2"} + llama + current), "fp8 current, llama pp=2 x tp=2 against tp=2");
  compare(run_eq(2, test::Sets{"parallel.pp=2", "parallel.vpp=2", "fp8.first_last_bf16=true"} + llama + current),
          run_eq(1, test::Sets{"fp8.first_last_bf16=true"} + llama + current),
          "fp8 current, first and last blocks bf16, llama pp=2 x vpp=2");
}

namespace {
// A module that makes one rank fail in the middle of a step's schedule: in its backward pass of a
// micro-batch, at a step.
struct DieConfig {
  int rank = 1;
  int step = 2;
  int micro_batch = 1;
};
KILN_CONFIG(DieConfig, (rank, "the rank that fails"), (step, "at this step"), (micro_batch, "in this backward pass"))
void register_die(ModuleRegistry& r) {
  r.add(make_module<DieConfig>("test_die", "", {"model"}, [](World& w, const DieConfig& cfg) {
    w.systems().add({"test_die.backward", Phase::backward, [cfg](World& world) {
                       const auto& ctl = world.resource<RunControl>();
                       if (world.resource<RankInfo>().rank == cfg.rank && ctl.step == cfg.step &&
                           ctl.micro_batch == cfg.micro_batch)
                         KILN_THROW("test_die: rank ", cfg.rank, " fails in micro-batch ", cfg.micro_batch,
                                    "'s backward");
                     }});
  }));
}
}  // namespace

TEST_CASE("a stage that dies mid-schedule stops the others, naming the peer and the transfer they waited in") {
  std::string failures;
  test::run_ranks(kTiny, 4, {"parallel.pp=4", "test_die.rank=2"}, register_die, &failures);
  INFO(failures);
  CHECK(failures.find("test_die: rank 2 fails in micro-batch 1's backward") != std::string::npos);
  // Its neighbours were waiting for what it would have sent them.
  CHECK(failures.find("receiving from rank 2") != std::string::npos);
  CHECK(failures.find("of micro-batch") != std::string::npos);
}

namespace {
// Passes whose time is known: every block's forward sleeps 20 ms and its backward 40 ms (the tiny
// model's own compute is well under a millisecond a block). Under the sanitizers the compute is
// several milliseconds a pass, more on the stages that hold the embedding or the head, and two
// cores serve four ranks: the sleeps are 3x there, so that compute stays small beside them.
struct SleepConfig {
  int forward_ms = 10;
};
KILN_CONFIG(SleepConfig, (forward_ms, "each block's forward sleeps this long, its backward twice as long"))
struct SleepHooks {
  Subscription f, b;
};
void register_sleep(ModuleRegistry& r) {
  r.add(make_module<SleepConfig>("test_sleep", "", {"model"}, [](World& w, const SleepConfig& cfg) {
    const int L = w.resource<model::ModelConfig>().n_layer;
    auto& h = w.emplace_resource<SleepHooks>();
    h.f = w.events().subscribe<nn::LayerForwardEnd>([cfg, L](const nn::LayerForwardEnd& e) {
      if (e.unit >= 1 && e.unit <= L) std::this_thread::sleep_for(std::chrono::milliseconds(cfg.forward_ms));
    });
    h.b = w.events().subscribe<nn::LayerBackwardEnd>([cfg, L](const nn::LayerBackwardEnd& e) {
      if (e.unit >= 1 && e.unit <= L) std::this_thread::sleep_for(std::chrono::milliseconds(2 * cfg.forward_ms));
    });
  }));
}
}  // namespace

TEST_CASE("the measured bubble of a timed step equals (pp - 1) / (vpp m + pp - 1): 1F1B and interleaved") {
  struct Case {
    int nproc;
    test::Sets sets;
  };
  for (const auto& c : std::vector<Case>{{2, {"parallel.pp=2"}},
                                         {4, {"parallel.pp=4"}},
                                         {2, {"parallel.pp=2", "parallel.vpp=2"}}}) {
    TempDir d;
    const std::string path = d.path + "/timeline";
    test::run_ranks(kTiny, c.nproc,
                    c.sets + test::Sets{"train.steps=2", "log.timeline=\"" + path + "\"", "log.timeline_step=2",
                                        "test_sleep.forward_ms=" + std::to_string(test::sanitized ? 60 : 20)},
                    register_sleep);
    std::vector<std::string> files;
    for (int r = 0; r < c.nproc; ++r) files.push_back(path + ".rank" + std::to_string(r));
    const auto passes = log::read_timeline(files);
    const auto s = log::summarize_timeline(passes);
    CAPTURE(c.sets.back());
    CHECK(s.micro_batches == 4);
    CHECK(passes.size() == static_cast<std::size_t>(c.nproc) * 2 * 4 * s.vpp);
    MESSAGE(c.sets.back(), ": measured bubble ", s.bubble, ", formula ", s.formula, ", step ", s.makespan_s * 1e3, " ms");
    CHECK(std::fabs(s.bubble - s.formula) < 0.05);
  }
}
namespace {
// The gradient's norm of every step as rank 0 logs it (the global norm, over every stage).
std::vector<double> norms(int nproc, const test::Sets& sets) {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, sets + test::Sets{"train.steps=4"});
  std::vector<double> out;
  std::mutex m;
  auto outcomes = parallel::run_thread_ranks(nproc, config::resolve(doc, "tiny.toml", reg), reg, [&](World& w) {
    if (w.resource<RankInfo>().rank != 0) return;
    w.systems().add({"test.norm", Phase::step_end,
                     [&](World& world) {
                       std::lock_guard lk(m);
                       out.push_back(world.resource<train::TrainState>().grad_norm);
                     },
                     {"optim.check"}});
  });
  (void)outcomes;
  return out;
}
}  // namespace

TEST_CASE("pipeline stages with FSDP inside each stage match the single-rank run, the gradient's norm over every stage") {
  const Trace single = run(1, {});
  compare(run(4, {"parallel.pp=2", "fsdp.strategy=\"full_shard\""}), single, "pp=2 x fsdp=2 (full_shard)");
  compare(run(4, {"parallel.pp=2", "fsdp.strategy=\"full_shard\"", "train.micro_batch_size=1"}), single,
          "pp=2 x fsdp=2, 4 micro-batches");
  compare(run(4, {"parallel.pp=2", "fsdp.strategy=\"full_shard\"", "fsdp.reduce=\"step\"", "train.micro_batch_size=1"}),
          single, "pp=2 x fsdp=2, 4 micro-batches, reduced once a step");
  compare(run(4, {"parallel.pp=2", "parallel.tp=2", "fsdp.strategy=\"full_shard\"", "train.micro_batch_size=4"}),
          single, "pp=2 x tp=2, fsdp over one data-parallel rank, 2 micro-batches");
  // AdamW does not see a wrong clipping scale (it is scale-free): the norm itself is checked.
  const auto one = norms(1, {});
  REQUIRE(one.size() == 4);
  for (const auto& sets : std::vector<test::Sets>{{"parallel.pp=2"},
                                                  {"parallel.pp=2", "fsdp.strategy=\"full_shard\""},
                                                  {"parallel.pp=2", "parallel.vpp=2"}}) {
    const int nproc = sets.size() > 1 && sets[1].rfind("fsdp", 0) == 0 ? 4 : 2;
    const auto n = norms(nproc, sets);
    REQUIRE(n.size() == one.size());
    for (std::size_t i = 0; i < n.size(); ++i) CHECK(n[i] == doctest::Approx(one[i]).epsilon(1e-5));
  }
}
namespace {
const test::Sets kMoe = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=64", "model.tie_embeddings=false",
                         "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=32"};

// Rank 0's metrics of the last step, by name.
std::map<std::string, double> last_metrics(int nproc, const test::Sets& sets) {
  ModuleRegistry reg;
  register_builtin_modules(reg);
  auto doc = config::parse_toml_text(kTiny, "tiny.toml");
  config::apply_overrides(doc, sets + test::Sets{"train.steps=3"});
  std::map<std::string, double> out;
  auto outcomes = parallel::run_thread_ranks(nproc, config::resolve(doc, "tiny.toml", reg), reg, {}, [&](World& w) {
    if (w.resource<RankInfo>().rank != 0) return;
    for (const auto& [name, v] : w.resource<train::TrainState>().metrics) out[name] = v;
  });
  for (auto& o : outcomes) REQUIRE(o.ok);
  return out;
}
}  // namespace

TEST_CASE("a mixture of experts on pipeline stages: one rank's training, routing state per micro-batch, metrics of every stage") {
  // The experts' routing of a micro-batch (host offsets, expert-parallel plans) lives from its
  // forward to its backward: pp = 2 trains bit-identically (untied Llama).
  const Trace single = run(1, kMoe);
  compare(run(2, test::Sets{"parallel.pp=2"} + kMoe), single, "moe pp=2");
  compare(run(2, test::Sets{"parallel.pp=2", "parallel.vpp=2"} + kMoe), single, "moe pp=2 x vpp=2");
  compare(run(4, test::Sets{"parallel.pp=2", "parallel.ep=2", "train.micro_batch_size=1"} + kMoe),
          run(1, test::Sets{"train.micro_batch_size=1"} + kMoe), "moe pp=2 x ep=2, 4 micro-batches");
  const test::Sets fp8 = {"fp8.enabled=true", "fp8.recipe=\"current\""};
  compare(run(2, test::Sets{"parallel.pp=2"} + kMoe + fp8), run(1, kMoe + fp8), "moe pp=2, fp8 current (grouped too)");
  // Expert dropout draws from the expert-parallel state: each stage's blocks start where one rank's
  // earlier blocks (the other stage's included) left it.
  const test::Sets drop = {"model.dropout=0.1", "model.moe.expert_dropout=0.1"};
  compare(run(2, test::Sets{"parallel.pp=2", "parallel.vpp=2"} + kMoe + drop), run(1, kMoe + drop),
          "moe pp=2 x vpp=2, dropout and expert dropout");
  // Every stage's layers in the metrics, the totals over the layers summed.
  const auto one = last_metrics(1, kMoe), two = last_metrics(2, test::Sets{"parallel.pp=2"} + kMoe);
  REQUIRE(one.size() == two.size());
  CHECK(one.count("blocks.3.mlp.tokens_cv") == 1);
  for (const auto& [name, v] : one) {
    CAPTURE(name);
    REQUIRE(two.count(name) == 1);
    CHECK(two.at(name) == doctest::Approx(v).epsilon(1e-6));
  }
}

TEST_CASE("a mixture of experts' balancing biases are saved from every stage and loaded at another pp") {
  const test::Sets sigmoid = kMoe + test::Sets{"model.moe.router=\"sigmoid\"", "model.moe.bias_update_rate=0.01"};
  const test::Sets pp2 = test::Sets{"parallel.pp=2"} + sigmoid;
  const Trace ref = run(2, pp2);
  const Trace resumed = stop_and_resume(2, pp2, 2, pp2, 8);
  for (std::size_t s = 9; s <= ref.loss.size(); ++s) CHECK(resumed.loss[s - 1] == ref.loss[s - 1]);
  CHECK(resumed.weights == ref.weights);
  const Trace single = run(1, sigmoid);
  const Trace other = stop_and_resume(2, pp2, 1, sigmoid, 8);
  for (std::size_t s = 9; s <= single.loss.size(); ++s)
    CHECK(std::fabs(other.loss[s - 1] - single.loss[s - 1]) / single.loss[s - 1] < 1e-5);
}
