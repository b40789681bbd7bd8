#include "kiln/data/tokenizer.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kiln/data/shard.hpp"
#include "kiln/core/error.hpp"

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
  std::string text;
  for (auto& path : inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) KILN_THROW(path, ": cannot read the input text");
    std::stringstream ss;
    ss << in.rdbuf();
    std::string t = options.strip_pos_tags ? strip_pos_tags(ss.str()) : ss.str();
    if (!text.empty() && text.back() != '\n') text += '\n';
    text += t;
  }
  auto tokens = byte_encode(text);
  const std::size_t n_val = static_cast<std::size_t>(static_cast<double>(tokens.size()) * options.val_fraction);
  const std::size_t n_train = tokens.size() - n_val;
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) KILN_THROW(out_dir, ": cannot create the output directory: ", ec.message());
  TokenizeResult result;
  result.train_tokens = static_cast<std::int64_t>(n_train);
  result.val_tokens = static_cast<std::int64_t>(n_val);
  auto write = [&](const char* split, std::size_t begin, std::size_t end) {
    int index = 0;
    for (std::size_t s = begin; s < end;) {
      std::size_t e = std::min(end, s + static_cast<std::size_t>(options.shard_tokens));
      char name[64];
      std::snprintf(name, sizeof name, "%s_%06d.bin", split, index++);
      auto path = (std::filesystem::path(out_dir) / name).string();
      write_llmc_shard(path, std::span<const std::uint16_t>(tokens.data() + s, e - s));
      result.files.push_back(path);
      s = e;
    }
  };
  write("train", 0, n_train);
  write("val", n_train, tokens.size());
  return result;
}

}  // namespace kiln::data
