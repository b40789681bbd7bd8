// Readers of BPE vocabularies: GPT-2's encoder.json + vocab.bpe and tiktoken's rank files. Every
// error names the file and, where there is one, the line.
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "kiln/data/bpe.hpp"
#include "vocab_files.hpp"

namespace kiln::data {

namespace {

using detail::dense_id_limit;
using detail::Gpt2ByteAlphabet;
using detail::place;
using detail::read_file;

// Calls f(line_number, line) for each line (without its "\n" or "\r\n").
template <class F>
void for_each_line(const std::string& text, F&& f) {
  std::size_t begin = 0;
  for (std::size_t number = 1; begin < text.size(); ++number) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    f(number, line);
    begin = end + 1;
  }
}

// Where a key of encoder.json is written, for messages ("" when it cannot be found).
std::string key_place(const std::string& text, const std::string& key) {
  for (bool ascii : {true, false}) {
    const std::string quoted = nlohmann::json(key).dump(-1, ' ', ascii);
    if (auto at = text.find(quoted); at != std::string::npos) return place(text, at) + ":";
  }
  return "";
}

std::string base64_decode(std::string_view s, bool& ok) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  ok = !s.empty() && s.size() % 4 == 0;
  for (std::size_t i = 0; ok && i < s.size(); i += 4) {
    const bool last = i + 4 == s.size();
    const int pad = last ? (s[i + 3] == '=') + (s[i + 2] == '=' && s[i + 3] == '=') : 0;
    int v[4] = {};
    for (int k = 0; k < 4 - pad; ++k)
      if ((v[k] = value(s[i + k])) < 0) ok = false;
    if (!ok) break;
    const std::uint32_t w = (std::uint32_t(v[0]) << 18) | (std::uint32_t(v[1]) << 12) | (std::uint32_t(v[2]) << 6) | v[3];
    out += static_cast<char>(w >> 16);
    if (pad < 2) out += static_cast<char>((w >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(w & 0xff);
  }
  return out;
}

// Names of the special tokens that follow the ranks of the two tiktoken files kiln knows.
std::vector<std::pair<std::uint32_t, std::string>> known_specials(std::size_t ranks) {
  std::vector<std::pair<std::uint32_t, std::string>> s;
  if (ranks == 100256) {  // cl100k_base
    s = {{100257, "<|endoftext|>"}, {100258, "<|fim_prefix|>"}, {100259, "<|fim_middle|>"},
         {100260, "<|fim_suffix|>"}, {100276, "<|endofprompt|>"}};
  } else if (ranks == 128000) {  // Llama 3 (3.1's names)
    const char* named[] = {"<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                           "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                           "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"};
    for (std::uint32_t i = 0; i < 256; ++i)
      s.emplace_back(128000 + i, i < 11 ? std::string(named[i]) : cat("<|reserved_special_token_", i - 11 + 3, "|>"));
  }
  return s;
}

}  // namespace

BpeVocabulary read_gpt2_vocabulary(const std::string& encoder_json, const std::string& vocab_bpe) {
  const Gpt2ByteAlphabet alphabet;
  BpeVocabulary v;
  v.pattern = PretokenizePattern::gpt2;
  const std::string json_text = read_file(encoder_json, "GPT-2's encoder.json");
  const nlohmann::json doc = detail::parse_json(encoder_json, json_text);
  if (!doc.is_object()) KILN_FILE_ERROR(encoder_json, ":1:1: expected a JSON object {\"token\": id, ...}");
  std::unordered_map<std::string, std::uint32_t> id_of;  // the token as written in the files -> id
  std::vector<std::string> written;                       // id -> the token as written
  std::string bytes;
  // Ids are numbered densely from 0: one far beyond the number of tokens is an error, not a table
  // of that size (a 16-byte file must not make kiln allocate gigabytes).
  const std::int64_t id_limit = dense_id_limit(doc.size());
  for (const auto& [key, value] : doc.items()) {
    if (!value.is_number_integer() || value.get<std::int64_t>() < 0 || value.get<std::int64_t>() >= id_limit)
      KILN_FILE_ERROR(encoder_json, ":", key_place(json_text, key), " token \"", key, "\" has the id ", value.dump(),
                      ", expected an integer in [0, ", id_limit, ") (the ", doc.size(),
                      " tokens are numbered densely from 0)");
    const auto id = value.get<std::uint32_t>();
    if (!alphabet.decode(key, bytes))
      KILN_FILE_ERROR(encoder_json, ":", key_place(json_text, key), " token \"", key,
                      "\" has a character outside GPT-2's byte alphabet");
    if (id >= v.tokens.size()) v.tokens.resize(id + 1), written.resize(id + 1);
    if (!v.tokens[id].empty())
      KILN_FILE_ERROR(encoder_json, ":", key_place(json_text, key), " tokens \"", written[id], "\" and \"", key,
                      "\" have the same id ", id);
    v.tokens[id] = bytes;
    written[id] = key;
    id_of.emplace(key, id);
  }
  if (auto it = id_of.find("<|endoftext|>"); it != id_of.end()) {
    v.document_separator = it->second;
    if (it->second + 1 == v.tokens.size()) v.specials_from = it->second;
    v.added_tokens.push_back({.content = it->first, .id = it->second, .special = true});
  }

  const std::string merges_text = read_file(vocab_bpe, "GPT-2's vocab.bpe");
  std::unordered_map<std::uint64_t, std::size_t> line_of_pair;
  for_each_line(merges_text, [&](std::size_t line, std::string_view text) {
    if (text.empty() || (line == 1 && text.starts_with("#version"))) return;
    const auto space = text.find(' ');
    if (space == std::string_view::npos || space == 0 || space + 1 == text.size() ||
        text.find(' ', space + 1) != std::string_view::npos)
      KILN_FILE_ERROR(vocab_bpe, ":", line, ": expected a merge \"LEFT RIGHT\" (two tokens and one space), got \"", text,
                      "\"");
    const std::string left(text.substr(0, space)), right(text.substr(space + 1));
    auto find = [&](const std::string& t) {
      auto it = id_of.find(t);
      if (it == id_of.end())
        KILN_FILE_ERROR(vocab_bpe, ":", line, ": \"", t, "\" (in \"", text, "\") is not a token of ", encoder_json);
      return it->second;
    };
    const std::uint32_t l = find(left), r = find(right);
    auto result = id_of.find(left + right);
    if (result == id_of.end())
      KILN_FILE_ERROR(vocab_bpe, ":", line, ": merging \"", left, "\" and \"", right, "\" makes \"", left + right,
                      "\", which ", encoder_json, " does not have");
    const auto [it, fresh] = line_of_pair.emplace((std::uint64_t{l} << 32) | r, line);
    if (!fresh) KILN_FILE_ERROR(vocab_bpe, ":", line, ": the merge \"", text, "\" was already given on line ", it->second);
    v.merges.push_back({l, r, result->second, static_cast<std::uint32_t>(v.merges.size())});
  });
  if (v.merges.empty()) KILN_FILE_ERROR(vocab_bpe, ": no merges (expected lines \"LEFT RIGHT\")");
  v.description = cat("GPT-2 BPE (", encoder_json, " + ", vocab_bpe, ", ", v.tokens.size(), " tokens)");
  return v;
}

BpeVocabulary read_tiktoken_vocabulary(const std::string& path) {
  BpeVocabulary v;
  v.pattern = PretokenizePattern::cl100k;
  v.whole_piece_tokens = true;
  const std::string text = read_file(path, "a tiktoken rank file");
  std::unordered_map<std::string, std::uint32_t> rank_of;
  std::vector<std::size_t> line_of_rank;
  std::size_t ranks = 0, entries = 0;
  for_each_line(text, [&](std::size_t, std::string_view l) { entries += !l.empty(); });
  const std::int64_t rank_limit = dense_id_limit(entries);  // ranks are numbered densely from 0
  for_each_line(text, [&](std::size_t line, std::string_view l) {
    if (l.empty()) return;
    const auto space = l.find(' ');
    if (space == std::string_view::npos || l.find(' ', space + 1) != std::string_view::npos)
      KILN_FILE_ERROR(path, ":", line, ": expected \"BASE64_TOKEN RANK\", got \"", l.substr(0, 80), "\"");
    bool ok = false;
    std::string token = base64_decode(l.substr(0, space), ok);
    if (!ok) KILN_FILE_ERROR(path, ":", line, ": \"", l.substr(0, space), "\" is not a base64 token");
    const std::string_view digits = l.substr(space + 1);
    std::uint64_t rank = 0;
    bool number = !digits.empty() && digits.size() <= 9;
    for (char c : digits) number = number && c >= '0' && c <= '9', rank = rank * 10 + static_cast<unsigned>(c - '0');
    if (!number) KILN_FILE_ERROR(path, ":", line, ": the rank \"", digits, "\" is not a number below 10^9");
    if (static_cast<std::int64_t>(rank) >= rank_limit)
      KILN_FILE_ERROR(path, ":", line, ": rank ", rank, " is far beyond the file's ", entries,
                      " entries (ranks are numbered densely from 0; expected below ", rank_limit, ")");
    if (rank >= v.tokens.size()) v.tokens.resize(rank + 1), line_of_rank.resize(rank + 1, 0);
    if (line_of_rank[rank])
      KILN_FILE_ERROR(path, ":", line, ": rank ", rank, " is given twice (first on line ", line_of_rank[rank], ")");
    const auto [it, fresh] = rank_of.emplace(token, static_cast<std::uint32_t>(rank));
    if (!fresh)
      KILN_FILE_ERROR(path, ":", line, ": token \"", l.substr(0, space), "\" is given twice (first with rank ", it->second,
                      ", on line ", line_of_rank[it->second], ")");
    v.tokens[rank] = std::move(token);
    line_of_rank[rank] = line;
    ++ranks;
  });
  if (ranks == 0) KILN_FILE_ERROR(path, ": no ranks (expected lines \"BASE64_TOKEN RANK\")");
  // tiktoken merges a pair when the joined bytes are a token, at that token's rank.
  for (std::uint32_t id = 0; id < v.tokens.size(); ++id) {
    const std::string& t = v.tokens[id];
    for (std::size_t k = 1; k < t.size(); ++k) {
      auto l = rank_of.find(t.substr(0, k));
      if (l == rank_of.end()) continue;
      auto r = rank_of.find(t.substr(k));
      if (r != rank_of.end()) v.merges.push_back({l->second, r->second, id, id});
    }
  }
  v.specials_from = static_cast<std::uint32_t>(v.tokens.size());
  const auto specials = known_specials(ranks);
  for (const auto& [id, name] : specials) {
    if (id >= v.tokens.size()) v.tokens.resize(id + 1);
    v.tokens[id] = name;
    v.added_tokens.push_back({.content = name, .id = id, .special = true});
  }
  if (ranks == 100256) v.document_separator = 100257;
  if (ranks == 128000) v.document_separator = 128000;
  v.description = cat("tiktoken BPE (", path, ", ", ranks, " ranks", specials.empty() ? "" : " + special tokens", ", ",
                      v.tokens.size(), " tokens)");
  return v;
}

}  // namespace kiln::data
