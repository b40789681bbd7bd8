#!/usr/bin/env bash
# On two GPUs: `kiln run --nproc 2` (one process per GPU, NCCL), rank 1 killed with SIGKILL once
# training is under way. Rank 0 must stop in its collective naming rank 1 ("... because rank 1
# disconnected"), and the launcher exit non-zero within twice the collective timeout, naming rank 1
# and the signal. Skipped (KILN_SKIP) without a CUDA build or two GPUs. LAYOUT "tp" (the default):
# tensor parallelism; "ep": a mixture of experts with expert parallelism, where rank 1 dies with its
# tokens' rows moving between the GPUs (rank 0 stops in the dispatch, the combine or the counts).
# usage: gpu_rank_killed_test.sh KILN [LAYOUT]
set -u
KILN=$1
LAYOUT=${2:-tp}
case $LAYOUT in
  tp) layout="[parallel]
tp = 2" ;;
  ep) layout="[model.moe]
n_experts = 4
top_k = 2
[parallel]
ep = 2" ;;
  *) echo "FAIL: no layout '$LAYOUT' (tp, ep)"; exit 1 ;;
esac
if ! command -v nvidia-smi >/dev/null || [ "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')" -lt 2 ]; then
  echo "KILN_SKIP: needs two GPUs"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"; [ -n "${launcher:-}" ] && kill "$launcher" 2>/dev/null' EXIT
cd "$TMP"
log=kill.log
cat > run.toml <<TOML
[engine]
device = "cuda"
[train]
steps = 1000000
batch_size = 8
seq_len = 64
[model]
n_layer = 2
n_head = 4
n_embd = 128
vocab_size = 256
max_seq_len = 64
[optim]
[data]
synthetic_vocab = 256
$layout
timeout_s = 30
[log]
every = 1
TOML
"$KILN" run run.toml --nproc 2 >"$log" 2>&1 &
launcher=$!
for _ in $(seq 1 240); do
  sleep 0.5
  grep -qE "step +5/" "$log" && break
  if ! kill -0 "$launcher" 2>/dev/null; then
    if grep -q "without CUDA" "$log"; then echo "KILN_SKIP: kiln was built without CUDA"; exit 0; fi
    echo "FAIL: the run ended before step 5:"; cat "$log"; exit 1
  fi
done
grep -qE "step +5/" "$log" || { echo "FAIL: no step 5 within 120 s:"; tail -20 "$log"; exit 1; }
victim=""
for pid in $(pgrep -P "$launcher"); do
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=1" && victim=$pid
done
[ -n "$victim" ] || { echo "FAIL: no process with RANK=1 under the launcher $launcher"; exit 1; }
start=$(date +%s)
kill -9 "$victim"
rc=0
for _ in $(seq 1 120); do  # 60 s: twice the collective timeout
  kill -0 "$launcher" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$launcher" 2>/dev/null; then
  echo "FAIL: the launcher still runs 60 s after rank 1 was killed"; tail -20 "$log"; exit 1
fi
wait "$launcher" || rc=$?
launcher=""
took=$(( $(date +%s) - start ))
echo "launcher exited $rc, ${took} s after rank 1 was killed"
grep -vE "^(\[rank [01]\] )?step" "$log" | tail -8
[ "$rc" != 0 ] || { echo "FAIL: the launcher exited 0"; exit 1; }
grep -q "rank 1 was killed by signal 9" "$log" || { echo "FAIL: the launcher does not name rank 1 and SIGKILL"; exit 1; }
grep -q "because rank 1" "$log" || { echo "FAIL: rank 0 did not stop on its own naming rank 1"; exit 1; }
echo "ok"
