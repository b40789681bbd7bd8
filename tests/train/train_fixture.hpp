#pragma once
// Pipelines of the engine, the parallel module and the train module alone.
#include <cctype>
#include <memory>
#include <string>
#include <vector>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::test {

inline ModuleRegistry train_registry() {
  ModuleRegistry reg;
  register_engine_module(reg);
  parallel::register_module(reg);
  train::register_module(reg);
  return reg;
}

inline config::PipelineConfig train_config(const std::string& toml, const std::vector<std::string>& sets = {}) {
  auto doc = config::parse_toml_text(toml, "p.toml");
  config::apply_overrides(doc, sets);
  return config::resolve(doc, "p.toml", train_registry());
}

// A one-rank World with the pipeline installed (nothing run yet).
inline std::unique_ptr<World> train_world(const std::string& toml, const std::vector<std::string>& sets = {}) {
  auto w = std::make_unique<World>();
  install_pipeline(*w, train_config(toml, sets), train_registry());
  return w;
}

// Whether `text` contains the number `n` on its own (not as part of a longer number).
inline bool names_number(const std::string& text, long long n) {
  const std::string s = std::to_string(n);
  for (auto at = text.find(s); at != std::string::npos; at = text.find(s, at + 1)) {
    const bool before = at > 0 && std::isdigit(static_cast<unsigned char>(text[at - 1]));
    const bool after = at + s.size() < text.size() && std::isdigit(static_cast<unsigned char>(text[at + s.size()]));
    if (!before && !after) return true;
  }
  return false;
}

}  // namespace kiln::test
