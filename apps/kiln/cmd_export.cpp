#include <cctype>
#include <filesystem>
#include <iostream>
#include <map>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "kiln/checkpoint/files.hpp"
#include "kiln/core/error.hpp"
#include "kiln/interop/hf_gpt2.hpp"
#include "kiln/interop/hf_llama.hpp"
#include "kiln/model/hf.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace kiln::app {

namespace {

// "5GB", "500MB", "2000000" (bytes): transformers' max_shard_size spelling, in powers of 1000.
std::uint64_t parse_size(const std::string& text) {
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit = text.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::map<std::string, std::uint64_t> units = {{"", 1}, {"B", 1}, {"KB", 1000}, {"MB", 1000'000}, {"GB", 1000'000'000}};
  const auto it = units.find(unit);
  if (digits == 0 || it == units.end() || std::stoull(text.substr(0, digits)) == 0)
    throw po::error("--max-shard-size must be a positive size such as 5GB, 500MB or 2000000, not '" + text + "'");
  return std::stoull(text.substr(0, digits)) * it->second;
}

// The token ids of the model it started from (bos / eos / pad), which kiln does not model, so the
// export's config.json and generation defaults match the original's.
std::string carried_config(const std::string& hf_dir) {
  if (hf_dir.empty()) return "";
  const auto path = fs::path(hf_dir) / "config.json";
  const auto j = nlohmann::json::parse(checkpoint::read_text_file(path.string()), nullptr, false);
  if (!j.is_object()) return "";
  nlohmann::json keep = nlohmann::json::object();
  for (const char* k : {"bos_token_id", "eos_token_id", "pad_token_id"})
    if (j.contains(k)) keep[k] = j[k];
  return keep.dump();
}

// The original's tokenizer and generation files, so transformers and kiln find them beside the weights.
std::vector<std::string> copy_companions(const std::string& hf_dir, const std::string& out) {
  std::vector<std::string> copied;
  if (hf_dir.empty() || fs::equivalent(hf_dir, out)) return copied;
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}) {
    const auto from = fs::path(hf_dir) / f;
    std::error_code ec;
    if (!fs::is_regular_file(from, ec)) continue;
    checkpoint::write_file_atomically((fs::path(out) / f).string(), checkpoint::read_text_file(from.string()));
    copied.push_back(f);
  }
  return copied;
}

}  // namespace

int cmd_export(const Args& args) {
  po::options_description opts(
      "kiln export CHECKPOINT -o DIR [--dtype bf16|f32] [--max-shard-size 5GB]\n\nWrites a model's weights (a "
      "checkpoint's ranks' pieces put together) in Hugging Face's layout, loadable by transformers' "
      "from_pretrained:\na Llama as DIR/config.json + model.safetensors (or shards of at most --max-shard-size with "
      "model.safetensors.index.json),\nwith the tokenizer files of the Hugging Face model it started from when "
      "that directory still exists;\na GPT-2 as DIR/model.safetensors (or -o FILE.safetensors) + config.json, for "
      "GPT2LMHeadModel and nanoGPT's loader.\nCHECKPOINT is a checkpoint directory or a folder of them (its "
      "newest), or a Hugging Face directory.\n\noptions");
  std::string input, output, dtype, shard;
  opts.add_options()("help,h", "show this help")("output,o", po::value(&output), "the directory (or GPT-2 .safetensors) to write")(
      "dtype", po::value(&dtype)->default_value("f32"), "f32 or bf16")(
      "max-shard-size", po::value(&shard)->default_value("5GB"), "Llama: the largest weight file (transformers' default)")(
      "input", po::value(&input), "checkpoint");
  po::positional_options_description pos;
  pos.add("input", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (input.empty()) throw po::error("a CHECKPOINT is required");
  if (output.empty()) throw po::error("the output (-o DIR) is required");
  if (dtype != "f32" && dtype != "bf16") throw po::error("--dtype must be f32 or bf16, not '" + dtype + "'");
  const std::uint64_t max_shard = parse_size(shard);
  const DType type = dtype == "bf16" ? DType::bf16 : DType::f32;
  const ModelSource src = open_model(input);
  const std::string what = cat(src.config.n_layer, " layers, ", src.config.n_embd, " wide, vocabulary ",
                               src.config.vocab_size);
  if (src.config.llama()) {
    if (output.ends_with(".safetensors"))
      throw po::error("a Llama is exported as a directory (config.json + model.safetensors or shards): give -o DIR");
    const auto files = interop::export_hf_llama(model::llama_shape(src.config), src.weights, output, type, max_shard,
                                                carried_config(src.hf_dir));
    const auto copied = copy_companions(src.hf_dir, output);
    std::string list;
    for (const auto& f : files) list += (list.empty() ? "" : ", ") + f;
    for (const auto& f : copied) list += ", " + f;
    std::cout << "exported " << src.description << " (Llama, " << what << ") to " << output << ": config.json, "
              << list << " (" << dtype << ")\n";
    return 0;
  }
  const std::string file = output.ends_with(".safetensors") ? output : (fs::path(output) / "model.safetensors").string();
  const auto folder = fs::path(file).parent_path();
  if (!folder.empty()) fs::create_directories(folder);
  std::map<std::string, std::vector<float>> held;
  interop::export_hf_gpt2(
      model::gpt2_shape(src.config),
      [&](const std::string& name) {
        auto it = held.find(name);
        if (it == held.end()) it = held.emplace(name, src.weights(name)).first;
        return it->second.data();
      },
      file, type);
  std::cout << "exported " << src.description << " (GPT-2, " << what << ") to " << file << " (" << dtype
            << ") and config.json beside it\n";
  return 0;
}

}  // namespace kiln::app
