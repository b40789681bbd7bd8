#include "kiln/model/hf.hpp"

#include <filesystem>

#include "kiln/core/error.hpp"
#include "kiln/engine/config/pipeline.hpp"

namespace kiln::model {

namespace fs = std::filesystem;

interop::Gpt2Shape gpt2_shape(const ModelConfig& cfg) {
  KILN_CHECK(cfg.arch == Arch::gpt2, "Hugging Face GPT-2 weights are for model.arch = \"gpt2\"; this model is a llama");
  KILN_CHECK(!cfg.moe.enabled(), "Hugging Face GPT-2 weights have dense MLPs; this model has a mixture of experts");
  return {.n_layer = cfg.n_layer,
          .n_head = cfg.n_head,
          .n_embd = cfg.n_embd,
          .vocab_size = cfg.vocab_size,
          .padded_vocab = cfg.padded_vocab(),
          .max_seq_len = cfg.max_seq_len,
          .norm_eps = cfg.norm_eps,
          .init_std = cfg.init_std,
          .dropout = cfg.dropout};
}

ModelConfig with_gpt2_shape(ModelConfig base, const interop::Gpt2Shape& shape) {
  base.arch = Arch::gpt2;
  base.n_layer = shape.n_layer;
  base.n_head = shape.n_head;
  base.n_embd = shape.n_embd;
  base.vocab_size = shape.vocab_size;
  base.max_seq_len = shape.max_seq_len;
  base.norm_eps = shape.norm_eps;
  return base;
}

interop::LlamaShape llama_shape(const ModelConfig& cfg) {
  KILN_CHECK(cfg.arch == Arch::llama, "Hugging Face Llama weights are for model.arch = \"llama\"; this model is a gpt2");
  KILN_CHECK(!cfg.moe.enabled(), "Hugging Face Llama weights have dense MLPs; this model has a mixture of experts");
  interop::LlamaShape s;
  s.n_layer = cfg.n_layer;
  s.n_head = cfg.n_head;
  s.n_kv_head = cfg.kv_heads();
  s.n_embd = cfg.n_embd;
  s.ffn_hidden = cfg.mlp_hidden();
  s.vocab_size = cfg.vocab_size;
  s.padded_vocab = cfg.padded_vocab();
  s.max_seq_len = cfg.max_seq_len;
  s.norm_eps = cfg.norm_eps;
  s.rope_theta = cfg.rope_theta;
  s.init_std = cfg.init_std;
  s.tie_embeddings = cfg.tie_embeddings;
  if (cfg.rope_scaling.enabled()) {
    s.rope_factor = cfg.rope_scaling.factor;
    s.rope_low_freq_factor = cfg.rope_scaling.low_freq_factor;
    s.rope_high_freq_factor = cfg.rope_scaling.high_freq_factor;
    s.rope_original_max_seq_len = cfg.rope_scaling.original_max_seq_len;
  }
  return s;
}

ModelConfig with_llama_shape(ModelConfig base, const interop::LlamaShape& s) {
  base.arch = Arch::llama;
  base.n_layer = s.n_layer;
  base.n_head = s.n_head;
  base.n_kv_head = s.n_kv_head;
  base.n_embd = s.n_embd;
  base.ffn_hidden = s.ffn_hidden;
  base.vocab_size = s.vocab_size;
  base.max_seq_len = s.max_seq_len;
  base.norm_eps = s.norm_eps;
  base.rope_theta = s.rope_theta;
  base.tie_embeddings = s.tie_embeddings;
  base.rope_scaling = {};
  if (s.rope_factor > 0) {
    base.rope_scaling.type = RopeScalingType::llama3;
    base.rope_scaling.factor = s.rope_factor;
    base.rope_scaling.low_freq_factor = s.rope_low_freq_factor;
    base.rope_scaling.high_freq_factor = s.rope_high_freq_factor;
    base.rope_scaling.original_max_seq_len = s.rope_original_max_seq_len;
  }
  return base;
}

HfModelPath classify_hf_path(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const std::string config = (fs::path(path) / "config.json").string();
    if (!fs::is_regular_file(config, ec))
      KILN_FILE_ERROR(path, ": no config.json (a Hugging Face model directory holds config.json and its weights)");
    const std::string type = interop::hf_model_type(config);
    if (type == "llama") return {HfModelPath::Kind::llama_dir, path, config};
    if (type == "gpt2") {
      const std::string weights = (fs::path(path) / interop::kHfWeightsFile).string();
      if (!fs::is_regular_file(weights, ec)) KILN_FILE_ERROR(path, ": no ", interop::kHfWeightsFile, " for its GPT-2");
      return {HfModelPath::Kind::gpt2_dir, weights, config};
    }
    KILN_FILE_ERROR(config, ": key 'model_type' is \"", type,
                    "\"; kiln starts from Hugging Face \"llama\" and \"gpt2\" models");
  }
  if (fs::is_regular_file(path, ec)) {
    if (!path.ends_with(".safetensors"))
      KILN_FILE_ERROR(path, ": not a .safetensors file or a Hugging Face model directory");
    const std::string config = (fs::path(path).parent_path() / "config.json").string();
    return {HfModelPath::Kind::gpt2_file, path, fs::is_regular_file(config, ec) ? config : ""};
  }
  KILN_FILE_ERROR(path, ": no such file or directory (a Hugging Face model directory or a GPT-2 .safetensors)");
}

