#!/usr/bin/env bash
# pipelines/moe-1b.toml variants on one GPU (synthetic tokens), each printing its last step line and
# peak memory (a profile's breakdown with PROFILE=1): bash bench/moe_runs.sh BUILD_DIR STEPS [--set ...]...
# Each argument after STEPS is one run's extra --set list, e.g. "fp8.enabled=true backend.profile=true".
B=${1:-.devbuild}
STEPS=${2:-30}
shift 2
export LD_LIBRARY_PATH="$PWD/$B/lib:$PWD/$B/syslib:${LD_LIBRARY_PATH:-}"
for run in "$@"; do
  sets=()
  for s in $run; do sets+=(--set "$s"); done
  echo "===== $run"
  timeout 300 "$B/bin/kiln" run pipelines/moe-1b.toml --set data.synthetic_vocab=50257 --set 'data.val_files=""' \
    --set log.val_every=0 --set log.every=10 --set train.steps="$STEPS" "${sets[@]}" 2>&1 |
    grep -E "step +$STEPS/|peak|op time|^  [a-z_0-9]+ +[0-9]|total \(ops|error|fp8:" | head -40
done
