// The optimizer under tensor parallelism: two CPU-thread ranks hold shards of the QKV and
// projection weights and full copies of the rest; the global gradient norm must count each
// logical element once.
#include <doctest/doctest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kiln/parallel/thread_ranks.hpp"
#include "toy_model.hpp"

using namespace kiln;

namespace {

struct RankResult {
  double grad_norm = 0;
  std::map<std::string, std::vector<float>> weights;  // this rank's part, after the run
  std::map<std::string, TensorShard> shards;
};

std::vector<RankResult> run_ranks(int nproc, std::vector<std::string> sets) {
  const auto cfg = test::toy_config(std::move(sets));
  std::mutex m;
  std::vector<RankResult> results(static_cast<std::size_t>(nproc));
  const auto outcomes = parallel::run_thread_ranks(nproc, cfg, test::toy_registry(), {}, [&](World& w) {
    RankResult r;
    r.grad_norm = w.resource<train::TrainState>().grad_norm;
    const auto& store = w.resource<nn::ParamStore>();
    for (Entity e : store.order()) {
      const auto& p = w.get<nn::Param>(e);
      r.weights[p.name] = test::to_vector(store.master_view(p));
      r.shards[p.name] = p.shard;
    }
    std::lock_guard lk(m);
    results[static_cast<std::size_t>(w.resource<RankInfo>().rank)] = std::move(r);
  });
  INFO(parallel::describe_failures(outcomes));
  for (const auto& o : outcomes) REQUIRE(o.ok);
  return results;
}

}  // namespace

TEST_CASE("with tensor parallelism the gradient norm counts sharded parameters over the group and replicated ones once") {
  const auto ranks = run_ranks(2, {"parallel.tp=2", "model.grad_gain=50", "optim.grad_clip=1", "train.steps=1"});
  REQUIRE(ranks.size() == 2);
  CHECK(ranks[0].shards.at("qkv.weight").sharded());
  CHECK(ranks[1].shards.at("proj.weight").dim == 1);
  CHECK_FALSE(ranks[0].shards.at("ln.weight").sharded());
  test::ToyModelConfig model;
  model.grad_gain = 50;
  const double norm = test::toy_grad_norm(model, 1);
  CHECK(ranks[0].grad_norm == doctest::Approx(norm).epsilon(1e-6));
  CHECK(ranks[1].grad_norm == ranks[0].grad_norm);  // one all-reduce: the same value on every rank
}

TEST_CASE("each tensor-parallel rank's shards take the same clipped steps as the single-rank run") {
  const std::vector<std::string> sets{"model.grad_gain=50", "optim.grad_clip=1", "optim.eps=0.05"};
  const auto single = run_ranks(1, sets);
  auto tp_sets = sets;
  tp_sets.push_back("parallel.tp=2");
  const auto tp = run_ranks(2, tp_sets);
  const auto specs = test::toy_params(test::ToyModelConfig{}.width);
  double worst = 0;
  for (const auto& rank : tp)
    for (const auto& spec : specs) {
      const auto want = test::local_part(rank.shards.at(spec.name), spec.global, single[0].weights.at(spec.name));
      const auto& got = rank.weights.at(spec.name);
      REQUIRE(got.size() == want.size());
      for (std::size_t k = 0; k < got.size(); ++k) worst = std::max(worst, double(std::fabs(got[k] - want[k])));
    }
  // The norms' float sums differ in rounding only; a miscounted norm would change the clipping scale
  // by percents (the replicated parameters hold 7% of the gradient's elements), and the weights far
  // more than this.
  CHECK(worst < 1e-6);
}
