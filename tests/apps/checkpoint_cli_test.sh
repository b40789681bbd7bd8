#!/usr/bin/env bash
# Training-state checkpoints through the kiln runner: a run interrupted (at a chosen step, and by
# SIGKILL at a random moment) and run again continues bit-identically; a process killed while
# saving, twenty times at random points, always leaves a loadable checkpoint; a damaged one exits 2;
# kiln export writes GPT-2 names a plain reader opens; kiln generate prints text; init_from starts
# from an export.
# usage: checkpoint_cli_test.sh KILN
set -u
KILN=$1
TMP=$(mktemp -d)
trap 'kill -9 $(jobs -p) 2>/dev/null; rm -rf "$TMP"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect() {  # expect RC PATTERN -- command...
  local want_rc=$1 pattern=$2
  shift 3
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  if [ "$rc" != "$want_rc" ]; then fail "'$*' exited $rc, expected $want_rc. Output:"$'\n'"$out"; return; fi
  if ! grep -qF -- "$pattern" <<<"$out"; then fail "'$*' output lacks '$pattern'. Output:"$'\n'"$out"; fi
}
# The "step": loss pairs of a metrics file, from step $2 on.
losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1" | awk -F'[:,]' -v from="${2:-1}" '$2 >= from'; }

cd "$TMP"
cat > tiny.toml <<TOML
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 40
batch_size = 4
seq_len = 16
[model]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 256
max_seq_len = 16
dropout = 0.1
[optim]
warmup_steps = 5
[data]
synthetic_vocab = 256
[log]
every = 10
metrics = "metrics.jsonl"
TOML

# The reference: 40 steps straight.
expect 0 "step 40/40" -- "$KILN" run tiny.toml --set log.metrics=straight.jsonl
[ "$(losses straight.jsonl | wc -l)" = 40 ] || fail "straight.jsonl has $(losses straight.jsonl | wc -l) steps"

# Interrupted after step 20 (train.exit_interval), run again with the same command: steps 21-40
# are the straight run's, and the metrics file reads as one run.
run_ck() { "$KILN" run tiny.toml --set checkpoint.dir=ck --set checkpoint.every=20 "$@"; }
expect 0 "train.exit_interval: stopping after step 20" -- run_ck --set train.exit_interval=20
expect 0 "checkpoint: resumed from ck/step_000020 at step 20 (loaded in" -- run_ck --set train.exit_interval=20
[ "$(losses metrics.jsonl)" = "$(losses straight.jsonl)" ] || fail "the resumed run's losses differ from the straight run's"
[ -f ck/step_000040/manifest.json ] && [ "$(cat ck/latest)" = step_000040 ] || fail "no complete step_000040 named by latest"

# Killed by SIGKILL at a random moment, run again until it finishes: the losses after the
# checkpoint it resumed from are the straight run's.
rm -rf ck2
for attempt in 1 2 3; do
  "$KILN" run tiny.toml --set checkpoint.dir=ck2 --set checkpoint.every=3 --set log.metrics=killed.jsonl >/dev/null 2>&1 &
  sleep "0.$((RANDOM % 4))$((RANDOM % 10 + 1))"
  kill -9 $! 2>/dev/null
  wait $! 2>/dev/null
done
expect 0 "done: train.steps reached" -- "$KILN" run tiny.toml --set checkpoint.dir=ck2 --set checkpoint.every=3 \
  --set log.metrics=killed.jsonl
[ "$(losses killed.jsonl)" = "$(losses straight.jsonl)" ] || fail "after SIGKILLs the losses differ from the straight run's"

# Twenty SIGKILLs at random points of a run that saves every step (keep 2, so removals are killed
# too): after each, every complete-looking directory is complete, and the newest loads.
cat > saver.toml <<TOML
[engine]
device = "cpu"
[train]
steps = 100000
batch_size = 2
seq_len = 16
[model]
n_layer = 4
n_head = 4
n_embd = 128
vocab_size = 256
max_seq_len = 16
[optim]
[data]
synthetic_vocab = 256
[checkpoint]
dir = "kill"
every = 1
keep = 2
TOML
loaded=0
for i in $(seq 1 20); do
  "$KILN" run saver.toml >/dev/null 2>&1 &
  pid=$!
  sleep "$((RANDOM % 2)).$((RANDOM % 10))$((RANDOM % 10))"
  kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
  for d in kill/step_*; do
    [ -e "$d" ] || continue
    case "$d" in *.tmp) continue ;; esac
    [ -f "$d/manifest.json" ] || fail "kill $i: $d has no manifest but is not a .tmp directory"
  done
  if ls kill/step_* >/dev/null 2>&1 && ls -d kill/step_* | grep -qv '\.tmp$'; then
    if "$KILN" export kill -o "kill_$i.safetensors" >/dev/null 2>export.err; then
      loaded=$((loaded + 1))
    else
      fail "kill $i: the newest checkpoint does not load: $(cat export.err)"
    fi
  fi
done
[ "$loaded" -ge 15 ] || fail "only $loaded of 20 kills left a checkpoint to load"
echo "20 SIGKILLs: the newest complete checkpoint loaded $loaded times"

# A damaged checkpoint: exit code 2, the file and rank named, nothing changed.
cp -r ck/step_000040 damaged
head -c 1000 ck/step_000040/rank_00000.bin > damaged/rank_00000.bin
expect 2 "damaged/rank_00000.bin (rank 0's shard file) is 1000 bytes" -- \
  "$KILN" run tiny.toml --set checkpoint.resume=damaged --set train.steps=41
