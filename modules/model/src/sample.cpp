#include "sample.hpp"

#include "kiln/data/tokenizer.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/model/param_weights.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/rng/seed_policy.hpp"

namespace kiln::model {

std::string sample_text(World& w, const ModelConfig& cfg, const train::SampleRequested& e) {
  const auto& par = w.resource<parallel::ParallelState>();
  if (par.tp_size() > 1 || par.pp_size() > 1 || w.resource<nn::ParamStore>().sharded())
    throw config_error(w, "log.sample_every",
                       "samples need the whole model on rank 0: parallel.tp = 1, parallel.pp = 1 and no fsdp sharding "
                       "(sample from a checkpoint with `kiln generate` instead)");
  if (w.resource<RankInfo>().rank != 0) return "";
  auto& be = w.resource<ops::ActiveBackend>().get();
  Generator gen(cfg, be, param_store_weights(w));
  const bool bytes = cfg.vocab_size <= 256;
  std::vector<int> prompt;
  if (bytes)
    for (auto t : data::byte_encode(e.prompt)) prompt.push_back(t);
  if (prompt.empty()) prompt.push_back(cfg.vocab_size > 50256 ? 50256 : 0);
  const int room = cfg.max_seq_len - static_cast<int>(prompt.size());
  SamplingOptions opt;
  opt.seed = rng::mix64(w.resource<train::TrainConfig>().seed ^ static_cast<std::uint64_t>(e.step));
  const std::vector<int> out = gen.generate(prompt, std::max(0, std::min(e.tokens, room)), opt);
  if (bytes) {
    std::vector<std::uint16_t> all(prompt.begin(), prompt.end());
    all.insert(all.end(), out.begin(), out.end());
    std::string text = data::byte_decode(all);
    for (char& c : text)  // a log line: bytes that are not printable ASCII (a model early in training) as '?'
      if (c != '\n' && (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)) c = '?';
    return text;
  }
  std::string text;
  for (int t : out) text += (text.empty() ? "" : " ") + std::to_string(t);
  return text;
}

}  // namespace kiln::model
