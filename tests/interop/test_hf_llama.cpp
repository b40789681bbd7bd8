// Hugging Face Llama directories: the name map onto kiln's fused tensors, reading piece by piece
// (one file and shards), config.json both ways (rope_scaling llama3 included), the export written
// back byte for byte in f32, and every bad input named by file and key.
#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "hf_llama_fixture.hpp"
#include "kiln/core/error.hpp"
#include "kiln/engine/config/node.hpp"
#include "kiln/interop/hf_llama.hpp"
#include "kiln/model/hf.hpp"
#include "kiln/tensor/bf16.hpp"
#include "kiln_test.hpp"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

// The fixture's shape as kiln reads it (its vocabulary padded to kiln's multiple of 128).
interop::LlamaShape shape_of(const std::string& dir) {
  const model::ModelConfig cfg = model::config_from_hf_dir({}, model::classify_hf_path(dir));
  return model::llama_shape(cfg);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const auto path = fs::path(dir) / "config.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(path));
  edit(j);
  std::ofstream(path) << j.dump(2);
}

}  // namespace

TEST_CASE("the layout fuses q/k/v and gate/up by rows and pads the vocabulary") {
  interop::LlamaShape s;
  s.n_layer = 1, s.n_head = 4, s.n_kv_head = 2, s.n_embd = 32, s.ffn_hidden = 48, s.vocab_size = 100;
  s.padded_vocab = 128, s.tie_embeddings = false;
  const auto layout = interop::hf_llama_layout(s);
  std::vector<std::string> names;
  for (const auto& t : layout) names.push_back(t.kiln_name);
  CHECK(names == std::vector<std::string>{"wte", "blocks.0.norm_1.weight", "blocks.0.attn.qkv.weight",
                                          "blocks.0.attn.proj.weight", "blocks.0.norm_2.weight",
                                          "blocks.0.mlp.fc.weight", "blocks.0.mlp.proj.weight", "norm_f.weight",
                                          "lm_head.weight"});
  const auto& qkv = layout[2];
  CHECK(qkv.kiln_shape == std::vector<std::int64_t>{64, 32});
  REQUIRE(qkv.pieces.size() == 3);
  CHECK(qkv.pieces[0].hf_name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(qkv.pieces[1].row == 32);
  CHECK(qkv.pieces[2].hf_name == "model.layers.0.self_attn.v_proj.weight");
  CHECK(qkv.pieces[2].row == 48);
  CHECK(layout[5].pieces[1].hf_name == "model.layers.0.mlp.up_proj.weight");
  CHECK(layout[5].pieces[1].row == 48);
  CHECK(layout[0].kiln_shape == std::vector<std::int64_t>{128, 32});
  CHECK(layout[0].pieces[0].hf_shape == std::vector<std::int64_t>{100, 32});
  s.tie_embeddings = true;
  CHECK(interop::hf_llama_layout(s).back().kiln_name == "norm_f.weight");
}

TEST_CASE("config.json sets the model's shape, GQA and llama3 rope scaling included") {
  const test::TempDir d("hf-llama-1");
  test::HfLlamaFixture f;
  f.rope_scaling = true;
  f.write(d.path().string());
  const model::ModelConfig cfg = model::config_from_hf_dir({}, model::classify_hf_path(d.path().string()));
  CHECK(cfg.llama());
  CHECK(cfg.n_layer == 2);
  CHECK(cfg.n_head == 4);
  CHECK(cfg.kv_heads() == 2);
  CHECK(cfg.n_embd == 32);
  CHECK(cfg.mlp_hidden() == 48);
  CHECK(cfg.vocab_size == 100);
  CHECK(cfg.padded_vocab() == 128);
  CHECK(cfg.max_seq_len == 64);
  CHECK(!cfg.tie_embeddings);
  CHECK(cfg.rope_scaling.type == model::RopeScalingType::llama3);
  CHECK(cfg.rope_scaling.factor == 8.0f);
  CHECK(cfg.rope_scaling.original_max_seq_len == 16);
  // And back: the export's config.json reads to the same shape.
  const std::string text = interop::hf_llama_config_json(model::llama_shape(cfg), DType::bf16, R"({"bos_token_id": 1})");
  std::ofstream(fs::path(d.path().string()) / "config.json") << text;
  const model::ModelConfig again = model::config_from_hf_dir({}, model::classify_hf_path(d.path().string()));
  CHECK(model::llama_shape(again).rope_factor == 8.0f);
  CHECK(again.kv_heads() == 2);
  const auto j = nlohmann::json::parse(text);
  CHECK(j["torch_dtype"] == "bfloat16");
  CHECK(j["bos_token_id"] == 1);
  CHECK(j["rope_scaling"]["rope_type"] == "llama3");
}

TEST_CASE("transformers 5's rope_parameters stand for rope_theta and rope_scaling") {
  const test::TempDir d("hf-llama-2");
  test::HfLlamaFixture().write(d.path().string());
  edit_config(d.path().string(), [](auto& j) {
    j.erase("rope_theta");
    j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
                            {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 8192}};
  });
  auto s = interop::read_hf_llama_config(d.path().string() + "/config.json");
  CHECK(s.rope_theta == 500000.0f);
  CHECK(s.rope_factor == 32.0f);
  CHECK(s.rope_original_max_seq_len == 8192);
  edit_config(d.path().string(), [](auto& j) { j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 250000.0}}; });
  s = interop::read_hf_llama_config(d.path().string() + "/config.json");
  CHECK(s.rope_theta == 250000.0f);
  CHECK(s.rope_factor == 0.0f);
  edit_config(d.path().string(), [](auto& j) { j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 1e4}, {"factor", 4.0}}; });
  CHECK(error_of([&] { interop::read_hf_llama_config(d.path().string() + "/config.json"); }).find("'rope_parameters.rope_type'") !=
        std::string::npos);
  // The export writes both spellings with the same numbers.
  s.rope_factor = 8, s.rope_theta = 500000;
  const auto j = nlohmann::json::parse(interop::hf_llama_config_json(s, DType::f32));
  CHECK(j["rope_theta"] == 500000.0);
  CHECK(j["rope_parameters"]["rope_theta"] == 500000.0);
  CHECK(j["rope_parameters"]["rope_type"] == "llama3");
  CHECK(j["rope_scaling"]["factor"] == 8.0);
}

