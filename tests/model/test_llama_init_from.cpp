// [model] init_from a Hugging Face Llama directory on CPU-thread ranks: the shape comes from its
// config.json, and every layout (one rank, TP = 2, FSDP = 2, sharded files or one) starts from the
// same weights bit for bit; the run then trains from them.
#include <doctest/doctest.h>

#include <filesystem>

#include "../interop/hf_llama_fixture.hpp"
#include "kiln/interop/hf_llama.hpp"
#include "kiln/model/hf.hpp"
#include "parallel_fixture.hpp"
#include "kiln_test.hpp"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

// The [model] section names only the architecture: config.json gives the rest.
const char* kFromHf = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 0
seed = 5
batch_size = 8
seq_len = 16
[model]
arch = "llama"
[optim]
lr = 2e-3
warmup_steps = 1
[data]
synthetic_vocab = 100
[parallel]
timeout_s = 60
)";

}  // namespace

TEST_CASE("init_from a Hugging Face Llama gives the same weights on one rank, TP = 2 and FSDP = 2") {
  const test::TempDir d("hf-init-1");
  test::HfLlamaFixture f;
  f.rope_scaling = true;
  f.shards = 2;
  f.write(d.path().string());
  const model::ModelConfig cfg = model::config_from_hf_dir({}, model::classify_hf_path(d.path().string()));
  interop::HfLlamaReader reader(model::llama_shape(cfg), d.path().string());
  const test::Sets from = {"model.init_from=\"" + d.path().string() + "\""};
  for (const auto& [nproc, layout] : {std::pair{1, test::Sets{}}, {2, test::Sets{"parallel.tp=2"}},
                                      {2, test::Sets{"fsdp.strategy=\"full_shard\""}}}) {
    CAPTURE(nproc);
    CAPTURE(layout.size() ? layout[0] : "one rank");
    const test::Trace t = test::run_ranks(kFromHf, nproc, test::operator+(from, layout));
    REQUIRE(t.weights.size() == reader.layout().size());
    for (const auto& l : reader.layout()) {
      CAPTURE(l.kiln_name);
      const auto want = reader.read(l.kiln_name);
      const auto& got = t.weights.at(l.kiln_name);
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), want.size() * 4) == 0);
    }
  }
}

TEST_CASE("a run started from a Hugging Face Llama trains, the same on one rank and on TP = 2") {
  const test::TempDir d("hf-init-2");
  test::HfLlamaFixture f;
  f.write(d.path().string());
  const test::Sets sets = {"model.init_from=\"" + d.path().string() + "\"", "train.steps=4"};
  const test::Trace one = test::run_ranks(kFromHf, 1, sets);
  const test::Trace two = test::run_ranks(kFromHf, 2, test::operator+(sets, test::Sets{"parallel.tp=2"}));
  REQUIRE(one.loss.size() == 4);
  // Random weights of std 0.2 over 100 tokens: the loss starts well above ln(100) and falls.
  CHECK(one.loss.back() < one.loss.front());
  for (std::size_t s = 0; s < one.loss.size(); ++s) CHECK(two.loss[s] == doctest::Approx(one.loss[s]).epsilon(1e-5));
}

TEST_CASE("init_from problems are config errors naming the key") {
  const test::TempDir d("hf-init-3");
  std::string failures;
  test::run_ranks(kFromHf, 1, {"model.init_from=\"" + d.path().string() + "/none\""}, nullptr, &failures);
  CHECK(failures.find("model.init_from") != std::string::npos);
  CHECK(failures.find("no such file or directory") != std::string::npos);
  test::HfLlamaFixture f;
  f.write(d.path().string());
  // The pipeline says gpt2 where config.json says llama.
  CHECK_THROWS_WITH(test::run_ranks(kFromHf, 1, {"model.init_from=\"" + d.path().string() + "\"", "model.arch=gpt2"}),
                    doctest::Contains("model.arch differs from 'model_type'"));
}
