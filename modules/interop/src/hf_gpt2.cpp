#include "kiln/interop/hf_gpt2.hpp"

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "hf_common.hpp"
#include "kiln/checkpoint/files.hpp"
#include "kiln/interop/safetensors.hpp"
#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"

namespace kiln::interop {

namespace {

using detail::numel;
using detail::shape_str;
using detail::short_double;

constexpr std::string_view kPrefix = "transformer.";

std::string config_str(const Gpt2Shape& c) {
  return cat("n_layer ", c.n_layer, ", n_embd ", c.n_embd, ", vocab_size ", c.vocab_size, ", max_seq_len ",
             c.max_seq_len);
}

// The causal-mask buffers older GPT-2 checkpoints carry: h.N.attn.bias and h.N.attn.masked_bias.
bool is_mask_buffer(std::string_view name) {
  if (!name.starts_with("h.")) return false;
  name.remove_prefix(2);
  const auto dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos) return false;
  for (char c : name.substr(0, dot))
    if (c < '0' || c > '9') return false;
  const auto rest = name.substr(dot);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

// dst[o, i] = src[i, o] for src [rows, cols] (either direction of the Conv1D transpose).
void transpose(const float* src, float* dst, std::int64_t rows, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace

std::vector<HfTensor> hf_gpt2_layout(const Gpt2Shape& cfg) {
  const std::int64_t C = cfg.n_embd;
  std::vector<HfTensor> out;
  auto add = [&](const std::string& kiln, std::vector<std::int64_t> shape, const std::string& hf, bool transposed,
                 std::int64_t rows = -1) {
    HfTensor t{kiln, shape, std::string(kPrefix) + hf, shape, transposed, rows < 0 ? shape[0] : rows};
    if (transposed)
      std::swap(t.hf_shape[0], t.hf_shape[1]);
    else
      t.hf_shape[0] = t.rows;
    out.push_back(std::move(t));
  };
  add("wte", {cfg.padded_vocab, C}, "wte.weight", false, cfg.vocab_size);
  add("wpe", {cfg.max_seq_len, C}, "wpe.weight", false);
  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", h = "h." + std::to_string(l) + ".";
    add(k + "ln_1.weight", {C}, h + "ln_1.weight", false);
    add(k + "ln_1.bias", {C}, h + "ln_1.bias", false);
    add(k + "attn.qkv.weight", {3 * C, C}, h + "attn.c_attn.weight", true);
    add(k + "attn.qkv.bias", {3 * C}, h + "attn.c_attn.bias", false);
    add(k + "attn.proj.weight", {C, C}, h + "attn.c_proj.weight", true);
    add(k + "attn.proj.bias", {C}, h + "attn.c_proj.bias", false);
    add(k + "ln_2.weight", {C}, h + "ln_2.weight", false);
    add(k + "ln_2.bias", {C}, h + "ln_2.bias", false);
    add(k + "mlp.fc.weight", {4 * C, C}, h + "mlp.c_fc.weight", true);
    add(k + "mlp.fc.bias", {4 * C}, h + "mlp.c_fc.bias", false);
    add(k + "mlp.proj.weight", {C, 4 * C}, h + "mlp.c_proj.weight", true);
    add(k + "mlp.proj.bias", {C}, h + "mlp.c_proj.bias", false);
  }
  add("ln_f.weight", {C}, "ln_f.weight", false);
  add("ln_f.bias", {C}, "ln_f.bias", false);
  return out;
}

std::string hf_gpt2_config_json(const Gpt2Shape& cfg, DType dtype) {
  KILN_CHECK(dtype == DType::f32 || dtype == DType::bf16, "a Hugging Face export is f32 or bf16, not ", name_of(dtype));
  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::json::array({"GPT2LMHeadModel"});
  j["model_type"] = "gpt2";
  j["vocab_size"] = cfg.vocab_size;
  j["n_positions"] = cfg.max_seq_len;
  j["n_embd"] = cfg.n_embd;
  j["n_layer"] = cfg.n_layer;
  j["n_head"] = cfg.n_head;
  j["n_inner"] = nullptr;                 // 4 n_embd, as kiln's MLP
  j["activation_function"] = "gelu_new";  // the tanh approximation kiln computes
  j["layer_norm_epsilon"] = short_double(cfg.norm_eps);
  j["initializer_range"] = short_double(cfg.init_std);
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) j[key] = short_double(cfg.dropout);
  j["tie_word_embeddings"] = true;
  j["torch_dtype"] = dtype == DType::bf16 ? "bfloat16" : "float32";
  if (cfg.vocab_size > 50256) {  // GPT-2's <|endoftext|>, only where the vocabulary has it
    j["bos_token_id"] = 50256;
    j["eos_token_id"] = 50256;
  }
  return j.dump(2) + "\n";
}

void export_hf_gpt2(const Gpt2Shape& cfg, const std::function<const float*(const std::string& kiln_name)>& weight,
                    const std::string& path, DType dtype) {
  const std::string config = hf_gpt2_config_json(cfg, dtype);
  const auto layout = hf_gpt2_layout(cfg);
  std::vector<std::vector<float>> f32(layout.size());
  std::vector<std::vector<std::uint16_t>> bf16(layout.size());
  std::vector<SafetensorsEntry> entries;
  for (std::size_t k = 0; k < layout.size(); ++k) {
    const auto& t = layout[k];
    const float* w = weight(t.kiln_name);
    if (!w) KILN_THROW(path, ": no weights given for kiln parameter '", t.kiln_name, "'");
    auto& v = f32[k];
    v.resize(static_cast<std::size_t>(numel(t.hf_shape)));
    if (t.transposed)
      transpose(w, v.data(), t.kiln_shape[0], t.kiln_shape[1]);
    else
      std::copy(w, w + v.size(), v.begin());  // wte: its first vocab_size rows
    if (dtype == DType::bf16) {
      bf16[k].resize(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) bf16[k][i] = float_to_bf16_bits(v[i]);
      std::vector<float>().swap(v);
      entries.push_back({t.hf_name, "BF16", t.hf_shape, bf16[k].data(), bf16[k].size() * 2});
    } else {
      entries.push_back({t.hf_name, "F32", t.hf_shape, v.data(), v.size() * 4});
    }
  }
  // transformers refuses a safetensors file whose metadata lacks a known "format".
  write_safetensors(path, entries, {{"format", "pt"}});
  auto dir = std::filesystem::path(path).parent_path();
  checkpoint::write_file_atomically((dir / "config.json").string(), config);
}

std::map<std::string, std::vector<float>> import_hf_gpt2(const Gpt2Shape& cfg, const std::string& path) {
  SafetensorsFile file(path);
  // The Hub's gpt2 file names its tensors without the "transformer." that GPT2LMHeadModel saves.
  std::map<std::string, const SafetensorsTensor*> by_name;
  for (const auto& t : file.tensors()) {
    const std::string key = t.name.starts_with(kPrefix) ? t.name.substr(kPrefix.size()) : t.name;
    if (!by_name.emplace(key, &t).second)
      KILN_FILE_ERROR(path, ": tensor '", t.name, "' is there both with and without the 'transformer.' prefix");
  }

  std::map<std::string, std::vector<float>> out;
  std::set<std::string> used;
  for (const auto& t : hf_gpt2_layout(cfg)) {
    const std::string key = t.hf_name.substr(kPrefix.size());
    const auto it = by_name.find(key);
    if (it == by_name.end())
      KILN_FILE_ERROR(path, ": tensor '", key, "' (kiln '", t.kiln_name, "', shape ", shape_str(t.hf_shape),
                      ") is missing");
    const auto& ft = *it->second;
    if (ft.shape != t.hf_shape)
      KILN_FILE_ERROR(path, ": tensor '", ft.name, "' has shape ", shape_str(ft.shape), " but the kiln config (",
                      config_str(cfg), ") needs ", shape_str(t.hf_shape), " for '", t.kiln_name, "'");
    const auto src = read_f32(file, ft.name);
    auto& dst = out[t.kiln_name];
    dst.assign(static_cast<std::size_t>(numel(t.kiln_shape)), 0.0f);  // wte's padding rows stay zero
    if (t.transposed)
      transpose(src.data(), dst.data(), t.hf_shape[0], t.hf_shape[1]);
    else
      std::copy(src.begin(), src.end(), dst.begin());
    used.insert(key);
  }

  for (const auto& [key, ft] : by_name) {
    if (used.count(key)) continue;
    if (key == "lm_head.weight") {
      const auto lm = read_f32(file, ft->name),
                 wte = read_f32(file, by_name.at("wte.weight")->name);
      if (lm.size() != wte.size() || std::memcmp(lm.data(), wte.data(), lm.size() * sizeof(float)) != 0)
        KILN_FILE_ERROR(path, ": tensor '", ft->name, "' differs from wte, but kiln's LM head is tied to wte");
      continue;
    }
    if (is_mask_buffer(key) && ft->shape.size() != 1) continue;  // a causal mask, not a parameter
    KILN_FILE_ERROR(path, ": tensor '", ft->name, "' (shape ", shape_str(ft->shape),
                    ") is not a parameter of kiln's GPT-2 with ", config_str(cfg));
  }
  return out;
}

Gpt2Shape read_hf_gpt2_config(const std::string& config_json, Gpt2Shape base) {
  const std::string text = checkpoint::read_text_file(config_json);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    KILN_FILE_ERROR(config_json, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) KILN_FILE_ERROR(config_json, ": not a JSON object");
  auto positive = [&](const char* key) {
    if (!j.contains(key)) KILN_FILE_ERROR(config_json, ": missing key '", key, "'");
    const auto& v = j[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0 || v.get<std::int64_t>() > INT32_MAX)
      KILN_FILE_ERROR(config_json, ": key '", key, "' must be a positive integer, got ", v.dump());
    return v.get<int>();
  };
  auto string_of = [&](const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : "";
  };

  if (j.contains("model_type") && string_of("model_type") != "gpt2")
    KILN_FILE_ERROR(config_json, ": key 'model_type' is ", j["model_type"].dump(), ", not \"gpt2\"");
  base.n_layer = positive("n_layer");
  base.n_head = positive("n_head");
  base.n_embd = positive("n_embd");
  base.vocab_size = positive("vocab_size");
  base.max_seq_len = positive("n_positions");
  if (base.n_embd % base.n_head != 0)
    KILN_FILE_ERROR(config_json, ": key 'n_embd' (", base.n_embd, ") is not a multiple of n_head (", base.n_head, ")");
  // Absent means GPT2Config's default, gelu_new; gelu_pytorch_tanh is the same function.
  if (j.contains("activation_function") && string_of("activation_function") != "gelu_new" &&
      string_of("activation_function") != "gelu_pytorch_tanh")
    KILN_FILE_ERROR(config_json, ": key 'activation_function' is ", j["activation_function"].dump(),
                    "; kiln computes the tanh-approximated GELU (gelu_new)");
  if (j.contains("n_inner") && !j["n_inner"].is_null() &&
      !(j["n_inner"].is_number_integer() && j["n_inner"].get<std::int64_t>() == 4 * base.n_embd))
    KILN_FILE_ERROR(config_json, ": key 'n_inner' is ", j["n_inner"].dump(),
                    "; kiln's MLP is 4 n_embd = ", 4 * base.n_embd);
  if (j.contains("layer_norm_epsilon")) {
    if (!j["layer_norm_epsilon"].is_number() || j["layer_norm_epsilon"].get<double>() <= 0)
      KILN_FILE_ERROR(config_json, ": key 'layer_norm_epsilon' must be a positive number, got ",
                      j["layer_norm_epsilon"].dump());
    base.norm_eps = j["layer_norm_epsilon"].get<float>();
  }
  return base;
}

}  // namespace kiln::interop