TEST_CASE("reading gives kiln's fused tensors, any range of them, from one file or from shards") {
  for (int shards : {1, 3}) {
    for (bool tied : {false, true}) {
      CAPTURE(shards);
      CAPTURE(tied);
      const test::TempDir d("hf-llama-101");
      test::HfLlamaFixture f;
      f.shards = shards;
      f.tied = tied;
      f.write(d.path().string());
      std::map<std::string, std::vector<float>> hf;
      for (auto& [name, t] : f.tensors()) hf[name] = t.second;
      interop::HfLlamaReader r(shape_of(d.path().string()), d.path().string());
      CHECK(r.checkpoint().sharded() == (shards > 1));
      // qkv = q | k | v by rows.
      const auto qkv = r.read("blocks.1.attn.qkv.weight");
      std::vector<float> want = hf["model.layers.1.self_attn.q_proj.weight"];
      for (const char* p : {"k_proj", "v_proj"}) {
        const auto& v = hf[std::string("model.layers.1.self_attn.") + p + ".weight"];
        want.insert(want.end(), v.begin(), v.end());
      }
      CHECK(qkv == want);
      // Ranges across piece boundaries equal the whole's slices.
      for (auto [begin, count] : {std::pair{0, 5}, {1000, 100}, {1020, 600}, {2040, 8}, {0, 2048}}) {
        std::vector<float> part(static_cast<std::size_t>(count));
        r.read("blocks.1.attn.qkv.weight", begin, count, part.data());
        CHECK(std::equal(part.begin(), part.end(), qkv.begin() + begin));
      }
      const auto fc = r.read("blocks.0.mlp.fc.weight");
      CHECK(std::equal(fc.begin() + 48 * 32, fc.end(), hf["model.layers.0.mlp.up_proj.weight"].begin()));
      // The embedding's padding rows (100 -> 128) are zero.
      const auto wte = r.read("wte");
      REQUIRE(wte.size() == 128 * 32);
      CHECK(std::equal(wte.begin(), wte.begin() + 100 * 32, hf["model.embed_tokens.weight"].begin()));
      CHECK(std::all_of(wte.begin() + 100 * 32, wte.end(), [](float x) { return x == 0; }));
      std::vector<float> pad(40);
      r.read("wte", 100 * 32 - 8, 40, pad.data());
      CHECK(pad[7] == hf["model.embed_tokens.weight"].back());
      CHECK(pad[8] == 0.0f);
    }
  }
}