expect 2 "damaged/rank_00000.bin (rank 0's shard file) is 1000 bytes" -- "$KILN" run tiny.toml --nproc 2 \
  --set parallel.tp=2 --set checkpoint.resume=damaged --set train.steps=41
mkdir empty
expect 2 "has no manifest.json" -- "$KILN" export empty -o x.safetensors

# Export: GPT-2 names, Conv1D layouts, config.json; generate prints text; init_from starts there.
expect 0 "exported ck/step_000040" -- "$KILN" export ck -o export/model.safetensors
[ -f export/config.json ] || fail "no config.json beside the export"
if command -v python3 >/dev/null; then
  python3 - export/model.safetensors <<'PY' || fail "a plain safetensors reader cannot open the export"
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
assert header["transformer.h.0.attn.c_attn.weight"]["shape"] == [32, 96], header["transformer.h.0.attn.c_attn.weight"]
assert header["transformer.wte.weight"]["shape"] == [256, 32]
assert "lm_head.weight" not in header
end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
assert 8 + n + end == len(data)
PY
fi
expect 0 "The " -- "$KILN" generate ck --prompt "The " --tokens 20 --seed 1
expect 0 "The " -- "$KILN" generate export/model.safetensors --prompt "The " --tokens 20 --temperature 0
expect 0 "model: weights from export/model.safetensors" -- \
  "$KILN" run tiny.toml --set model.init_from=export/model.safetensors --set train.steps=1 --set log.metrics=ft.jsonl

# A Llama through Hugging Face's layout: trained and exported as a directory of shards with the
# index; a run with init_from takes its shape from config.json (the pipeline names only the
# architecture), saves at step 0, and that checkpoint exports to the same bytes (f32).
cat > llama.toml <<TOML
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 3
batch_size = 4
seq_len = 16
[model]
arch = "llama"
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 32
ffn_hidden = 48
vocab_size = 100
max_seq_len = 64
tie_embeddings = false
[model.rope_scaling]
type = "llama3"
factor = 8.0
original_max_seq_len = 16
[data]
synthetic_vocab = 100
TOML
cat > llama-ft.toml <<TOML
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 0
batch_size = 4
seq_len = 16
[model]
arch = "llama"
[data]
synthetic_vocab = 100
TOML
expect 0 "train.steps reached" -- "$KILN" run llama.toml --set checkpoint.dir=lck --set checkpoint.every=3
expect 0 "model.safetensors.index.json" -- "$KILN" export lck -o hf --max-shard-size 20KB
[ -f hf/model-00002-of-00005.safetensors ] || fail "the export is not 5 shards of at most 20 KB: $(ls hf)"
grep -q '"rope_type": "llama3"' hf/config.json || fail "config.json lacks rope_scaling: $(cat hf/config.json)"
expect 0 "checkpoint: saved fck/step_000000" -- "$KILN" run llama-ft.toml --set model.init_from=hf --set checkpoint.dir=fck
expect 0 "exported fck" -- "$KILN" export fck -o hf2 --max-shard-size 20KB
for f in hf/*.safetensors; do
  cmp -s "$f" "hf2/$(basename "$f")" || fail "$(basename "$f") differs after the round trip through init_from"
done
expect 0 "exported hf" -- "$KILN" export hf -o hf3
[ -f hf3/model.safetensors ] || fail "an export of a Hugging Face directory into one file: $(ls hf3)"
expect 2 "model.n_layer differs from 'num_hidden_layers'" -- \
  "$KILN" run llama-ft.toml --set model.init_from=hf --set model.n_layer=3
sed -i 's/"llama3"/"yarn"/' hf3/config.json
expect 2 "rope_type' is \"yarn\"; kiln implements \"llama3\"" -- "$KILN" run llama-ft.toml --set model.init_from=hf3
expect 0 "" -- "$KILN" generate hf --prompt-ids "1 2 3" --tokens 4 --temperature 0
expect 2 "neither Llama 3's header tokens nor ChatML" -- "$KILN" generate hf --chat --prompt hi --tokenizer bytes
expect 2 "--system and --template go with --chat" -- "$KILN" generate hf --prompt-ids "1 2" --system hi
for i in $(seq 40); do echo "THE QUICK BROWN FOX JUMPS OVER 1234567890 LAZY DOGS"; done > upper.txt
echo "lowercase bytes are beyond a vocabulary of 100" > lower.txt
expect 0 "tokenized" -- "$KILN" tokenize upper.txt -o up
expect 0 "tokenized" -- "$KILN" tokenize lower.txt -o low --val-fraction 0
expect 0 "over 64 tokens (4 windows of 16)" -- "$KILN" eval hf --data 'up/train_*.bin' --seq-len 16 --max-sequences 4
expect 0 "loss " -- "$KILN" eval fck --data 'up/*.bin' --seq-len 16
expect 0 "over 64 tokens (4 windows of 16)" -- "$KILN" eval hf --data "up/train_*.bin" --seq-len 16 --max-sequences 4 --attend-across-documents
expect 2 "outside the model's vocabulary of 100" -- "$KILN" eval hf --data 'low/*.bin' --seq-len 16
expect 2 "no window of 61 tokens fits" -- "$KILN" eval hf --data 'low/*.bin' --seq-len 60

if [ "$failures" != 0 ]; then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checkpoint CLI checks passed"
