#include "kiln/interop/hf_llama.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "hf_common.hpp"
#include "kiln/checkpoint/files.hpp"
#include "kiln/core/error.hpp"
#include "kiln/tensor/bf16.hpp"

namespace kiln::interop {

namespace {

using detail::numel;
using detail::shape_str;
using detail::short_double;

std::string config_str(const LlamaShape& c) {
  return cat("num_hidden_layers ", c.n_layer, ", hidden_size ", c.n_embd, ", num_attention_heads ", c.n_head,
             ", num_key_value_heads ", c.n_kv_head, ", intermediate_size ", c.ffn_hidden, ", vocab_size ",
             c.vocab_size);
}

// model.layers.N.self_attn.rotary_emb.inv_freq: a buffer older exports saved, not a parameter.
bool is_rotary_buffer(const std::string& name) {
  return name.starts_with("model.layers.") && name.ends_with(".self_attn.rotary_emb.inv_freq");
}

}  // namespace

std::vector<HfLlamaTensor> hf_llama_layout(const LlamaShape& s) {
  const std::int64_t C = s.n_embd, D = s.head_dim(), H = s.n_head, K = s.n_kv_head, F = s.ffn_hidden;
  const std::int64_t V = s.vocab_size, Vp = s.padded_vocab;
  std::vector<HfLlamaTensor> out;
  auto one = [&](std::string kiln, std::vector<std::int64_t> shape, std::string hf, std::int64_t rows = -1) {
    std::vector<std::int64_t> hf_shape = shape;
    if (rows >= 0) hf_shape[0] = rows;
    out.push_back({std::move(kiln), std::move(shape), {{std::move(hf), std::move(hf_shape), 0}}});
  };
  one("wte", {Vp, C}, "model.embed_tokens.weight", V);
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string k = "blocks." + std::to_string(l) + ".", h = "model.layers." + std::to_string(l) + ".";
    one(k + "norm_1.weight", {C}, h + "input_layernorm.weight");
    out.push_back({k + "attn.qkv.weight",
                   {(H + 2 * K) * D, C},
                   {{h + "self_attn.q_proj.weight", {H * D, C}, 0},
                    {h + "self_attn.k_proj.weight", {K * D, C}, H * D},
                    {h + "self_attn.v_proj.weight", {K * D, C}, (H + K) * D}}});
    one(k + "attn.proj.weight", {C, H * D}, h + "self_attn.o_proj.weight");
    one(k + "norm_2.weight", {C}, h + "post_attention_layernorm.weight");
    out.push_back({k + "mlp.fc.weight",
                   {2 * F, C},
                   {{h + "mlp.gate_proj.weight", {F, C}, 0}, {h + "mlp.up_proj.weight", {F, C}, F}}});
    one(k + "mlp.proj.weight", {C, F}, h + "mlp.down_proj.weight");
  }
  one("norm_f.weight", {C}, "model.norm.weight");
  if (!s.tie_embeddings) one("lm_head.weight", {Vp, C}, "lm_head.weight", V);
  return out;
}

HfLlamaReader::HfLlamaReader(const LlamaShape& shape, const std::string& dir)
    : shape_(shape), layout_(hf_llama_layout(shape)), ckpt_(dir) {
  std::set<std::string> known;
  for (const auto& t : layout_)
    for (const auto& p : t.pieces) {
      known.insert(p.hf_name);
      if (!ckpt_.contains(p.hf_name))
        KILN_FILE_ERROR(dir, ": tensor '", p.hf_name, "' (kiln '", t.kiln_name, "', shape ", shape_str(p.hf_shape),
                        ") is missing from the model's weights");
      const auto& ft = ckpt_.tensor(p.hf_name);
      if (ft.shape != p.hf_shape)
        KILN_FILE_ERROR(ckpt_.path_of(p.hf_name), ": tensor '", p.hf_name, "' has shape ", shape_str(ft.shape),
                        " but config.json (", config_str(shape), ") makes it ", shape_str(p.hf_shape));
    }
  for (const auto& name : ckpt_.names()) {
    if (known.count(name) || is_rotary_buffer(name)) continue;
    if (name == "lm_head.weight" && shape.tie_embeddings) {
      // save_pretrained drops a tied head; a file that kept it must hold the embedding's values.
      const auto& ft = ckpt_.tensor(name);
      const auto& et = ckpt_.tensor("model.embed_tokens.weight");
      const std::int64_t n = et.numel();
      std::vector<float> a(static_cast<std::size_t>(n)), b(a.size());
      if (ft.shape == et.shape) {
        ckpt_.read(name, 0, n, a.data());
        ckpt_.read("model.embed_tokens.weight", 0, n, b.data());
      }
      if (ft.shape != et.shape || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0)
        KILN_FILE_ERROR(ckpt_.path_of(name), ": tensor 'lm_head.weight' differs from model.embed_tokens.weight, but "
                        "config.json ties them (tie_word_embeddings = true)");
      continue;
    }
    KILN_FILE_ERROR(ckpt_.path_of(name), ": tensor '", name, "' (shape ", shape_str(ckpt_.tensor(name).shape),
                    ") is not a parameter of kiln's Llama with ", config_str(shape));
  }
}

