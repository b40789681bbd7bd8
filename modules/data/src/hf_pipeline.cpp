// The steps around the model in a Hugging Face tokenizer.json: normalizer (none or NFC),
// pre-tokenizer (ByteLevel, after a Split or Digits or alone), decoder (ByteLevel) and post-processor
// (what it puts before a text: the document token).
#include <cctype>
#include <vector>

#include "hf_json.hpp"

namespace kiln::data::detail {

Normalization read_normalizer(const Reader& r, const json& doc) {
  const json* n = Reader::member(doc, "normalizer");
  if (!n) return Normalization::none;
  std::vector<std::pair<std::string, const json*>> steps;
  if (r.type(*n, "normalizer") == "Sequence") {
    const json& list = r.array(*n, "normalizer.normalizers", "normalizers");
    for (std::size_t i = 0; i < list.size(); ++i) steps.emplace_back(cat("normalizer.normalizers[", i, "]"), &list[i]);
  } else {
    steps.emplace_back("normalizer", n);
  }
  for (const auto& [key, step] : steps)
    if (const std::string t = r.type(*step, key); t != "NFC")
      r.fail(key + ".type", cat("is ", json(t).dump(), "; kiln implements no normalizer but NFC (Qwen2's)"));
  return steps.empty() ? Normalization::none : Normalization::nfc;
}

void read_pre_tokenizer(const Reader& r, const json& doc, BpeVocabulary& v) {
  const json* pre = Reader::member(doc, "pre_tokenizer");
  if (!pre) r.fail("pre_tokenizer", "is missing; byte-level BPE needs the ByteLevel pre-tokenizer");
  std::vector<std::pair<std::string, const json*>> steps;
  if (r.type(*pre, "pre_tokenizer") == "Sequence") {
    const json& list = r.array(*pre, "pre_tokenizer.pretokenizers", "pretokenizers");
    for (std::size_t i = 0; i < list.size(); ++i) steps.emplace_back(cat("pre_tokenizer.pretokenizers[", i, "]"), &list[i]);
  } else {
    steps.emplace_back("pre_tokenizer", pre);
  }
  std::optional<std::string> split;  // the Split's pattern, for PCRE2
  std::optional<bool> digits;        // a Digits step: individual_digits
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& [key, step] = steps[k];
    const std::string t = r.type(*step, key);
    if (t == "Digits") {
      if (split || digits) r.fail(key, "follows a Split or Digits; kiln splits text by one pattern");
      digits = r.flag(*step, key + ".individual_digits", "individual_digits", false);
    } else if (t == "Split") {
      if (split || digits) r.fail(key, "follows a Split or Digits; kiln splits text by one pattern");
      if (const std::string b = r.string(*step, key + ".behavior", "behavior"); b != "Isolated")
        r.fail(key + ".behavior", cat("is ", json(b).dump(), "; kiln keeps each match as a piece (\"Isolated\") only"));
      if (r.flag(*step, key + ".invert", "invert", false)) r.fail(key + ".invert", "is true; kiln splits at matches only");
      const json& pattern = r.object(*step, key + ".pattern", "pattern");
      if (Reader::member(pattern, "Regex")) {
        const std::string onig = r.string(pattern, key + ".pattern.Regex", "Regex");
        try {
          split = pcre2_from_oniguruma(onig);
          Pretokenizer compiles(*split);
        } catch (const FileError&) {
          throw;
        } catch (const Error& e) {
          r.fail(key + ".pattern.Regex", cat("cannot be used: ", e.what()));
        }
      } else {
        std::string literal;  // tokenizers escapes a String pattern into a regex
        for (char c : r.string(pattern, key + ".pattern.String", "String")) {
          if (static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) literal += '\\';
          literal += c;
        }
        split = literal;
      }
    } else if (t == "ByteLevel") {
      if (k + 1 != steps.size()) r.fail(key, "is followed by another pre-tokenizer; ByteLevel comes last");
      if (r.flag(*step, key + ".add_prefix_space", "add_prefix_space", false))
        r.fail(key + ".add_prefix_space", "is true; kiln adds no space before text (GPT-2, Llama 3 and Qwen2 add none)");
      const bool own_pattern = r.flag(*step, key + ".use_regex", "use_regex", true);
      if (own_pattern && split) r.fail(key + ".use_regex", "is true after a Split; kiln splits text by one pattern");
      if (digits)
        v.regex = digits_then_regex(*digits, own_pattern);
      else if (own_pattern)
        v.pattern = PretokenizePattern::gpt2;
      else
        v.regex = split ? *split : std::string("(?s).+");  // no pattern: the whole text is one piece
      return;
    } else {
      const char* what = t == "Metaspace" ? " (SentencePiece's)" : "";
      r.fail(key + ".type", cat("is ", json(t).dump(), what, "; kiln reads byte-level BPE pre-tokenizers only: ByteLevel, "
                                                            "after a Split or Digits or alone"));
    }
  }
  r.fail("pre_tokenizer", "has no ByteLevel step; kiln reads byte-level BPE tokenizers only");
}

