#pragma once
// Supervised fine-tuning data: conversations ({"messages": [{"role", "content"}, ...]}) and
// prompt-completion pairs ({"prompt", "completion"}), one JSON object per line, turned into tokens
// and a loss mask by a chat template. Only what the model should learn to write is trained on: the
// assistant's turns (their content and the token that ends them), or the completion and the end
// of text. Conversations are packed one after another into shards; each starts a document
// (kDocumentStart) and the masks go beside the shards (shard.hpp's TokenMask).
#include <cstdint>
#include <string>
#include <vector>

#include "kiln/data/tokenizer.hpp"

namespace kiln::data {

// Llama 3's header tokens (<|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, after
// <|begin_of_text|>; contents trimmed as its template trims them), or ChatML
// (<|im_start|>role\ncontent<|im_end|>\n: Qwen2, SmolLM). No system message is added.
enum class ChatTemplate { llama3, chatml };

struct ChatTurn {
  std::string role;  // system, user, assistant (others are passed through, not trained on)
  std::string content;
};

struct Tokenized {
  std::vector<std::uint32_t> tokens;
  std::vector<std::uint8_t> flags;  // per token: kTrained, kDocumentStart (shard.hpp)
};

// The template's special tokens must exist in the tokenizer (an error naming the missing one).
Tokenized encode_chat(TextTokenizer& tokenizer, ChatTemplate tmpl, const std::vector<ChatTurn>& messages);
// The prompt as the user's turn and the completion as the assistant's answer, under the template.
Tokenized encode_prompt_completion(TextTokenizer& tokenizer, ChatTemplate tmpl, const std::string& prompt,
                                   const std::string& completion);

// The conversation and the header of the assistant's answer that follows it, as the template is
// written for generation (Hugging Face's add_generation_prompt): Llama 3's
// <|start_header_id|>assistant<|end_header_id|>\n\n, ChatML's <|im_start|>assistant\n.
std::vector<std::uint32_t> encode_chat_prompt(TextTokenizer& tokenizer, ChatTemplate tmpl,
                                              const std::vector<ChatTurn>& messages);
// The tokens that end the assistant's answer: <|eot_id|> (and <|end_of_text|>) for Llama 3,
// <|im_end|> (and <|endoftext|>) for ChatML, those the tokenizer has.
std::vector<std::uint32_t> chat_stop_tokens(const TextTokenizer& tokenizer, ChatTemplate tmpl);

// The template a tokenizer's model uses: `name` (llama3, chatml), or "auto": the chat_template of
// tokenizer_config.json in `tokenizer_dir` when it is one of the two, else the one whose special
// tokens the tokenizer has. An error saying which names kiln knows otherwise.
ChatTemplate choose_chat_template(const std::string& name, const TextTokenizer& tokenizer,
                                  const std::string& tokenizer_dir);

enum class SftFormat { chat, prompt_completion };

struct SftOptions {
  SftFormat format = SftFormat::chat;
  ChatTemplate tmpl = ChatTemplate::llama3;
  double val_fraction = 0.1;  // the last fraction of the examples (whole ones) go to validation
  std::int64_t shard_tokens = 100'000'000;
  TextTokenizer* tokenizer = nullptr;
};
struct SftResult {
  std::int64_t examples = 0, train_tokens = 0, val_tokens = 0, trained_tokens = 0;
  std::vector<std::string> files;  // shards and their masks
};
// Reads the JSONL files (a bad line is a FileError naming the file, the line and the key) and
// writes DIR/train_NNNNNN.bin + .mask and DIR/val_NNNNNN.bin + .mask.
SftResult tokenize_sft_files(const std::vector<std::string>& inputs, const std::string& out_dir,
                             const SftOptions& options);

}  // namespace kiln::data
