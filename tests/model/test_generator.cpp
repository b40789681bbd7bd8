// model::Generator on the CPU backend: its next-token logits against the training model's losses
// on the same weights (prefilled and decoded positions alike), and the sampling loop.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/model/param_weights.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln_test.hpp"
#include "model_fixture.hpp"

using namespace kiln;

namespace {

// vocab_size 200 pads to 256: the padding rows of wte must not reach the logits.
const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 1
seed = 5
batch_size = 1
seq_len = 64
[model]
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 200
max_seq_len = 64
[optim]
[data]
synthetic_vocab = 200
)";
constexpr int kVocab = 200, kT = 64;

std::vector<int> random_tokens(int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(0, kVocab - 1);
  std::vector<int> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = dist(gen);
  return t;
}

// The tiny training model after setup, its weights made random everywhere (initialisation leaves
// biases at 0 and LayerNorm weights at 1, which would hide a mixed-up bias or norm).
struct TrainedTiny {
  test::Pipeline pipeline;
  World& world = *pipeline.world;
  model::ModelConfig cfg;

  explicit TrainedTiny(const std::vector<std::string>& sets = {}) : pipeline(kTiny, sets) {
    world.systems().run(Phase::setup, world);
    cfg = world.resource<model::ModelConfig>();
    auto& store = world.resource<nn::ParamStore>();
    std::mt19937 gen(99);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (Entity e : store.order()) {
      const auto& p = world.get<nn::Param>(e);
      const bool norm = p.name.find("ln_") != std::string::npos || p.name.find("norm_") != std::string::npos;
      float* v = store.master_view(p).as<float>();
      for (std::int64_t i = 0; i < p.numel; ++i)
        v[i] = norm && p.name.ends_with(".weight") ? 1.0f + 0.2f * normal(gen) : 0.1f * normal(gen);
    }
    auto& be = world.resource<ops::ActiveBackend>().get();
    be.convert(store.compute_flat(), store.master_flat());
  }

  // The training model's loss at position t for target `target` (all other rows ignored), with
  // packed documents' starts when given.
  double loss_at(const std::vector<int>& tokens, int t, int target, const std::vector<std::int32_t>& doc_start = {}) {
    train::Batch batch{1, kT, std::vector<std::int32_t>(tokens.begin(), tokens.end()),
                       std::vector<std::int32_t>(kT, -1), 0};
    batch.targets[static_cast<std::size_t>(t)] = target;
    batch.doc_start = doc_start;
    auto& m = world.resource<model::GptModel>();
    m.forward(batch, 0, false, nullptr);
    return m.mean_loss(1) * kT;  // the mean counts the ignored rows as 0
  }
};

// -log softmax(row)[target], in double.
double loss_of(const float* row, int target) {
  double mx = -INFINITY, sum = 0;
  for (int v = 0; v < kVocab; ++v) mx = std::max(mx, double(row[v]));
  for (int v = 0; v < kVocab; ++v) sum += std::exp(double(row[v]) - mx);
  return mx + std::log(sum) - row[target];
}

int argmax(const float* row) { return static_cast<int>(std::max_element(row, row + kVocab) - row); }

}  // namespace

// Llama: grouped-query attention (2 key/value heads for 4), rotary positions written into the
// cache, SwiGLU, RMSNorm, an untied LM head.
const std::vector<std::string> kLlama = {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=96",
                                         "model.tie_embeddings=false"};