void check_decoder(const Reader& r, const json& doc) {
  const json* d = Reader::member(doc, "decoder");
  if (!d) return;  // kiln decodes bytes whatever the file says
  if (const std::string t = r.type(*d, "decoder"); t != "ByteLevel")
    r.fail("decoder.type", cat("is ", json(t).dump(), "; byte-level BPE decodes with ByteLevel"));
}

std::optional<std::uint32_t> post_processor_token(const Reader& r, const json& p, const std::string& key) {
  const std::string t = r.type(p, key);
  if (t == "ByteLevel") return std::nullopt;
  if (t == "Sequence") {
    const json& list = r.array(p, key + ".processors", "processors");
    for (std::size_t i = 0; i < list.size(); ++i)
      if (auto id = post_processor_token(r, list[i], cat(key, ".processors[", i, "]"))) return id;
    return std::nullopt;
  }
  if (t == "RobertaProcessing" || t == "BertProcessing") {  // "cls": ["<s>", 0] goes first
    const json& cls = r.array(p, key + ".cls", "cls");
    if (cls.size() != 2 || !cls[1].is_number_unsigned())
      r.fail(key + ".cls", cat("is ", shown(cls), ", expected [name, id]"));
    return cls[1].get<std::uint32_t>();
  }
  if (t != "TemplateProcessing")
    r.fail(key + ".type", cat("is ", json(t).dump(), "; kiln reads ByteLevel, TemplateProcessing, RobertaProcessing, "
                                                    "BertProcessing and Sequence post-processors"));
  const json& single = r.array(p, key + ".single", "single");
  const json& specials = r.object(p, key + ".special_tokens", "special_tokens");
  std::vector<std::string> before, after;
  bool text_seen = false;
  for (std::size_t i = 0; i < single.size(); ++i) {
    const json& piece = single[i];
    if (piece.is_object() && piece.contains("Sequence")) {
      text_seen = true;
    } else if (piece.is_object() && piece.contains("SpecialToken") && piece["SpecialToken"].is_object()) {
      const std::string name = r.string(piece["SpecialToken"], cat(key, ".single[", i, "].SpecialToken.id"), "id");
      (text_seen ? after : before).push_back(name);
    } else {
      r.fail(cat(key, ".single[", i, "]"),
             cat("is ", shown(piece), ", expected {\"Sequence\": ...} or {\"SpecialToken\": ...}"));
    }
  }
  const auto& chosen = !before.empty() ? before : after;
  if (chosen.size() != 1) return std::nullopt;
  const std::string at = cat(key, ".special_tokens[", json(chosen[0]).dump(), "]");
  const json& entry = r.object(specials, at, chosen[0].c_str());
  const json& ids = r.array(entry, at + ".ids", "ids");
  if (ids.size() != 1 || !ids[0].is_number_unsigned()) return std::nullopt;  // a sequence of tokens: no one token
  return ids[0].get<std::uint32_t>();
}

}  // namespace kiln::data::detail
