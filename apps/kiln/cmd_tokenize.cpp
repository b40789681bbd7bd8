#include <cstdio>
#include <filesystem>
#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/data/chat.hpp"
#include "kiln/data/tokenizer.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_tokenize(const Args& args) {
  po::options_description opts(
      "kiln tokenize TEXT... -o DIR [--tokenizer bytes|gpt2|PATH]\n\nTokenizes text files into llm.c token shards "
      "DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin:\nuint16 tokens (llm.c's GPT-2 header) when the vocabulary fits, "
      "else uint32 (its Llama 3 header).\nWith a BPE tokenizer each file is a document, preceded by the document "
      "token\n(GPT-2, Qwen2: <|endoftext|>; Llama 3: <|begin_of_text|>), as llm.c's data scripts do.\nThe text is "
      "plain text: special tokens' names in it (\"<|endoftext|>\") are encoded as text.\nWith --format chat "
      "(JSONL {\"messages\": [{\"role\", \"content\"}, ...]}) or prompt-completion (JSONL {\"prompt\", "
      "\"completion\"}) each line is an example under a\nchat template (Llama 3's headers or ChatML), and a loss mask "
      "beside each shard (DIR/train_NNNNNN.mask) trains on the\nassistant's turns (or the completion) only; the last "
      "fraction of the examples goes to validation.\n\noptions");
  std::vector<std::string> inputs;
  std::string out, tokenizer_spec, format, chat_template;
  data::TokenizeOptions o;
  opts.add_options()("help,h", "show this help")("output,o", po::value(&out), "output directory")(
      "tokenizer", po::value(&tokenizer_spec)->default_value("bytes"),
      "bytes (vocabulary 256), gpt2 (GPT-2's BPE, fetched by scripts/fetch-tokenizers.sh), a Hugging Face "
      "tokenizer.json of a byte-level BPE model (GPT-2, Llama 3, Qwen2) or a model directory holding one, a directory "
      "with encoder.json + vocab.bpe, or a tiktoken rank file (cl100k_base.tiktoken, Llama 3's tokenizer.model)")(
      "val-fraction", po::value(&o.val_fraction)->default_value(0.1), "last fraction of the tokens used for validation")(
      "shard-tokens", po::value(&o.shard_tokens)->default_value(100'000'000), "tokens per shard")(
      "strip-pos-tags", po::bool_switch(&o.strip_pos_tags), "input is word/TAG text (e.g. the Brown corpus)")(
      "format", po::value(&format)->default_value("text"), "text, chat or prompt-completion")(
      "template", po::value(&chat_template)->default_value("auto"),
      "chat and prompt-completion: llama3, chatml, or auto (the tokenizer directory's tokenizer_config.json "
      "chat_template, else the template whose special tokens the tokenizer has)")(
      "input", po::value(&inputs)->composing(), "text files");
  po::positional_options_description pos;
  pos.add("input", -1);
  if (!parse_args(args, opts, pos)) return 0;
  if (inputs.empty()) throw po::error("at least one TEXT file is required");
  if (out.empty()) throw po::error("the output directory (-o DIR) is required");
  if (format != "text" && format != "chat" && format != "prompt-completion")
    throw po::error("--format must be text, chat or prompt-completion, not '" + format + "'");
  const auto tokenizer = open_tokenizer(tokenizer_spec);
  if (format != "text") {
    data::SftOptions so;
    so.format = format == "chat" ? data::SftFormat::chat : data::SftFormat::prompt_completion;
    std::error_code ec;
    const std::string dir = std::filesystem::is_directory(tokenizer_spec, ec)
                                ? tokenizer_spec
                                : std::filesystem::path(tokenizer_spec).parent_path().string();
    so.tmpl = data::choose_chat_template(chat_template, *tokenizer, dir);
    so.val_fraction = o.val_fraction;
    so.shard_tokens = o.shard_tokens;
    so.tokenizer = tokenizer.get();
    const auto r = data::tokenize_sft_files(inputs, out, so);
    std::cout << "tokenized " << r.examples << " " << format << " example(s) with " << tokenizer->description()
              << " (template " << (so.tmpl == data::ChatTemplate::llama3 ? "llama3" : "chatml") << "): "
              << r.train_tokens << " train and " << r.val_tokens << " validation tokens, " << r.trained_tokens
              << " trained on, into " << r.files.size() / 2 << " shard(s) with loss masks in " << out << "\n";
    return 0;
  }
  o.tokenizer = tokenizer.get();
  auto r = data::tokenize_files(inputs, out, o);
  const double tokens = static_cast<double>(r.train_tokens + r.val_tokens);
  const double s = r.encode_seconds > 0 ? r.encode_seconds : 1e-9;
  std::cout << "tokenized " << inputs.size() << " file(s) with " << tokenizer->description() << ": " << r.train_tokens
            << " train and " << r.val_tokens << " validation tokens into " << r.files.size() << " shard(s) in " << out
            << " (uint" << 8 * r.token_bytes << ")\n";
  char line[160];
  std::snprintf(line, sizeof line, "encoding: %.0f tokens in %.3f s: %.0f tokens/s, %.2f MB/s of text\n", tokens,
                r.encode_seconds, tokens / s, static_cast<double>(r.text_bytes) / s / 1e6);
  std::cout << line;
  return 0;
}

}  // namespace kiln::app