const HfLlamaTensor& HfLlamaReader::find(const std::string& kiln_name) const {
  const auto it = std::find_if(layout_.begin(), layout_.end(), [&](const auto& t) { return t.kiln_name == kiln_name; });
  if (it == layout_.end()) KILN_FILE_ERROR(ckpt_.dir(), ": no tensor for kiln's parameter '", kiln_name, "'");
  return *it;
}

void HfLlamaReader::read(const std::string& kiln_name, std::int64_t begin, std::int64_t count, float* out) {
  const HfLlamaTensor& t = find(kiln_name);
  const std::int64_t total = numel(t.kiln_shape);
  KILN_CHECK(begin >= 0 && count >= 0 && begin + count <= total, kiln_name, ": values [", begin, ", ", begin + count,
             ") outside its ", total);
  const std::int64_t row_len = t.kiln_shape.size() > 1 ? total / t.kiln_shape[0] : total;
  std::int64_t at = begin;
  const std::int64_t end = begin + count;
  float* dst = out;
  // Each piece covers flat values [row * row_len, (row + rows) * row_len); what none covers is zero.
  for (const auto& p : t.pieces) {
    const std::int64_t lo = p.row * row_len, hi = lo + numel(p.hf_shape);
    if (at >= end) break;
    if (hi <= at) continue;
    if (lo > at) {  // a gap before this piece
      const std::int64_t n = std::min(lo, end) - at;
      std::fill(dst, dst + n, 0.0f);
      dst += n;
      at += n;
      if (at >= end) break;
    }
    const std::int64_t n = std::min(hi, end) - at;
    ckpt_.read(p.hf_name, at - lo, n, dst);
    dst += n;
    at += n;
  }
  std::fill(dst, dst + (end - at), 0.0f);
}

std::vector<float> HfLlamaReader::read(const std::string& kiln_name) {
  std::vector<float> out(static_cast<std::size_t>(numel(find(kiln_name).kiln_shape)));
  read(kiln_name, 0, static_cast<std::int64_t>(out.size()), out.data());
  return out;
}

namespace {
// A config.json's object; a FileError naming it if it is not one.
nlohmann::json read_config_object(const std::string& config_json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(checkpoint::read_text_file(config_json));
  } catch (const nlohmann::json::exception& e) {
    KILN_FILE_ERROR(config_json, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) KILN_FILE_ERROR(config_json, ": not a JSON object");
  return j;
}
}  // namespace

std::string hf_model_type(const std::string& config_json) {
  const nlohmann::json j = read_config_object(config_json);
  return j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
}

