#!/usr/bin/env bash
# Sets everything up and runs kiln's tests. GPU tests report "skipped" where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/fetch-tokenizers.sh  # GPT-2's encoder.json + vocab.bpe for the tokenizer tests
ctest --test-dir build --output-on-failure -j "$(nproc)"
