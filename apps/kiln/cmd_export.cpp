#include <filesystem>
#include <iostream>
#include <map>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/interop/hf_gpt2.hpp"
#include "kiln/model/hf.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_export(const Args& args) {
  po::options_description opts(
      "kiln export CHECKPOINT -o MODEL.safetensors [--dtype bf16|f32]\n\nWrites a checkpoint's weights (its ranks' "
      "pieces put together) as a safetensors file with Hugging Face GPT-2 names and layouts, and config.json beside "
      "it, for transformers' GPT2LMHeadModel and nanoGPT's loader. CHECKPOINT is a checkpoint directory or a folder "
      "of them (its newest).\n\noptions");
  std::string input, output, dtype;
  opts.add_options()("help,h", "show this help")("output,o", po::value(&output), "the .safetensors file to write")(
      "dtype", po::value(&dtype)->default_value("f32"), "f32 or bf16")("input", po::value(&input), "checkpoint");
  po::positional_options_description pos;
  pos.add("input", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (input.empty()) throw po::error("a CHECKPOINT is required");
  if (output.empty()) throw po::error("the output file (-o MODEL.safetensors) is required");
  if (dtype != "f32" && dtype != "bf16") throw po::error("--dtype must be f32 or bf16, not '" + dtype + "'");
  const ModelSource src = open_model(input);
  const auto folder = std::filesystem::path(output).parent_path();
  if (!folder.empty()) std::filesystem::create_directories(folder);
  std::map<std::string, std::vector<float>> held;
  interop::export_hf_gpt2(
      model::gpt2_shape(src.config),
      [&](const std::string& name) {
        auto it = held.find(name);
        if (it == held.end()) it = held.emplace(name, src.weights(name)).first;
        return it->second.data();
      },
      output, dtype == "bf16" ? DType::bf16 : DType::f32);
  std::cout << "exported " << src.description << " (" << src.config.n_layer << " layers, " << src.config.n_embd
            << " wide, vocabulary " << src.config.vocab_size << ") to " << output << " (" << dtype
            << ") and config.json beside it\n";
  return 0;
}

}  // namespace kiln::app