TEST_CASE("an f32 export writes back every tensor byte for byte, in one file or shards with the index") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    const test::TempDir d("hf-llama-102");
    test::HfLlamaFixture f;
    f.tied = tied;
    f.rope_scaling = true;
    f.shards = 2;
    const std::string in = d.path().string() + "/in", out = d.path().string() + "/out";
    f.write(in);
    interop::HfLlamaReader r(shape_of(in), in);
    const auto shape = shape_of(in);
    // One file first, then shards over it: the stale model.safetensors must go.
    interop::export_hf_llama(shape, [&](const std::string& n) { return r.read(n); }, out);
    CHECK(fs::exists(out + "/model.safetensors"));
    const auto files = interop::export_hf_llama(shape, [&](const std::string& n) { return r.read(n); }, out,
                                                DType::f32, 20'000);
    CHECK(files.size() > 2);
    CHECK(files.back() == "model.safetensors.index.json");
    CHECK(!fs::exists(out + "/model.safetensors"));
    interop::HfCheckpoint back(out);
    CHECK(back.sharded());
    std::size_t n = 0;
    for (auto& [name, t] : f.tensors()) {
      const auto& ft = back.tensor(name);
      CHECK(ft.dtype == "F32");
      CHECK(ft.shape == t.first);
      std::vector<float> v(t.second.size());
      back.read(name, 0, static_cast<std::int64_t>(v.size()), v.data());
      CHECK(std::memcmp(v.data(), t.second.data(), v.size() * 4) == 0);
      ++n;
    }
    CHECK(back.names().size() == n);  // nothing else: no tied lm_head, no padding rows
    CHECK(shape_of(out).rope_factor == 8.0f);
  }
}

TEST_CASE("a bf16 export rounds to nearest even") {
  const test::TempDir d("hf-llama-3");
  test::HfLlamaFixture f;
  f.write(d.path().string() + "/in");
  interop::HfLlamaReader r(shape_of(d.path().string() + "/in"), d.path().string() + "/in");
  interop::export_hf_llama(shape_of(d.path().string() + "/in"), [&](const std::string& n) { return r.read(n); }, d.path().string() + "/out",
                           DType::bf16);
  interop::SafetensorsFile file(d.path().string() + "/out/model.safetensors");
  CHECK(file.find("model.norm.weight")->dtype == "BF16");
  const auto got = interop::read_f32(file, "model.layers.0.mlp.down_proj.weight");
  const auto want = r.read("blocks.0.mlp.proj.weight");
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(got[i] == bf16_bits_to_float(float_to_bf16_bits(want[i])));
}

TEST_CASE("config.json fields kiln cannot honour are errors naming the file and the key") {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](auto& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}}; }, "rope_scaling.rope_type"},
      {[](auto& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}}; }, "rope_scaling.rope_type"},
      {[](auto& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}};
       },
       "rope_scaling.original_max_position_embeddings"},
      {[](auto& j) { j["attention_bias"] = true; }, "attention_bias"},
      {[](auto& j) { j["mlp_bias"] = true; }, "mlp_bias"},
      {[](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act"},
      {[](auto& j) { j["head_dim"] = 16; }, "head_dim"},
      {[](auto& j) { j["num_key_value_heads"] = 3; }, "num_key_value_heads"},
      {[](auto& j) { j.erase("intermediate_size"); }, "intermediate_size"},
      {[](auto& j) { j["vocab_size"] = -5; }, "vocab_size"},
  };
  for (const auto& [edit, key] : cases) {
    CAPTURE(key);
    const test::TempDir d("hf-llama-103");
    test::HfLlamaFixture().write(d.path().string());
    edit_config(d.path().string(), edit);
    const std::string e = error_of([&] { interop::read_hf_llama_config(d.path().string() + "/config.json"); });
    CHECK(e.find(d.path().string() + "/config.json") != std::string::npos);
    CHECK(e.find("'" + key + "'") != std::string::npos);
  }
  const test::TempDir d("hf-llama-4");
  test::HfLlamaFixture().write(d.path().string());
  edit_config(d.path().string(), [](auto& j) { j["model_type"] = "mistral"; });
  CHECK(error_of([&] { model::classify_hf_path(d.path().string()); }).find("model_type") != std::string::npos);
}

