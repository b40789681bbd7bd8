#include "kiln/data/chat.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kiln/core/error.hpp"
#include "kiln/data/shard.hpp"

namespace kiln::data {

namespace {

std::uint32_t special(const TextTokenizer& t, std::string_view name, ChatTemplate tmpl) {
  const auto id = t.token_id(name);
  if (!id)
    KILN_THROW("the ", tmpl == ChatTemplate::llama3 ? "llama3" : "chatml", " chat template needs the special token ",
               name, ", which ", t.description(), " does not have");
  return *id;
}

// Appends tokens with one flag for all of them.
void put(Tokenized& out, const std::vector<std::uint32_t>& ids, std::uint8_t flag) {
  out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
  out.flags.insert(out.flags.end(), ids.size(), flag);
}

std::string trim(const std::string& s) {
  const auto ws = " \t\n\r\f\v";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

Tokenized encode_chat(TextTokenizer& tk, ChatTemplate tmpl, const std::vector<ChatTurn>& messages) {
  Tokenized out;
  // Text is encoded as ordinary text: a special token's name written inside a message stays text.
  if (tmpl == ChatTemplate::llama3) {
    put(out, {special(tk, "<|begin_of_text|>", tmpl)}, 0);
    const std::uint32_t start = special(tk, "<|start_header_id|>", tmpl), end = special(tk, "<|end_header_id|>", tmpl),
                        eot = special(tk, "<|eot_id|>", tmpl);
    for (const auto& m : messages) {
      const std::uint8_t trained = m.role == "assistant" ? kTrained : 0;
      put(out, {start}, 0);
      put(out, tk.encode(m.role), 0);
      put(out, {end}, 0);
      put(out, tk.encode("\n\n"), 0);
      put(out, tk.encode(trim(m.content)), trained);
      put(out, {eot}, trained);
    }
  } else {
    const std::uint32_t start = special(tk, "<|im_start|>", tmpl), end = special(tk, "<|im_end|>", tmpl);
    for (const auto& m : messages) {
      const std::uint8_t trained = m.role == "assistant" ? kTrained : 0;
      put(out, {start}, 0);
      put(out, tk.encode(m.role + "\n"), 0);
      put(out, tk.encode(m.content), trained);
      put(out, {end}, trained);
      put(out, tk.encode("\n"), 0);
    }
  }
  if (!out.flags.empty()) out.flags[0] |= kDocumentStart;
  return out;
}

Tokenized encode_prompt_completion(TextTokenizer& tk, ChatTemplate tmpl, const std::string& prompt,
                                   const std::string& completion) {
  return encode_chat(tk, tmpl, {{"user", prompt}, {"assistant", completion}});
}

std::vector<std::uint32_t> encode_chat_prompt(TextTokenizer& tk, ChatTemplate tmpl,
                                              const std::vector<ChatTurn>& messages) {
  Tokenized conversation = encode_chat(tk, tmpl, messages);
  std::vector<std::uint32_t> out = std::move(conversation.tokens);
  auto put_ids = [&](const std::vector<std::uint32_t>& ids) { out.insert(out.end(), ids.begin(), ids.end()); };
  if (tmpl == ChatTemplate::llama3) {
    put_ids({special(tk, "<|start_header_id|>", tmpl)});
    put_ids(tk.encode("assistant"));
    put_ids({special(tk, "<|end_header_id|>", tmpl)});
    put_ids(tk.encode("\n\n"));
  } else {
    put_ids({special(tk, "<|im_start|>", tmpl)});
    put_ids(tk.encode("assistant\n"));
  }
  return out;
}

std::vector<std::uint32_t> chat_stop_tokens(const TextTokenizer& tk, ChatTemplate tmpl) {
  std::vector<std::uint32_t> out = {special(tk, tmpl == ChatTemplate::llama3 ? "<|eot_id|>" : "<|im_end|>", tmpl)};
  if (const auto eos = tk.token_id(tmpl == ChatTemplate::llama3 ? "<|end_of_text|>" : "<|endoftext|>")) out.push_back(*eos);
  return out;
}

ChatTemplate choose_chat_template(const std::string& name, const TextTokenizer& tk, const std::string& dir) {
  if (name == "llama3") return ChatTemplate::llama3;
  if (name == "chatml") return ChatTemplate::chatml;
  if (name != "auto") KILN_THROW("chat template '", name, "': kiln knows llama3 and chatml (or auto)");
  const auto config = std::filesystem::path(dir) / "tokenizer_config.json";
  std::error_code ec;
  if (!dir.empty() && std::filesystem::is_regular_file(config, ec)) {
    std::ifstream in(config);
    const auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
      const std::string t = j["chat_template"].get<std::string>();
      if (t.find("<|start_header_id|>") != std::string::npos) return ChatTemplate::llama3;
      if (t.find("<|im_start|>") != std::string::npos) return ChatTemplate::chatml;
      KILN_FILE_ERROR(config.string(), ": key 'chat_template' is neither Llama 3's nor ChatML; give --template "
                      "llama3 or chatml");
    }
  }
  if (tk.token_id("<|start_header_id|>")) return ChatTemplate::llama3;
  if (tk.token_id("<|im_start|>")) return ChatTemplate::chatml;
  KILN_THROW(tk.description(), " has neither Llama 3's header tokens nor ChatML's <|im_start|>: no chat template "
             "fits it (give a tokenizer.json that has them)");
}

namespace {

std::string string_at(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_string()) KILN_FILE_ERROR(where, ": key '", key, "' must be a string");
  return j[key].get<std::string>();
}

}  // namespace

SftResult tokenize_sft_files(const std::vector<std::string>& inputs, const std::string& out_dir, const SftOptions& o) {
  KILN_CHECK(o.tokenizer, "supervised fine-tuning data needs a tokenizer");
  KILN_CHECK(o.val_fraction >= 0 && o.val_fraction < 1, "val_fraction must be in [0, 1)");
  std::vector<Tokenized> examples;
  for (const auto& path : inputs) {
    std::ifstream in(path);
    if (!in) KILN_FILE_ERROR(path, ": cannot open");
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = cat(path, ":", n);
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_object()) KILN_FILE_ERROR(where, ": not a JSON object");
      if (o.format == SftFormat::prompt_completion) {
        examples.push_back(encode_prompt_completion(*o.tokenizer, o.tmpl, string_at(j, "prompt", where),
                                                    string_at(j, "completion", where)));
        continue;
      }
      if (!j.contains("messages") || !j["messages"].is_array() || j["messages"].empty())
        KILN_FILE_ERROR(where, ": key 'messages' must be a non-empty array of {\"role\", \"content\"}");
      std::vector<ChatTurn> turns;
      bool answered = false;
      for (const auto& m : j["messages"]) {
        if (!m.is_object()) KILN_FILE_ERROR(where, ": key 'messages' holds a non-object");
        turns.push_back({string_at(m, "role", where + " (messages)"), string_at(m, "content", where + " (messages)")});
        answered |= turns.back().role == "assistant";
      }
      if (!answered) KILN_FILE_ERROR(where, ": key 'messages' has no assistant turn (nothing to train on)");
      examples.push_back(encode_chat(*o.tokenizer, o.tmpl, turns));
    }
  }
  if (examples.empty()) KILN_FILE_ERROR(inputs.empty() ? "(no input)" : inputs.front(), ": no examples");
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec) KILN_FILE_ERROR(out_dir, ": cannot create the output directory: ", ec.message());
  SftResult r;
  r.examples = static_cast<std::int64_t>(examples.size());
  // The examples packed into one stream; the last val_fraction of them (whole) is the validation split.
  // n_train >= 1: val_fraction < 1.
  const std::size_t n_train = examples.size() - static_cast<std::size_t>(o.val_fraction * static_cast<double>(examples.size()));
  Tokenized all;
  std::size_t train_tokens = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    all.tokens.insert(all.tokens.end(), examples[i].tokens.begin(), examples[i].tokens.end());
    all.flags.insert(all.flags.end(), examples[i].flags.begin(), examples[i].flags.end());
    if (i + 1 == n_train) train_tokens = all.tokens.size();
  }
  r.train_tokens = static_cast<std::int64_t>(train_tokens);
  r.val_tokens = static_cast<std::int64_t>(all.tokens.size() - train_tokens);
  r.trained_tokens = std::count_if(all.flags.begin(), all.flags.end(), [](std::uint8_t f) { return f & kTrained; });
  const bool wide = o.tokenizer->vocab_size() > 65536;
  const std::span<const std::uint32_t> tokens(all.tokens);
  const std::span<const std::uint8_t> flags(all.flags);
  for (const auto& [split, begin, end] :
       {std::tuple{"train", std::size_t{0}, train_tokens}, std::tuple{"val", train_tokens, all.tokens.size()}})
    for (auto& f : write_split_shards(out_dir, split, tokens.subspan(begin, end - begin), flags.subspan(begin, end - begin),
                                      o.shard_tokens, wide))
      r.files.push_back(std::move(f));
  return r;
}

}  // namespace kiln::data
