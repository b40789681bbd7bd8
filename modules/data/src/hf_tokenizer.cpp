// Hugging Face tokenizer.json (byte-level BPE) into kiln's BpeVocabulary: the model, the added
// tokens and the document token here, the steps around the model in hf_pipeline.cpp. Every error
// names the file and the key ("model.merges[17]"). Where tokenizers decides something from the
// file (merge ranks, added tokens' ids), this does what tokenizers does, so that the ids are its ids.
#include "kiln/data/hf_tokenizer.hpp"

#include <filesystem>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "hf_json.hpp"
#include "vocab_files.hpp"

namespace kiln::data {

namespace {

using detail::json;
using detail::Reader;
using detail::shown;

// The model's vocabulary and merges, as tokenizers' BPE builds them.
struct Model {
  std::unordered_map<std::string, std::uint32_t> id_of;  // the token as written in the file -> id
  std::vector<std::pair<std::string, std::uint32_t>> unwritable;  // tokens outside the byte alphabet
  std::size_t size = 0;  // entries of model.vocab: where tokenizers numbers new added tokens from
};

void check_model_options(const Reader& r, const json& model) {
  if (const json* t = Reader::member(model, "type")) {
    if (!t->is_string()) r.fail("model.type", cat("is ", shown(*t), ", expected \"BPE\""));
    const std::string type = t->get<std::string>();
    const char* what = type == "Unigram"     ? " (a SentencePiece unigram model)"
                       : type == "WordPiece" ? " (BERT's WordPiece)"
                       : type == "WordLevel" ? " (a word-level vocabulary)"
                                             : "";
    if (type != "BPE") r.fail("model.type", cat("is ", shown(*t), what, "; kiln reads byte-level BPE tokenizers only"));
  } else if (!Reader::member(model, "merges")) {
    r.fail("model.type", "is missing, and a model without merges is not BPE; kiln reads byte-level BPE tokenizers only");
  }
  if (r.flag(model, "model.byte_fallback", "byte_fallback", false))
    r.fail("model.byte_fallback", "is true (a SentencePiece model converted to BPE, as Llama 2 and Mistral ship "
                                  "it); kiln reads byte-level BPE tokenizers only");
  if (const json* d = Reader::member(model, "dropout"); d && !(d->is_number() && d->get<double>() == 0))
    r.fail("model.dropout", cat("is ", shown(*d), "; BPE dropout makes encoding random (expected null)"));
  for (const char* name : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = Reader::member(model, name); v && *v != "")
      r.fail(cat("model.", name), cat("is ", shown(*v), "; byte-level BPE has none (expected null or \"\")"));
}

Model read_model(const Reader& r, const json& model, BpeVocabulary& v) {
  const detail::Gpt2ByteAlphabet alphabet;
  Model m;
  const json& vocab = r.object(model, "model.vocab", "vocab");
  m.size = vocab.size();
  const std::int64_t id_limit = detail::dense_id_limit(vocab.size());
  std::vector<const std::string*> written;  // id -> its key, for messages
  std::string bytes;
  for (const auto& [key, value] : vocab.items()) {
    const std::string at = cat("model.vocab[", json(key).dump(), "]");
    if (!value.is_number_integer() || value.get<std::int64_t>() < 0 || value.get<std::int64_t>() >= id_limit)
      r.fail(at, cat("is ", shown(value), ", expected an id in [0, ", id_limit, ") (the ", vocab.size(),
                     " tokens are numbered densely from 0)"));
    const auto id = value.get<std::uint32_t>();
    if (id >= v.tokens.size()) v.tokens.resize(id + 1), written.resize(id + 1, nullptr);
    if (written[id]) r.fail(at, cat("has the id ", id, ", as ", json(*written[id]).dump(), " does"));
    const auto [it, fresh] = m.id_of.emplace(key, id);
    written[id] = &it->first;
    if (alphabet.decode(key, bytes))
      v.tokens[id] = bytes;
    else
      v.tokens[id] = key, m.unwritable.emplace_back(key, id);  // fine for an added token's content only
  }
  v.specials_from = static_cast<std::uint32_t>(v.tokens.size());
  v.whole_piece_tokens = r.flag(model, "model.ignore_merges", "ignore_merges", false);

  const json& merges = r.array(model, "model.merges", "merges");
  std::unordered_map<std::uint64_t, std::size_t> index_of_pair;
  for (std::size_t i = 0; i < merges.size(); ++i) {
    const json& e = merges[i];
    const std::string at = cat("model.merges[", i, "]");
    std::string left, right;
    if (e.is_string()) {  // "a b" (older files); tokenizers wants exactly one space
      const std::string s = e.get<std::string>();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        r.fail(at, cat("is ", shown(e), ", expected \"LEFT RIGHT\" (two tokens and one space)"));
      left = s.substr(0, space), right = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {  // newer files
      left = e[0].get<std::string>(), right = e[1].get<std::string>();
    } else {
      r.fail(at, cat("is ", shown(e), ", expected \"LEFT RIGHT\" or [\"LEFT\", \"RIGHT\"]"));
    }
    auto find = [&](const std::string& token, const char* what) {
      auto it = m.id_of.find(token);
      if (it == m.id_of.end())
        r.fail(at, cat("(", shown(e), ") ", what, " ", json(token).dump(), ", which is not a token of model.vocab"));
      return it->second;
    };
    const std::uint32_t l = find(left, "names"), rt = find(right, "names"), result = find(left + right, "makes");
    // tokenizers keeps a pair's last rank when the pair is given twice.
    const auto rank = static_cast<std::uint32_t>(i);
    const auto [it, fresh] = index_of_pair.emplace((std::uint64_t{l} << 32) | rt, v.merges.size());
    if (fresh)
      v.merges.push_back({l, rt, result, rank});
    else
      v.merges[it->second].rank = rank;
  }
  return m;
}

// The added tokens, checked against the ids tokenizers gives them: a token of model.vocab keeps its
// id there, the others are numbered on from model.vocab's size in the file's order.
void read_added_tokens(const Reader& r, const json& doc, const Model& m, BpeVocabulary& v) {
  const json* list = Reader::member(doc, "added_tokens");
  if (!list) return;
  if (!list->is_array()) r.fail("added_tokens", cat("is ", shown(*list), ", expected a list"));
  auto next_id = static_cast<std::uint32_t>(m.size);
  std::unordered_map<std::string, std::size_t> index_of;
  const std::int64_t id_limit = detail::dense_id_limit(m.size + list->size());
  for (std::size_t i = 0; i < list->size(); ++i) {
    const json& e = (*list)[i];
    const std::string at = cat("added_tokens[", i, "]");
    if (!e.is_object()) r.fail(at, cat("is ", shown(e), ", expected an object"));
    AddedToken t;
    t.content = r.string(e, at + ".content", "content");
    t.special = r.flag(e, at + ".special", "special", false);
    t.normalized = r.flag(e, at + ".normalized", "normalized", !t.special);
    t.lstrip = r.flag(e, at + ".lstrip", "lstrip", false);
    t.rstrip = r.flag(e, at + ".rstrip", "rstrip", false);
    t.single_word = r.flag(e, at + ".single_word", "single_word", false);
    const json* id = Reader::member(e, "id");
    if (!id || !id->is_number_integer() || id->get<std::int64_t>() < 0 || id->get<std::int64_t>() >= id_limit)
      r.fail(at + ".id", cat("is ", id ? shown(*id) : "missing", ", expected an id in [0, ", id_limit, ")"));
    t.id = id->get<std::uint32_t>();
    if (t.content.empty()) continue;  // tokenizers skips these
    const auto [seen, fresh] = index_of.emplace(t.content, i);
    if (!fresh) r.fail(at, cat("repeats the content ", json(t.content).dump(), " of added_tokens[", seen->second, "]"));
    const auto in_vocab = m.id_of.find(t.content);
    const std::uint32_t expected = in_vocab != m.id_of.end() ? in_vocab->second : next_id++;
    const char* why = in_vocab != m.id_of.end() ? " (its id in model.vocab)"
                                                : " (added tokens not in model.vocab are numbered on from its size)";
    if (t.id != expected)
      r.fail(at + ".id", cat("is ", t.id, ", but tokenizers gives ", json(t.content).dump(), " the id ", expected, why));
    if (t.id >= v.tokens.size()) v.tokens.resize(t.id + 1);
    // A normalized token decodes as its normalized content, as tokenizers decodes it.
    std::string buffer;
    if (in_vocab == m.id_of.end())
      v.tokens[t.id] = t.normalized ? std::string(normalize(v.normalization, t.content, buffer)) : t.content;
    v.added_tokens.push_back(std::move(t));
  }
  for (const auto& [key, id] : m.unwritable)
    if (!index_of.contains(key))
      r.fail(cat("model.vocab[", json(key).dump(), "]"),
             "has characters outside GPT-2's byte alphabet and is no added token: not a byte-level BPE vocabulary");
}

// bos_token, then eos_token, of tokenizer_config.json beside the file: a name or {"content": name}.
std::optional<std::uint32_t> config_token(const std::string& tokenizer_json, const std::vector<AddedToken>& added) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(tokenizer_json).parent_path() / "tokenizer_config.json").string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  const json config = detail::parse_json(path, detail::read_file(path, "tokenizer_config.json"));
  if (!config.is_object()) KILN_FILE_ERROR(path, ": expected a JSON object");
  for (const char* key : {"bos_token", "eos_token"}) {
    const json* v = Reader::member(config, key);
    if (v && v->is_object()) v = Reader::member(*v, "content");
    if (!v) continue;
    if (!v->is_string()) KILN_FILE_ERROR(path, ": ", key, " is ", shown(*v), ", expected a token's name");
    for (const auto& t : added)
      if (t.content == v->get<std::string>()) return t.id;
    KILN_FILE_ERROR(path, ": ", key, " ", shown(*v), " is no added token of ", tokenizer_json);
  }
  return std::nullopt;
}

}  // namespace