LlamaShape read_hf_llama_config(const std::string& config_json) {
  nlohmann::json j = read_config_object(config_json);
  const auto fail = [&](const std::string& key, auto&&... what) {
    KILN_FILE_ERROR(config_json, ": key '", key, "' ", what...);
  };
  auto positive = [&](const char* key) {
    if (!j.contains(key)) fail(key, "is missing");
    const auto& v = j[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() <= 0 || v.get<std::int64_t>() > INT32_MAX)
      fail(key, "must be a positive integer, got ", v.dump());
    return v.get<int>();
  };
  auto number = [&](const nlohmann::json& obj, const std::string& prefix, const char* key, float fallback) {
    if (!obj.contains(key) || obj[key].is_null()) return fallback;
    if (!obj[key].is_number() || obj[key].get<double>() <= 0) fail(prefix + key, "must be a positive number, got ", obj[key].dump());
    return obj[key].get<float>();
  };
  auto flag = [&](const char* key, bool fallback) {
    if (!j.contains(key) || j[key].is_null()) return fallback;
    if (!j[key].is_boolean()) fail(key, "must be true or false, got ", j[key].dump());
    return j[key].get<bool>();
  };

  const std::string type = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  if (type != "llama")
    fail("model_type", "is ", j.contains("model_type") ? j["model_type"].dump() : "missing",
         "; kiln reads Llama-architecture checkpoints (model_type \"llama\": Llama 2/3.x, SmolLM, TinyLlama)");
  LlamaShape s;
  s.n_layer = positive("num_hidden_layers");
  s.n_head = positive("num_attention_heads");
  s.n_kv_head = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                    ? positive("num_key_value_heads")
                    : s.n_head;
  s.n_embd = positive("hidden_size");
  s.ffn_hidden = positive("intermediate_size");
  s.vocab_size = positive("vocab_size");
  s.padded_vocab = s.vocab_size;
  s.max_seq_len = positive("max_position_embeddings");
  s.norm_eps = number(j, "", "rms_norm_eps", 1e-6f);  // LlamaConfig's default
  // transformers 5 writes rope_parameters {rope_type, rope_theta, factor, ...}; earlier versions
  // (and most released checkpoints) rope_theta and rope_scaling.
  const bool v5 = j.contains("rope_parameters") && !j["rope_parameters"].is_null();
  if (v5 && !j["rope_parameters"].is_object()) fail("rope_parameters", "must be an object, got ", j["rope_parameters"].dump());
  s.rope_theta = v5 ? number(j["rope_parameters"], "rope_parameters.", "rope_theta", 10000.0f)
                    : number(j, "", "rope_theta", 10000.0f);
  s.init_std = number(j, "", "initializer_range", 0.02f);
  s.tie_embeddings = flag("tie_word_embeddings", false);
  if (s.n_embd % s.n_head != 0) fail("hidden_size", "(", s.n_embd, ") is not a multiple of num_attention_heads (", s.n_head, ")");
  if (s.n_head % s.n_kv_head != 0)
    fail("num_key_value_heads", "(", s.n_kv_head, ") does not divide num_attention_heads (", s.n_head, ")");
  if (s.head_dim() % 2 != 0) fail("hidden_size", "/ num_attention_heads = ", s.head_dim(), " is odd; RoPE rotates pairs");
  if (j.contains("head_dim") && !j["head_dim"].is_null() &&
      !(j["head_dim"].is_number_integer() && j["head_dim"].get<std::int64_t>() == s.head_dim()))
    fail("head_dim", "is ", j["head_dim"].dump(), "; kiln's heads are hidden_size / num_attention_heads = ", s.head_dim(),
         " wide");
  if (j.contains("hidden_act") && !(j["hidden_act"].is_string() && j["hidden_act"].get<std::string>() == "silu"))
    fail("hidden_act", "is ", j["hidden_act"].dump(), "; kiln's Llama MLP is SwiGLU (silu)");
  if (flag("attention_bias", false)) fail("attention_bias", "is true; kiln's Llama attention has no biases");
  if (flag("mlp_bias", false)) fail("mlp_bias", "is true; kiln's Llama MLP has no biases");
  const std::string rkey = v5 ? "rope_parameters" : "rope_scaling";
  if (j.contains(rkey) && !j[rkey].is_null()) {
    const auto& r = j[rkey];
    if (!r.is_object()) fail(rkey, "must be null or an object, got ", r.dump());
    const std::string p = rkey + ".";
    // transformers reads "rope_type", older files say "type".
    const auto kind = r.contains("rope_type") ? r["rope_type"] : r.contains("type") ? r["type"] : nlohmann::json();
    const bool plain = v5 && (kind.is_null() || (kind.is_string() && kind.get<std::string>() == "default"));
    if (!plain) {
      if (!kind.is_string() || kind.get<std::string>() != "llama3")
        fail(p + "rope_type", "is ", kind.dump(), "; kiln implements \"llama3\" (Llama 3.1 / 3.2) only");
      s.rope_factor = number(r, p, "factor", 0.0f);
      if (s.rope_factor < 1) fail(p + "factor", "must be at least 1, got ", r.value("factor", nlohmann::json()).dump());
      s.rope_low_freq_factor = number(r, p, "low_freq_factor", 1.0f);
      s.rope_high_freq_factor = number(r, p, "high_freq_factor", 4.0f);
      if (s.rope_high_freq_factor <= s.rope_low_freq_factor) fail(p + "high_freq_factor", "must exceed low_freq_factor");
      if (!r.contains("original_max_position_embeddings")) fail(p + "original_max_position_embeddings", "is missing");
      const auto& o = r["original_max_position_embeddings"];
      if (!o.is_number_integer() || o.get<std::int64_t>() <= 0 || o.get<std::int64_t>() > INT32_MAX)
        fail(p + "original_max_position_embeddings", "must be a positive integer, got ", o.dump());
      s.rope_original_max_seq_len = o.get<int>();
    }
  }
  return s;
}

