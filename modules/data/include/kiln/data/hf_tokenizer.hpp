#pragma once
// Hugging Face tokenizer.json files of byte-level BPE models (GPT-2, Llama 3.0-3.2, Qwen2/2.5),
// read into kiln's BPE so that BpeTokenizer gives the ids of Hugging Face's tokenizers.
#include <string>

#include "kiln/data/bpe.hpp"

namespace kiln::data {

// Reads what tokenizers' Tokenizer.from_file reads, for the byte-level BPE models:
//  - model: BPE, its vocab in GPT-2's byte alphabet, merges as "a b" strings or [a, b] pairs,
//    ignore_merges (Llama 3: a piece that is a token is that token); no byte fallback, dropout,
//    subword prefix or suffix;
//  - normalizer: none or NFC (Qwen2);
//  - pre_tokenizer: ByteLevel (GPT-2's pattern), or a Sequence of one Split (an Oniguruma regex,
//    "Isolated", not inverted; see pcre2_from_oniguruma) and ByteLevel without its own pattern
//    (Llama 3, Qwen2), or of Digits and ByteLevel (StarCoder2, SmolLM; see digits_then_regex);
//  - decoder ByteLevel; post_processor ByteLevel, TemplateProcessing, RobertaProcessing,
//    BertProcessing, or a Sequence of them;
//  - added_tokens with their ids and flags (inside or beyond the vocab; vocab_size = largest + 1).
// Anything else (Unigram, WordPiece, byte fallback as in SentencePiece-converted Llama 2, other
// normalizers or pre-tokenizers) is a FileError naming the file and the key.
//
// The document token (TextTokenizer::document_separator) is the first of: the special token the
// post-processor puts before a text (Llama 3: <|begin_of_text|>; after it when none is before);
// an added special token <|endoftext|> (GPT-2, Qwen2: what their pre-training put between
// documents; Qwen2-Instruct's eos_token <|im_end|> ends chat turns, not documents); the
// bos_token, then the eos_token, of tokenizer_config.json beside the file, when there is one.
BpeVocabulary read_hf_tokenizer_json(const std::string& path);

}  // namespace kiln::data
