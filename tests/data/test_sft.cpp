// Supervised fine-tuning data: chat templates (Llama 3's headers, ChatML) turned into tokens with a
// loss mask that trains on the assistant's turns only; JSONL files into shards and masks; bad lines
// named by file, line and key.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "kiln/core/error.hpp"
#include "kiln/data/chat.hpp"
#include "kiln/data/loader.hpp"
#include "kiln/data/shard.hpp"
#include "kiln_test.hpp"

using namespace kiln;
using namespace kiln::data;
namespace fs = std::filesystem;

namespace {

// Bytes, plus special tokens from 256 on.
class FakeTokenizer final : public TextTokenizer {
 public:
  explicit FakeTokenizer(std::vector<std::string> specials) : specials_(std::move(specials)) {}
  using TextTokenizer::encode;
  void encode(std::string_view text, std::vector<std::uint32_t>& out) override {
    for (unsigned char c : text) out.push_back(c);
  }
  std::string decode(std::span<const std::uint32_t> ids) const override {
    std::string s;
    for (auto id : ids) s += id < 256 ? std::string(1, static_cast<char>(id)) : specials_.at(id - 256);
    return s;
  }
  std::uint32_t vocab_size() const override { return 256 + static_cast<std::uint32_t>(specials_.size()); }
  std::optional<std::uint32_t> token_id(std::string_view name) const override {
    for (std::size_t i = 0; i < specials_.size(); ++i)
      if (specials_[i] == name) return static_cast<std::uint32_t>(256 + i);
    return std::nullopt;
  }
  std::string description() const override { return "fake"; }

 private:
  std::vector<std::string> specials_;
};

FakeTokenizer llama3() {
  return FakeTokenizer({"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
}
FakeTokenizer chatml() { return FakeTokenizer({"<|endoftext|>", "<|im_start|>", "<|im_end|>"}); }

// The trained tokens' text.
std::string trained_text(const TextTokenizer& t, const Tokenized& x) {
  std::vector<std::uint32_t> ids;
  for (std::size_t i = 0; i < x.tokens.size(); ++i)
    if (x.flags[i] & kTrained) ids.push_back(x.tokens[i]);
  return t.decode(ids);
}

}  // namespace

TEST_CASE("Llama 3's template: headers, trimmed contents, the assistant's turns trained with their <|eot_id|>") {
  auto tk = llama3();
  const auto x = encode_chat(tk, ChatTemplate::llama3,
                             {{"system", "Be brief."}, {"user", " Hi \n"}, {"assistant", "Hello."}, {"user", "Bye"},
                              {"assistant", "Bye!"}});
  CHECK(tk.decode(x.tokens) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye!<|eot_id|>");
  CHECK(trained_text(tk, x) == "Hello.<|eot_id|>Bye!<|eot_id|>");
  CHECK(x.flags[0] == kDocumentStart);
  for (std::size_t i = 1; i < x.flags.size(); ++i) CHECK((x.flags[i] & kDocumentStart) == 0);
}

TEST_CASE("ChatML: <|im_start|>role, the assistant's content and <|im_end|> trained, not the newline after") {
  auto tk = chatml();
  const auto x = encode_prompt_completion(tk, ChatTemplate::chatml, "2+2?", "4");
  CHECK(tk.decode(x.tokens) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n");
  CHECK(trained_text(tk, x) == "4<|im_end|>");
  auto bytes = FakeTokenizer({});
  CHECK_THROWS_WITH(encode_chat(bytes, ChatTemplate::chatml, {{"user", "x"}}), doctest::Contains("<|im_start|>"));
}

TEST_CASE("a generation prompt is the conversation and the assistant's header, and its turn ends at the stop tokens") {
  for (auto [tk, tmpl] : {std::pair{llama3(), ChatTemplate::llama3}, std::pair{chatml(), ChatTemplate::chatml}}) {
    const std::vector<ChatTurn> turns = {{"system", "Be brief."}, {"user", "2+2?"}};
    auto answered = turns;
    answered.push_back({"assistant", "4"});
    const auto prompt = encode_chat_prompt(tk, tmpl, turns);
    const auto whole = encode_chat(tk, tmpl, answered).tokens;
    // The prompt is what the template writes before the answer's content, token for token.
    REQUIRE(prompt.size() < whole.size());
    CHECK(std::equal(prompt.begin(), prompt.end(), whole.begin()));
    const std::vector<std::uint32_t> rest(whole.begin() + static_cast<std::ptrdiff_t>(prompt.size()), whole.end());
    const auto stop = chat_stop_tokens(tk, tmpl);
    REQUIRE(!rest.empty());
    CHECK(rest.front() == '4');
    CHECK(rest[1] == stop.front());  // the answer ends with the first stop token
    CHECK(stop.size() == 2);         // and the end of text, which both fakes have
  }
  auto l = llama3(), c = chatml();
  CHECK(l.decode(encode_chat_prompt(l, ChatTemplate::llama3, {{"user", "hi"}})) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant"
        "<|end_header_id|>\n\n");
  CHECK(c.decode(encode_chat_prompt(c, ChatTemplate::chatml, {{"user", "hi"}})) ==
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  CHECK_THROWS_WITH(chat_stop_tokens(FakeTokenizer({"<|im_start|>"}), ChatTemplate::chatml),
                    doctest::Contains("<|im_end|>"));
}

TEST_CASE("the template is chosen by name, from tokenizer_config.json, or by the tokenizer's special tokens") {
  const test::TempDir d("sft-1");
  auto l = llama3();
  auto c = chatml();
  CHECK(choose_chat_template("chatml", l, "") == ChatTemplate::chatml);
  CHECK(choose_chat_template("auto", l, "") == ChatTemplate::llama3);
  CHECK(choose_chat_template("auto", c, "") == ChatTemplate::chatml);
  std::ofstream(d.path().string() + "/tokenizer_config.json") << R"({"chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}"})";
  CHECK(choose_chat_template("auto", l, d.path().string()) == ChatTemplate::chatml);
  CHECK_THROWS_WITH(choose_chat_template("vicuna", l, ""), doctest::Contains("llama3 and chatml"));
  auto none = FakeTokenizer({});
  CHECK_THROWS_WITH(choose_chat_template("auto", none, ""), doctest::Contains("no chat template"));
}

TEST_CASE("JSONL conversations become packed shards with masks, the last examples go to validation") {
  const test::TempDir d("sft-2");
  std::ofstream(d.path().string() + "/chat.jsonl")
      << R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bb"}]})" << "\n\n"
      << R"({"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "ddd"}]})" << "\n"
      << R"({"messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]})" << "\n";
  auto tk = chatml();
  SftOptions o;
  o.tmpl = ChatTemplate::chatml;
  o.tokenizer = &tk;
  o.val_fraction = 0.34;
  o.shard_tokens = 40;
  const SftResult r = tokenize_sft_files({d.path().string() + "/chat.jsonl"}, d.path().string() + "/out", o);
  CHECK(r.examples == 3);
  CHECK(r.trained_tokens == 3 + 4 + 2);  // each answer and its <|im_end|>
  CHECK(fs::exists(d.path().string() + "/out/train_000000.bin"));
  CHECK(fs::exists(d.path().string() + "/out/train_000000.mask"));
  CHECK(fs::exists(d.path().string() + "/out/val_000000.mask"));
  // The first example alone: 40-token shards split the second example across train_000000/1.
  const TokenShard shard(d.path().string() + "/out/train_000000.bin", ShardFormat::auto_);
  const TokenMask mask(d.path().string() + "/out/train_000000.mask", shard.size());
  std::vector<std::uint8_t> flags(shard.size());
  mask.read(0, flags.size(), flags.data());
  const auto first = encode_chat(tk, ChatTemplate::chatml, {{"user", "a"}, {"assistant", "bb"}});
  CHECK(std::equal(first.flags.begin(), first.flags.end(), flags.begin()));
  CHECK((flags[first.flags.size()] & kDocumentStart) != 0);  // the second conversation starts a document
  std::vector<std::uint16_t> tokens = shard.tokens();
  CHECK(std::equal(first.tokens.begin(), first.tokens.end(), tokens.begin()));
  CHECK(r.val_tokens == static_cast<std::int64_t>(encode_chat(tk, ChatTemplate::chatml, {{"user", "e"}, {"assistant", "f"}}).tokens.size()));
}

