// Loss masks (supervised fine-tuning trains on some targets only): shards with masks beside them
// give targets of -1 where masked; the loss is the mean over the global batch's trained targets, so
// it equals a hand computation and does not depend on how the batch is split (DP, TP,
// micro-batches); bad masks are errors naming the file.
#include <doctest/doctest.h>

#include <filesystem>
#include <random>

#include "kiln/data/loader.hpp"
#include "kiln/data/shard.hpp"
#include "parallel_fixture.hpp"
#include "kiln_test.hpp"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 3
seed = 9
batch_size = 8
seq_len = 16
[model]
n_layer = 2
n_head = 4
n_embd = 32
vocab_size = 64
max_seq_len = 16
[optim]
lr = 1e-2
warmup_steps = 1
[data]
shuffle = false
[parallel]
timeout_s = 60
)";

constexpr int T = 16, kWindows = 8;

// Windows of T + 1 tokens that overlap by one (window w is tokens [w T, w T + T]).
std::vector<std::uint16_t> random_tokens(std::uint32_t seed, std::size_t n) {
  std::mt19937 g(seed);
  std::vector<std::uint16_t> t(n);
  for (auto& x : t) x = static_cast<std::uint16_t>(g() % 64);
  return t;
}

test::Sets data_from(const std::string& dir) { return {"data.train_files=\"" + dir + "/train_*.bin\""}; }

}  // namespace

TEST_CASE("a window's targets are -1 where the mask does not train on them") {
  const test::TempDir d("loss-mask-1");
  const auto tokens = random_tokens(1, kWindows * T + 1);
  std::vector<std::uint8_t> flags(tokens.size());
  for (std::size_t i = 0; i < flags.size(); ++i) flags[i] = (i % 3 == 0 ? data::kTrained : 0) | (i == 0 ? data::kDocumentStart : 0);
  data::write_llmc_shard(d.path().string() + "/train_000000.bin", tokens);
  data::write_token_mask(d.path().string() + "/train_000000.mask", flags);
  std::vector<data::TokenShard> shards;
  shards.emplace_back(d.path().string() + "/train_000000.bin", data::ShardFormat::auto_);
  data::WindowIndex index(std::move(shards), T);
  CHECK(index.masked());
  std::vector<std::int32_t> in(T), tg(T);
  index.read(2, in.data(), tg.data());
  int trained = 0;
  for (int t = 0; t < T; ++t) {
    const std::size_t at = 2 * T + t + 1;
    CHECK(tg[t] == (at % 3 == 0 ? static_cast<std::int32_t>(tokens[at]) : -1));
    CHECK(in[t] == tokens[at - 1]);
    trained += at % 3 == 0;
  }
  CHECK(index.trained_targets(2) == trained);
}

TEST_CASE("bad masks are errors naming the file") {
  const test::TempDir d("loss-mask-2");
  const auto tokens = random_tokens(2, 40);
  data::write_llmc_shard(d.path().string() + "/train_000000.bin", tokens);
  data::write_llmc_shard(d.path().string() + "/train_000001.bin", tokens);
  data::write_token_mask(d.path().string() + "/train_000000.mask", std::vector<std::uint8_t>(39, 1));
  CHECK_THROWS_WITH(data::TokenMask(d.path().string() + "/train_000000.mask", 40),
                    doctest::Contains("train_000000.mask: holds 39 flags but its shard has 40 tokens"));
  data::write_token_mask(d.path().string() + "/train_000000.mask", std::vector<std::uint8_t>(40, 1));
  std::vector<data::TokenShard> shards;
  shards.emplace_back(d.path().string() + "/train_000000.bin", data::ShardFormat::auto_);
  shards.emplace_back(d.path().string() + "/train_000001.bin", data::ShardFormat::auto_);
  CHECK_THROWS_WITH(data::WindowIndex(std::move(shards), T), doctest::Contains("train_000001.bin: has no loss mask"));
  data::write_llmc_shard(d.path().string() + "/x.mask", tokens);  // a token shard where a mask should be
  CHECK_THROWS_WITH(data::TokenMask(d.path().string() + "/x.mask", 40), doctest::Contains("not a kiln loss mask"));
}

