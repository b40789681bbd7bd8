#!/usr/bin/env bash
# Sets everything up, fetches the corpus and trains the default pipeline: on the GPU when one is
# visible (pipelines/default.toml), otherwise the tiny CPU model (pipelines/tiny-cpu.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/prepare-data.sh
if nvidia-smi -L >/dev/null 2>&1 && ldd build/lib/libkiln_ops.so | grep -q libcudart; then
  pipeline=pipelines/default.toml
else
  pipeline=pipelines/tiny-cpu.toml
fi
echo "kiln: running $pipeline"
exec ./build/bin/kiln run "$pipeline" "$@"