ModelConfig config_from_hf_dir(ModelConfig base, const HfModelPath& path) {
  KILN_CHECK(!path.config_json.empty(), path.weights, ": no config.json to take the model's shape from");
  if (path.kind == HfModelPath::Kind::llama_dir) {
    auto shape = interop::read_hf_llama_config(path.config_json);
    return with_llama_shape(base, shape);
  }
  return with_gpt2_shape(base, interop::read_hf_gpt2_config(path.config_json));
}

namespace {

// The architecture keys a Hugging Face config.json decides, with the field each comes from.
struct ShapeKey {
  const char* key;
  const char* hf_field;
  bool (*same)(const ModelConfig&, const ModelConfig&);
};

template <auto Member>
bool same_member(const ModelConfig& a, const ModelConfig& b) {
  return a.*Member == b.*Member;
}

constexpr ShapeKey kLlamaKeys[] = {
    {"arch", "model_type", same_member<&ModelConfig::arch>},
    {"n_layer", "num_hidden_layers", same_member<&ModelConfig::n_layer>},
    {"n_head", "num_attention_heads", same_member<&ModelConfig::n_head>},
    {"n_kv_head", "num_key_value_heads", [](const ModelConfig& a, const ModelConfig& b) { return a.kv_heads() == b.kv_heads(); }},
    {"n_embd", "hidden_size", same_member<&ModelConfig::n_embd>},
    {"ffn_hidden", "intermediate_size", [](const ModelConfig& a, const ModelConfig& b) { return a.mlp_hidden() == b.mlp_hidden(); }},
    {"vocab_size", "vocab_size", same_member<&ModelConfig::vocab_size>},
    {"max_seq_len", "max_position_embeddings", same_member<&ModelConfig::max_seq_len>},
    {"norm_eps", "rms_norm_eps", same_member<&ModelConfig::norm_eps>},
    {"rope_theta", "rope_theta", same_member<&ModelConfig::rope_theta>},
    {"tie_embeddings", "tie_word_embeddings", same_member<&ModelConfig::tie_embeddings>},
    {"rope_scaling", "rope_scaling",
     [](const ModelConfig& a, const ModelConfig& b) {
       const auto &x = a.rope_scaling, &y = b.rope_scaling;
       return x.type == y.type && (!x.enabled() || (x.factor == y.factor && x.low_freq_factor == y.low_freq_factor &&
                                                    x.high_freq_factor == y.high_freq_factor &&
                                                    x.original_max_seq_len == y.original_max_seq_len));
     }},
};
constexpr ShapeKey kGpt2Keys[] = {
    {"arch", "model_type", same_member<&ModelConfig::arch>},
    {"n_layer", "n_layer", same_member<&ModelConfig::n_layer>},
    {"n_head", "n_head", same_member<&ModelConfig::n_head>},
    {"n_embd", "n_embd", same_member<&ModelConfig::n_embd>},
    {"vocab_size", "vocab_size", same_member<&ModelConfig::vocab_size>},
    {"max_seq_len", "n_positions", same_member<&ModelConfig::max_seq_len>},
    {"norm_eps", "layer_norm_epsilon", same_member<&ModelConfig::norm_eps>},
};

}  // namespace

void complete_from_hf(ModelConfig& cfg, const config::Node& doc, const std::string& file, config::Errors& errors) {
  if (cfg.init_from.empty()) return;
  std::error_code ec;
  if (!fs::is_directory(cfg.init_from, ec)) return;  // a GPT-2 file: the pipeline gives the shape
  const config::Node* section = doc.find("model");
  ModelConfig from;
  HfModelPath path;
  try {
    path = classify_hf_path(cfg.init_from);
    from = config_from_hf_dir(cfg, path);
  } catch (const Error& e) {
    errors.add(config::source_of(doc, file, "model.init_from"), e.what());
    return;
  }
  const std::span<const ShapeKey> keys =
      path.kind == HfModelPath::Kind::llama_dir ? std::span<const ShapeKey>(kLlamaKeys) : std::span<const ShapeKey>(kGpt2Keys);
  for (const ShapeKey& k : keys) {
    if (!section || !section->find(k.key) || k.same(cfg, from)) continue;
    errors.add(config::source_of(doc, file, cat("model.", k.key)),
               cat("model.", k.key, " differs from '", k.hf_field, "' in ", path.config_json,
                   " (model.init_from): the model's shape comes from there; remove the key from the pipeline"));
  }
  cfg = from;
}

}  // namespace kiln::model
