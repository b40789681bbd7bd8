#!/usr/bin/env bash
# Sets everything up and runs kiln's tests. GPU tests report "skipped" where no GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