TEST_CASE("the masked loss is the mean over the trained targets: one sequence trained equals a batch of it") {
  // Window 3 is trained on; the other seven are masked out. The reference: eight copies of window 3,
  // all trained on. The first step's loss and gradients (before any update) must agree.
  const test::TempDir masked("loss-mask-3");
  const test::TempDir copies("loss-mask-4");
  const auto tokens = random_tokens(3, kWindows * T + 1);
  std::vector<std::uint8_t> flags(tokens.size(), 0);
  for (int t = 1; t <= T; ++t) flags[3 * T + t] = data::kTrained;
  data::write_llmc_shard(masked.path().string() + "/train_000000.bin", tokens);
  data::write_token_mask(masked.path().string() + "/train_000000.mask", flags);
  // Eight shards of window 3's T + 1 tokens: one window each.
  std::vector<std::uint16_t> repeated;
  for (int w = 0; w < kWindows; ++w) {
    repeated.insert(repeated.end(), tokens.begin() + 3 * T, tokens.begin() + 4 * T + 1);
    data::write_llmc_shard(copies.path().string() + "/train_00000" + std::to_string(w) + ".bin", repeated);
    repeated.clear();
  }
  const test::Sets one = {"train.steps=1"};
  const test::Trace a = test::run_ranks(kTiny, 1, test::operator+(data_from(masked.path().string()), one));
  const test::Trace b = test::run_ranks(kTiny, 1, test::operator+(data_from(copies.path().string()), one));
  REQUIRE(a.loss.size() == 1);
  CHECK(a.loss[0] == doctest::Approx(b.loss[0]).epsilon(1e-6));
  for (const auto& [name, g] : b.grads[0]) {
    CAPTURE(name);
    const auto& h = a.grads[0].at(name);
    double worst = 0, scale = 1e-12;
    for (std::size_t i = 0; i < g.size(); ++i) {
      worst = std::max(worst, std::fabs(double(h[i]) - g[i]));
      scale = std::max(scale, std::fabs(double(g[i])));
    }
    CHECK(worst <= 1e-5 * scale);
  }
}

TEST_CASE("the masked loss does not depend on the split: DP = 2, TP = 2, micro-batches") {
  const test::TempDir d("loss-mask-5");
  const auto tokens = random_tokens(4, 2 * kWindows * T + 1);
  std::mt19937 g(5);
  std::vector<std::uint8_t> flags(tokens.size());
  // Each window trains on a different share of its targets (some none, some all).
  for (std::size_t i = 0; i < flags.size(); ++i) {
    const std::size_t w = i / T;
    flags[i] = (g() % 8 < w % 9) ? data::kTrained : 0;
  }
  data::write_llmc_shard(d.path().string() + "/train_000000.bin", tokens);
  data::write_token_mask(d.path().string() + "/train_000000.mask", flags);
  const test::Trace ref = test::run_ranks(kTiny, 1, data_from(d.path().string()));
  REQUIRE(ref.loss.size() == 3);
  for (const auto& [nproc, sets] :
       {std::pair{2, test::Sets{}}, {2, test::Sets{"parallel.tp=2"}}, {1, test::Sets{"train.micro_batch_size=2"}},
        {2, test::Sets{"train.micro_batch_size=1"}}}) {
    CAPTURE(nproc);
    CAPTURE(sets.empty() ? "DP = 2" : sets[0]);
    const test::Trace t = test::run_ranks(kTiny, nproc, test::operator+(data_from(d.path().string()), sets));
    for (std::size_t s = 0; s < ref.loss.size(); ++s) CHECK(t.loss[s] == doctest::Approx(ref.loss[s]).epsilon(1e-5));
  }
}