std::string hf_llama_config_json(const LlamaShape& s, DType dtype, const std::string& extra) {
  KILN_CHECK(dtype == DType::f32 || dtype == DType::bf16, "a Hugging Face export is f32 or bf16, not ", name_of(dtype));
  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["hidden_size"] = s.n_embd;
  j["intermediate_size"] = s.ffn_hidden;
  j["num_hidden_layers"] = s.n_layer;
  j["num_attention_heads"] = s.n_head;
  j["num_key_value_heads"] = s.n_kv_head;
  j["head_dim"] = s.head_dim();
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = s.max_seq_len;
  j["vocab_size"] = s.vocab_size;
  j["rms_norm_eps"] = short_double(s.norm_eps);
  j["rope_theta"] = short_double(s.rope_theta);
  // Both spellings: rope_theta + rope_scaling (transformers 4, and 5 still reads them) and
  // transformers 5's rope_parameters, the same numbers.
  nlohmann::ordered_json params;
  if (s.rope_factor > 0) {
    nlohmann::ordered_json r;
    r["rope_type"] = "llama3";
    r["factor"] = short_double(s.rope_factor);
    r["low_freq_factor"] = short_double(s.rope_low_freq_factor);
    r["high_freq_factor"] = short_double(s.rope_high_freq_factor);
    r["original_max_position_embeddings"] = s.rope_original_max_seq_len;
    j["rope_scaling"] = r;
    params = r;
  } else {
    j["rope_scaling"] = nullptr;
    params["rope_type"] = "default";
  }
  params["rope_theta"] = short_double(s.rope_theta);
  j["rope_parameters"] = params;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["initializer_range"] = short_double(s.init_std);
  j["tie_word_embeddings"] = s.tie_embeddings;
  j["torch_dtype"] = dtype == DType::bf16 ? "bfloat16" : "float32";
  if (!extra.empty()) {
    const auto e = nlohmann::ordered_json::parse(extra);
    KILN_CHECK(e.is_object(), "extra config.json keys must be a JSON object");
    for (const auto& [k, v] : e.items())
      if (!j.contains(k)) j[k] = v;
  }
  return j.dump(2) + "\n";
}

std::vector<std::string> export_hf_llama(const LlamaShape& shape,
                                         const std::function<std::vector<float>(const std::string& kiln_name)>& weight,
                                         const std::string& dir, DType dtype, std::uint64_t max_shard_bytes,
                                         const std::string& extra_config) {
  const std::string config = hf_llama_config_json(shape, dtype, extra_config);
  const bool bf = dtype == DType::bf16;
  std::vector<std::vector<float>> f32;
  std::vector<std::vector<std::uint16_t>> b16;
  std::vector<SafetensorsEntry> entries;
  // One buffer per Hugging Face tensor, sliced out of kiln's as each is asked for.
  for (const auto& t : hf_llama_layout(shape)) {
    const std::vector<float> w = weight(t.kiln_name);
    if (static_cast<std::int64_t>(w.size()) != numel(t.kiln_shape))
      KILN_THROW(dir, ": kiln parameter '", t.kiln_name, "' has ", w.size(), " values, its shape ",
                 shape_str(t.kiln_shape), " needs ", numel(t.kiln_shape));
    const std::int64_t row_len = numel(t.kiln_shape) / t.kiln_shape[0];
    for (const auto& p : t.pieces) {
      const float* src = w.data() + p.row * row_len;
      const auto n = static_cast<std::size_t>(numel(p.hf_shape));
      if (bf) {
        auto& v = b16.emplace_back(n);
        for (std::size_t i = 0; i < n; ++i) v[i] = float_to_bf16_bits(src[i]);
        entries.push_back({p.hf_name, "BF16", p.hf_shape, v.data(), n * 2});
      } else {
        auto& v = f32.emplace_back(src, src + n);
        entries.push_back({p.hf_name, "F32", p.hf_shape, v.data(), n * 4});
      }
    }
  }
  std::filesystem::create_directories(dir);
  auto files = write_hf_weights(dir, entries, max_shard_bytes);
  checkpoint::write_file_atomically((std::filesystem::path(dir) / "config.json").string(), config);
  return files;
}

}  // namespace kiln::interop