namespace {
void check_generator_matches_training(bool llama, const std::vector<std::string>& more = {}) {
  INFO((llama ? "llama" : "gpt2") << (more.empty() ? "" : " " + more[0]));
  std::vector<std::string> sets = llama ? kLlama : std::vector<std::string>{};
  sets.insert(sets.end(), more.begin(), more.end());
  TrainedTiny tiny(sets);
  auto& be = tiny.world.resource<ops::ActiveBackend>().get();
  model::Generator gen(tiny.cfg, be, model::param_store_weights(tiny.world));
  const auto tokens = random_tokens(kT, 3);

  // Three ways through the sequence: all prefilled, 10 prefilled then decoded, all decoded.
  std::vector<std::vector<float>> runs;
  for (int prefilled : {kT, 10, 1}) {
    auto logits = gen.prefill(std::span(tokens).first(static_cast<std::size_t>(prefilled)), true);
    REQUIRE(logits.size() == static_cast<std::size_t>(prefilled) * kVocab);
    for (int t = prefilled; t < kT; ++t) {
      const auto next = gen.decode(tokens[static_cast<std::size_t>(t)]);
      REQUIRE(next.size() == static_cast<std::size_t>(kVocab));
      logits.insert(logits.end(), next.begin(), next.end());
    }
    CHECK(gen.length() == kT);
    runs.push_back(std::move(logits));
  }
  // Every logit, not only the losses below: decoding reproduces the prefilled logits.
  for (std::size_t r = 1; r < runs.size(); ++r) {
    double worst = 0;
    for (std::size_t i = 0; i < runs[0].size(); ++i) worst = std::max(worst, double(std::fabs(runs[r][i] - runs[0][i])));
    INFO("run " << r << ": largest logit difference " << worst);
    CHECK(worst < 1e-5);
  }
  // The training model's loss of a target at a position is -log softmax(logits)[target].
  std::mt19937 pick(5);
  for (int t = 0; t < kT; ++t) {
    // The sequence's own next token, the generator's most likely one, and a random one.
    const int next = t + 1 < kT ? tokens[static_cast<std::size_t>(t + 1)] : 7;
    const int likely = argmax(runs[0].data() + static_cast<std::size_t>(t) * kVocab);
    for (int target : {next, likely, static_cast<int>(pick() % kVocab)}) {
      const double expected = tiny.loss_at(tokens, t, target);
      for (std::size_t r = 0; r < runs.size(); ++r) {
        INFO("position " << t << " target " << target << " run " << r);
        CHECK(loss_of(runs[r].data() + static_cast<std::size_t>(t) * kVocab, target) ==
              doctest::Approx(expected).epsilon(2e-6));
      }
    }
  }
}
}  // namespace

TEST_CASE("generator logits at every position equal the training model's, prefilled or decoded") {
  check_generator_matches_training(false);
  check_generator_matches_training(true);
  // Llama 3.1's scaled rotary frequencies, in the cache as in training.
  check_generator_matches_training(true, {"model.rope_scaling.type=llama3", "model.rope_scaling.original_max_seq_len=16"});
}

// kiln eval's packed documents: a prefill given document starts attends within each document, as
// the training model does with the same starts, and no document's logits depend on another's tokens.
TEST_CASE("a prefill with document starts equals the training model's and ignores other documents") {
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    TrainedTiny tiny(llama ? kLlama : std::vector<std::string>{});
    model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
    // Documents starting at 0, 1, 17 and 40 (a one-token one among them).
    std::vector<std::int32_t> starts(kT);
    for (int t = 0; t < kT; ++t) starts[static_cast<std::size_t>(t)] = t >= 40 ? 40 : t >= 17 ? 17 : t >= 1 ? 1 : 0;
    auto tokens = random_tokens(kT, 21);
    const auto docs = gen.prefill(tokens, true, starts);
    const auto across = gen.prefill(tokens, true);
    // Other documents rewritten: the third document's logits stay bit-identical.
    auto other = tokens;
    for (int t = 0; t < kT; ++t)
      if (t < 17 || t >= 40) other[static_cast<std::size_t>(t)] = (other[static_cast<std::size_t>(t)] + 7) % kVocab;
    const auto rewritten = gen.prefill(other, true, starts);
    const std::size_t first = 17 * kVocab, last = 40 * kVocab;
    CHECK(std::equal(docs.begin() + first, docs.begin() + last, rewritten.begin() + first));
    CHECK(!std::equal(docs.begin() + first, docs.begin() + last, across.begin() + first));
    CHECK(std::equal(docs.begin(), docs.begin() + kVocab, across.begin()));  // the first document's one token
    for (int t : {0, 5, 16, 17, 30, 40, 63}) {
      const int target = tokens[static_cast<std::size_t>((t + 1) % kT)];
      INFO("position " << t);
      CHECK(loss_of(docs.data() + static_cast<std::size_t>(t) * kVocab, target) ==
            doctest::Approx(tiny.loss_at(tokens, t, target, starts)).epsilon(2e-6));
    }
    CHECK_THROWS_WITH_AS(gen.prefill(tokens, true, std::vector<std::int32_t>(kT, 2)),
                         doctest::Contains("document start 2 of position 0"), Error);
  }
}

TEST_CASE("greedy generation is deterministic and follows the most likely token") {
  TrainedTiny tiny;
  model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
  const auto prompt = random_tokens(5, 11);
  const model::SamplingOptions greedy{.temperature = 0};
  const auto a = gen.generate(prompt, 20, greedy), b = gen.generate(prompt, 20, greedy);
  REQUIRE(a.size() == 20);
  CHECK(a == b);
  // The same chain by hand: each token is the argmax of the logits after the one before.
  auto logits = gen.prefill(prompt);
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("token " << i);
    CHECK(a[i] == argmax(logits.data()));
    logits = gen.decode(a[i]);
  }
}

