// The Hugging Face GPT-2 mapping: export -> import round trips (f32 bit for bit, bf16 rounded), the
// transposed Conv1D weights and the sliced vocabulary on disk, the Hub's unprefixed names and mask
// buffers, config.json, and the errors for files that do not fit the config.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#include "kiln/interop/safetensors.hpp"
#include "kiln/core/error.hpp"
#include "kiln/model/hf.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using model::ModelConfig;
using Weights = std::map<std::string, std::vector<float>>;

namespace {

ModelConfig tiny() {
  ModelConfig c;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 300;  // padded to 384
  c.max_seq_len = 32;
  return c;
}

std::int64_t numel(const std::vector<std::int64_t>& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

Weights random_weights(const ModelConfig& cfg) {
  std::mt19937 gen(7);
  std::normal_distribution<float> d(0.0f, 0.1f);
  Weights w;
  for (const auto& t : interop::hf_gpt2_layout(model::gpt2_shape(cfg))) {
    auto& v = w[t.kiln_name];
    v.resize(static_cast<std::size_t>(numel(t.kiln_shape)));
    for (auto& x : v) x = d(gen);
  }
  return w;
}

void export_to(const std::string& path, const ModelConfig& cfg, const Weights& w, DType dtype = DType::f32) {
  interop::export_hf_gpt2(
      model::gpt2_shape(cfg), [&](const std::string& name) { return w.at(name).data(); }, path, dtype);
}

// Rewrites `from` into `to` with each tensor renamed by `rename` ("" drops it), plus `extra`.
void rewrite(const std::string& from, const std::string& to,
             const std::function<std::string(const std::string&)>& rename,
             std::vector<interop::SafetensorsEntry> extra = {}) {
  interop::SafetensorsFile f(from);
  for (const auto& t : f.tensors()) {
    const std::string name = rename(t.name);
    if (name.empty()) continue;
    const auto b = f.bytes(t.name);
    extra.push_back({name, t.dtype, t.shape, b.data(), b.size()});
  }
  interop::write_safetensors(to, extra, f.metadata());
}

std::string strip_prefix(const std::string& name) { return name.starts_with("transformer.") ? name.substr(12) : name; }

std::string import_error(const ModelConfig& cfg, const std::string& path) {
  try {
    interop::import_hf_gpt2(model::gpt2_shape(cfg), path);
  } catch (const FileError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("the layout names every kiln parameter as GPT2LMHeadModel does, with its shape and transpose") {
  const auto cfg = tiny();
  const auto layout = interop::hf_gpt2_layout(model::gpt2_shape(cfg));
  REQUIRE(layout.size() == 2 + 12 * 2 + 2);
  CHECK(layout[0].kiln_name == "wte");
  CHECK(layout[0].kiln_shape == std::vector<std::int64_t>{384, 64});
  CHECK(layout[0].hf_name == "transformer.wte.weight");
  CHECK(layout[0].hf_shape == std::vector<std::int64_t>{300, 64});
  CHECK(layout[0].rows == 300);
  CHECK(!layout[0].transposed);
  const auto& qkv = layout[2 + 12 + 2];  // blocks.1.attn.qkv.weight
  CHECK(qkv.kiln_name == "blocks.1.attn.qkv.weight");
  CHECK(qkv.hf_name == "transformer.h.1.attn.c_attn.weight");
  CHECK(qkv.kiln_shape == std::vector<std::int64_t>{192, 64});
  CHECK(qkv.hf_shape == std::vector<std::int64_t>{64, 192});
  CHECK(qkv.transposed);
  const auto& fc2 = layout[2 + 10];  // blocks.0.mlp.proj.weight
  CHECK(fc2.hf_name == "transformer.h.0.mlp.c_proj.weight");
  CHECK(fc2.hf_shape == std::vector<std::int64_t>{256, 64});
  CHECK(layout.back().hf_name == "transformer.ln_f.bias");
}

TEST_CASE("an f32 export imports back bit for bit, with wte's padding rows as zeros") {
  test::TempDir dir("hf-f32");
  const auto cfg = tiny();
  const auto w = random_weights(cfg);
  const std::string path = (dir.path() / "model.safetensors").string();
  export_to(path, cfg, w);
  const auto back = interop::import_hf_gpt2(model::gpt2_shape(cfg), path);
  REQUIRE(back.size() == w.size());
  for (const auto& [name, v] : w) {
    const auto& b = back.at(name);
    REQUIRE(b.size() == v.size());
    if (name == "wte") {
      const std::size_t kept = 300 * 64;
      CHECK(std::memcmp(b.data(), v.data(), kept * 4) == 0);
      CHECK(std::all_of(b.begin() + kept, b.end(), [](float x) { return x == 0.0f; }));
    } else {
      INFO(name);
      CHECK(std::memcmp(b.data(), v.data(), v.size() * 4) == 0);
    }
  }
}

TEST_CASE("the export stores Conv1D weights transposed, wte's vocab_size rows and no lm_head") {
  test::TempDir dir("hf-layout");
  const auto cfg = tiny();
  const auto w = random_weights(cfg);
  const std::string path = (dir.path() / "model.safetensors").string();
  export_to(path, cfg, w);
  interop::SafetensorsFile f(path);
  CHECK(f.tensors().size() == 28);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.find("lm_head.weight") == nullptr);
  for (const auto& t : f.tensors()) {
    CHECK(t.name.starts_with("transformer."));
    CHECK(t.dtype == "F32");
  }
  const auto* c_attn = f.find("transformer.h.1.attn.c_attn.weight");
  REQUIRE(c_attn);
  CHECK(c_attn->shape == std::vector<std::int64_t>{64, 192});
  const auto hf = interop::read_f32(f, c_attn->name);
  const auto& kiln = w.at("blocks.1.attn.qkv.weight");  // [out 192, in 64]
  for (int i : {0, 5, 63})
    for (int o : {0, 64, 130, 191}) CHECK(hf[i * 192 + o] == kiln[o * 64 + i]);
  CHECK(f.find("transformer.wte.weight")->shape == std::vector<std::int64_t>{300, 64});
  const auto wte = interop::read_f32(f, "transformer.wte.weight");
  CHECK(std::memcmp(wte.data(), w.at("wte").data(), wte.size() * 4) == 0);
}

TEST_CASE("a bf16 export holds the weights rounded to nearest even") {
  test::TempDir dir("hf-bf16");
  const auto cfg = tiny();
  const auto w = random_weights(cfg);
  const std::string path = (dir.path() / "model.safetensors").string();
  export_to(path, cfg, w, DType::bf16);
  interop::SafetensorsFile f(path);
  for (const auto& t : f.tensors()) CHECK(t.dtype == "BF16");
  const auto back = interop::import_hf_gpt2(model::gpt2_shape(cfg), path);
  for (const auto& [name, v] : w) {
    const auto& b = back.at(name);
    const std::size_t n = name == "wte" ? 300 * 64 : v.size();
    bool same = true;
    for (std::size_t i = 0; i < n; ++i) same = same && b[i] == round_bf16(v[i]);
    INFO(name);
    CHECK(same);
  }
  CHECK(interop::read_hf_gpt2_config((dir.path() / "config.json").string()).n_embd == 64);
  std::ifstream in(dir.path() / "config.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(text.find(R"("torch_dtype": "bfloat16")") != std::string::npos);
}

TEST_CASE("config.json describes a standard GPT-2 and reads back into the model config") {
  test::TempDir dir("hf-config");
  auto cfg = tiny();
  cfg.dropout = 0.1f;
  export_to((dir.path() / "model.safetensors").string(), cfg, random_weights(cfg));
  const std::string path = (dir.path() / "config.json").string();
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (const char* s :
       {R"("architectures": [)", R"("GPT2LMHeadModel")", R"("model_type": "gpt2")",
        R"("activation_function": "gelu_new")", R"("layer_norm_epsilon": 1e-05)", R"("tie_word_embeddings": true)",
        R"("n_inner": null)", R"("resid_pdrop": 0.1)", R"("n_positions": 32)", R"("torch_dtype": "float32")"}) {
    INFO(s);
    CHECK(text.find(s) != std::string::npos);
  }
  CHECK(text.find("bos_token_id") == std::string::npos);  // vocab 300 has no token 50256
  ModelConfig other;
  other.vocab_multiple = 64;
  const auto read = model::with_gpt2_shape(other, interop::read_hf_gpt2_config(path, model::gpt2_shape(other)));
  CHECK(read.n_layer == 2);
  CHECK(read.n_head == 4);
  CHECK(read.n_embd == 64);
  CHECK(read.vocab_size == 300);
  CHECK(read.max_seq_len == 32);
  CHECK(read.norm_eps == cfg.norm_eps);
  CHECK(read.vocab_multiple == 64);  // what config.json does not say stays as given

  auto gpt2 = cfg;
  gpt2.vocab_size = 50257;
  CHECK(interop::hf_gpt2_config_json(model::gpt2_shape(gpt2), DType::f32).find(R"("eos_token_id": 50256)") != std::string::npos);
}

TEST_CASE("read_hf_gpt2_config names the file and the key it cannot use") {
  test::TempDir dir("hf-config-bad");
  const auto missing = dir.file(
      "a/config.json", R"({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 300})");
  CHECK_THROWS_WITH_AS(interop::read_hf_gpt2_config(missing),
                       doctest::Contains("a/config.json: missing key 'n_positions'"), FileError);
  const auto erf = dir.file("b/config.json", R"({"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 300,
    "n_positions": 32, "activation_function": "gelu"})");
  CHECK_THROWS_WITH(interop::read_hf_gpt2_config(erf),
                    doctest::Contains("b/config.json: key 'activation_function' is \"gelu\""));
  const auto neg =
      dir.file("c/config.json", R"({"n_layer": -2, "n_head": 4, "n_embd": 64, "vocab_size": 300, "n_positions": 32})");
  CHECK_THROWS_WITH(interop::read_hf_gpt2_config(neg),
                    doctest::Contains("c/config.json: key 'n_layer' must be a positive integer"));
}

TEST_CASE("import accepts the Hub's unprefixed names, its causal-mask buffers and a tied lm_head") {
  test::TempDir dir("hf-hub");
  const auto cfg = tiny();
  const auto w = random_weights(cfg);
  const std::string exported = (dir.path() / "exported.safetensors").string();
  export_to(exported, cfg, w);
  const auto expect = interop::import_hf_gpt2(model::gpt2_shape(cfg), exported);

  // As the Hub's gpt2/model.safetensors: "h.0.attn.c_attn.weight", "wte.weight", mask buffers.
  const std::vector<float> mask(32 * 32, 1.0f), masked_bias = {-1e4f};
  interop::SafetensorsFile src(exported);
  const auto wte = src.bytes("transformer.wte.weight");
  const std::string hub = (dir.path() / "model.safetensors").string();
  rewrite(exported, hub, strip_prefix,
          {{"h.0.attn.bias", "F32", {1, 1, 32, 32}, mask.data(), mask.size() * 4},
           {"h.1.attn.bias", "F32", {1, 1, 32, 32}, mask.data(), mask.size() * 4},
           {"h.0.attn.masked_bias", "F32", {}, masked_bias.data(), 4},
           {"lm_head.weight", "F32", {300, 64}, wte.data(), wte.size()}});
  CHECK(interop::import_hf_gpt2(model::gpt2_shape(cfg), hub) == expect);
}

TEST_CASE("import names the file and the tensor that is missing") {
  test::TempDir dir("hf-missing");
  const auto cfg = tiny();
  const std::string exported = (dir.path() / "exported.safetensors").string(),
                    path = (dir.path() / "model.safetensors").string();
  export_to(exported, cfg, random_weights(cfg));
  rewrite(exported, path, [](const std::string& n) { return n == "transformer.h.1.mlp.c_fc.bias" ? "" : n; });
  CHECK(import_error(cfg, path).find("model.safetensors: tensor 'h.1.mlp.c_fc.bias' (kiln 'blocks.1.mlp.fc.bias', "
                                     "shape [256]) is missing") != std::string::npos);
}

TEST_CASE("import names the tensor and both shapes when the file does not fit the config") {
  test::TempDir dir("hf-shape");
  const auto cfg = tiny();
  const std::string path = (dir.path() / "model.safetensors").string();
  export_to(path, cfg, random_weights(cfg));
  auto longer = cfg;
  longer.max_seq_len = 64;
  CHECK(import_error(longer, path)
            .find("model.safetensors: tensor 'transformer.wpe.weight' has shape [32, 64] but the "
                  "kiln config (n_layer 2, n_embd 64, vocab_size 300, max_seq_len 64) needs "
                  "[64, 64] for 'wpe'") != std::string::npos);
  auto vocab = cfg;
  vocab.vocab_size = 301;
  CHECK(import_error(vocab, path).find("tensor 'transformer.wte.weight' has shape [300, 64]") != std::string::npos);
}

TEST_CASE("import refuses tensors kiln has no parameter for") {
  test::TempDir dir("hf-extra");
  const auto cfg = tiny();
  const std::string path = (dir.path() / "model.safetensors").string();
  export_to(path, cfg, random_weights(cfg));
  auto one = cfg;
  one.n_layer = 1;
  CHECK(import_error(one, path).find(
            "model.safetensors: tensor 'transformer.h.1.attn.c_attn.bias' (shape [192]) is not a "
            "parameter") != std::string::npos);
  // A one-dimensional attn.bias is not a causal mask: it is not skipped silently.
  const std::vector<float> bias(192, 0.5f);
  const std::string odd = (dir.path() / "odd.safetensors").string();
  rewrite(path, odd, [](const std::string& n) { return n; },
          {{"h.0.attn.bias", "F32", {192}, bias.data(), bias.size() * 4}});
  CHECK(import_error(cfg, odd).find("tensor 'h.0.attn.bias' (shape [192]) is not a parameter") != std::string::npos);
}

TEST_CASE("import refuses an lm_head that differs from wte") {
  test::TempDir dir("hf-untied");
  const auto cfg = tiny();
  const std::string exported = (dir.path() / "exported.safetensors").string(),
                    path = (dir.path() / "model.safetensors").string();
  export_to(exported, cfg, random_weights(cfg));
  const std::vector<float> head(300 * 64, 0.25f);
  rewrite(exported, path, [](const std::string& n) { return n; },
          {{"lm_head.weight", "F32", {300, 64}, head.data(), head.size() * 4}});
  CHECK(import_error(cfg, path).find("model.safetensors: tensor 'lm_head.weight' differs from wte") !=
        std::string::npos);
}