TEST_CASE("bad weights are errors naming the file and the tensor") {
  const test::TempDir d("hf-llama-5");
  test::HfLlamaFixture f;
  f.shards = 2;
  f.write(d.path().string() + "/a");
  const auto shape = shape_of(d.path().string() + "/a");
  // A shard the index names is missing.
  fs::remove(d.path().string() + "/a/model-00002-of-00002.safetensors");
  std::string e = error_of([&] { interop::HfLlamaReader(shape, d.path().string() + "/a"); });
  CHECK(e.find("model.safetensors.index.json") != std::string::npos);
  CHECK(e.find("model-00002-of-00002.safetensors") != std::string::npos);
  // No weights at all.
  fs::remove(d.path().string() + "/a/model.safetensors.index.json");
  CHECK(error_of([&] { interop::HfLlamaReader(shape, d.path().string() + "/a"); }).find("model.safetensors") != std::string::npos);

  // A shape that does not fit config.json.
  test::HfLlamaFixture g;
  g.write(d.path().string() + "/b");
  edit_config(d.path().string() + "/b", [](auto& j) { j["intermediate_size"] = 40; });
  e = error_of([&] { interop::HfLlamaReader(shape_of(d.path().string() + "/b"), d.path().string() + "/b"); });
  CHECK(e.find("model.layers.0.mlp.gate_proj.weight") != std::string::npos);
  CHECK(e.find("[48, 32]") != std::string::npos);
  CHECK(e.find("[40, 32]") != std::string::npos);

  // An untied model without its head; a tied one whose head differs from the embedding.
  g.write(d.path().string() + "/c");
  edit_config(d.path().string() + "/c", [](auto& j) { j["tie_word_embeddings"] = true; });
  e = error_of([&] { interop::HfLlamaReader(shape_of(d.path().string() + "/c"), d.path().string() + "/c"); });
  CHECK(e.find("lm_head.weight") != std::string::npos);
  CHECK(e.find("tie_word_embeddings") != std::string::npos);
  test::HfLlamaFixture tied;
  tied.tied = true;
  tied.write(d.path().string() + "/e");
  edit_config(d.path().string() + "/e", [](auto& j) { j["tie_word_embeddings"] = false; });
  e = error_of([&] { interop::HfLlamaReader(shape_of(d.path().string() + "/e"), d.path().string() + "/e"); });
  CHECK(e.find("'lm_head.weight'") != std::string::npos);
  CHECK(e.find("missing") != std::string::npos);
  // A tensor kiln has no parameter for.
  g.layers = 3;
  g.write(d.path().string() + "/f");
  edit_config(d.path().string() + "/f", [](auto& j) { j["num_hidden_layers"] = 2; });
  e = error_of([&] { interop::HfLlamaReader(shape_of(d.path().string() + "/f"), d.path().string() + "/f"); });
  CHECK(e.find("model.layers.2.") != std::string::npos);
  CHECK(e.find("not a parameter") != std::string::npos);
}

TEST_CASE("[model] init_from a Hugging Face directory fills the shape keys, a conflicting key is an error") {
  const test::TempDir d("hf-llama-6");
  test::HfLlamaFixture f;
  f.write(d.path().string());
  auto complete = [&](const std::string& toml) {
    const config::Node doc = config::parse_toml_text(toml, "p.toml");
    model::ModelConfig cfg;
    cfg.init_from = d.path().string();
    // What the schema would have read from the section.
    if (const auto* m = doc.find("model"); m && m->find("n_layer")) cfg.n_layer = static_cast<int>(m->find("n_layer")->integer);
    if (const auto* m = doc.find("model"); m && m->find("arch") && m->find("arch")->string == "llama")
      cfg.arch = model::Arch::llama;
    config::Errors errors;
    model::complete_from_hf(cfg, doc, "p.toml", errors);
    return std::pair{cfg, errors.messages()};
  };
  auto [cfg, errors] = complete("[model]\narch = \"llama\"\n");
  CHECK(errors.empty());
  CHECK(cfg.llama());
  CHECK(cfg.n_layer == 2);
  CHECK(cfg.kv_heads() == 2);
  CHECK(!cfg.tie_embeddings);
  std::tie(cfg, errors) = complete("[model]\nn_layer = 2\n");
  CHECK(errors.empty());
  std::tie(cfg, errors) = complete("[model]\nn_layer = 5\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].find("p.toml:2") != std::string::npos);
  CHECK(errors[0].find("model.n_layer") != std::string::npos);
  CHECK(errors[0].find("num_hidden_layers") != std::string::npos);
}
