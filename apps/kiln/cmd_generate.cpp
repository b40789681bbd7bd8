#include <algorithm>
#include <iostream>
#include <sstream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/data/chat.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/ops/backend.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_generate(const Args& args) {
  po::options_description opts(
      "kiln generate MODEL --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]\n"
      "kiln generate MODEL --chat --prompt MESSAGE [--system TEXT] [--template auto|llama3|chatml] ...\n\n"
      "Prints the prompt and N tokens sampled after it (a KV cache on the GPU, or on the CPU backend). MODEL is a\n"
      "checkpoint, a Hugging Face model directory (Llama or GPT-2) or a GPT-2 .safetensors file. Text is encoded\n"
      "and decoded by --tokenizer: by default the Hugging Face directory's tokenizer.json, bytes for a vocabulary\n"
      "of at most 256, GPT-2's BPE for 50257 (when scripts/fetch-tokenizers.sh has fetched its files). Without a\n"
      "tokenizer, give --prompt-ids: token ids are printed. With --chat the prompt is a user's message: the chat\n"
      "template (the model directory's tokenizer_config.json, else the one whose special tokens the tokenizer has)\n"
      "wraps it and the assistant's header, generation stops at the end of the assistant's turn, and the reply\n"
      "alone is printed.\n\noptions");
  std::string input, prompt, prompt_ids, device, tokenizer_spec, system, template_name;
  bool chat = false;
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
      "chat", po::bool_switch(&chat), "the prompt is a user's message under the model's chat template")(
      "system", po::value(&system), "with --chat: a system message before the user's")(
      "template", po::value(&template_name)->default_value("auto"), "with --chat: auto, llama3 or chatml")(
      "input", po::value(&input), "checkpoint, Hugging Face directory or .safetensors file");
  po::positional_options_description pos;
  pos.add("input", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (input.empty()) throw po::error("a CHECKPOINT or .safetensors file is required");
  if (tokens < 1) throw po::error("--tokens must be at least 1");
  auto backend = open_backend(device);
  const ModelSource src = open_model(input);
  const auto tokenizer = model_tokenizer(src, tokenizer_spec);
  if (chat && !tokenizer) throw po::error("--chat needs a tokenizer with the chat template's special tokens (--tokenizer)");
  if (chat && !prompt_ids.empty()) throw po::error("--chat takes --prompt, not --prompt-ids");
  if (!chat && (!system.empty() || template_name != "auto")) throw po::error("--system and --template go with --chat");
  std::vector<int> ids, stop;
  if (chat) {
    try {  // a template the tokenizer cannot write is a usage error (exit 2)
      const auto tmpl = data::choose_chat_template(template_name, *tokenizer, src.hf_dir);
      std::vector<data::ChatTurn> turns;
      if (!system.empty()) turns.push_back({"system", system});
      turns.push_back({"user", prompt});
      for (auto t : data::encode_chat_prompt(*tokenizer, tmpl, turns)) ids.push_back(static_cast<int>(t));
      for (auto t : data::chat_stop_tokens(*tokenizer, tmpl)) stop.push_back(static_cast<int>(t));
    } catch (const FileError&) {
      throw;
    } catch (const Error& e) {
      throw po::error(std::string("--chat: ") + e.what());
    }
  } else if (!prompt_ids.empty()) {
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
  o.stop = stop;
  std::vector<int> out = gen.generate(ids, tokens, o);
  if (chat) {  // the reply, without the token that ended it
    if (!out.empty() && std::find(stop.begin(), stop.end(), out.back()) != stop.end()) out.pop_back();
    std::cout << tokenizer->decode(std::vector<std::uint32_t>(out.begin(), out.end())) << "\n";
  } else if (tokenizer) {
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
