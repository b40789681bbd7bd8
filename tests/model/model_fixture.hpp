#pragma once
// Builds a World from pipeline text and --set overrides with kiln's modules, as the runner does.
#include <memory>
#include <string>
#include <vector>

#include "kiln/builtin.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/train/train.hpp"
#include "kiln_test.hpp"

namespace kiln::test {

// The small model the CUDA-vs-CPU training tests run (2 blocks, width 128, T = 96).
inline constexpr const char* kSmallGpuModel = R"(
[train]
steps = 6
seed = 11
batch_size = 4
seq_len = 96
[model]
n_layer = 2
n_head = 4
n_embd = 128
vocab_size = 300
max_seq_len = 96
[optim]
lr = 1e-3
[data]
synthetic_vocab = 300
)";

struct Pipeline {
  ModuleRegistry registry;
  config::PipelineConfig config;
  std::unique_ptr<World> world;

  explicit Pipeline(const std::string& toml, const std::vector<std::string>& sets = {},
                    void (*extra)(ModuleRegistry&) = nullptr) {
    register_builtin_modules(registry);
    if (extra) extra(registry);
    auto doc = config::parse_toml_text(toml, "test.toml");
    config::apply_overrides(doc, sets);
    config = config::resolve(doc, "test.toml", registry);
    world = std::make_unique<World>();
    world->emplace_resource<RankInfo>(RankInfo{0, 1, 0, "test.toml"});
    install_pipeline(*world, config, registry);
  }
  void run() { run_pipeline(*world); }
};

// A small, learnable byte-level corpus ("the cat sat on the mat." ...) tokenized into `dir`;
// returns the glob of its training shards.
inline std::string pattern_corpus(const TempDir& dir) {
  std::string text;
  const char* words[] = {"the cat", "a dog", "the bird", "my fish"};
  const char* verbs[] = {" sat on", " ran to", " looked at", " jumped over"};
  const char* things[] = {" the mat.\n", " a tree.\n", " the house.\n", " my hat.\n"};
  for (int i = 0; i < 4000; ++i) text += std::string(words[i % 4]) + verbs[(i / 4) % 4] + things[(i / 16) % 4];
  auto src = dir.file("corpus.txt", text);
  data::tokenize_files({src}, (dir.path() / "shards").string(), {.val_fraction = 0.1});
  return (dir.path() / "shards/train_*.bin").string();
}

// Trains a 2-layer byte-level GPT on `shards` on the CPU for `steps` steps; returns each step's loss.
inline std::vector<double> train_losses(const std::string& shards, int steps, std::vector<std::string> sets = {}) {
  sets.insert(sets.begin(), {"data.train_files=" + shards, "train.steps=" + std::to_string(steps)});
  Pipeline p(R"(
[engine]
device = "cpu"
[train]
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 256
max_seq_len = 32
[optim]
lr = 3e-3
warmup_steps = 10
[log]
every = 1000
)",
             sets);
  std::vector<double> losses;
  p.world->systems().add({"test.record", Phase::step_end,
                          [&losses](World& world) { losses.push_back(world.resource<train::TrainState>().loss); },
                          {"train.step_end"}});
  p.run();
  return losses;
}

// The flat f32 gradient buffer copied to the host (from whichever backend the World runs on).
inline std::vector<float> grads_of(World& w) {
  auto& be = w.resource<ops::ActiveBackend>().get();
  auto flat = w.resource<nn::ParamStore>().grads_flat();
  std::vector<float> h(static_cast<std::size_t>(flat.numel()));
  be.copy(TensorView(h.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
  return h;
}

}  // namespace kiln::test
