#pragma once
// A small Llama written in Hugging Face's layout (LlamaForCausalLM's tensor names and config.json),
// independently of kiln's exporter: random f32 values, tied or untied, one file or shards with the
// index, optionally with Llama 3.1's rope_scaling. For the import, export and init_from tests.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kiln/interop/safetensors.hpp"

namespace kiln::test {

struct HfLlamaFixture {
  int layers = 2, heads = 4, kv_heads = 2, width = 32, ffn = 48, vocab = 100, positions = 64;
  bool tied = false;
  bool rope_scaling = false;
  int shards = 1;  // > 1: model-0000k-of-0000n.safetensors + the index
  std::uint32_t seed = 3;

  // name -> (shape, values), in LlamaForCausalLM's state_dict order.
  std::vector<std::pair<std::string, std::pair<std::vector<std::int64_t>, std::vector<float>>>> tensors() const {
    std::mt19937 gen(seed);
    std::normal_distribution<float> d(0.0f, 0.2f);
    std::vector<std::pair<std::string, std::pair<std::vector<std::int64_t>, std::vector<float>>>> out;
    auto add = [&](const std::string& name, std::vector<std::int64_t> shape) {
      std::int64_t n = 1;
      for (auto x : shape) n *= x;
      std::vector<float> v(static_cast<std::size_t>(n));
      for (auto& x : v) x = d(gen) + (shape.size() == 1 ? 1.0f : 0.0f);  // norms near one
      out.push_back({name, {shape, v}});
    };
    const std::int64_t D = width / heads;
    add("model.embed_tokens.weight", {vocab, width});
    for (int l = 0; l < layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      add(p + "self_attn.q_proj.weight", {heads * D, width});
      add(p + "self_attn.k_proj.weight", {kv_heads * D, width});
      add(p + "self_attn.v_proj.weight", {kv_heads * D, width});
      add(p + "self_attn.o_proj.weight", {width, heads * D});
      add(p + "mlp.gate_proj.weight", {ffn, width});
      add(p + "mlp.up_proj.weight", {ffn, width});
      add(p + "mlp.down_proj.weight", {width, ffn});
      add(p + "input_layernorm.weight", {width});
      add(p + "post_attention_layernorm.weight", {width});
    }
    add("model.norm.weight", {width});
    if (!tied) add("lm_head.weight", {vocab, width});
    return out;
  }

  nlohmann::json config() const {
    nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                        {"model_type", "llama"},
                        {"hidden_size", width},
                        {"intermediate_size", ffn},
                        {"num_hidden_layers", layers},
                        {"num_attention_heads", heads},
                        {"num_key_value_heads", kv_heads},
                        {"hidden_act", "silu"},
                        {"max_position_embeddings", positions},
                        {"vocab_size", vocab},
                        {"rms_norm_eps", 1e-5},
                        {"rope_theta", 10000.0},
                        {"tie_word_embeddings", tied},
                        {"attention_bias", false},
                        {"bos_token_id", 1},
                        {"eos_token_id", 2},
                        {"torch_dtype", "float32"}};
    if (rope_scaling)
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", 8.0},
                           {"low_freq_factor", 1.0},
                           {"high_freq_factor", 4.0},
                           {"original_max_position_embeddings", 16}};
    return j;
  }

  // Writes config.json and the weights into `dir` (created).
  void write(const std::string& dir) const {
    namespace fs = std::filesystem;
    fs::create_directories(dir);
    std::ofstream(fs::path(dir) / "config.json") << config().dump(2);
    const auto all = tensors();
    std::vector<std::vector<interop::SafetensorsEntry>> files(static_cast<std::size_t>(shards));
    for (std::size_t i = 0; i < all.size(); ++i) {
      const auto& [name, t] = all[i];
      files[i * files.size() / all.size()].push_back({name, "F32", t.first, t.second.data(), t.second.size() * 4});
    }
    if (shards == 1) {
      interop::write_safetensors((fs::path(dir) / "model.safetensors").string(), files[0], {{"format", "pt"}});
      return;
    }
    nlohmann::json map = nlohmann::json::object();
    for (std::size_t k = 0; k < files.size(); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, files.size());
      interop::write_safetensors((fs::path(dir) / name).string(), files[k], {{"format", "pt"}});
      for (const auto& e : files[k]) map[e.name] = name;
    }
    std::ofstream(fs::path(dir) / "model.safetensors.index.json")
        << nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump(2);
  }
};

}  // namespace kiln::test
