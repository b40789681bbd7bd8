#include <algorithm>
#include <iostream>
#include <sstream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/ops/backend.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_generate(const Args& args) {
  po::options_description opts(
      "kiln generate MODEL --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]\n\n"
      "Prints the prompt and N tokens sampled after it (a KV cache on the GPU, or on the CPU backend). MODEL is a\n"
      "checkpoint, a Hugging Face model directory (Llama or GPT-2) or a GPT-2 .safetensors file. Text is encoded\n"
      "and decoded by --tokenizer: by default the Hugging Face directory's tokenizer.json, bytes for a vocabulary\n"
      "of at most 256, GPT-2's BPE for 50257 (when scripts/fetch-tokenizers.sh has fetched its files). Without a\n"
      "tokenizer, give --prompt-ids: token ids are printed.\n\noptions");
  std::string input, prompt, prompt_ids, device, tokenizer_spec;
  int tokens = 64, top_k = 0;
  float temperature = 1.0f;
  std::uint64_t seed = 0;
  opts.add_options()("help,h", "show this help")("prompt", po::value(&prompt), "the text to continue")(
      "prompt-ids", po::value(&prompt_ids), "the prompt as token ids, space-separated (any vocabulary)")(
      "tokens", po::value(&tokens)->default_value(64), "tokens to generate")(
      "temperature", po::value(&temperature)->default_value(1.0f), "0: always the most likely token")(
      "top-k", po::value(&top_k)->default_value(0), "sample among the k most likely tokens; 0: all")(
      "seed", po::value(&seed)->default_value(0), "sampling seed")(
      "device", po::value(&device)->default_value("auto"), "cpu, cuda, or auto (cuda when there is a GPU)")(
      "tokenizer", po::value(&tokenizer_spec), "bytes, gpt2, a directory with encoder.json + vocab.bpe, or a tiktoken file")(
      "input", po::value(&input), "checkpoint, Hugging Face directory or .safetensors file");
  po::positional_options_description pos;
  pos.add("input", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (input.empty()) throw po::error("a CHECKPOINT or .safetensors file is required");
  if (tokens < 1) throw po::error("--tokens must be at least 1");
  auto backend = open_backend(device);
  const ModelSource src = open_model(input);
  const auto tokenizer = model_tokenizer(src, tokenizer_spec);
  std::vector<int> ids;
  if (!prompt_ids.empty()) {
    std::istringstream in(prompt_ids);
    for (int t; in >> t;) ids.push_back(t);
  } else if (tokenizer) {
    for (auto t : tokenizer->encode(prompt)) ids.push_back(static_cast<int>(t));
  } else if (!prompt.empty()) {
    throw po::error("this model's vocabulary has " + std::to_string(src.config.vocab_size) +
                    " tokens and no tokenizer was found for it" +
                    (src.config.vocab_size == 50257 ? " (GPT-2's files: scripts/fetch-tokenizers.sh fetches them)" : "") +
                    ": give --tokenizer gpt2|bytes|PATH (or --prompt-ids)");
  }
  if (ids.empty()) throw po::error("give a --prompt (or --prompt-ids)");

  // The cache holds max_seq_len positions: a Llama (no position table; Llama 3.1 says 131072) needs
  // only the prompt and the new tokens.
  model::ModelConfig cfg = src.config;
  if (cfg.llama()) cfg.max_seq_len = std::min(cfg.max_seq_len, static_cast<int>(ids.size()) + tokens);
  model::Generator gen(cfg, *backend, src.weights);
  model::SamplingOptions o;
  o.temperature = temperature;
  o.top_k = top_k;
  o.seed = seed;
  const std::vector<int> out = gen.generate(ids, tokens, o);
  if (tokenizer) {
    std::vector<std::uint32_t> all(ids.begin(), ids.end());
    all.insert(all.end(), out.begin(), out.end());
    std::cout << tokenizer->decode(all) << "\n";
  } else {
    for (std::size_t i = 0; i < ids.size() + out.size(); ++i)
      std::cout << (i ? " " : "") << (i < ids.size() ? ids[i] : out[i - ids.size()]);
    std::cout << "\n";
  }
  return 0;
}

}  // namespace kiln::app