TEST_CASE("sampling with the same seed repeats its tokens, another seed gives others") {
  TrainedTiny tiny;
  model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
  const auto prompt = random_tokens(4, 12);
  auto run = [&](std::uint64_t seed, int top_k) {
    return gen.generate(prompt, 30, {.temperature = 1.0f, .top_k = top_k, .seed = seed});
  };
  CHECK(run(1, 0) == run(1, 0));
  CHECK(run(1, 0) != run(2, 0));
  CHECK(run(4, 20) == run(4, 20));
  CHECK(run(4, 20) != run(5, 20));
}

TEST_CASE("top-k = 1 samples the greedy tokens") {
  TrainedTiny tiny;
  model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
  const auto prompt = random_tokens(6, 13);
  CHECK(gen.generate(prompt, 25, {.temperature = 1.5f, .top_k = 1, .seed = 9}) ==
        gen.generate(prompt, 25, {.temperature = 0}));
}

TEST_CASE("generation stops after a stop token, which it returns last") {
  TrainedTiny tiny;
  model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
  const auto prompt = random_tokens(5, 16);
  const auto free = gen.generate(prompt, 20, {.temperature = 0});
  REQUIRE(free.size() == 20);
  // Stop at the first occurrence of the fourth token: the run is the free run's prefix up to it.
  const int stop = free[3];
  const auto first = static_cast<std::size_t>(std::find(free.begin(), free.end(), stop) - free.begin());
  const auto stopped = gen.generate(prompt, 20, {.temperature = 0, .stop = {stop}});
  CHECK(stopped == std::vector<int>(free.begin(), free.begin() + static_cast<std::ptrdiff_t>(first) + 1));
  CHECK(gen.generate(prompt, 20, {.temperature = 0, .stop = {-1}}) == free);  // a token never drawn
}

TEST_CASE("generation stops when the sequence fills max_seq_len") {
  TrainedTiny tiny;
  model::Generator gen(tiny.cfg, tiny.world.resource<ops::ActiveBackend>().get(), model::param_store_weights(tiny.world));
  CHECK(gen.generate(random_tokens(60, 14), 10, {.seed = 1}).size() == 4);
  CHECK(gen.generate(random_tokens(kT, 15), 10, {.seed = 1}).empty());
  CHECK_THROWS_WITH_AS(gen.generate(random_tokens(kT + 1, 16), 1, {}), doctest::Contains("exceeds the context of 64"),
                       Error);
  gen.prefill(random_tokens(kT, 17));
  CHECK_THROWS_WITH_AS(gen.decode(3), doctest::Contains("beyond the context of 64 positions"), Error);
}

TEST_CASE("the generator rejects tokens outside the vocabulary and weights of the wrong size") {
  TrainedTiny tiny;
  auto& be = tiny.world.resource<ops::ActiveBackend>().get();
  model::Generator gen(tiny.cfg, be, model::param_store_weights(tiny.world));
  CHECK_THROWS_WITH_AS(gen.prefill(std::vector<int>{1, kVocab}), doctest::Contains("token 200 at 1"), Error);
  auto short_wpe = [&](const std::string& name) {
    auto w = model::param_store_weights(tiny.world)(name);
    if (name == "wpe") w.pop_back();
    return w;
  };
  CHECK_THROWS_WITH_AS(model::Generator(tiny.cfg, be, short_wpe), doctest::Contains("weight 'wpe' has 4095 values"),
                       Error);
}

TEST_CASE("sample_token draws from the softmax at the temperature, among the top k") {
  const std::vector<float> logits = {0.0f, std::log(3.0f), -1.0f, 2.0f};
  // Top 2 (tokens 3 and 1) at temperature 1: p(1) = 3 / (3 + e^2).
  int counts[4] = {};
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++counts[model::sample_token(logits, {.temperature = 1, .top_k = 2, .seed = 3}, i)];
  CHECK(counts[0] == 0);
  CHECK(counts[2] == 0);
  CHECK(double(counts[1]) / n == doctest::Approx(3.0 / (3.0 + std::exp(2.0))).epsilon(0.05));
  // A low temperature concentrates on the most likely token; greedy ignores the seed.
  int top = 0;
  for (int i = 0; i < 1000; ++i) top += model::sample_token(logits, {.temperature = 0.05f, .seed = 8}, i) == 3;
  CHECK(top == 1000);
  CHECK(model::sample_token(logits, {.temperature = 0, .seed = 1}, 0) == 3);
  CHECK_THROWS_WITH_AS(model::sample_token(logits, {.temperature = -1}, 0), doctest::Contains("temperature"), Error);
}