BpeVocabulary read_hf_tokenizer_json(const std::string& path) {
  const std::string text = detail::read_file(path, "a Hugging Face tokenizer.json");
  const json doc = detail::parse_json(path, text);
  const Reader r{path};
  if (!doc.is_object()) r.fail("the document", "is not a JSON object");
  if (const json* version = Reader::member(doc, "version"); version && *version != "1.0")
    r.fail("version", cat("is ", shown(*version), ", expected \"1.0\""));
  // (truncation and padding cut and pad encodings to fixed lengths; kiln encodes whole texts.)
  const json& model = r.object(doc, "model", "model");
  check_model_options(r, model);
  BpeVocabulary v;
  v.normalization = detail::read_normalizer(r, doc);
  detail::read_pre_tokenizer(r, doc, v);
  detail::check_decoder(r, doc);
  const Model m = read_model(r, model, v);
  read_added_tokens(r, doc, m, v);
  v.description = cat("Hugging Face BPE (", path, ", ", v.tokens.size(), " tokens)");

  if (const json* p = Reader::member(doc, "post_processor"))
    v.document_separator = detail::post_processor_token(r, *p, "post_processor");
  if (v.document_separator && (*v.document_separator >= v.tokens.size() || v.tokens[*v.document_separator].empty()))
    r.fail("post_processor", cat("puts the id ", *v.document_separator, " before a text, which has no token"));
  if (!v.document_separator)
    for (const auto& t : v.added_tokens)
      if (t.special && t.content == "<|endoftext|>") v.document_separator = t.id;
  if (!v.document_separator) v.document_separator = config_token(path, v.added_tokens);
  return v;
}

}  // namespace kiln::data
