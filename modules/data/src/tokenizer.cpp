#include "kiln/data/tokenizer.hpp"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/core/error.hpp"
#include "kiln/data/bpe.hpp"
#include "kiln/data/hf_tokenizer.hpp"
#include "kiln/data/shard.hpp"

namespace kiln::data {

std::vector<std::uint16_t> byte_encode(std::string_view text) {
  std::vector<std::uint16_t> out(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
  return out;
}

std::string byte_decode(const std::vector<std::uint16_t>& tokens) {
  std::string s(tokens.size(), '\0');
  for (std::size_t i = 0; i < tokens.size(); ++i) s[i] = static_cast<char>(tokens[i] & 0xff);
  return s;
}

void ByteTokenizer::encode(std::string_view text, std::vector<std::uint32_t>& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  out.insert(out.end(), p, p + text.size());
}

std::string ByteTokenizer::decode(std::span<const std::uint32_t> ids) const {
  std::string s(ids.size(), '\0');
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] > 255) KILN_THROW("token id ", ids[i], " is not a byte (the byte tokenizer has 256 tokens)");
    s[i] = static_cast<char>(ids[i]);
  }
  return s;
}

std::optional<std::string> find_gpt2_files(const std::vector<std::string>& dirs) {
  namespace fs = std::filesystem;
  for (const auto& d : dirs) {
    std::error_code ec;
    if (fs::is_regular_file(fs::path(d) / "encoder.json", ec) && fs::is_regular_file(fs::path(d) / "vocab.bpe", ec))
      return d;
  }
  return std::nullopt;
}

std::unique_ptr<TextTokenizer> open_tokenizer(const std::string& spec, const std::vector<std::string>& gpt2_dirs) {
  namespace fs = std::filesystem;
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  auto gpt2_in = [](const std::string& dir) {
    return std::make_unique<BpeTokenizer>(read_gpt2_vocabulary((fs::path(dir) / "encoder.json").string(),
                                                               (fs::path(dir) / "vocab.bpe").string()));
  };
  if (spec == "gpt2") {
    if (auto dir = find_gpt2_files(gpt2_dirs)) return gpt2_in(*dir);
    std::string where;
    for (const auto& d : gpt2_dirs) where += cat(where.empty() ? "" : ", ", d);
    KILN_FILE_ERROR("tokenizer gpt2: GPT-2's encoder.json and vocab.bpe are in none of: ", where.empty() ? "(no place)" : where,
                    " (scripts/fetch-tokenizers.sh fetches them; or give their directory)");
  }
  std::error_code ec;
  auto hf = [](const fs::path& file) { return std::make_unique<BpeTokenizer>(read_hf_tokenizer_json(file.string())); };
  if (fs::is_directory(spec, ec)) {
    // A Hugging Face model's directory: tokenizer.json (beside vocab.json + merges.txt, which it holds too).
    if (fs::is_regular_file(fs::path(spec) / "tokenizer.json", ec)) return hf(fs::path(spec) / "tokenizer.json");
    if (!find_gpt2_files({spec}))
      KILN_FILE_ERROR(spec, ": a tokenizer directory must hold a Hugging Face tokenizer.json or GPT-2's encoder.json "
                      "and vocab.bpe");
    return gpt2_in(spec);
  }
  if (fs::is_regular_file(spec, ec)) {
    // tiktoken rank files (.tiktoken, Llama 3's tokenizer.model) are never named .json.
    if (fs::path(spec).extension() == ".json") return hf(spec);
    return std::make_unique<BpeTokenizer>(read_tiktoken_vocabulary(spec));
  }
  KILN_FILE_ERROR("tokenizer \"", spec, "\": not bytes, gpt2, a Hugging Face tokenizer.json or a directory with one, a "
                  "directory with encoder.json + vocab.bpe, or a tiktoken rank file (no such file or directory)");
}

std::string strip_pos_tags(std::string_view tagged) {
  std::string out;
  std::istringstream lines{std::string(tagged)};
  std::string line;
  auto is_closing = [](const std::string& w) {
    return w == "." || w == "," || w == ";" || w == ":" || w == "?" || w == "!" || w == ")" || w == "'" ||
           w == "'s" || w == "n't";
  };
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string item, sentence;
    bool glue_next = false;  // no space before the next word (after an opening quote or bracket)
    while (words >> item) {
      auto slash = item.rfind('/');
      std::string w = slash == std::string::npos || slash == 0 ? item : item.substr(0, slash);
      if (w == "``") {
        if (!sentence.empty()) sentence += ' ';
        sentence += '"';
        glue_next = true;
        continue;
      }
      if (w == "''") {
        sentence += '"';
        glue_next = false;
        continue;
      }
      if (!sentence.empty() && !glue_next && !is_closing(w)) sentence += ' ';
      sentence += w;
      glue_next = (w == "(");
    }
    if (!sentence.empty()) out += sentence + '\n';
  }
  return out;
}

TokenizeResult tokenize_files(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const TokenizeOptions& options) {
  if (inputs.empty()) KILN_THROW("tokenize: no input files");
  if (options.val_fraction < 0 || options.val_fraction >= 1)
    KILN_THROW("tokenize: the validation fraction must be in [0, 1), got ", options.val_fraction);
  if (options.shard_tokens <= 0) KILN_THROW("tokenize: shard size must be positive");
  ByteTokenizer bytes;
  TextTokenizer& tokenizer = options.tokenizer ? *options.tokenizer : bytes;
  const auto separator = tokenizer.document_separator();
  TokenizeResult result;
  std::vector<std::uint32_t> tokens;
  std::string text;  // without a separator, the files are joined into one text
  double seconds = 0;
  auto encode = [&](std::string_view t) {
    const auto start = std::chrono::steady_clock::now();
    tokenizer.encode(t, tokens);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.text_bytes += static_cast<std::int64_t>(t.size());
  };
  for (auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) KILN_FILE_ERROR(path, ": cannot read the input text");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string t = options.strip_pos_tags ? strip_pos_tags(ss.str()) : ss.str();
    if (separator) {
      tokens.push_back(*separator);
      encode(t);
    } else {
      if (!text.empty() && text.back() != '\n') text += '\n';
      text += t;
    }
  }
  if (!separator) encode(text);
  result.encode_seconds = seconds;
  const bool wide = tokenizer.vocab_size() > 65536;
  result.token_bytes = wide ? 4 : 2;
  const std::size_t n_val = static_cast<std::size_t>(static_cast<double>(tokens.size()) * options.val_fraction);
  const std::size_t n_train = tokens.size() - n_val;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) KILN_FILE_ERROR(out_dir, ": cannot create the output directory: ", ec.message());
  result.train_tokens = static_cast<std::int64_t>(n_train);
  result.val_tokens = static_cast<std::int64_t>(n_val);
  const std::span<const std::uint32_t> all(tokens);
  for (const auto& [split, part] : {std::pair{"train", all.first(n_train)}, std::pair{"val", all.subspan(n_train)}})
    for (auto& f : write_split_shards(out_dir, split, part, {}, options.shard_tokens, wide))
      result.files.push_back(std::move(f));
  return result;
}

}  // namespace kiln::data
