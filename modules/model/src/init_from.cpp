#include "init_from.hpp"

#include <cstring>
#include <iostream>
#include <memory>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/hf.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"

namespace kiln::model {

namespace {

// Values [begin, begin + count) of a kiln parameter's flattened global tensor.
using RangeReader = std::function<void(const std::string& name, std::int64_t begin, std::int64_t count, float* out)>;

// GPT-2's weights are small enough to convert whole (its Conv1D weights are transposed).
RangeReader gpt2_reader(const ModelConfig& cfg, const std::string& file) {
  auto weights = std::make_shared<std::map<std::string, std::vector<float>>>(
      interop::import_hf_gpt2(gpt2_shape(cfg), file));
  return [weights, file](const std::string& name, std::int64_t begin, std::int64_t count, float* out) {
    const auto it = weights->find(name);
    if (it == weights->end()) KILN_FILE_ERROR(file, ": no tensor for kiln's parameter '", name, "'");
    std::memcpy(out, it->second.data() + begin, static_cast<std::size_t>(count) * 4);
  };
}

// A Llama's are read piece by piece from the mapped files: a rank reads only what it holds.
RangeReader llama_reader(const ModelConfig& cfg, const std::string& dir) {
  auto reader = std::make_shared<interop::HfLlamaReader>(llama_shape(cfg), dir);
  return [reader](const std::string& name, std::int64_t begin, std::int64_t count, float* out) {
    reader->read(name, begin, count, out);
  };
}

}  // namespace

void load_initial_weights(World& w, const ModelConfig& cfg, const std::string& path) {
  // The model module checked at install that the path holds this architecture's weights.
  const HfModelPath source = classify_hf_path(path);
  const RangeReader read = cfg.llama() ? llama_reader(cfg, source.weights) : gpt2_reader(cfg, source.weights);
  auto& store = w.resource<nn::ParamStore>();
  auto& be = w.resource<ops::ActiveBackend>().get();
  // The held master weights in host memory first (padding zero), then one copy.
  Buffer staging = be.alloc_host(static_cast<std::size_t>(store.held()) * 4);
  std::memset(staging.data(), 0, staging.bytes());
  float* held = static_cast<float*>(staging.data());
  for (Entity e : store.order()) {
    const auto& p = w.get<nn::Param>(e);
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        read(p.name, b.global, b.count, held + part.held + (b.local - part.first));
      });
    });
  }
  be.copy(store.master_flat(), staging.view(DType::f32, {store.held()}));
  for (const auto& [act, master] : store.act_copies()) be.convert(act, master);
  be.synchronize();
  w.events().publish(nn::ParamsLoaded{0});
  if (w.resource<RankInfo>().rank == 0) std::cout << "model: weights from " << path << "\n";
}

}  // namespace kiln::model
