#include <cmath>
#include <cstdio>
#include <algorithm>
#include <iostream>
#include <optional>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/core/error.hpp"
#include "kiln/data/loader.hpp"
#include "kiln/data/shard.hpp"
#include "kiln/model/generator.hpp"
#include "kiln/ops/backend.hpp"
#include "model_source.hpp"

namespace po = boost::program_options;

namespace kiln::app {

namespace {

// -log p(target) of one position from its logits, in double.
double token_loss(const float* logits, int vocab, int target) {
  double max = logits[0];
  for (int v = 1; v < vocab; ++v) max = std::max(max, static_cast<double>(logits[v]));
  double sum = 0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - max);
  return std::log(sum) + max - logits[target];
}

}  // namespace

int cmd_eval(const Args& args) {
  po::options_description opts(
      "kiln eval MODEL --data SHARDS... [--seq-len T] [--max-sequences N] [--device auto|cpu|cuda]\n"
      "          [--attend-across-documents]\n\n"
      "Prints the mean loss (cross-entropy in nats per predicted token) and perplexity of a model over token "
      "shards\n(llm.c shards, as kiln tokenize writes them): each shard is cut into windows of T + 1 tokens, the "
      "model reads\nT of them and predicts the next, as a training step's validation does. Targets a loss mask "
      "beside a shard\n(SHARD.mask) does not train on are left out, and each token attends only to its own document "
      "there\n(as data.attend_within_documents trains). MODEL is a checkpoint directory (or a\nfolder of them: its "
      "newest), a Hugging Face model directory (Llama or GPT-2) or a GPT-2 .safetensors file.\n\noptions");
  std::string input, device;
  std::vector<std::string> patterns;
  int seq_len = 0;
  std::int64_t max_sequences = 0;
  bool across_documents = false;
  opts.add_options()("help,h", "show this help")("data", po::value(&patterns)->multitoken()->composing(),
                                                  "token shards (glob patterns, e.g. 'data/brown/val_*.bin')")(
      "seq-len", po::value(&seq_len)->default_value(0), "tokens the model reads per window (0: min(1024, its max_seq_len))")(
      "max-sequences", po::value(&max_sequences)->default_value(0), "stop after this many windows (0: all)")(
      "device", po::value(&device)->default_value("auto"), "cpu, cuda, or auto (cuda when there is a GPU)")(
      "attend-across-documents", po::bool_switch(&across_documents),
      "let attention cross the documents the masks mark (as data.attend_within_documents = false)")(
      "input", po::value(&input), "checkpoint, Hugging Face directory or .safetensors file");
  po::positional_options_description pos;
  pos.add("input", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (input.empty()) throw po::error("a MODEL (checkpoint, Hugging Face directory or .safetensors) is required");
  if (patterns.empty()) throw po::error("--data SHARDS is required");
  if (seq_len < 0 || max_sequences < 0) throw po::error("--seq-len and --max-sequences must not be negative");

  auto backend = open_backend(device);
  const ModelSource src = open_model(input);
  model::ModelConfig cfg = src.config;
  const int T = seq_len > 0 ? seq_len : std::min(1024, cfg.max_seq_len);
  if (T > cfg.max_seq_len)
    throw po::error("--seq-len " + std::to_string(T) + " exceeds the model's max_seq_len " + std::to_string(cfg.max_seq_len));
  // The generator's cache holds max_seq_len positions: a Llama (no position table) needs only T.
  if (cfg.llama()) cfg.max_seq_len = T;

  std::vector<std::string> files;
  for (const auto& p : patterns)
    for (auto& f : data::expand_glob(p, "--data")) files.push_back(std::move(f));
  // The windows a training run's validation reads: T + 1 tokens from every multiple of T in each
  // shard, with the loss masks beside the shards (all or none) and their documents' starts.
  std::vector<data::TokenShard> shards;
  for (const auto& f : files) shards.emplace_back(f, data::ShardFormat::auto_);
  std::optional<data::WindowIndex> index;
  try {
    index.emplace(std::move(shards), T);
  } catch (const FileError&) {
    throw;
  } catch (const Error& e) {  // no window fits: the files' fault (exit 2), and the message names them
    throw FileError(cat(e.what(), " (kiln eval --seq-len ", T, ")"));
  }
  const data::WindowIndex& windows = *index;
  const bool documents = windows.masked() && !across_documents;

  model::Generator gen(cfg, *backend, src.weights);
  const int vocab = cfg.vocab_size;
  double total = 0;
  std::int64_t predicted = 0, sequences = 0;
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(T)), targets(inputs.size()), doc_start(inputs.size());
  std::vector<int> ids(inputs.size());
  for (std::uint64_t w = 0; w < windows.windows(); ++w) {
    if (max_sequences > 0 && sequences >= max_sequences) break;
    windows.read(w, inputs.data(), targets.data(), vocab, documents ? doc_start.data() : nullptr);
    std::copy(inputs.begin(), inputs.end(), ids.begin());
    const std::vector<float> logits =
        gen.prefill(ids, true, documents ? std::span<const std::int32_t>(doc_start) : std::span<const std::int32_t>());
    for (int t = 0; t < T; ++t) {
      const int target = targets[static_cast<std::size_t>(t)];
      if (target < 0) continue;  // masked: not trained on
      total += token_loss(logits.data() + static_cast<std::size_t>(t) * vocab, vocab, target);
      ++predicted;
    }
    ++sequences;
  }
  if (predicted == 0)
    KILN_FILE_ERROR(files.front(), (files.size() > 1 ? " and the other shards" : ""),
                    ": every target is masked out by the loss masks; nothing to evaluate");
  const double loss = total / static_cast<double>(predicted);
  char line[256];
  std::snprintf(line, sizeof line, "loss %.6f, perplexity %.4f over %lld tokens (%lld windows of %d) from %zu shard(s)\n",
                loss, std::exp(loss), static_cast<long long>(predicted), static_cast<long long>(sequences), T, files.size());
  std::cout << "eval: " << src.description << " on " << backend->name() << "\n" << line;
  return 0;
}

}  // namespace kiln::app