namespace {

// Shards of kWindows windows of T + 1 tokens, each window two documents: [0, 8) and [8, T] of its
// tokens; only the second's targets inside the window are trained on. `other` rewrites the first
// documents' tokens.
void write_two_documents(const std::string& dir, std::uint32_t other) {
  auto tokens = random_tokens(6, kWindows * T + 1);
  std::vector<std::uint8_t> flags(tokens.size(), 0);
  for (int w = 0; w < kWindows; ++w) {
    flags[w * T] |= data::kDocumentStart;
    flags[w * T + 8] |= data::kDocumentStart;
    for (int t = 9; t < T; ++t) flags[w * T + t] |= data::kTrained;
  }
  std::mt19937 g(other);
  if (other != 0)
    for (int w = 0; w < kWindows; ++w)
      for (int t = 0; t < 8; ++t) tokens[w * T + t] = static_cast<std::uint16_t>(g() % 64);
  data::write_llmc_shard(dir + "/train_000000.bin", tokens);
  data::write_token_mask(dir + "/train_000000.mask", flags);
}

}  // namespace

TEST_CASE("a window's document starts: the nearest start at or before each input, 0 inside a document") {
  const test::TempDir d("doc-starts");
  const auto tokens = random_tokens(7, 2 * T + 1);
  std::vector<std::uint8_t> flags(tokens.size(), 0);
  flags[3] = flags[10] = flags[T + 5] = data::kDocumentStart;
  data::write_llmc_shard(d.path().string() + "/train_000000.bin", tokens);
  data::write_token_mask(d.path().string() + "/train_000000.mask", flags);
  std::vector<data::TokenShard> shards;
  shards.emplace_back(d.path().string() + "/train_000000.bin", data::ShardFormat::auto_);
  data::WindowIndex index(std::move(shards), T);
  std::vector<std::int32_t> in(T), tg(T), starts(T);
  index.read(0, in.data(), tg.data(), 0, starts.data());
  for (int t = 0; t < T; ++t) CHECK(starts[t] == (t < 3 ? 0 : t < 10 ? 3 : 10));
  index.read(1, in.data(), tg.data(), 0, starts.data());  // begins inside the document started at 10
  for (int t = 0; t < T; ++t) CHECK(starts[t] == (t < 5 ? 0 : 5));
}

TEST_CASE("packed documents do not attend across their boundaries: another document's tokens change nothing") {
  // The loss is taken on the second documents only. Rewriting the first documents' tokens must
  // leave every loss and gradient as it was (a token's loss has zero gradient with respect to
  // other documents' tokens), unless attention may cross the boundary.
  const test::TempDir a("docs-a"), b("docs-b");
  write_two_documents(a.path().string(), 0);
  write_two_documents(b.path().string(), 11);
  const test::Trace ta = test::run_ranks(kTiny, 1, data_from(a.path().string()));
  const test::Trace tb = test::run_ranks(kTiny, 1, data_from(b.path().string()));
  REQUIRE(ta.loss.size() == 3);
  CHECK(ta.loss == tb.loss);
  for (std::size_t s = 0; s < ta.grads.size(); ++s)
    for (const auto& [name, g] : ta.grads[s]) {
      CAPTURE(name);
      CHECK(g == tb.grads[s].at(name));
    }
  const test::Sets across = {"data.attend_within_documents=false"};
  const test::Trace xa = test::run_ranks(kTiny, 1, test::operator+(data_from(a.path().string()), across));
  const test::Trace xb = test::run_ranks(kTiny, 1, test::operator+(data_from(b.path().string()), across));
  CHECK(xa.loss[0] != xb.loss[0]);
  CHECK(xa.loss[0] != ta.loss[0]);
  // The same under DP = 2, TP = 2 (with sequence parallelism) and micro-batches.
  for (const auto& [nproc, sets] :
       {std::pair{2, test::Sets{}}, {2, test::Sets{"parallel.tp=2", "parallel.sequence_parallel=true"}},
        {1, test::Sets{"train.micro_batch_size=2"}}}) {
    CAPTURE(nproc);
    const test::Trace t = test::run_ranks(kTiny, nproc, test::operator+(data_from(a.path().string()), sets));
    for (std::size_t s = 0; s < ta.loss.size(); ++s) CHECK(t.loss[s] == doctest::Approx(ta.loss[s]).epsilon(1e-5));
  }
}
