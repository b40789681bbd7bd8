#pragma once
// The parts of a Hugging Face tokenizer.json reader that its two files share (hf_tokenizer.cpp:
// model, added tokens, document token; hf_pipeline.cpp: normalizer, pre-tokenizer, decoder,
// post-processor): a reader of JSON members whose errors name the file and the key.
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "kiln/data/bpe.hpp"

namespace kiln::data::detail {

using json = nlohmann::json;

// A value as the file writes it, cut short for messages.
inline std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// Errors are FileErrors "PATH: KEY WHAT" ("tokenizer.json: model.type is \"Unigram\" ...").
struct Reader {
  const std::string& path;

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    KILN_FILE_ERROR(path, ": ", key, " ", what);
  }
  // The member `name` of `object` (at `key`), nullptr when absent or null.
  static const json* member(const json& object, const char* name) {
    auto it = object.find(name);
    return it == object.end() || it->is_null() ? nullptr : &*it;
  }
  const json& object(const json& parent, const std::string& key, const char* name) const {
    const json* v = member(parent, name);
    if (!v) fail(key, "is missing");
    if (!v->is_object()) fail(key, cat("is ", shown(*v), ", expected an object"));
    return *v;
  }
  const json& array(const json& parent, const std::string& key, const char* name) const {
    const json* v = member(parent, name);
    if (!v) fail(key, "is missing");
    if (!v->is_array()) fail(key, cat("is ", shown(*v), ", expected a list"));
    return *v;
  }
  std::string string(const json& parent, const std::string& key, const char* name) const {
    const json* v = member(parent, name);
    if (!v) fail(key, "is missing");
    if (!v->is_string()) fail(key, cat("is ", shown(*v), ", expected a string"));
    return v->get<std::string>();
  }
  bool flag(const json& parent, const std::string& key, const char* name, bool otherwise) const {
    const json* v = member(parent, name);
    if (v && !v->is_boolean()) fail(key, cat("is ", shown(*v), ", expected true or false"));
    return v ? v->get<bool>() : otherwise;
  }
  std::string type(const json& step, const std::string& key) const {
    if (!step.is_object()) fail(key, cat("is ", shown(step), ", expected an object with a \"type\""));
    return string(step, key + ".type", "type");
  }
};

Normalization read_normalizer(const Reader& r, const json& doc);
// Into v.pattern or v.regex: ByteLevel alone, after Digits, or after a Split (without its own pattern).
void read_pre_tokenizer(const Reader& r, const json& doc, BpeVocabulary& v);
void check_decoder(const Reader& r, const json& doc);
// The one special token the post-processor `p` (at `key`) puts before a text (else after it), if any.
std::optional<std::uint32_t> post_processor_token(const Reader& r, const json& p, const std::string& key);

}  // namespace kiln::data::detail