TEST_CASE("prompt-completion lines and bad lines named by file, line and key") {
  const test::TempDir d("sft-3");
  auto tk = llama3();
  SftOptions o;
  o.tokenizer = &tk;
  o.format = SftFormat::prompt_completion;
  o.val_fraction = 0;
  std::ofstream(d.path().string() + "/pc.jsonl") << R"({"prompt": "Say hi", "completion": "hi"})" << "\n";
  const SftResult r = tokenize_sft_files({d.path().string() + "/pc.jsonl"}, d.path().string() + "/pc", o);
  CHECK(r.trained_tokens == 3);  // "hi" and <|eot_id|>
  auto error_of = [&](const std::string& line, SftFormat f) {
    std::ofstream(d.path().string() + "/bad.jsonl") << "\n" << line << "\n";
    o.format = f;
    try {
      tokenize_sft_files({d.path().string() + "/bad.jsonl"}, d.path().string() + "/bad", o);
    } catch (const FileError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(error_of(R"({"prompt": "x"})", SftFormat::prompt_completion).find("bad.jsonl:2: key 'completion'") != std::string::npos);
  CHECK(error_of("not json", SftFormat::chat).find("bad.jsonl:2: not a JSON object") != std::string::npos);
  CHECK(error_of(R"({"messages": []})", SftFormat::chat).find("key 'messages'") != std::string::npos);
  CHECK(error_of(R"({"messages": [{"role": "user", "content": "q"}]})", SftFormat::chat).find("no assistant turn") !=
        std::string::npos);
  CHECK(error_of(R"({"messages": [{"role": "user"}]})", SftFormat::chat).find("key 'content'") != std::string::npos);
}
