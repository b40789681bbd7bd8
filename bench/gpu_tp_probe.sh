#!/usr/bin/env bash
# Tensor parallelism at 1.3B on two GPUs, building nothing: the one-GPU run, then TP=2 (vocabulary-
# parallel head) in the variants named by VARIANTS, each a dash-separated list of
#   sp (sequence parallelism), lap (parallel.tp_comm_overlap), ce (parallel.copy_engine), keepnorm
#   (model.recompute_norm = false: the norms' gathered outputs kept for the backward), graph
#   (backend.cuda_graph), c2 (tp_comm_chunks = 2), sm8 (tp_comm_sms = 8)
# or "plain" (VARIANTS="" runs none: the one-GPU row and the traces only); then rank 0's timeline of
# each variant in TRACES: busy time per stream, the compute stream's gaps by the record after them,
# the copies' durations (bench/trace/streams.py), and a window.
# Prints the rows and each one's share of the one-GPU run per GPU.
# usage: bash bench/gpu_tp_probe.sh BUILD_DIR [extra --set args...]   (logs under $OUT)
set -uo pipefail
B=${1:-.devbuild}
shift || true
source bench/kiln_rows.sh
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} kiln_gpu_env "$B"
m=(pipelines/gpt2-124m.toml --set model.n_layer=24 --set model.n_head=16 --set model.n_embd=2048
   --set train.batch_size=8 --set model.recompute_gelu=true "$@")
tp=(--set parallel.tp=2 --set parallel.vocab_parallel=true)
S=${STEPS:-16}
args() {  # variant -> its --set arguments
  local a=() t
  IFS=- read -ra ts <<< "$1"
  for t in "${ts[@]}"; do
    case $t in
      sp) a+=(--set parallel.sequence_parallel=true) ;;
      lap) a+=(--set parallel.tp_comm_overlap=true) ;;
      ce) a+=(--set parallel.copy_engine=true) ;;
      keepnorm) a+=(--set model.recompute_norm=false) ;;
      graph) a+=(--set backend.cuda_graph=true) ;;
      c2) a+=(--set parallel.tp_comm_chunks=2) ;;
      sm8) a+=(--set parallel.tp_comm_sms=8) ;;
      plain) ;;
      *) echo "unknown variant token $t" >&2 ;;
    esac
  done
  echo "${a[@]}"
}
kiln_row one 1 "$S" "${m[@]}"
for v in ${VARIANTS-plain lap lap-ce sp sp-lap sp-lap-ce sp-lap-ce-keepnorm}; do
  # shellcheck disable=SC2046
  kiln_row "tp2v-$v" 2 "$S" "${m[@]}" "${tp[@]}" $(args "$v")
done
kiln_rows_table
python3 - "$OUT/rows.txt" <<'PY'
import sys
rows = {l.split()[0]: l.split() for l in open(sys.argv[1]) if l.strip() and len(l.split()) > 2}
one = rows.get("one")
for n, f in rows.items():
    if one and n != "one":
        print(f"{n:<30} {float(f[2].replace(',', '')) / float(one[2].replace(',', '')):.3f} of one GPU per GPU")
PY
if [ -f "$B/lib/libkiln_trace.so" ]; then
  for v in ${TRACES-}; do
    # shellcheck disable=SC2046
    CUDA_INJECTION64_PATH="$PWD/$B/lib/libkiln_trace.so" KILN_TRACE_API=0 KILN_TRACE="$OUT/tr-$v-{rank}.csv" \
      kiln_row "traced-$v" 2 8 "${m[@]}" "${tp[@]}" $(args "$v")
    echo "================ $v (rank 0)"
    python3 bench/trace/streams.py "$OUT/tr-$v-0.csv"
    python3 bench/trace/window.py "$OUT/tr-$v-0.csv" --at 0.8 --grep "${WINDOW_AT:-flash_fprop}" --count "${WINDOW:-0}"
    rm -f "$OUT"/tr-$v-*.csv
  done
fi
